"""Two ranks agree on "fresh run or resume" whatever their timing (torchrun, real CLI, TP=2).

Each launch delays one rank inside the warm-up (``_delayed_rank_main.py``), i.e. after the run directory
was judged and before anything is written to it. When every rank judged the directory on its own, a
delayed rank 1 saw rank 0's fresh ``metrics.jsonl``, refused to start ("already holds a run") and rank 0
died in its next collective ("Connection closed by peer"). Now rank 0 decides and broadcasts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ._cli import TINY

HERE = Path(__file__).resolve().parent
ARGS = [*TINY, "warmup.steps=0", "fp8=off", "calibration=off", "seed=3", "parallel.tensor_model_parallel_size=2"]


def _launch(out: Path, logs: Path, delay_rank: int, *overrides: str) -> tuple[int, list[str]]:
    """torchrun 2 ranks of the CLI; returns (exit code, [stderr of rank 0, stderr of rank 1])."""
    env = dict(os.environ, DELAY_RANK=str(delay_rank), DELAY_SECONDS="3", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--log-dir", str(logs), "--redirects", "3", str(HERE / "_delayed_rank_main.py"), *ARGS,
           f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    errs = [sorted(logs.glob(f"*/attempt_0/{r}/stderr.log"))[-1].read_text() for r in (0, 1)]
    return proc.returncode, errs


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_starts_fresh_resumed_and_refused(tmp_path):
    # fresh starts, each rank in turn the slow one (the delay is in the warm-up, which a resumed run skips)
    for delay_rank in (1, 0):
        out = tmp_path / f"fresh{delay_rank}"
        rc, errs = _launch(out, tmp_path / f"logs_fresh{delay_rank}", delay_rank, "trainer.max_steps=1")
        assert rc == 0, errs
        assert _steps(out) == [0]
        assert not any("cannot start" in e for e in errs)
        assert f"rank {delay_rank} sleeps 3 s" in errs[delay_rank] and "sleeps" not in errs[1 - delay_rank]

    # resume=true on an existing run: every rank resumes from the same checkpoint
    out = tmp_path / "fresh1"
    rc, errs = _launch(out, tmp_path / "logs_resume", 1, "trainer.max_steps=2", "resume=true")
    assert rc == 0, errs
    assert _steps(out) == [0, 1]
    assert f"resumed from {out}/checkpoints/step_1" in errs[0] + errs[1]

    # a fresh start on that run is refused on both ranks with one message; no rank crashes or hangs
    before = (out / "metrics.jsonl").read_text()
    log_before = (out / "train.log").read_text()
    assert f"resumed from {out}/checkpoints/step_1" in log_before  # the run's own log records the resume
    rc, errs = _launch(out, tmp_path / "logs_refused", 1, "trainer.max_steps=3")
    assert rc != 0
    msgs = [[ln for ln in e.splitlines() if ln.startswith("nemo-fp8rl-train: cannot start:")] for e in errs]
    assert msgs[0] == msgs[1] and len(msgs[0]) == 1, errs
    assert f"{out} already holds a run (checkpoints [1, 2]); pass resume=true" in msgs[0][0]
    for e in errs:
        assert "Traceback" not in e and "Connection closed" not in e, e[-3000:]
    assert (out / "metrics.jsonl").read_text() == before  # nothing was overwritten
    assert (out / "train.log").read_text() == log_before  # nor appended to: the refused start opened no log
