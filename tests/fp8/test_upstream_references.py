"""Our quantizers against readable ports of the upstream projects' own rules, bit for bit.

``_te_reference.py`` (Transformer Engine's scale, block and MX kernels and its torch references) checks
``nemo_fp8rl.fp8.quantize``; ``_vllm_reference.py`` (vLLM's FP8 kernels and test references) checks the
rollout schemes of ``nemo_fp8rl.fp8.rollout``. FP8 data is compared as bytes, scales as float32 bits,
over several seeds, shapes that are not multiples of the block, float32 and bfloat16 inputs, and the
edge cases: all-zero tensors and blocks, amax near 1e-38, inf, NaN and values at the saturation boundary.
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8rl.fp8.quantize import compute_scale, e8m0_exponent, fake_quantize, quantize
from nemo_fp8rl.fp8.rollout import VllmBlock, VllmW8A8
from tests.fp8 import _te_reference as te
from tests.fp8 import _vllm_reference as vllm

SEEDS = (0, 1, 2)
DTYPES = (torch.float32, torch.bfloat16)
FORMATS = ("e4m3", "e5m2")


# ----------------------------------------------------------------------------- helpers
def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (FP8) or equal float32 bits (scales: NaN equals NaN, +0 differs from -0)."""
    if a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.float().contiguous().view(torch.int32), b.float().contiguous().view(torch.int32))


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    ua = a.view(torch.uint8) if a.element_size() == 1 else a.float().contiguous().view(torch.int32)
    ub = b.view(torch.uint8) if b.element_size() == 1 else b.float().contiguous().view(torch.int32)
    return f"{int((ua != ub).sum())} of {ua.numel()} differ"


def _row_blocks(data: torch.Tensor, k: int) -> torch.Tensor:
    """Our 1-D block layout [..., n_blocks, B] (zero padded) -> [..., k]."""
    return data.view(torch.uint8).reshape(*data.shape[:-2], -1)[..., :k].view(data.dtype)


def _tiles(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Our 2-D tile layout [R/B, C/B, B, B] (zero padded) -> [rows, cols]."""
    u = data.view(torch.uint8)
    rr, cc, br, bc = u.shape
    return u.permute(0, 2, 1, 3).reshape(rr * br, cc * bc)[:rows, :cols].view(data.dtype)


def _sample(shape, dtype, seed, scale=1.0, outliers=True, heavy_tail=False):
    """Gaussian values in ``dtype``, with a few 40x outliers, or magnitudes spread over decades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    if heavy_tail:
        x = x * torch.exp(3.0 * torch.randn(shape, generator=g))
    if outliers:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 500),), generator=g)
        flat[idx] *= 40.0
    return x.to(dtype)


# ----------------------------------------------------------------------------- Transformer Engine: scales
_AMAX = torch.tensor([0.0, 1e-45, 1e-38, 1e-37, 1e-36, 2e-36, 1e-20, 1e-12, 2.0, 3.0, 448.0, 449.0, 57344.0,
                      1e30, torch.finfo(torch.float32).max, float("inf"), float("nan")])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-12, 1.0])
