"""Transformer Engine's FP8 quantization rules, rewritten as plain torch for bit-exact checks of ours.

Read from TE 2.8 to 2.20 (the rules below did not change in that range):

* ``transformer_engine/common/recipe/recipe_common.cuh``: ``compute_scale_from_amax``, the scale rule of
  every current-scaling and block-scaling kernel, and ``compute_scale_from_types``, which picks the value
  an infinite scale is replaced by (the *input* dtype's largest value for the 1x128 / 128x128 kernels).
* ``transformer_engine/common/recipe/current_scaling.cu``: the per-tensor scale kernel passes float32's
  largest value instead.
* ``transformer_engine/common/util/ptx.cuh``: ``float_to_e8m0`` (round the exponent up, saturate at
  2^127) and ``exp2f_rcp`` (the power of two the MX kernel multiplies by);
  ``cast/mxfp8/quantize_mxfp8.cuh``: the MX exponent comes from ``amax * (1 / max)`` where max belongs
  to the *output* format (448 for E4M3, 57344 for E5M2).
* TE's own pure-torch references, ``tests/pytorch/references/quantize_scale_calc.py``,
  ``ref_per_tensor_cs.py`` and ``blockwise_quantizer_reference.py``: same arithmetic for finite amax.

Where TE's torch references and its CUDA kernels disagree, this file follows the kernels (they are what
runs), and says so:

* amax: the kernels reduce with ``fmaxf`` starting from 0, which skips NaN; ``torch.amax`` returns NaN.
* amax of inf or NaN: the kernel's scale is 1; the torch reference computes M / inf = 0 (and NaN).

Every function works in float32 the way the kernels do: the input is widened to float32 exactly, the
scale is ``fp32(M) / amax`` (IEEE division), the data is ``fp8_satfinite(x * s)`` (round to nearest even,
finite overflow and inf clamp to +-M, NaN stays NaN) and the stored inverse is ``fp32(1 / s)``.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP32_MAX = torch.finfo(torch.float32).max
_SIGN_AND_EXPONENT = -(1 << 23)  # 0xFF800000 as an int32: keeps the sign and exponent bits of a float32


def amax_like_kernel(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| in float32 the way TE's kernels reduce (``fmaxf`` from 0): NaN elements are skipped."""
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    return a.amax() if dim is None else a.amax(dim=dim)


