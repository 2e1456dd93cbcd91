"""Misbehaving reward functions for the reward-runner tests (module-level so the worker can import them)."""

from __future__ import annotations

import os
import time


def flaky_reward(response: str, answer: str) -> tuple[float, bool]:
    """Behaves per response: 'raise', 'hang', 'crash', 'nan', 'text', 'print', else exact match."""
    if response == "raise":
        raise RuntimeError("reward function bug")
    if response == "hang":
        time.sleep(600)
    if response == "crash":
        os._exit(3)
    if response == "nan":
        return float("nan")
    if response == "text":
        return "1.0"  # type: ignore[return-value]
    if response == "print":
        print("noise on stdout must not corrupt the result pipe")
        return 0.5
    return (1.0, True) if response == answer else (0.0, False)


def slow_reward(response: str, answer: str, delay: float) -> float:
    time.sleep(delay)
    return 1.0


_prepared = False
"""Whether this worker process has run its (simulated) slow set-up."""


def prepare_slowly(delay: float) -> None:
    """A reward function's set-up that takes ``delay`` seconds (like ``import reasoning_gym``)."""
    global _prepared
    time.sleep(delay)
    _prepared = True


def lazy_setup_reward(response: str, answer: str, delay: float) -> float:
    """Fast, except that a worker's first call does the set-up itself when nobody prepared it."""
    if not _prepared:
        prepare_slowly(delay)
    return 1.0


def failing_prepare() -> None:
    raise ImportError("No module named 'my_checker'")