@pytest.mark.parametrize("input_dtype", DTYPES)
def test_compute_scale_is_te_compute_scale_from_amax(fmt, pow2, eps, input_dtype):
    """Per-tensor kernels replace an infinite scale by float32's max, block kernels by the input dtype's."""
    want = te.scale_from_amax(_AMAX, fmt, eps=eps, pow2=pow2, value_for_inf=torch.finfo(input_dtype).max)
    got = compute_scale(_AMAX, fmt, pow2=pow2, eps=eps, input_dtype=input_dtype)
    assert _same_bits(got, want), _mismatch(got, want)
    if input_dtype == torch.float32:  # the default is the per-tensor kernel's rule
        assert _same_bits(compute_scale(_AMAX, fmt, pow2=pow2, eps=eps), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_e8m0_exponent_is_te_float_to_e8m0(fmt):
    """The MX exponent uses the output format's max: fp32(1/448) for E4M3, fp32(1/57344) for E5M2."""
    m = te.FP8_MAX[fmt]
    amax = torch.cat([_AMAX[:-1], torch.tensor([m, m * 2**-3, m * 2**-3 * 1.0001, m * 2**-130, m * 2**-127,
                                                 m * 1.5 * 2**-127, 1.7e38])])
    want = te.e8m0_from_amax(amax, fmt)
    got = e8m0_exponent(amax, fmt) + 127
    assert torch.equal(got.to(torch.int32), want), (got.tolist(), want.tolist())
    # NaN amax: TE's fmaxf reductions never produce one; ours (torch.amax) can, and keeps scale 1.
    assert e8m0_exponent(torch.tensor([float("nan")]), fmt).tolist() == [0]


# ----------------------------------------------------------------------------- Transformer Engine: quantizers
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pow2,eps", [(False, 0.0), (True, 0.0), (False, 1e-12)])
def test_tensorwise_is_te_current_scaling(fmt, dtype, seed, pow2, eps):
    x = _sample((37, 203), dtype, seed, scale=0.05)
    q, si = quantize(x, fmt, "tensor", pow2_scales=pow2, eps=eps)
    wq, wsi = te.quantize_per_tensor(x, fmt, eps=eps, pow2=pow2)
    assert _same_bits(q, wq), _mismatch(q, wq)
    assert _same_bits(si, wsi)
    want = te.dequantize(wq, wsi).to(dtype)
    got = fake_quantize(x, fmt, "tensor", pow2_scales=pow2, eps=eps)
    assert _same_bits(got.float(), want.float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("tile", [(1, 128), (128, 128)])
def test_blockwise_is_te_block_scaling(fmt, dtype, seed, pow2, tile):
    """1x128 and 128x128 on a 300x260 tensor: partial blocks at both edges."""
    x = _sample((300, 260), dtype, seed)
    q, si = quantize(x, fmt, tile, pow2_scales=pow2)
    wq, wsi = te.quantize_blockwise(x, fmt, tile, pow2=pow2)
    if tile[0] == 1:
        q, si = _row_blocks(q, 260), si[..., 0]
    else:
        q, si = _tiles(q, 300, 260), si[..., 0, 0]
    assert _same_bits(q, wq), _mismatch(q, wq)
    assert _same_bits(si, wsi), _mismatch(si, wsi)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", SEEDS)
def test_1x128_along_tokens_is_te_columnwise(fmt, seed):
    """wgrad operands: 1x128 blocks along dim 0 are TE's blocks of the transpose."""
    x = _sample((200, 96), torch.bfloat16, seed)
    q, si = quantize(x, fmt, (1, 128), dim=0, pow2_scales=True)
    wq, wsi = te.quantize_blockwise(x.t().contiguous(), fmt, (1, 128), pow2=True)
    assert _same_bits(_row_blocks(q, 200), wq)
    assert _same_bits(si[..., 0], wsi)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dim", [-1, 0])
def test_mxfp8_is_te_mxfp8(fmt, dtype, seed, dim):
    """E8M0 exponents and data, for E4M3 and for hybrid's E5M2 gradients; K = 200 (not a multiple of 32)."""
    x = _sample((64, 200), dtype, seed, scale=1e-3, heavy_tail=True)
    q, si = quantize(x, fmt, "mx", dim=dim)
    ref_in = x if dim == -1 else x.t().contiguous()
    wq, byte = te.quantize_mxfp8(ref_in, fmt)
    q = _row_blocks(q, ref_in.shape[-1])
    assert _same_bits(q, wq), _mismatch(q, wq)
    assert _same_bits(si[..., 0], te.e8m0_scale_inv(byte)), _mismatch(si[..., 0], te.e8m0_scale_inv(byte))
    got = fake_quantize(x, fmt, "mx", dim=dim)
    want = te.dequantize(wq, te.e8m0_scale_inv(byte).repeat_interleave(32, dim=-1)[..., : ref_in.shape[-1]])
    want = want.to(dtype) if dim == -1 else want.t().to(dtype)
    assert _same_bits(got.float(), want.float())


# ----------------------------------------------------------------------------- Transformer Engine: edge cases
def _blocks_with_edges(dtype):
    """[256, 256]: tile (0, 0) all zero, tile (0, 1) amax 1e-38, tile (1, 0) holds +inf, (1, 1) normal."""
    x = _sample((256, 256), torch.float32, 7)
    x[:128, :128] = 0.0
    x[:128, 128:] = x[:128, 128:] / x[:128, 128:].abs().max() * 1e-38
    x[200, 5] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-12])
@pytest.mark.parametrize("tile", [(1, 128), (128, 128)])
def test_blockwise_edge_blocks_are_te(fmt, dtype, pow2, eps, tile):
    """Zero block (scale 1, or M/eps when eps > 0: TE clamps first), amax 1e-38 (an infinite scale), inf."""
    x = _blocks_with_edges(dtype)
    q, si = quantize(x, fmt, tile, pow2_scales=pow2, eps=eps)
    wq, wsi = te.quantize_blockwise(x, fmt, tile, pow2=pow2, eps=eps)
    if tile[0] == 1:
        q, si = _row_blocks(q, 256), si[..., 0]
    else:
        q, si = _tiles(q, 256, 256), si[..., 0, 0]
    assert _same_bits(si, wsi), _mismatch(si, wsi)
    assert _same_bits(q, wq), _mismatch(q, wq)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-12])
