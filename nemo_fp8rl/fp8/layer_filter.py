"""Which linears FP8 makes faster on torch's FP8 GEMMs (``fp8.backend=auto``), from measured H200 numbers.

An FP8 linear saves GEMM time (the FP8 GEMM runs ~1.75x BF16 on an H200) and pays for it around the GEMM:
each activation and gradient is read and written again by the cast kernels, and every call costs host time
(kernel launches, Python) that a small GEMM cannot hide. So FP8 wins only above a size, and the size depends
on the recipe (delayed scaling updates its amax history on the host; block scales have slower GEMMs).
torchao's answer is a ``module_filter_fn`` that keeps small layers in BF16; ours is this table.

Rule: a linear [out_features, in_features] that runs ``tokens`` rows per micro-batch stays BF16 when its GEMM
work ``tokens * out_features * in_features`` (multiply-adds of one GEMM) is below the recipe's threshold:

    recipe            threshold (M*N*K)   measured x BF16 just below | at or above (H200, 2026-12-04, run b)
    tensorwise        1.6e11              o@8192 (1.37e11) 0.86      | qkv@8192, down@4096 (2.06e11) 0.98, 1.06
    blockwise         1.6e11              o@8192 (1.37e11) 1.07      | qkv@8192, down@4096 (2.06e11) 1.17, 1.22
    delayed           4.0e11              o@16384 (2.75e11) 0.79     | qkv@16384, gate_up@4096, down@8192 1.30-1.36
    rowwise           1.6e12              down@16384 (8.2e11) 0.91   | gate_up@16384 (1.65e12) 1.01
    blockwise+hybrid  1.6e12              down@16384 (8.2e11) 1.04, gate_up@8192 (8.2e11) 0.97 | gate_up@16384 1.11
    mxfp8             never on Hopper     no sm90 kernel (emulated)

(``benchmarks/gpu/records/2026-12-04-b/summary.md``: Qwen3-8B projections, forward + dgrad + wgrad, FP8 with
the weight cached per optimizer step, the Triton kernels with the GPU's own FP8 conversions; rowwise was
measured before it had a kernel, on the compiled quantizer: its threshold stands until the next GPU check
re-measures it on the kernel.) The same GEMM
work does not always give the same ratio (qkv@8192 and down@4096 share 2.06e11; qkv@8192 tensorwise measured
1.12x in the morning run and 0.98x in run b): the thresholds sit where the measured rows change sign, and
rows near them may land on either side of 1.0x by a few percent. The decision is made once per layer when the model is built, from the
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

MEASURED_ON = "H200, 2026-12-04 (benchmarks/gpu/records/2026-12-04-b)"

MIN_GEMM_WORK = {
    "tensorwise": 1.6e11,
    "blockwise": 1.6e11,
    "blockwise_hybrid": 1.6e12,
    "delayed": 4.0e11,
    "rowwise": 1.6e12,
}
"""``tokens * out_features * in_features`` at and above which the recipe's FP8 linear measured faster than
BF16 (module docstring); ``blockwise_hybrid`` is blockwise with E5M2 gradients (its dgrad and wgrad are bf16
GEMMs of dequantized operands). A scaling not listed (mxfp8 on Hopper) never is."""


def recipe_threshold(recipe: Fp8Recipe) -> float:
    """The GEMM work at which ``recipe`` pays off on the torch backend (``inf``: never, on the measured GPU)."""
    if recipe.block_e5m2_grads:
        return MIN_GEMM_WORK["blockwise_hybrid"]
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
        return f"{recipe.scaling}: slower than BF16 at every measured shape ({MEASURED_ON})"
    return (f"{recipe.scaling}: {tokens} tokens x [{out_features}, {in_features}] = {work:.2g} < {threshold:.2g}, "
            f"below which FP8 measured slower than BF16 ({MEASURED_ON})")


def auto_keep_reason(recipe: Fp8Recipe, layer_backend: str, auto_tokens: Optional[int], out_features: int,
                     in_features: int, device) -> Optional[str]:
    """The converters' question: keep this linear high precision under ``fp8.backend=auto``? Only a layer
    that would run torch's FP8 GEMMs (``layer_backend == "torch"``) with ``auto_tokens`` set is judged
    (:func:`keep_bf16_reason`); None: convert it."""
    if not auto_tokens or layer_backend != "torch":
        return None
    return keep_bf16_reason(recipe, auto_tokens, out_features, in_features, device)


def log_auto_kept(log, auto_kept: dict) -> None:
    """One warning naming the linears ``fp8.backend=auto`` kept high precision, by reason (``{reason: n}``)."""
    if auto_kept:
        log.warning("fp8.backend=auto: %d linear(s) kept in high precision, where FP8 measured slower than BF16: %s",
                    sum(auto_kept.values()), "; ".join(f"{n}x {r}" for r, n in sorted(auto_kept.items())))


__all__ = ["MEASURED_ON", "MIN_GEMM_WORK", "auto_keep_reason", "keep_bf16_reason", "log_auto_kept", "recipe_threshold"]
