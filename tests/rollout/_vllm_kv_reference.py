"""A readable port of vLLM 0.32's FP8 KV-cache rules, one value at a time: the arbiter of
``nemo_fp8rl.fp8.kv_cache`` (which is vectorized).

Ported rules, not code (the upstream files, read for this port):

- GPU cache writer: ``reshape_and_cache_flash`` (csrc/cache_kernels.cu) converts each element with
  ``fp8::scaled_convert`` (csrc/quantization/fp8/nvidia/quant_utils.cuh): float32(x) divided by the
  float32 scale, then ``__nv_cvt_float_to_fp8`` with ``__NV_SATFINITE``: round to the nearest FP8 value,
  ties to the even code, saturating at the largest finite value.
- CPU cache writer (vLLM-CPU): ``cpu_attn_reshape_and_cache`` with ``float_to_fp8e4m3_scalar`` /
  ``float_to_fp8e5m2_scalar`` (csrc/cpu/cpu_attn_fp8.hpp): multiply by the float32 reciprocal of the
  scale, clamp to the format's largest value, then cut the code out of the float32 bits (E4M3: the bits
  of ``v * 2^-120``; E5M2: exponent and top two mantissa bits, subnormals by a right shift).
- Query: ``Attention.forward`` quantizes the query with ``QuantFP8(static=True)`` on backends with
  ``supports_quant_query_input`` (vllm/model_executor/layers/attention/attention.py): float32(x) times the
  float32 reciprocal of ``_q_scale``, clamped, cast to E4M3 (vllm/model_executor/layers/quantization/
  input_quant_fp8.py, ``forward_native``; the CUDA kernel computes the same product).
- Read-back: the cache value times the scale in float32 (``scaled_vec_conversion`` fp8 -> float, and the
  CPU reference ``fp8e4m3_to_float_scalar``).
- Scales: ``BaseKVCacheMethod.process_weights_after_loading`` (vllm/model_executor/layers/quantization/
  kv_cache.py) keeps per-tensor scales only and uses 1.0 when the checkpoint has none.

Float32 arithmetic is done in Python doubles and rounded to float32 with ``struct``: for one +, -, *, /
of float32 operands the double result rounded to float32 is the correctly rounded float32 result
(53 >= 2 * 24 + 2 bits), so no double-rounding error can appear.
"""

from __future__ import annotations

import math
import struct

FORMATS = {"e4m3": {"exp": 4, "man": 3, "bias": 7, "max": 448.0},
           "e5m2": {"exp": 5, "man": 2, "bias": 15, "max": 57344.0}}


def f32(x: float) -> float:
    """Round a double to float32 (round to nearest even, subnormals kept)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def decode(code: int, fmt: str) -> float:
    """The value of an FP8 code (0..255): sign, biased exponent, mantissa; exponent 0 is subnormal."""
    f = FORMATS[fmt]
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> f["man"]) & ((1 << f["exp"]) - 1)
    m = code & ((1 << f["man"]) - 1)
    if fmt == "e4m3" and e == 15 and m == 7:
        return math.nan
    if fmt == "e5m2" and e == 31:
        return math.nan if m else sign * math.inf
    if e == 0:
        return sign * m / (1 << f["man"]) * 2.0 ** (1 - f["bias"])
    return sign * (1 + m / (1 << f["man"])) * 2.0 ** (e - f["bias"])


def _finite_codes(fmt: str) -> list[tuple[int, float]]:
    return [(c, decode(c, fmt)) for c in range(256) if math.isfinite(decode(c, fmt))]


def nearest_code(v: float, fmt: str) -> int:
    """Saturate to +-max, then the finite code nearest to v, ties to the even code (the one whose last
    mantissa bit is 0); -0 for a negative value that rounds to zero."""
    f = FORMATS[fmt]
    v = max(-f["max"], min(f["max"], v))
    best = None
    for c, x in _finite_codes(fmt):
        if (c & 0x80) != (0x80 if math.copysign(1.0, v) < 0 else 0):
            continue  # keep the sign (zeros are signed)
        d = abs(x - v)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c)
    return best[1]


def cuda_store(x: float, scale: float, fmt: str) -> int:
    """vLLM's GPU cache writer: nearest_code(float32(float32(x) / float32(scale)))."""
    return nearest_code(f32(f32(x) / f32(scale)), fmt)


def cpu_store(x: float, scale: float, fmt: str) -> int:
    """vLLM-CPU's cache writer: v = float32(x) * float32(1 / scale), clamped, the code cut from the bits."""
    inv = f32(1.0 / f32(scale))
    v = f32(f32(x) * inv)
    mx = FORMATS[fmt]["max"]
    v = max(-mx, min(mx, v))
    if v == 0.0:
        return 0
    if fmt == "e4m3":
        bits = f32_bits(f32(v * 2.0**-120))  # moves the exponent bias from 127 to 7 (a subnormal below 2^-6)
        sign = (bits >> 24) & 0x80
        payload = (bits >> 20) & 0x7F  # 4 exponent + 3 mantissa bits: the rest is dropped (toward zero)
        if payload == 0:
            return sign
        return sign | min(payload, 0x7E)  # 0x7F is E4M3's NaN
    bits = f32_bits(v)
    sign = (bits >> 24) & 0x80
    exp = ((bits >> 23) & 0xFF) - 127
    mant2 = (bits >> 21) & 0x03
    if exp < -14:  # E5M2 subnormal: the significand shifted right
        shift = -14 - exp
        if shift + 21 >= 32:
            return sign
        m = (0x800000 | (bits & 0x7FFFFF)) >> (shift + 21)
        return sign | min(m, 3)
    return sign | ((exp + 15) << 2) | mant2


def query_store(x: float, scale: float) -> int:
    """The query's E4M3 code: nearest_code(float32(float32(x) * float32(1 / scale)))."""
    return nearest_code(f32(f32(x) * f32(1.0 / f32(scale))), "e4m3")


def read_back(code: int, scale: float, fmt: str) -> float:
    """What the attention computes with: float32(decode(code) * scale)."""
    return f32(decode(code, fmt) * f32(scale))


def store(x: float, scale: float, fmt: str, kernel: str) -> int:
    return cuda_store(x, scale, fmt) if kernel == "cuda" else cpu_store(x, scale, fmt)