@pytest.mark.parametrize("kind", ["zero", "tiny", "inf"])
def test_tensorwise_edge_tensors_are_te(fmt, dtype, pow2, eps, kind):
    x = {"zero": torch.zeros(5, 7), "tiny": torch.full((5, 7), 1e-38),
         "inf": torch.tensor([[1.0, float("inf"), -3.0, 1e-3]])}[kind].to(dtype)
    q, si = quantize(x, fmt, "tensor", pow2_scales=pow2, eps=eps)
    wq, wsi = te.quantize_per_tensor(x, fmt, eps=eps, pow2=pow2)
    assert _same_bits(si, wsi), (si, wsi)
    assert _same_bits(q, wq), _mismatch(q, wq)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_edge_blocks_are_te(fmt, dtype):
    """All-zero block (exponent -127), amax at the bottom of float32, an inf (exponent 127: TE saturates)."""
    x = _sample((4, 128), torch.float32, 3)
    x[0, :32] = 0.0
    x[1, 32:64] = 1e-38
    x[2, 64:96] *= 1e-30
    x[3, 100] = float("inf")
    x[3, 101] = -float("inf")
    x = x.to(dtype)
    q, si = quantize(x, fmt, "mx")
    wq, byte = te.quantize_mxfp8(x, fmt)
    assert _same_bits(si[..., 0], te.e8m0_scale_inv(byte))
    assert _same_bits(_row_blocks(q, 128), wq), _mismatch(_row_blocks(q, 128), wq)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_given_scale_saturates_like_te(fmt, dtype):
    """Delayed scaling's cast at and past the top of the range: +-M, the midpoint above M, inf, huge."""
    m = te.FP8_MAX[fmt]
    vals = [m, -m, m * (1 + 2**-4), m * (1 + 2**-3), m * 2, 1e30, -1e30, float("inf"), -float("inf"),
            m * (1 - 2**-5), m * (1 - 2**-4), 1.0, -0.0, 2.0**-20]
    x = torch.tensor(vals).to(dtype)
    for s in (torch.tensor(1.0), torch.tensor(2.0**-3), torch.tensor(3.0)):
        q, si = quantize(x, fmt, "tensor", scale=s)
        wq = te.cast_with_scale(x, s, fmt)
        assert _same_bits(q, wq), (s, _mismatch(q, wq))
        assert _same_bits(si, torch.reciprocal(s))


@pytest.mark.parametrize("tile", [(1, 128), (128, 128), "mx"])
def test_nan_leaves_other_blocks_as_te(tile):
    """A NaN stays NaN, and every block without one is TE's."""
    x = _sample((256, 256), torch.float32, 4)
    x[3, 10] = float("nan")
    q, _ = quantize(x, "e4m3", tile, pow2_scales=True)
    if tile == "mx":
        wq, _ = te.quantize_mxfp8(x, "e4m3")
        q, nan_block = _row_blocks(q, 256), (slice(3, 4), slice(0, 32))
    elif tile[0] == 1:
        wq, _ = te.quantize_blockwise(x, "e4m3", tile)
        q, nan_block = _row_blocks(q, 256), (slice(3, 4), slice(0, 128))
    else:
        wq, _ = te.quantize_blockwise(x, "e4m3", tile)
        q, nan_block = _tiles(q, 256, 256), (slice(0, 128), slice(0, 128))
    assert torch.isnan(q.float()[3, 10]) and torch.isnan(wq.float()[3, 10])
    outside = torch.ones(256, 256, dtype=torch.bool)
    outside[nan_block] = False
    assert torch.equal(q.view(torch.uint8)[outside], wq.view(torch.uint8)[outside])


@pytest.mark.xfail(strict=True, reason="TE's kernels take amax with fmaxf, which skips NaN, so the other "
                   "elements of a NaN block keep a finite-amax scale; our torch.amax gives NaN and scale 1 "
                   "(quantize.py's _group_amax computes it)")
def test_nan_block_scale_is_te():
    x = _sample((1, 128), torch.float32, 5)
    x[0, 10] = float("nan")
    _, si = quantize(x, "e4m3", (1, 128), pow2_scales=True)
    _, wsi = te.quantize_blockwise(x, "e4m3", (1, 128))
    assert _same_bits(si[..., 0], wsi)


