"""benchmarks/bench_step.py prints the step's phase split: weight sync, generation, log-probs, shadow, train."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_step", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_phase_rows_split_the_rollout_into_sync_and_generation():
    b = _bench()
    assert {"rollout", "weight_sync", "logprobs", "train", "step"} <= set(b.PHASES)
    times = {arm: {p: [0.0, 0.0] for p in b.PHASES} for arm in ("a", "b")}
    for arm, k in (("a", 1.0), ("b", 2.0)):
        times[arm].update(rollout=[1.0 * k, 1.2 * k], weight_sync=[0.25 * k, 0.35 * k], logprobs=[0.1 * k] * 2,
                          train=[0.5 * k] * 2, step=[1.8 * k] * 2)
    rows = {r.split()[0]: [float(v) for v in r.split()[1:]] for r in b.phase_rows(times, ("a", "b"))}
    assert rows["weight_sync"] == [0.3, 0.6] and rows["generate"] == [0.8, 1.6]
    assert rows["logprobs"] == [0.1, 0.2] and rows["train"] == [0.5, 1.0] and rows["step"] == [1.8, 3.6]
    assert "shadow" not in rows  # a phase no arm ran is left out
