"""benchmarks/gpu_check.sh --dry-run runs its CPU parts (the GPU run itself needs a lent GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["env"]["torch"] == __import__("torch").__version__
    parity = results["parity"]
    assert set(parity["max_abs_diff"]) == {"delayed", "tensorwise", "blockwise_1x128", "blockwise_128x128", "mxfp8"}
    assert all(v == 0.0 for v in parity["max_abs_diff"].values())
    # TE is not installed on CPU: the support probe answers with a reason instead of raising
    assert all(ok is False and reason for ok, reason in parity["te_support"].values())
    summary = (out / "summary.md").read_text()
    assert "| env | ok |" in summary and "| parity | ok |" in summary
    assert "## throughput: skipped" in summary and "## grpo: skipped" in summary
    assert [results[k]["status"] for k in ("env", "parity", "throughput", "grpo")] == ["ok", "ok", "skipped", "skipped"]