def satfinite_cast(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 -> FP8 as CUDA's ``__NV_SATFINITE`` conversion: nearest even, +-inf and overflow to +-M."""
    m = FP8_MAX[fmt]
    clamped = torch.where(torch.isnan(v), v, v.clamp(-m, m))
    return clamped.to(FP8_DTYPE[fmt])


def scale_from_amax(amax: torch.Tensor, fmt: str, *, eps: float = 0.0, pow2: bool = False,
                    value_for_inf: float = FP32_MAX) -> torch.Tensor:
    """``compute_scale_from_amax``, element by element (amax: float32, any shape).

    1. amax below eps is raised to eps (a NaN amax is not: NaN < eps is false);
    2. amax of 0, inf or NaN (after step 1) gives scale 1;
    3. otherwise s = fp32(M) / amax, and an infinite s (amax tiny) becomes ``value_for_inf``;
    4. power-of-two mode keeps only the sign and exponent bits of s, i.e. 2^floor(log2 s).
    """
    amax = amax.float()
    eps_t = torch.tensor(eps, dtype=torch.float32)
    amax = torch.where(amax < eps_t, eps_t, amax)
    unusable = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    s = torch.tensor(FP8_MAX[fmt], dtype=torch.float32) / amax
    s = torch.where(torch.isinf(s), torch.tensor(value_for_inf, dtype=torch.float32), s)
    if pow2:
        s = (s.view(torch.int32) & _SIGN_AND_EXPONENT).view(torch.float32)
    return torch.where(unusable, torch.ones_like(s), s)


def quantize_per_tensor(x: torch.Tensor, fmt: str, *, eps: float = 0.0, pow2: bool = False):
    """Float8CurrentScaling: one scale from the tensor's amax -> (fp8 data shaped like x, scale_inv [])."""
    s = scale_from_amax(amax_like_kernel(x), fmt, eps=eps, pow2=pow2, value_for_inf=FP32_MAX)
    return satfinite_cast(x.float() * s, fmt), torch.reciprocal(s)


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Delayed scaling's cast with a given float32 scale: ``fp8_satfinite(x * scale)``."""
    return satfinite_cast(x.float() * scale.float(), fmt)


def quantize_blockwise(x: torch.Tensor, fmt: str, tile: tuple, *, eps: float = 0.0, pow2: bool = True):
    """Float8BlockScaling on a 2-D x [M, K] with ``tile`` (1, 128) or (128, 128); edge tiles are partial.

    Returns (fp8 data [M, K], scale_inv [ceil(M / tile_rows), ceil(K / tile_cols)]); for (1, 128) that is
    [M, ceil(K / 128)]. An infinite scale becomes the input dtype's largest value (bf16's for bf16 x).
    """
    rows, cols = x.shape
    tr, tc = tile
    nr, nc = math.ceil(rows / tr), math.ceil(cols / tc)
    value_for_inf = torch.finfo(x.dtype).max
    xf = x.float()
    data = torch.zeros(rows, cols, dtype=torch.uint8)
    scale_inv = torch.zeros(nr, nc, dtype=torch.float32)
    for j in range(nc):
        c0, c1 = j * tc, min((j + 1) * tc, cols)
        if tr == 1:  # 1 x 128: every row of this column strip is its own block
            strip = xf[:, c0:c1]
            s = scale_from_amax(amax_like_kernel(strip, dim=1), fmt, eps=eps, pow2=pow2,
                                value_for_inf=value_for_inf)
            data[:, c0:c1] = satfinite_cast(strip * s[:, None], fmt).view(torch.uint8)
            scale_inv[:, j] = torch.reciprocal(s)
            continue
        for i in range(nr):
            r0, r1 = i * tr, min((i + 1) * tr, rows)
            tile_x = xf[r0:r1, c0:c1]
            s = scale_from_amax(amax_like_kernel(tile_x), fmt, eps=eps, pow2=pow2,
                                value_for_inf=value_for_inf)
            data[r0:r1, c0:c1] = satfinite_cast(tile_x * s, fmt).view(torch.uint8)
            scale_inv[i, j] = torch.reciprocal(s)
    return data.view(FP8_DTYPE[fmt]), scale_inv


def e8m0_from_amax(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """MX shared scale as TE stores it: a biased E8M0 byte (int32 in 0..255), exponent = byte - 127.

    v = fp32(amax * fp32(1 / M)) with M the output format's max; the byte is v's float32 exponent field,
    plus one when v is not already a power of two (round up), except at the top field 254 (saturate) and
    for a subnormal v <= 2^-127. v = 0 gives 0, inf gives 254, NaN gives 255 (a NaN scale).
    """
    v = amax.float() * torch.tensor(1.0 / FP8_MAX[fmt], dtype=torch.float32)
    bits = v.view(torch.int32)
    field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (field != 254) & ~((field == 0) & (mantissa <= 0x400000))
    byte = field + round_up.to(torch.int32)
    byte = torch.where(v == 0, torch.zeros_like(byte), byte)
    byte = torch.where(torch.isinf(v), torch.full_like(byte, 254), byte)
    return torch.where(torch.isnan(v), torch.full_like(byte, 255), byte)


def e8m0_multiplier(byte: torch.Tensor) -> torch.Tensor:
    """``exp2f_rcp``: the MX cast's multiplier, 2^(127 - byte) (2^-127 for 254; NaN for 255)."""
    m = torch.ldexp(torch.ones(byte.shape, dtype=torch.float32), (127 - byte).to(torch.int32))
    return torch.where(byte == 255, torch.full_like(m, float("nan")), m)


def e8m0_scale_inv(byte: torch.Tensor) -> torch.Tensor:
    """The dequantization factor of a byte, 2^(byte - 127) (2^-127 for 0; NaN for 255)."""
    m = torch.ldexp(torch.ones(byte.shape, dtype=torch.float32), (byte - 127).to(torch.int32))
    return torch.where(byte == 255, torch.full_like(m, float("nan")), m)


def quantize_mxfp8(x: torch.Tensor, fmt: str, block: int = 32):
    """MXFP8 along the last dim of x [..., K] -> (fp8 data [..., K], E8M0 bytes [..., ceil(K / block)]).

    Per block of ``block`` consecutive elements (the last one zero padded, which leaves its amax
    unchanged): byte = :func:`e8m0_from_amax`, data = fp8_satfinite(x * 2^(127 - byte)).
    """
    k = x.shape[-1]
    pad = (-k) % block
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    blocks = xf.reshape(*xf.shape[:-1], -1, block)
    byte = e8m0_from_amax(amax_like_kernel(blocks, dim=-1), fmt)
    q = satfinite_cast(blocks * e8m0_multiplier(byte)[..., None], fmt)
    q = q.view(torch.uint8).reshape(*xf.shape[:-1], -1)[..., :k]
    return q.view(FP8_DTYPE[fmt]), byte


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """TE's read-back: ``float32(q) * scale_inv`` (scale_inv broadcast to data's shape)."""
    return data.float() * scale_inv
