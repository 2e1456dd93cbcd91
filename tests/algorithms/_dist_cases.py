"""Functions run on each rank of a 2-process gloo group by ``_dist.run_gloo``, and their test data.

All gloo checks of this folder run in one pair of processes (``all_cases``, through the session
fixture ``gloo_results`` in conftest.py) because starting interpreters dominates their cost.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_fp8rl.algorithms import CalibratedClipping, make_metric, metrics_to_floats, reduce_metrics

CALIB_KW = {"eps_low": 0.2, "eps_high": 0.28, "min_tokens": 16, "max_tokens": 100000}


def step_data(seed, n_mb=2, B=8, T=16, noise=0.15):
    """Minibatches (ratio, ref_ratio, advantages [B], mask) with FP8-like noise on the BF16 log-ratio."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_mb):
        hp = 0.1 * torch.randn(B, T, generator=g)
        r = (hp + noise * torch.randn(B, T, generator=g)).exp()
        adv = torch.randn(B, generator=g)
        mask = torch.rand(B, T, generator=g) > 0.2
        out.append((r, hp.exp(), adv, mask))
    return out


def calibration_shards():
    """Per-rank minibatches of one calibration step (rank 1 has more and larger minibatches)."""
    return [step_data(11, n_mb=2), step_data(12, n_mb=3, B=6)]


def reduce_case(rank: int, world: int):
    calls = []
    orig = dist.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    dist.all_reduce = counting
    try:
        mbs = [
            {
                "loss": make_metric(float(rank + i), "mean"),
                "tok": make_metric(10.0 * (rank + 1), "sum"),
                "kl": make_metric(0.5 * rank, "mean"),
                "rmin": make_metric(1.0 - rank - i, "min"),
                "rmax": make_metric(rank + 2.0 * i, "max"),
            }
            for i in range(2)
        ]
        out = metrics_to_floats(reduce_metrics(mbs, group=dist.group.WORLD))
    finally:
        dist.all_reduce = orig
    return out, len(calls)


def calibration_case(rank: int, world: int):
    """Each rank observes its own shard, then ``update`` all-gathers over WORLD."""
    ctrl = CalibratedClipping(**CALIB_KW)
    for r, rho, a, m in calibration_shards()[rank]:
        ctrl.observe(r, rho, a, m, step=0)
    metrics = metrics_to_floats(ctrl.update(0, group=dist.group.WORLD))
    return ctrl.bounds, metrics


def all_cases(rank: int, world: int):
    return {"reduce": reduce_case(rank, world), "calibration": calibration_case(rank, world)}
