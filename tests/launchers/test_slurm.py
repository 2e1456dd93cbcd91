"""Real SLURM (marker ``slurm``; scripts/slurm_local.sh starts a one-node cluster): the tiny CPU stage with
2 tasks through sbatch, preempted by SIGUSR1 -> checkpoint -> requeue -> resume to the end; and a plain
scancel, which checkpoints and does not requeue.

The stage's plain run through sbatch (3 steps, DP=2) was a test of its own until 2026-12-07; the preemption
test runs the same stage through sbatch to its end and now asserts what that one did (job name, 2 tasks,
ranks from srun's SLURM variables, config and log files): one SLURM job fewer (it took 102 s of one
worker in a full run beside other jobs). What went with it: 2 tasks as DP=2 through SLURM (TP=2 remains)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from ._launch import TINY, job_id, launch_cli, metrics_steps

pytestmark = pytest.mark.slurm

JOB_TIMEOUT_S = 300
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def _job(jid: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _logs(d: Path, tail: int | None = None) -> str:
    """The job's log files (whole, or the last ``tail`` characters of each for assertion messages)."""
    return "".join(f"\n--- {p.name}\n{p.read_text()[-tail if tail else 0:]}" for p in sorted(d.glob("log-*")))


def _wait_done(jid: str, d: Path, seen: list) -> dict:
    """Poll the job until it ends; ``seen`` collects each distinct (JobState, Restarts)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        info = _job(jid)
        state = (info["JobState"], int(info["Restarts"]))
        if not seen or seen[-1] != state:
            seen.append(state)
        if info["JobState"] in DONE:
            return info
        time.sleep(0.3)
    subprocess.run(["scancel", jid], timeout=30, check=False)
    raise AssertionError(f"job {jid} did not finish within {JOB_TIMEOUT_S}s; states {seen}{_logs(d)}")


def _submit(base: Path, name: str, cache: Path, *overrides: str) -> tuple[str, Path]:
    proc = launch_cli(f"base_results_dir={base}", "rl=tiny_grpo_blockwise", f"rl.run.name={name}", *TINY,
                      f"rl.warmup.cache_dir={cache}", *overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return job_id(proc.stdout), base / name


def test_usr1_checkpoints_requeues_and_resumes(tmp_path, warm_cache):
    max_steps = 10
    name = f"t_preempt_{os.getpid()}"
    jid, d = _submit(tmp_path, name, warm_cache, f"rl.trainer.max_steps={max_steps}",
                     "rl.trainer.checkpoint_interval=0")  # checkpoints only at the end and on a signal
    metrics = d / "metrics.jsonl"
    seen: list = []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):  # RL is running
        info = _job(jid)
        assert info["JobState"] in ("PENDING", "RUNNING"), (info, _logs(d))
        assert time.monotonic() < deadline, f"no RL steps within {JOB_TIMEOUT_S}s{_logs(d)}"
        time.sleep(0.2)
    # what a preemption notice or --signal=USR1@<s> does: SIGUSR1 to every task of the job
    subprocess.run(["scancel", "--signal=USR1", jid], check=True, timeout=30)
    info = _wait_done(jid, d, seen)
    logs = _logs(d)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (info, seen,
                                                                                                   _logs(d, 6000))
    assert info["JobName"] == f"nemo-fp8rl-{name}" and info["NumTasks"] == "2", info
    assert (d / "config.yaml").is_file() and (d / "train.log").is_file()
    # ranks came from srun's SLURM variables, not torchrun
    assert "rank 0 of 2 (slurm)" in logs and "rank 1 of 2 (slurm)" in logs, _logs(d, 6000)
    # running, then back in the queue after the requeue (PENDING, restart count 1), running again, done
    states = [s for s, _ in seen]
    assert ("RUNNING", 0) in seen and ("RUNNING", 1) in seen and seen[-1] == ("COMPLETED", 1), seen
    assert states.index("RUNNING") < max(i for i, s in enumerate(seen) if s[0] in ("PENDING", "REQUEUED") and s[1] == 1)

    m = re.search(r"checkpoint saved at step (\d+) after signal", logs)
    assert m, logs
    stop = int(m.group(1))
    assert 1 <= stop < max_steps
    assert (f"nemo-fp8rl: stopped by a signal after the checkpoint of step {stop} of {max_steps}; requeueing job "
            f"{jid}") in logs
    assert f"nemo-fp8rl: job {jid} run 2 on " in logs and f"latest checkpoint step {stop}," in logs
    assert f"resumed from {d}/checkpoints/step_{stop}" in logs
    assert f"nemo-fp8rl: training finished at step {max_steps} of {max_steps}" in logs
    # the signal checkpoint and the final one; every step logged exactly once across both runs
    assert sorted(p.name for p in (d / "checkpoints").glob("step_*")) == sorted([f"step_{stop}", f"step_{max_steps}"])
    assert (d / "checkpoints" / "latest").read_text().strip() == f"step_{max_steps}"
    assert metrics_steps(d) == list(range(max_steps))


def test_plain_scancel_checkpoints_and_does_not_requeue(tmp_path, warm_cache):
    name = f"t_cancel_{os.getpid()}"
    # a checkpoint every step: the first save starts megatron's results-queue manager in each task, and
    # SLURM's SIGTERM reaches it too; the tasks' last checkpoint still goes through it
    jid, d = _submit(tmp_path, name, warm_cache, "rl.trainer.max_steps=500", "rl.trainer.checkpoint_interval=1")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (d / "checkpoints" / "latest").is_file():
        assert _job(jid)["JobState"] in ("PENDING", "RUNNING") and time.monotonic() < deadline, _logs(d)
        time.sleep(0.2)
    subprocess.run(["scancel", jid], check=True, timeout=30)  # SIGTERM to the batch shell and every task
    while "nemo-fp8rl: job ended by SLURM" not in _logs(d):  # the tasks checkpoint within KillWait
        assert time.monotonic() < deadline, _logs(d)
        time.sleep(0.3)
    time.sleep(3)  # a requeue, if there were one, would show by now
    seen: list = []
    info = _wait_done(jid, d, seen)  # under load the job can still be COMPLETING here: wait for its end state
    logs = _logs(d)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), (info, seen, logs)
    assert all(r == 0 and st not in ("PENDING", "REQUEUED") for st, r in seen), (seen, logs)  # never requeued
    m = re.search(r"checkpoint saved at step (\d+) after signal", logs)
    assert m and (d / "checkpoints" / "latest").read_text().strip() == f"step_{m.group(1)}", logs
    assert "batch shell got SIGTERM" in logs and "requeueing" not in logs
