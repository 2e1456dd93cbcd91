"""Bit-exact cast tables and the scale rule of every granularity."""

import math

import pytest
import torch

from nemo_fp8rl.fp8 import (
    E4M3,
    E5M2,
    cast_to_fp8,
    compute_scale,
    dequantize,
    e8m0_exponent,
    fake_quantize,
    quantize,
    round_to_fp8,
)


def all_finite_values(fmt):
    bits = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    return bits[torch.isfinite(bits)]


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_every_representable_value_round_trips(fmt):
    v = all_finite_values(fmt)
    assert torch.equal(round_to_fp8(v, fmt), v)
    assert v.abs().max().item() == fmt.max
    assert v[v > 0].min().item() == fmt.min_subnormal


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_midpoints_round_to_even(fmt):
    v = torch.unique(all_finite_values(fmt))
    pos = v[v >= 0]
    mid = (pos[:-1] + pos[1:]) / 2  # exact in float32
    q = cast_to_fp8(mid, fmt)
    lsb = q.view(torch.uint8) & 1
    assert torch.all(lsb == 0), "ties must go to the even mantissa"
    got = q.float()
    assert torch.all((got == pos[:-1]) | (got == pos[1:]))


def test_e4m3_cast_table():
    x = torch.tensor([448.0, 449.0, 464.0, 1e6, -1e6, float("inf"), -float("inf"),
                      1.0 + 1 / 16, 1.0 + 3 / 16, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 2.0**-9, 0.0, -0.0])
    want = [448.0, 448.0, 448.0, 448.0, -448.0, 448.0, -448.0,
            1.0, 1.25, 0.0, 2.0**-9, 2.0**-8, 2.0**-9, 0.0, -0.0]
    assert round_to_fp8(x, E4M3).tolist() == want
    assert torch.isnan(round_to_fp8(torch.tensor([float("nan")]), E4M3)).all()


def test_e5m2_cast_saturates_where_torch_does_not():
    x = torch.tensor([57344.0, 61440.0, 1e6, -1e6, 2.0**-17, 3 * 2.0**-17, 1.0 + 1 / 8])
    assert torch.isinf(x[2:3].to(torch.float8_e5m2).float()).all(), "torch's raw E5M2 cast overflows to inf"
    want = [57344.0, 57344.0, 57344.0, -57344.0, 0.0, 2.0**-15, 1.0]
    assert round_to_fp8(x, E5M2).tolist() == want
    assert torch.isnan(round_to_fp8(torch.tensor([float("nan")]), E5M2)).all()


def test_compute_scale_rule():
    a = torch.tensor([2.0, 3.0, 0.0, float("inf"), float("nan"), 1e-45])
    s = compute_scale(a, E4M3)
    assert s[0].item() == 224.0
    assert s[1].item() == torch.tensor(448.0 / 3.0, dtype=torch.float32).item()
    assert s[2:5].tolist() == [1.0, 1.0, 1.0]
    assert s[5].item() == torch.finfo(torch.float32).max
    p = compute_scale(a[:2], E4M3, pow2=True)
    assert p.tolist() == [128.0, 128.0]
    assert compute_scale(torch.tensor(2.0), E4M3, margin=1).item() == 112.0
    assert compute_scale(torch.tensor(1e-3), E4M3, eps=1.0).item() == 448.0
    # pow2 is exact at powers of two (no log2 rounding error)
    assert compute_scale(torch.tensor(448.0 / 2**10), E4M3, pow2=True).item() == 2.0**10


def test_e8m0_exponent():
    a = torch.tensor([448.0, 449.0, 448.0 * 2**-3, 448.0 * 2**-3 * 1.0001, 0.0, 1e38, float("nan")])
    assert e8m0_exponent(a).tolist() == [0, 1, -3, -2, -127, 118, 0]  # 1e38/448 = 2^117.4


def test_tensorwise_and_row_scales():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    q, si = quantize(x, E4M3, "tensor")
    assert si.shape == () and si.item() == pytest.approx(4.0 / 448.0)
    assert torch.equal(dequantize(q, si, x), q.float() * si)
    q, si = quantize(x, E4M3, "row", dim=-1, pow2_scales=True)
    assert si.shape == (2, 1)
    assert si.flatten().tolist() == [1 / 128.0, 1 / 64.0]  # 448/2=224 -> 128 ; 448/4=112 -> 64
    q, si = quantize(x, E4M3, "row", dim=0)
    assert si.shape == (1, 2)


def test_1x128_blocks_are_independent():
    torch.manual_seed(0)
    x = torch.randn(3, 300)
    x_out = x.clone()
    x_out[1, 200] = 1000.0  # outlier in block 1 of row 1 (elements 128..255)
    a = fake_quantize(x, E4M3, (1, 128), pow2_scales=True)
    b = fake_quantize(x_out, E4M3, (1, 128), pow2_scales=True)
    changed = (a != b)
    changed[1, 200] = False
    rows, cols = torch.nonzero(changed, as_tuple=True)
    assert set(rows.tolist()) <= {1} and cols.min() >= 128 and cols.max() < 256
    assert changed.any(), "the outlier's block must be quantized more coarsely"
    # block = separate quantization of each 128-chunk (last chunk zero padded)
    for c0 in (0, 128, 256):
        chunk = x[:, c0:c0 + 128]
        ref = torch.stack([fake_quantize(r, E4M3, "tensor", pow2_scales=True) for r in chunk])
        assert torch.equal(a[:, c0:c0 + 128], ref)
    # along dim 0 (the token dimension, for wgrad operands)
    d0 = fake_quantize(x.t().contiguous(), E4M3, (1, 128), dim=0)
    assert d0.shape == (300, 3)