# ----------------------------------------------------------------------------- vLLM
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS + (3, 4, 5))
@pytest.mark.parametrize("shape", [(256, 384), (100, 70)])
def test_vllm_w8a8_weight_is_scaled_fp8_quant(dtype, seed, shape):
    """vLLM's per-tensor weight quantization multiplies by fp32(1 / s). Dividing by s instead moves ~1.5% of
    the codes of bf16 N(0, 0.02) weights whose amax makes ties likely (seed 3 here)."""
    w = _sample(shape, dtype, seed, scale=0.02, outliers=False)
    wq, ws = vllm.quantize_weight_per_tensor(w)
    op = VllmW8A8().weight_fp8(w)
    assert _same_bits(op.data, wq), _mismatch(op.data, wq)
    assert _same_bits(op.scale_inv, ws.expand(shape[0], 1))
    got = VllmW8A8().quantize_weight(w)
    assert _same_bits(got, vllm.dequantize(wq, ws)), _mismatch(got, vllm.dequantize(wq, ws))


def test_vllm_w8a8_weight_for_every_bf16_amax_significand():
    """Rounding ties of x * 448 / amax depend on amax: try each of the 128 bf16 significands (7 of them
    move codes when dividing by s)."""
    for i in range(128):
        amax = 1.0 + i / 128
        g = torch.Generator().manual_seed(i)
        w = ((torch.rand((64, 64), generator=g) * 2 - 1) * amax).to(torch.bfloat16)
        w[0, 0] = amax
        wq, ws = vllm.quantize_weight_per_tensor(w)
        op = VllmW8A8().weight_fp8(w)
        assert _same_bits(op.data, wq), (amax, _mismatch(op.data, wq))
        assert _same_bits(VllmW8A8().quantize_weight(w), vllm.dequantize(wq, ws)), amax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_vllm_w8a8_activation_is_dynamic_per_token_quant(dtype, seed):
    """Per token, floor 1/(448*512) on the scale, each element divided by it; rows of zeros and of 1e-9."""
    x = _sample((9, 200), dtype, seed)
    x[0] *= 300.0
    x[1] = 0.0
    x[2] = 1e-9
    x[3] = x[3] * 1e-30
    wq, ws = vllm.quantize_activation_per_token(x)
    op = VllmW8A8().activation_fp8(x)
    assert _same_bits(op.data, wq), _mismatch(op.data, wq)
    assert _same_bits(op.scale_inv, ws)
    got = VllmW8A8().quantize_activation(x)
    assert _same_bits(got, vllm.dequantize(wq, ws))
    x3 = x.reshape(3, 3, 200)
    assert _same_bits(VllmW8A8().quantize_activation(x3), vllm.dequantize(wq, ws).reshape(3, 3, 200))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [384, 200])
def test_vllm_block_activation_is_per_token_group_quant(dtype, seed, k):
    """1x128 groups, amax floored at 1e-10, each element divided by amax/448; a zero group and a 1e-12 one."""
    x = _sample((6, k), dtype, seed)
    x[1, :128] = 0.0
    x[2, 128:] = 1e-12
    wq, ws = vllm.quantize_activation_per_group(x)
    got = VllmBlock().quantize_activation(x)
    want = vllm.dequantize(wq, ws.repeat_interleave(128, dim=-1)[..., :k])
    assert _same_bits(got, want), _mismatch(got, want)
    if k % 128 == 0:
        op = VllmBlock().activation_fp8(x)
        assert _same_bits(op.data, wq), _mismatch(op.data, wq)
        assert _same_bits(op.scale_inv, ws)


def test_vllm_zero_weight_and_nan_differ_only_as_documented():
    """An all-zero weight: vLLM writes 448 with scale 0, we write 0 with scale 1; both read back 0.
    A NaN: vLLM's fminf/fmaxf saturation writes +448, we keep NaN (formats.py: the trainer must see it)."""
    z = torch.zeros(4, 8)
    wq, ws = vllm.quantize_weight_per_tensor(z)
    assert ws.item() == 0.0 and (wq.float() == 448.0).all()
    assert torch.equal(VllmW8A8().quantize_weight(z), vllm.dequantize(wq, ws))
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5]])
    wq, ws = vllm.quantize_activation_per_token(x)
    assert wq.float()[0, 1] == 448.0
    ours = VllmW8A8().activation_fp8(x)
    assert torch.isnan(ours.data.float()[0, 1])
