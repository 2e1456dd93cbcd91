"""What the GPU check's parts share: the Qwen3-8B layer shapes, the recipes compared, the part context
and a timer.

Every part module (``part_*.py``) runs in its own child process (``runner.py``) and receives a
:class:`Ctx`; ``--dry-run`` gives the same code tiny shapes on the CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Tuple

# Qwen3-8B (nemo_fp8rl/conf/model/qwen3_8b.yaml): hidden 4096, FFN 12288, 32 query heads and 8 KV heads
# of 128 -> one decoder layer's four linears as (out_features, in_features).
SHAPES_8B: Dict[str, Tuple[int, int]] = {
    "qkv": (6144, 4096),      # (32 + 2 * 8) * 128 = 6144
    "o": (4096, 4096),
    "gate_up": (24576, 4096),  # SwiGLU: gate and up fused, 2 * 12288
    "down": (4096, 12288),
}
TOKENS_8B = (4096, 8192, 16384)
# dry run: the same four roles, tiny (multiples of 128, so blockwise shapes stay legal); torch's CPU FP8
# GEMM is a scalar loop (~20M multiply-adds/s on a shared core), so the CPU shapes must stay this small
SHAPES_DRY: Dict[str, Tuple[int, int]] = {"qkv": (384, 128), "o": (128, 128), "gate_up": (256, 128),
                                          "down": (128, 256)}
TOKENS_DRY = (16, 32)

# (label, recipe name, overrides): the recipes the parity and throughput parts compare
RECIPES: List[Tuple[str, str, dict]] = [
    ("delayed", "delayed", {}),
    ("tensorwise", "tensorwise", {}),
    ("rowwise", "rowwise", {}),
    ("blockwise", "blockwise", {}),
    ("blockwise_hybrid", "blockwise", {"fp8_format": "hybrid"}),
    ("mxfp8", "mxfp8", {}),
]


def recipe(label: str):
    """The :class:`~nemo_fp8rl.fp8.Fp8Recipe` of a :data:`RECIPES` label."""
    from nemo_fp8rl.fp8 import get_recipe

    for lab, name, overrides in RECIPES:
        if lab == label:
            return get_recipe(name, **overrides)
    raise ValueError(f"unknown recipe label {label!r}; valid: {[r[0] for r in RECIPES]}")


def shapes(dry: bool) -> Dict[str, Tuple[int, int]]:
    return SHAPES_DRY if dry else SHAPES_8B


def token_counts(dry: bool) -> Tuple[int, ...]:
    return TOKENS_DRY if dry else TOKENS_8B


@dataclass
class Ctx:
    """What a part gets: dry run or not, its device, the output folder, its deadline (Unix time), and
    ``res`` + ``save()`` to write partial results that survive a timeout."""

    dry: bool
    device: str
    out: Path
    deadline: float
    result_path: Path
    res: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.res, default=str))
        os.replace(tmp, self.result_path)


def time_ms(fn: Callable[[], object], device: str, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds after ``warmup`` calls.

    CUDA: one pair of CUDA events per call (kernel time on the stream, no host sync inside the timed
    region); CPU: ``time.perf_counter``.
    """
    import torch

    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        events = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def free_memory() -> None:
    """Drop cached CUDA blocks between arms (modules hold reference cycles: collect them first)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
