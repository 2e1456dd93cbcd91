"""benchmarks/gpu_check.sh --dry-run runs its CPU parts (the GPU run itself needs a lent GPU)."""

import importlib.util
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
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT, check=False)
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
    # the vLLM parts run in a child process on a tiny float32 model with FP8 off (vLLM's FP8 needs a GPU)
    rollout, vparity = results["vllm_rollout"], results["vllm_parity"]
    if importlib.util.find_spec("vllm") is None:
        assert rollout["status"] == vparity["status"] == "skipped"
        assert "vLLM is not installed" in rollout["skipped"]
        return
    assert rollout["status"] == "ok", rollout
    assert rollout["arms"]["float32"]["decode_tokens_per_s"] > 0 and rollout["arms"]["float32"]["prefill_tokens_per_s"] > 0
    assert "UnquantizedLinearMethod" in rollout["arms"]["float32"]["quant_methods"]
    assert set(rollout["skipped"]) == {"fp8_w8a8", "fp8_block"}
    assert vparity["status"] == "ok", vparity
    off = vparity["schemes"]["off"]
    # FP8 off, float32 in both engines: the same function up to summation order
    assert off["tokens"] == vparity["prompts"] * vparity["new_tokens"]
    assert off["max_abs_diff"] < 1e-4 and off["argmax_agree"] == 1.0
    assert all("dry run" in vparity["schemes"][s]["skipped"] for s in ("vllm_w8a8", "vllm_block"))
    assert "| vllm_rollout | ok |" in summary and "| vllm_parity | ok |" in summary
    assert "| off | " in summary  # the parity table
