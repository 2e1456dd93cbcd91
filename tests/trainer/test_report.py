"""nemo-fp8rl-report on real runs: figure and final-metrics table."""

import subprocess
import sys

from ._cli import DEMO_STEPS


def test_report_overlays_runs(demo_runs, tmp_path):
    """The demo's bf16 and fp8 arms (tests/conftest.py; fp8 measures calibration without applying it)."""
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "nemo_fp8rl.report", str(demo_runs["bf16"]), str(demo_runs["fp8"]),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    table = (out / "summary.md").read_text()
    assert f"| bf16 | {DEMO_STEPS} |" in table and f"| fp8 | {DEMO_STEPS} |" in table and "alpha fp8 nominal" in table
    bad = subprocess.run([sys.executable, "-m", "nemo_fp8rl.report", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "metrics.jsonl not found" in bad.stderr
