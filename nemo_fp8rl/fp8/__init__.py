"""FP8 training numerics, emulated exactly in pure torch (and mapped to Transformer Engine on GPU).

How FP8 training works
======================
An FP8 number has 8 bits: E4M3 (4 exponent, 3 mantissa bits, max 448) keeps more precision and is
used for what the forward pass multiplies (activations, weights); E5M2 (5 exponent, 2 mantissa bits,
max 57344) keeps more range and is used for output gradients in the ``hybrid`` format. Eight bits
cannot hold a tensor's values directly, so each tensor (or each row, 1x128 block, 128x128 tile, or
1x32 MX block) is multiplied by a *scale* s that maps its largest magnitude (amax) onto the top of
the format, cast with round-to-nearest-even, and saturated: ``q = fp8(clamp(x * s, -M, M))``. The
tensor core multiplies the FP8 values and the result is rescaled by ``1/s`` of each operand. We
always clamp before the cast because torch's E5M2 cast turns overflow into inf rather than
saturating.

A linear layer runs three GEMMs per step: forward ``y = x W^T`` (reduce over K), dgrad
``dx = dy W`` (reduce over N) and wgrad ``dW = dy^T x`` (reduce over tokens M). Scales may vary
only across the dimension that is *not* summed, so per-row and per-block recipes quantize each
operand again along the reduction dimension of each GEMM (Transformer Engine keeps a row-wise and a
column-wise copy for this). Recipes differ in how scales are chosen:

* ``delayed``: one scale per tensor from the amax *history* of previous steps (cheap, but a sudden
  outlier overflows until the history catches up). The first step uses s = 1.
* ``tensorwise`` (current scaling): one scale per tensor from its current amax.
* ``rowwise``: one power-of-two scale per row / output channel (torchao).
* ``blockwise``: 1x128 groups for activations and gradients, 128x128 tiles for weights (DeepSeek-V3
  style), power-of-two scales by default.
* ``mxfp8``: 1x32 blocks with E8M0 (power-of-two) scales (OCP microscaling, Blackwell).

What stays in high precision: embeddings, the LM head, norms, softmax/attention scores, optimizer
master weights (and optionally the first/last layers). The emulation here reproduces the FP8 values
fed to each GEMM bit-exactly and computes the GEMM in float32; ``accumulation="fast"`` additionally
models Hopper's un-promoted FP8 accumulation. ``disable_fp8(model)`` runs the same weights in high
precision: that is the BF16 shadow forward Calibrated Clipping measures against.

This package imports only torch and the standard library (``te.py`` and ``megatron.py`` import their
frameworks lazily / on use), so it can be used from any training stack.
"""

from nemo_fp8rl.fp8 import layer_filter  # noqa: F401 (fp8.backend=auto rule)
from nemo_fp8rl.fp8.formats import E4M3, E5M2, Fp8Format, cast_to_fp8, get_format, round_to_fp8
from nemo_fp8rl.fp8.linear import (
    DelayedScalingMeta,
    Fp8Linear,
    Fp8LinearState,
    collect_fp8_stats,
    convert_to_fp8,
    default_module_filter,
    disable_fp8,
    fp8_gemm,
    fp8_linear,
    fp8_modules,
    fp8_weight_cache,
    quantize_operand,
)
from nemo_fp8rl.fp8.quantize import (
    Fp8Stats,
    compute_scale,
    dequantize,
    e8m0_exponent,
    fake_quantize,
    pow2_floor,
    quantize,
)
from nemo_fp8rl.fp8.recipes import Fp8Recipe, get_recipe, list_recipes, register_fp8_recipe, resolve_recipe
from nemo_fp8rl.fp8.rollout import ROLLOUT_SCHEMES, RolloutScheme, get_rollout_scheme

__all__ = [
    "E4M3", "E5M2", "Fp8Format", "cast_to_fp8", "get_format", "round_to_fp8",
    "DelayedScalingMeta", "Fp8Linear", "Fp8LinearState", "collect_fp8_stats", "convert_to_fp8",
    "default_module_filter", "disable_fp8", "fp8_gemm", "fp8_linear", "fp8_modules", "fp8_weight_cache", "quantize_operand",
    "Fp8Stats", "compute_scale", "dequantize", "e8m0_exponent", "fake_quantize", "pow2_floor", "quantize",
    "Fp8Recipe", "get_recipe", "list_recipes", "register_fp8_recipe", "resolve_recipe",
    "ROLLOUT_SCHEMES", "RolloutScheme", "get_rollout_scheme",
]