def test_128x128_tiles():
    torch.manual_seed(0)
    w = torch.randn(256, 200)
    w2 = w.clone()
    w2[10, 10] = 500.0
    a = fake_quantize(w, E4M3, (128, 128), pow2_scales=True)
    b = fake_quantize(w2, E4M3, (128, 128), pow2_scales=True)
    diff = a != b
    assert diff[:128, :128].any() and not diff[128:].any() and not diff[:, 128:].any()
    q, si = quantize(w, E4M3, (128, 128))
    assert q.shape == (2, 2, 128, 128) and si.shape == (2, 2, 1, 1)
    assert torch.equal(dequantize(q, si, w, (128, 128)), fake_quantize(w, E4M3, (128, 128)))
    # tiles are the same for W and W^T: transpose commutes with quantization
    assert torch.equal(fake_quantize(w.t().contiguous(), E4M3, (128, 128)), fake_quantize(w, E4M3, (128, 128)).t())


def test_mx_blocks():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-3.0, 3.0, 32)
    x[0, 32:] = torch.linspace(-900.0, 900.0, 32)
    q, si = quantize(x, E4M3, "mx")
    assert q.shape == (1, 2, 32)
    # block 0: amax 3 -> e = ceil(log2(3/448)) = -7 ; block 1: amax 900 -> e = ceil(log2(900/448)) = 2
    assert si.flatten().tolist() == [2.0**-7, 4.0]
    y = fake_quantize(x, E4M3, "mx")
    assert torch.equal(y[0, :32], round_to_fp8(x[0, :32] * 2.0**7, E4M3) * 2.0**-7)
    assert torch.equal(y[0, 32:], round_to_fp8(x[0, 32:] / 4.0, E4M3) * 4.0)


def test_divide_vs_scale_inv_within_one_ulp():
    torch.manual_seed(1)
    x = torch.randn(64, 64) * 3.7
    a = fake_quantize(x, E4M3, "tensor")
    b = fake_quantize(x, E4M3, "tensor", divide=True)
    ulp = torch.finfo(torch.float32).eps * x.abs().max()
    assert (a - b).abs().max() <= ulp
    # identical for power-of-two scales
    assert torch.equal(fake_quantize(x, E4M3, "tensor", pow2_scales=True),
                       fake_quantize(x, E4M3, "tensor", pow2_scales=True, divide=True))


def test_fake_quantize_keeps_dtype_and_nan():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert fake_quantize(x, E4M3, (1, 32)).dtype == torch.bfloat16
    x = torch.randn(4, 64)
    x[0, 0] = float("nan")
    y = fake_quantize(x, E4M3, "row")
    assert math.isnan(y[0, 0].item()) and torch.isfinite(y[1:]).all()


def test_unknown_granularity_and_format():
    with pytest.raises(ValueError, match="granularity"):
        quantize(torch.randn(4), E4M3, "per-channel")
    with pytest.raises(ValueError, match="e4m3"):
        quantize(torch.randn(4), "e3m4")
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 2, 2), E4M3, (128, 128))


def _amaxes(n: int = 4096) -> torch.Tensor:
    """float32 values spread over many binades, as weight and activation amaxes are (seeded)."""
    g = torch.Generator().manual_seed(3)
    return torch.rand(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())


def test_divide_exact_is_the_correctly_rounded_quotient():
    """``divide_exact(x, 448)`` is float32(x / 448) correctly rounded (the float64 quotient rounded once: exact
    for float32 operands), which a multiplication by float32(1/448), what ATen's CUDA kernel does with a
    Python scalar, is not for many of the values."""
    from nemo_fp8rl.fp8.formats import divide_exact

    x = _amaxes()
    for c in (448.0, 57344.0, 3.0):
        want = (x.double() / c).float()
        assert torch.equal(divide_exact(x, c), want)
    assert (x * torch.tensor(1 / 448.0) != (x.double() / 448.0).float()).float().mean() > 0.2
    assert divide_exact(x.bfloat16(), 448.0).dtype == torch.bfloat16


@pytest.mark.gpu
def test_divide_exact_on_cuda_equals_the_cpu_quotient():
    """On CUDA too: the rollout's weight and activation scales (``amax / 448``) equal the CPU's and vLLM's."""
    from nemo_fp8rl.fp8.formats import divide_exact
    from nemo_fp8rl.fp8.rollout import VllmBlock, _per_tensor_weight

    x = _amaxes()
    assert torch.equal(divide_exact(x.cuda(), 448.0).cpu(), divide_exact(x, 448.0))
    w = (torch.randn(256, 384, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    (q_gpu, s_gpu), (q_cpu, s_cpu) = _per_tensor_weight(w.cuda()), _per_tensor_weight(w)
    assert torch.equal(s_gpu.cpu(), s_cpu) and torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    b_gpu, b_cpu = VllmBlock().weight_fp8(w.cuda()), VllmBlock().weight_fp8(w)
    assert torch.equal(b_gpu.scale_inv.cpu(), b_cpu.scale_inv)
    assert torch.equal(b_gpu.data.cpu().view(torch.uint8), b_cpu.data.view(torch.uint8))
