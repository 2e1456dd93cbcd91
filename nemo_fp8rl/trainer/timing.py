"""Wall-clock phase timers of the RL step (the ``timing/<phase>`` metrics: step, rollout, weight_sync, logprobs,
train, shadow, push_forward).

A CUDA stream runs its kernels after the host has queued them, so a host clock read right after a phase
measures what the phase launched, not what it ran: an unsynchronized log-prob forward on a GPU can read
little more than its launch time, and its kernels' time then lands in whichever later phase first waits for
the device (the train phase's first ``.item()``). Each timer therefore waits for the device at both ends
(``torch.cuda.synchronize()``), as Megatron's timers do, so a phase's time is the time until its work is
done and nothing queued before it is counted. That costs one wait per phase boundary, a handful per step
of seconds. Without CUDA in use (CPU runs, and GPU hosts where this process never touched CUDA) there is
nothing to wait for and the timers only read the clock.

Each timed block is also a named range, ``phase/<key>``, in a profile of the step
(``trainer.profile``, :mod:`nemo_fp8rl.trainer.profiling`): a ``torch.profiler.record_function`` (a few
microseconds when no profiler runs) and, while an Nsight Systems capture runs, an NVTX range.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["device_sync", "elapsed_since", "set_nvtx", "start", "timed"]

_nvtx = {"on": False}


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def device_sync() -> None:
    """Wait until the work queued on this process's current CUDA device is done (no-op without CUDA in use)."""
    if _cuda_in_use():
        torch.cuda.synchronize()


def start() -> float:
    """A phase's start: the device's queued work done, then the clock (``time.perf_counter()``, seconds)."""
    device_sync()
    return time.perf_counter()


def elapsed_since(t0: float) -> float:
    """Seconds from :func:`start`'s ``t0`` until the work queued since then is done."""
    device_sync()
    return time.perf_counter() - t0


def set_nvtx(on: bool) -> None:
    """Push an NVTX range per timed block from now on (``trainer.profile.kind=nsys`` while it captures)."""
    _nvtx["on"] = bool(on)


@contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's time (:func:`start` to :func:`elapsed_since`) to ``timings[key]``; the block is the
    range ``phase/<key>`` of a profile. A block that raises adds nothing (its step fails, and a device wait
    could hide the error)."""
    name = f"phase/{key}"
    nvtx = _nvtx["on"]
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            t0 = start()
            yield
            timings[key] = timings.get(key, 0.0) + elapsed_since(t0)
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()
