"""Long-run soak (marker slow): 500 steps with periodic checkpoints and two forced kills + resumes
give exactly the trajectory of an uninterrupted run. Run with ``pytest --run-slow tests/reliability``."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_fp8rl.trainer import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "trainer"))
from _cli import TINY, metrics, run_cli, strip_timing  # noqa: E402

STEPS = 500
ARM = ["fp8=tensorwise", "calibration=paper", "calibration.interval=20", "calibration.min_tokens=4",
       "algorithm.old_logprobs=rollout", f"trainer.max_steps={STEPS}", "trainer.checkpoint_interval=25"]


@pytest.mark.slow
def test_soak_500_steps_two_kills(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_cli(ref, *ARM, timeout=3600)
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *TINY, *ARM, f"output_dir={out}",
           f"warmup.cache_dir={tmp_path / '.warmup_cache'}"]
    for kill_after in (130, 340):  # kill -9 mid-interval, twice
        proc = subprocess.Popen(cmd + (["resume=true"] if (out / "checkpoints").exists() else []),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 3600
        while time.time() < deadline and len(read_metrics(str(out))) < kill_after:
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    run_cli(out, *ARM, "resume=true", timeout=3600)
    a, b = metrics(ref), metrics(out)
    assert [r["step"] for r in b] == list(range(STEPS))
    assert strip_timing(a) == strip_timing(b)
