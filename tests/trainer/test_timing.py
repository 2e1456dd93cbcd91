"""The step's phase timers wait for the GPU at both ends (nemo_fp8rl/trainer/timing.py; docs/design.md, "One
training step"), so ``timing/<phase>`` is the time until a phase's kernels are done.

A CPU has no queue to wait for, so the device is modelled: ``torch.cuda.synchronize`` is replaced by a
function that runs the modelled device's pending work forward on a modelled clock, which the timers read.
"""

from types import SimpleNamespace

import torch

from nemo_fp8rl.trainer import RLTrainer, timing

from ._cli import every_phase_config


class _Device:
    """A GPU stream as the host sees it: ``launch(s)`` queues s seconds of kernels and returns after
    ``host`` seconds; ``synchronize()`` waits for them. ``clock`` is the host's wall clock in seconds (the
    tests use binary fractions, so sums are exact)."""

    def __init__(self) -> None:
        self.clock, self.pending, self.syncs = 0.0, 0.0, 0

    def launch(self, seconds: float, host: float = 2.0**-7) -> None:
        self.clock += host
        self.pending += seconds

    def synchronize(self) -> None:
        self.clock += self.pending
        self.pending = 0.0
        self.syncs += 1


def _on_modelled_gpu(monkeypatch) -> _Device:
    dev = _Device()
    monkeypatch.setattr(timing, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", dev.synchronize)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: dev.clock))
    return dev


def test_a_phase_counts_its_kernels_until_done_and_not_the_work_queued_before_it(monkeypatch):
    dev = _on_modelled_gpu(monkeypatch)
    timings: dict[str, float] = {}
    dev.launch(0.5)  # the previous phase's kernels, still running
    with timing.timed(timings, "logprobs"):
        dev.launch(0.25)  # this phase's forward: queued in 1/128 s of host time
    assert timings == {"logprobs": 0.25 + 2.0**-7}
    with timing.timed(timings, "logprobs"):  # a second block adds to the key
        dev.launch(0.125)
    assert timings["logprobs"] == 0.25 + 0.125 + 2 * 2.0**-7
    t0 = timing.start()
    dev.launch(0.25, host=0.0)
    assert timing.elapsed_since(t0) == 0.25


def test_without_cuda_in_use_the_timers_only_read_the_clock(monkeypatch):
    monkeypatch.setattr(timing, "_cuda_in_use", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: (_ for _ in ()).throw(AssertionError("synced")))
    timings: dict[str, float] = {}
    with timing.timed(timings, "rollout"):
        pass
    assert timings["rollout"] >= 0.0


def test_a_block_that_raises_adds_no_time_and_no_device_wait(monkeypatch):
    dev = _on_modelled_gpu(monkeypatch)
    timings: dict[str, float] = {}
    try:
        with timing.timed(timings, "train"):
            raise RuntimeError("CUDA error: an illegal memory access")
    except RuntimeError:
        pass
    assert timings == {} and dev.syncs == 1  # the start's wait only


def test_every_timing_metric_of_a_step_is_measured_between_device_waits(tmp_path, monkeypatch, close_trainer):
    """A real FP8 trainer step (calibration step: shadow forwards and the push forward; recomputed old
    log-probs) on a modelled GPU whose clock moves only when the host waits for the device, by exactly one
    second per wait. A phase timed between device waits reads a whole number of waits; a phase timed from
    the raw host clock would read a fraction (or nothing)."""
    cfg = every_phase_config(tmp_path / "run", 1)
    tr = RLTrainer(cfg)
    tr.setup()
    waits = {"n": 0}

    def one_second_per_wait() -> None:
        waits["n"] += 1

    monkeypatch.setattr(timing, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", one_second_per_wait)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: float(waits["n"])))
    m = tr.step()
    close_trainer(tr)
    got = {k: v for k, v in m.items() if k.startswith("timing/")}
    assert set(got) == {f"timing/{k}" for k in ("step", "rollout", "weight_sync", "logprobs", "train", "shadow",
                                                "push_forward")}, got
    for key, seconds in got.items():
        assert seconds >= 1 and seconds == int(seconds), (key, seconds)
    # nested and accumulated timers: weight_sync is part of rollout, and the step holds every phase
    assert got["timing/rollout"] > got["timing/weight_sync"]
    phases = ("rollout", "logprobs", "train", "shadow", "push_forward")
    assert got["timing/step"] > sum(got[f"timing/{k}"] for k in phases)
