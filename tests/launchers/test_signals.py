"""Preemption signals reach every process of a job step (SLURM signals all of them; Ctrl-C the whole
process group). The trainer's reward worker must survive them so the trainer can finish its step and
checkpoint; without this, SIGUSR1 killed the worker and the trainer died with BrokenPipeError."""

import operator
import os
import signal
import time

import pytest

from nemo_fp8rl.tasks.reward_runner import RewardRunner


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_reward_worker_survives_the_jobs_signals(sig):
    with RewardRunner(timeout_s=20.0) as runner:
        first = runner.run(operator.add, [(1.0, 2.0)])
        assert first[0].reward == 3.0 and first[0].error is None
        pid = runner.worker_pid
        os.kill(pid, sig)
        time.sleep(0.5)  # a default handler would have ended the process by now
        os.kill(pid, 0)  # still alive (raises ProcessLookupError otherwise)
        again = runner.run(operator.add, [(2.0, 5.0), (0.5, 0.25)])
        assert [r.reward for r in again] == [7.0, 0.75] and all(r.error is None for r in again)
        assert runner.worker_pid == pid and runner.restarts == 0
