"""A readable port of vLLM 0.32's FP8 KV-cache rules, one value at a time: the arbiter of
``nemo_fp8rl.fp8.kv_cache`` (which is vectorized), as tests/_scaled_mm_reference.py is for the GEMM.

Ported rules, not code (the upstream sources, read for this port):

- GPU cache writer: ``reshape_and_cache_flash`` (csrc/cache_kernels.cu) converts each element with
  ``fp8::scaled_convert`` (csrc/quantization/fp8/nvidia/quant_utils.cuh): float32(x) divided by the
  float32 scale, then ``__nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt)`` (CUDA's cuda_fp8.hpp; on sm89+
  the ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` instruction): round to the nearest FP8 value, ties to the even
  code, finite values and +-inf beyond the largest finite value saturate to it, and NaN becomes the
  canonical NaN code 0x7F (both formats; the sign of the NaN is dropped). :func:`cuda_store`.
- CPU cache writer (vLLM-CPU): ``cpu_attn_reshape_and_cache`` with ``float_to_fp8e4m3_scalar`` /
  ``float_to_fp8e5m2_scalar`` (csrc/cpu/cpu_attn_fp8.hpp): multiply by the float32 reciprocal of the
  scale; clamp with ``std::max(-M, std::min(M, v))``; return +0 for ``v == 0``; then cut the code out of
  the float32 bits (E4M3: the bits of ``v * 2^-120``; E5M2: exponent and top two mantissa bits,
  subnormals by a right shift). :func:`cpu_store`.
- Query: ``Attention.forward`` quantizes the query with ``QuantFP8(static=True)`` on backends with
  ``supports_quant_query_input`` (vllm/model_executor/layers/attention/attention.py): float32(x) times the
  float32 reciprocal of ``_q_scale``, clamped, cast to E4M3 (vllm/model_executor/layers/quantization/
  input_quant_fp8.py, ``forward_native``). :func:`query_store` (finite inputs).
- Read-back: the cache value times the scale in float32 (``scaled_vec_conversion`` fp8 -> float, and the
  CPU reference ``fp8e4m3_to_float_scalar``). :func:`read_back`.

Float32 arithmetic is done in Python doubles and rounded to float32 with ``struct``: for one +, -, *, /
of float32 operands the double result rounded to float32 is the correctly rounded float32 result
(53 >= 2 * 24 + 2 bits), so no double-rounding error can appear. Rounding to an FP8 grid divides by a
power of two (exact in a double) and uses Python's ``round``, which rounds ties to even.
"""

from __future__ import annotations

import math
import struct

FORMATS = {"e4m3": {"exp": 4, "man": 3, "bias": 7, "max": 448.0},
           "e5m2": {"exp": 5, "man": 2, "bias": 15, "max": 57344.0}}

NAN_CODE_CUDA = 0x7F
"""``__nv_cvt_float_to_fp8``'s NaN, E4M3 and E5M2 alike (cuda_fp8.hpp: the canonical NaN, sign dropped)."""


