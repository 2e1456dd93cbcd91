"""Metric convention shared by the whole package: tensors with a reduction hint.

A metric is a pair ``(tensor, reduction)``: ``tensor`` is a 0-dim tensor that may live on the GPU and
may still be part of nothing (always detached by the producer), and ``reduction`` says how values from
different microbatches and data-parallel ranks combine: ``"mean"``, ``"sum"``, ``"min"`` or ``"max"``.

Why tensors and not floats: converting to a Python float (``.item()``) forces a host-device sync. Doing
that inside a loss, once per microbatch, stalls the GPU pipeline (verl and TRL both warn about it). So
losses return tensors, the trainer combines them with :func:`reduce_metrics` (one collective per
reduction kind, not one per metric) and converts to floats once per step with :func:`metrics_to_floats`.

Note on ``"mean"``: it is the plain mean over entries (microbatches, then ranks). A fraction over tokens
that must be exact across uneven microbatches should be reported as two ``"sum"`` metrics (numerator,
denominator) and divided by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Metric = tuple[torch.Tensor, str]
"""``(0-dim tensor, reduction)`` with reduction in :data:`REDUCTIONS`."""

REDUCTIONS = ("mean", "sum", "min", "max")


def make_metric(value: torch.Tensor | float, reduction: str) -> Metric:
    """Build a validated :data:`Metric`: detach ``value`` and make it a 0-dim float tensor.

    Args:
        value: a tensor with exactly one element, or a Python number.
        reduction: one of ``"mean"``, ``"sum"``, ``"min"``, ``"max"``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not valid; use one of {REDUCTIONS}")
    t = torch.as_tensor(value).detach()
    if t.numel() != 1:
        raise ValueError(f"a metric value must have one element, got shape {tuple(t.shape)}; reduce it first")
    if not torch.is_floating_point(t):
        t = t.to(torch.float32)
    return t.reshape(()), reduction


def _check_metric(name: str, m: object) -> Metric:
    if not (
        isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], torch.Tensor) and isinstance(m[1], str)
    ):
        raise ValueError(f"metric {name!r} must be a (tensor, reduction) tuple, got {type(m).__name__}")
    t, red = m
    if red not in REDUCTIONS:
        raise ValueError(f"metric {name!r} has reduction {red!r}; use one of {REDUCTIONS}")
    if t.numel() != 1:
        raise ValueError(f"metric {name!r} must be a 0-dim tensor, got shape {tuple(t.shape)}")
    return t, red


def reduce_metrics(
    metric_dicts: Sequence[Mapping[str, Metric]], group: torch.distributed.ProcessGroup | None = None
) -> dict[str, Metric]:
    """Combine metrics of several microbatches and, optionally, over a process group.

    Local step, for each name present in any entry (entries lacking a name are skipped for it):
    ``mean`` -> mean over the entries, ``sum`` -> sum, ``min`` -> min, ``max`` -> max.
    Distributed step (``group`` given and ``torch.distributed`` initialised): the local results of each
    reduction kind are stacked into one float64 vector and all-reduced with one collective per kind
    (SUM for ``sum`` and ``mean``, then ``mean`` divides by the group size; MIN; MAX), keys sorted by
    name. Every rank of ``group`` must therefore call this with the same set of ``(name, reduction)``
    pairs, in any order.

    Args:
        metric_dicts: list of ``dict[str, Metric]`` (one per microbatch).
        group: a ``torch.distributed`` process group, or None for local reduction only.

    Returns:
        ``dict[str, Metric]`` with 0-dim float64 tensors (detached), same reductions as the inputs.
    """
    values: dict[str, list[torch.Tensor]] = {}
    kinds: dict[str, str] = {}
    for d in metric_dicts:
        for name, m in d.items():
            t, red = _check_metric(name, m)
            if kinds.setdefault(name, red) != red:
                raise ValueError(
                    f"metric {name!r} has reduction {red!r} in one entry and {kinds[name]!r} in another"
                )
            values.setdefault(name, []).append(t.detach().reshape(()).to(torch.float64))

    local: dict[str, torch.Tensor] = {}
    for name, ts in values.items():
        device = ts[0].device
        x = torch.stack([t.to(device) for t in ts])
        red = kinds[name]
        local[name] = {"mean": x.mean, "sum": x.sum, "min": x.min, "max": x.max}[red]()

    if group is not None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group was given but torch.distributed is not initialised; pass group=None")
        world = dist.get_world_size(group)
        # NCCL reduces CUDA tensors only; metrics made on the host (e.g. calibration) are moved there.
        nccl = dist.get_backend(group) == "nccl"
        ops = {
            "mean": dist.ReduceOp.SUM,
            "sum": dist.ReduceOp.SUM,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
        }
        for red in REDUCTIONS:
            names = sorted(n for n in local if kinds[n] == red)
            if not names:
                continue
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else local[names[0]].device
            buf = torch.stack([local[n].to(device) for n in names])
            dist.all_reduce(buf, op=ops[red], group=group)
            if red == "mean":
                buf = buf / world
            for i, n in enumerate(names):
                local[n] = buf[i]

    return {name: (local[name], kinds[name]) for name in values}


def metrics_to_floats(d: Mapping[str, Metric | torch.Tensor | float]) -> dict[str, float]:
    """Convert metrics to Python floats with a single host sync.

    All tensor values are stacked (on the device of the first one) and copied to the host once, instead
    of one ``.item()`` per metric. Accepts ``Metric`` tuples, bare tensors, or numbers.
    """
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    out: dict[str, float] = {}
    for name, m in d.items():
        t = m[0] if isinstance(m, tuple) else m
        if isinstance(t, torch.Tensor):
            if t.numel() != 1:
                raise ValueError(f"metric {name!r} must be a 0-dim tensor, got shape {tuple(t.shape)}")
            names.append(name)
            tensors.append(t.detach().reshape(()).to(torch.float64))
        else:
            out[name] = float(t)
    if tensors:
        device = tensors[0].device
        host = torch.stack([t.to(device) for t in tensors]).cpu().tolist()
        out.update(zip(names, host))
    return {name: out[name] for name in d}
