"""nemo-fp8rl-report on real runs: figure and final-metrics table."""

import subprocess
import sys

from ._cli import run_cli


def test_report_overlays_runs(tmp_path):
    run_cli(tmp_path / "bf16", "trainer.max_steps=2")
    run_cli(tmp_path / "fp8", "fp8=tensorwise", "calibration=measure", "calibration.interval=1",
            "calibration.min_tokens=4", "trainer.max_steps=2")
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "nemo_fp8rl.report", str(tmp_path / "bf16"), str(tmp_path / "fp8"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    table = (out / "summary.md").read_text()
    assert "| bf16 | 2 |" in table and "| fp8 | 2 |" in table and "alpha fp8 nominal" in table
    bad = subprocess.run([sys.executable, "-m", "nemo_fp8rl.report", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "metrics.jsonl not found" in bad.stderr