def f32(x: float) -> float:
    """Round a double to float32 (round to nearest even, subnormals kept, overflow to +-inf; NaN passes)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # struct rounds as C's (float) cast does and refuses a result of inf
        return math.copysign(math.inf, x)


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_value(bits: int) -> float:
    """The value of a bfloat16 bit pattern (0..65535): the top half of a float32."""
    return f32_from_bits(bits << 16)


def fp16_value(bits: int) -> float:
    """The value of an IEEE half bit pattern (0..65535)."""
    return struct.unpack("<e", struct.pack("<H", bits))[0]


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


_CODE_OF = {fmt: {(decode(c, fmt), c >> 7): c for c in range(256) if math.isfinite(decode(c, fmt))}
            for fmt in FORMATS}
"""(value, sign bit) -> code of every finite FP8 value; zeros are signed (+0 is 0x00, -0 is 0x80)."""


def encode(v: float, fmt: str) -> int:
    """The code of a value on the FP8 grid (the sign of a zero kept)."""
    return _CODE_OF[fmt][(v, 1 if math.copysign(1.0, v) < 0 else 0)]


def nearest_code(v: float, fmt: str) -> int:
    """Round a finite or infinite double to the nearest FP8 value, ties to the even code, saturating at the
    largest finite value; -0 for a negative value that rounds to zero.

    The grid spacing at |v| is 2^(e - man) in the binade [2^e, 2^(e+1)) of a normal value and the smallest
    subnormal 2^(1 - bias - man) below the smallest normal 2^(1 - bias); |v| / spacing is exact, and
    rounding it to an integer ties to even (an even multiple of the spacing is a code with mantissa bit 0).
    """
    f = FORMATS[fmt]
    mag = min(abs(v), f["max"])  # saturation (+-inf too)
    e = max(math.frexp(mag)[1] - 1, 1 - f["bias"]) if mag else 1 - f["bias"]
    spacing = 2.0 ** (e - f["man"])
    q = min(round(mag / spacing) * spacing, f["max"])  # a round-up past the largest value saturates
    return encode(math.copysign(q, v), fmt)


def cuda_store(x: float, scale: float, fmt: str) -> int:
    """vLLM's GPU cache writer: ``__nv_cvt_float_to_fp8(float32(float32(x) / float32(scale)), SATFINITE)``."""
    v = f32(f32(x) / f32(scale))
    if math.isnan(v):
        return NAN_CODE_CUDA
    return nearest_code(v, fmt)


def _std_min(a: float, b: float) -> float:
    """C++ ``std::min(a, b)``: ``(b < a) ? b : a`` (a NaN in either place loses the comparison: a is kept)."""
    return b if b < a else a


def _std_max(a: float, b: float) -> float:
    """C++ ``std::max(a, b)``: ``(a < b) ? b : a``."""
    return b if a < b else a


def cpu_store(x: float, scale: float, fmt: str) -> int:
    """vLLM-CPU's cache writer: v = float32(x) * float32(1 / scale), clamped, +0 for zero, the code cut from
    the bits (toward zero)."""
    inv = f32(1.0 / f32(scale))
    v = f32(f32(x) * inv)
    mx = FORMATS[fmt]["max"]
    v = _std_max(-mx, _std_min(mx, v))  # NaN: min(M, NaN) keeps M
    if v == 0.0:  # +0 and -0, before anything below can round a tiny value to zero
        return 0
    if fmt == "e4m3":
        bits = f32_bits(f32(v * 2.0**-120))  # moves the exponent bias from 127 to 7 (a subnormal below 2^-6)
        sign = (bits >> 24) & 0x80
        payload = (bits >> 20) & 0x7F  # 4 exponent + 3 mantissa bits: the rest is dropped (toward zero)
        if payload == 0:
            return sign  # a nonzero value cut to zero keeps its sign
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
    """The query's E4M3 code: nearest_code(float32(float32(x) * float32(1 / scale))) (finite x)."""
    return nearest_code(f32(f32(x) * f32(1.0 / f32(scale))), "e4m3")


def read_back(code: int, scale: float, fmt: str) -> float:
    """What the attention computes with: float32(decode(code) * scale)."""
    return f32(decode(code, fmt) * f32(scale))


def store(x: float, scale: float, fmt: str, kernel: str) -> int:
    return cuda_store(x, scale, fmt) if kernel == "cuda" else cpu_store(x, scale, fmt)


def calibrated_scale(amax: float, margin: float, fmt: str) -> float:
    """NeMo RL's calibrated scale as vLLM holds it: ``(amax * margin) / M`` in Python floats (doubles), stored
    in vLLM's float32 scale buffer; an amax of 0, inf or NaN gives vLLM's default 1.0 (our rule: NeMo RL
    would send 0)."""
    if not (math.isfinite(amax) and amax > 0):
        return 1.0
    return f32((amax * margin) / FORMATS[fmt]["max"])
