"""Functions run on each rank of a 2-process gloo group by ``_dist.run_gloo`` (see the tests)."""

from __future__ import annotations

import torch.distributed as dist

from nemo_fp8rl.algorithms import CalibratedClipping, make_metric, metrics_to_floats, reduce_metrics


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


def calibration_case(rank: int, world: int, shards, kwargs):
    """Each rank observes its own shards (list of (ratio, ref_ratio, adv, mask)), then update over WORLD."""
    ctrl = CalibratedClipping(**kwargs)
    for r, rho, a, m in shards[rank]:
        ctrl.observe(r, rho, a, m, step=0)
    metrics = metrics_to_floats(ctrl.update(0, group=dist.group.WORLD))
    return ctrl.bounds, metrics
