"""Which linears FP8 makes faster on torch's FP8 GEMMs (``fp8.backend=auto``), from measured H200 numbers.

An FP8 linear saves GEMM time (the FP8 GEMM runs ~1.75x BF16 on an H200) and pays for it around the GEMM:
each activation and gradient is read and written again by the cast kernels, and every call costs host time
(kernel launches, Python) that a small GEMM cannot hide. So FP8 wins only above a size, and the size depends
on the recipe (delayed scaling updates its amax history on the host; block scales have slower GEMMs).
torchao's answer is a ``module_filter_fn`` that keeps small layers in BF16; ours is this table.

Rule: a linear [out_features, in_features] that runs ``tokens`` rows per micro-batch stays BF16 when its GEMM
work ``tokens * out_features * in_features`` (multiply-adds of one GEMM) is below the recipe's threshold:

    recipe            threshold (M*N*K)   measured x BF16 just below / at-or-above (H200, 2026-12-04)
    tensorwise        1.6e11              o@8192 (1.37e11) 0.79  |  qkv@8192, down@4096 (2.06e11) 1.12, 1.52
    blockwise         1.6e11              o@8192 (1.37e11) 0.83  |  qkv@8192 (2.06e11) 1.09, down@4096 1.19
    delayed           4.0e11              o@16384 (2.75e11) 0.97 |  qkv@16384, gate_up@4096, down@8192 (4.1e11) 1.21-1.30
    rowwise           1.6e12              down@16384 (8.2e11) 0.84 | gate_up@16384 (1.65e12) 1.03
    blockwise+hybrid  never               0.79-0.99 at every shape (its E5M2 GEMMs run in bf16)
    mxfp8             never on Hopper     no sm90 kernel (emulated)

(``benchmarks/gpu/records/2026-12-04/summary.md``: Qwen3-8B projections, forward + dgrad + wgrad, FP8 with
the weight cached per optimizer step.) The decision is made once per layer when the model is built, from the
run's micro-batch size (``parallel.micro_batch_size * model.seq_length`` tokens): a layer never switches
between FP8 and BF16 from one call to the next, which would change the numbers of the log-prob ratio that
Calibrated Clipping measures. It applies to the torch backend on a CUDA GPU only: the emulation (CPU) and
Transformer Engine keep every layer they convert. Other GPUs than the H200 are judged by the same table
until they are measured. This module imports only torch.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from nemo_fp8rl.fp8.recipes import Fp8Recipe

MEASURED_ON = "H200, 2026-12-04 (benchmarks/gpu/records/2026-12-04)"

MIN_GEMM_WORK = {
    "tensorwise": 1.6e11,
    "blockwise": 1.6e11,
    "delayed": 4.0e11,
    "rowwise": 1.6e12,
}
"""``tokens * out_features * in_features`` at and above which the recipe's FP8 linear measured faster than
BF16 (module docstring). A scaling not listed (mxfp8 on Hopper) or blockwise with E5M2 gradients never is."""


def recipe_threshold(recipe: Fp8Recipe) -> float:
    """The GEMM work at which ``recipe`` pays off on the torch backend (``inf``: never, on the measured GPU)."""
    if recipe.scaling == "blockwise" and recipe.format_for("grad_output").name == "e5m2":
        return math.inf  # hybrid: dgrad and wgrad are bf16 GEMMs of dequantized operands plus the casts
    return MIN_GEMM_WORK.get(recipe.scaling, math.inf)


def keep_bf16_reason(recipe: Fp8Recipe, tokens: int, out_features: int, in_features: int, device) -> Optional[str]:
    """Why ``fp8.backend=auto`` keeps this linear in high precision (None: it runs FP8).

    Only a CUDA layer on the torch backend is judged; ``tokens`` is the rows of one micro-batch.
    """
    if torch.device(device).type != "cuda":
        return None
    work = float(tokens) * out_features * in_features
    threshold = recipe_threshold(recipe)
    if work >= threshold:
        return None
    if math.isinf(threshold):
        what = "blockwise with E5M2 gradients" if recipe.scaling == "blockwise" else recipe.scaling
        return f"{what}: slower than BF16 at every measured shape ({MEASURED_ON})"
    return (f"{recipe.scaling}: {tokens} tokens x [{out_features}, {in_features}] = {work:.2g} < {threshold:.2g}, "
            f"below which FP8 measured slower than BF16 ({MEASURED_ON})")


__all__ = ["MEASURED_ON", "MIN_GEMM_WORK", "keep_bf16_reason", "recipe_threshold"]
