"""Reward functions that raise, hang, crash or return garbage score 0, are counted, and never stop scoring."""

from __future__ import annotations

import functools
import os
import time

import pytest

from nemo_fp8rl.tasks import ArithmeticTask
from nemo_fp8rl.tasks.reward_runner import RewardRunner

from .reward_helpers import failing_prepare, flaky_reward, lazy_setup_reward, prepare_slowly, slow_reward


def test_errors_timeouts_and_crashes_score_zero_and_scoring_continues():
    items = [("0579", "0579"), ("raise", "x"), ("hang", "x"), ("0001", "0001"), ("crash", "x"),
             ("nan", "x"), ("text", "x"), ("print", "x"), ("0002", "0003"), ("0004", "0004")]
    with RewardRunner(timeout_s=1.0) as runner:
        assert runner.worker_pid is None  # started on first use
        assert runner.run(flaky_reward, [("a", "a")])[0].reward == 1.0
        first_pid = runner.worker_pid
        t0 = time.monotonic()
        res = runner.run(flaky_reward, items)
        elapsed = time.monotonic() - t0
        assert [r.reward for r in res] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.0, 1.0]
        assert [r.correct for r in res] == [True, False, False, True, False, False, False, True, False, True]
        errors = {i: r.error for i, r in enumerate(res) if r.error is not None}
        assert sorted(errors) == [1, 2, 4, 5, 6]
        assert "RuntimeError: reward function bug" in errors[1]
        assert "timed out after 1 s" in errors[2]
        assert "worker died (exit code 3)" in errors[4]
        assert "non-finite" in errors[5]
        assert "must return a float" in errors[6]
        # the hang was cut at the timeout, not waited out (the function sleeps 600 s)
        assert elapsed < 15, elapsed
        assert runner.restarts == 2 and runner.worker_pid != first_pid
        # the killed worker is really gone
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)
        # and the runner keeps working afterwards
        assert [r.reward for r in runner.run(flaky_reward, [("a", "a")])] == [1.0]


def test_timeout_is_per_call():
    # 4 calls of 0.3 s each take 1.2 s in total, but none exceeds the 1 s per-call timeout.
    with RewardRunner(timeout_s=1.0) as runner:
        res = runner.run(functools.partial(slow_reward, delay=0.3), [("a", "b")] * 4)
    assert [r.error for r in res] == [None] * 4


def test_unpicklable_function_is_a_programming_error():
    with RewardRunner(timeout_s=1.0) as runner, pytest.raises(TypeError, match="not picklable"):
        runner.run(lambda r, a: 1.0, [("a", "b")])
    with pytest.raises(ValueError, match="reward_timeout_s"):
        RewardRunner(timeout_s=0)


class FlakyArithmetic(ArithmeticTask):
    @property
    def reward_fn(self):
        return flaky_reward


def test_task_score_counts_reward_errors_in_metrics():
    task = FlakyArithmetic(reward_timeout_s=1.0)
    try:
        prompts = task.prompts(4)
        responses = [prompts[0].answer, "raise", "hang", prompts[3].answer]
        t0 = time.monotonic()
        s = task.score(prompts, responses)
        assert time.monotonic() - t0 < 15
        assert s.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
        assert s.errors == 2 and len(s.error_messages) == 2
        assert s.invalid.tolist() == [False, True, True, False]
        m = {k: float(v[0]) for k, v in s.metrics().items()}
        assert m == {"reward/mean": 0.5, "reward/accuracy": 0.5, "reward/errors": 2.0, "rollout/invalid_frac": 0.5}
        assert s.metrics()["reward/errors"][1] == "sum"
    finally:
        task.close()


def test_worker_killed_between_batches_is_restarted():
    """A worker that dies while idle (e.g. a signal to the whole job step) costs a restart, not the run."""
    runner = RewardRunner(timeout_s=10.0)
    try:
        first = runner.run(flaky_reward, [("1", "1")])
        runner._proc.kill()
        runner._proc.wait()
        second = runner.run(flaky_reward, [("1", "1"), ("2", "1")])
        assert [r.error for r in first + second] == [None, None, None]
        assert runner.restarts == 1
    finally:
        runner.close()


def test_prepare_runs_once_per_worker_outside_the_per_call_deadline():
    """A checker whose set-up (an import) outlasts the per-call timeout: without ``prepare`` the first call
    of every fresh worker times out, and the worker that replaces the killed one starts over; with it, each
    worker sets up once under the start-up deadline and no call is lost, after a restart too."""
    fn = functools.partial(lazy_setup_reward, delay=2.5)
    with RewardRunner(timeout_s=1.0) as runner:
        res = runner.run(fn, [("a", "b")] * 3)
        assert [r.error is not None for r in res[:2]] == [True, True], res  # the cascade
        assert "timed out after 1 s" in res[0].error and runner.restarts >= 2
    with RewardRunner(timeout_s=1.0) as runner:
        prepare = functools.partial(prepare_slowly, delay=2.5)
        assert [r.error for r in runner.run(fn, [("a", "b")] * 3, prepare=prepare)] == [None] * 3
        runner._proc.kill()  # a fresh worker prepares again
        runner._proc.wait()
        assert [r.error for r in runner.run(fn, [("a", "b")] * 2, prepare=prepare)] == [None] * 2
        assert runner.restarts == 1


def test_a_failing_or_unpicklable_prepare_is_a_programming_error():
    with RewardRunner(timeout_s=1.0) as runner:
        with pytest.raises(RuntimeError, match=r"could not prepare the reward function: ImportError: No module "
                                               r"named 'my_checker' \(the task's reward_prepare"):
            runner.run(flaky_reward, [("a", "a")], prepare=failing_prepare)
        with pytest.raises(TypeError, match="reward prepare .* is not picklable"):
            runner.run(flaky_reward, [("a", "a")], prepare=lambda: None)
        assert [r.reward for r in runner.run(flaky_reward, [("a", "a")])] == [1.0]  # and it still works after


@pytest.mark.parametrize("name", ["reasoning_gym", "math_jsonl"])
def test_the_slow_importing_tasks_prepare_their_checker(name, tmp_path):
    """reasoning_gym (matplotlib) and math_jsonl (SymPy) import their checkers in ``reward_prepare``."""
    import pickle

    from nemo_fp8rl.tasks import get_task

    pytest.importorskip("reasoning_gym" if name == "reasoning_gym" else "math_verify")
    kw = {}
    if name == "math_jsonl":
        (tmp_path / "d.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
        kw["path"] = str(tmp_path / "d.jsonl")
    task = get_task(name, **kw)
    try:
        prepare = pickle.loads(pickle.dumps(task.reward_prepare))
        prepare()
        p = task.prompts(1)[0]
        good = f"<answer>{p.answer}</answer>" if name == "reasoning_gym" else f"\\boxed{{{p.answer}}}"
        s = task.score([p], [good])
        assert s.errors == 0 and s.correct.tolist() == [True]
        # score() handed the prepare to its worker, which ran it before the call
        assert task._runner._loaded == (pickle.dumps(task.reward_fn), pickle.dumps(task.reward_prepare))
    finally:
        task.close()
    assert ArithmeticTask().reward_prepare is None
