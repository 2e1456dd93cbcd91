"""The torch backend's GPU paths, made right before they first run on a GPU (issue 26), checked on CPU.

Each test drives ``fp8.backend=torch`` with torch's kernel replaced by the readable reference of
tests/_scaled_mm_reference.py, which first refuses what torch's CUDA scaled GEMM refuses:

1. blockwise + hybrid: torch's 1x128/128x128 kernels take E4M3 x E4M3 only, so the dgrad and wgrad GEMMs
   (an E5M2 gradient operand) must never reach the kernel; they run in float32 on the dequantized
   operands, the emulation's numbers, counted and logged once. The forward stays on the kernel.
2. fp32 output where the kernel writes it: the wgrad of row- and block-scaled recipes is asked for
   float32 on sm90 with cuBLAS >= 12.9 (and bf16 elsewhere), decided by ``kernel_out_dtype``.
3. No float round trips: a bf16 layer asks the kernel for bf16 with the bias in its epilogue,
   quantizes the output gradient from bf16, and uses fast accumulation in the forward GEMM only.
4. 1x128 scales with M % 4 != 0: the rows are padded to a multiple of 4, so the scale's columns are
   16-byte aligned, torch's own shape/stride check (its CUDA meta registration) passes, and the
   results are the emulation's at M = 1000, 1001, 1003.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from nemo_fp8rl.fp8 import Fp8LinearState, fp8_linear, get_recipe, quantize_operand
from nemo_fp8rl.fp8 import backends, torch_linear
from nemo_fp8rl.fp8.backends import QuantizedOperand, gemm_error_bound, scaled_mm_args
from nemo_fp8rl.fp8.torch_linear import quantize_operand_fp8

from tests._scaled_mm_reference import check_scaled_mm, cuda_meta_check, reference_kernel

pytestmark = pytest.mark.skipif(not hasattr(torch.nn.functional, "ScalingType"),
                                reason="this torch has no torch.nn.functional.ScalingType")

ST = torch.nn.functional.ScalingType if hasattr(torch.nn.functional, "ScalingType") else None


def _data(m, k, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)).to(dtype)  # outlier channels
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    gy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, gy


def _step(recipe, backend, x, w, gy, bias=None):
    """One forward + backward: (y, dx, dW, db)."""
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    bb = bias.clone().requires_grad_() if bias is not None else None
    y = fp8_linear(xx, ww, bb, recipe, Fp8LinearState(recipe), backend=backend)
    y.backward(gy)
    return y.detach(), xx.grad, ww.grad, (bb.grad if bb is not None else None)


def _hats(recipe, x, w, gy):
    """The emulation's dequantized operands of the three GEMMs: name -> (A [M, K], B [N, K]), C = A B^T."""
    def q(t, role, dim):
        return quantize_operand(t.float(), role, dim, recipe, Fp8LinearState(recipe), False)

    return {"y": (q(x, "input", 1), q(w, "weight", 1)), "dx": (q(gy, "grad_output", 1), q(w, "weight", 0).t()),
            "dw": (q(gy, "grad_output", 0).t(), q(x, "input", 0).t())}


def _assert_gemm(got, want, a_hat, b_hat, got_dtype, what):
    """Both results within their accumulation bound of the exact product of the same FP8 operands (the
    emulation: float32; ``got``: rounded once to ``got_dtype``)."""
    bound = gemm_error_bound(a_hat, b_hat, torch.float32) + gemm_error_bound(a_hat, b_hat, got_dtype)
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= bound).all()), (what, float((diff - bound).max()))


# ------------------------------------------------------------------------------------------------
# 1. blockwise + hybrid (E5M2 gradients)
# ------------------------------------------------------------------------------------------------


def test_reference_refuses_what_torch_refuses():
    """The stand-in raises like torch: an E5M2 operand under block scaling, E5M2 x E5M2, fast accumulation
    with block scales; it takes E4M3 x E4M3 blocks and E5M2 x E4M3 per-tensor."""
    recipe = get_recipe("blockwise", fp8_format="hybrid")
    g = torch.Generator().manual_seed(0)
    x = quantize_operand_fp8(torch.randn(128, 256, generator=g), "input", recipe, None, False)
    w = quantize_operand_fp8(torch.randn(128, 256, generator=g), "weight", recipe, None, False)
    gy = quantize_operand_fp8(torch.randn(128, 256, generator=g), "grad_output", recipe, None, False)
    assert gy.data.dtype == torch.float8_e5m2
    mat_a, mat_b, sa, sb = scaled_mm_args(x, w)
    check_scaled_mm(mat_a, mat_b, sa, ST.BlockWise1x128, sb, ST.BlockWise128x128, torch.bfloat16)
    ga, gb, gsa, gsb = scaled_mm_args(gy, w)  # the dgrad of blockwise + hybrid: E5M2 (1x128) x E4M3 (128x128)
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        check_scaled_mm(ga, gb, gsa, ST.BlockWise1x128, gsb, ST.BlockWise128x128, torch.bfloat16)
    with pytest.raises(RuntimeError, match="fast accum"):
        check_scaled_mm(mat_a, mat_b, sa, ST.BlockWise1x128, sb, ST.BlockWise128x128, torch.bfloat16, True)
    t = get_recipe("tensorwise", fp8_format="hybrid")
    g1 = quantize_operand_fp8(torch.randn(32, 64, generator=g), "grad_output", t, None, False)
    g2 = quantize_operand_fp8(torch.randn(48, 64, generator=g), "grad_output", t, None, False)
    wq = quantize_operand_fp8(torch.randn(48, 64, generator=g), "weight", t, None, False)
    ma, mb, s1, s2 = scaled_mm_args(g1, wq)  # per-tensor E5M2 x E4M3: torch takes it
    check_scaled_mm(ma, mb, s1, ST.TensorWise, s2, ST.TensorWise, torch.float32)
    ma, mb, s1, s2 = scaled_mm_args(g1, g2)
    with pytest.raises(ValueError, match="two Float8_e5m2"):
        check_scaled_mm(ma, mb, s1, ST.TensorWise, s2, ST.TensorWise, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_hybrid_never_hands_the_kernel_an_e5m2_block_gemm(dtype, monkeypatch, caplog):
    """Forward on the kernel (E4M3 x E4M3); dgrad and wgrad in float32 on the dequantized operands, counted
    and logged once; all three within the GEMM bound of the emulation."""
    calls = []
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel(calls))
    monkeypatch.setattr(backends, "_GEMM_FALLBACKS", {})
    recipe = get_recipe("blockwise", fp8_format="hybrid")
    x, w, gy = _data(130, 256, 128, dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="nemo_fp8rl.fp8.backends"):
        got = _step(recipe, "torch", x, w, gy)
        _step(recipe, "torch", x, w, gy)  # a second step: counted again, not logged again
    assert len(calls) == 2  # one forward per step
    assert all(c[0].dtype == c[1].dtype == torch.float8_e4m3fn for c in calls)
    fallbacks = backends.gemm_fallbacks()
    assert len(fallbacks) == 1 and list(fallbacks.values()) == [4]  # dgrad + wgrad, two steps
    assert "E4M3 x E4M3 only" in next(iter(fallbacks))
    assert caplog.text.count("block scaling with an E5M2 operand") == 1
    want = _step(recipe, "emulate", x, w, gy)
    hats = _hats(recipe, x, w, gy)
    # forward: the kernel's output dtype (bf16 for a block-scaled GEMM off cuBLAS); dgrad: the fallback's
    # float32 product in the model dtype; wgrad: float32
    for i, (what, out_dtype) in enumerate((("y", calls[0][6]), ("dx", dtype), ("dw", torch.float32))):
        _assert_gemm(got[i], want[i], *hats[what], out_dtype, what)
    cuda_meta_check(calls)


def test_kernel_refusal_rules():
    e4 = QuantizedOperand(torch.zeros(4, 16, dtype=torch.float8_e4m3fn), torch.ones(()), "tensor")
    e5 = QuantizedOperand(torch.zeros(4, 16, dtype=torch.float8_e5m2), torch.ones(()), "tensor")
    assert backends.kernel_refusal(e4, e5) is None and backends.kernel_refusal(e5, e4) is None
    assert "E5M2 x E5M2" in backends.kernel_refusal(e5, e5)
    b4 = QuantizedOperand(e4.data, torch.ones(4, 1), (1, 128))
    b5 = QuantizedOperand(e5.data, torch.ones(4, 1), (1, 128))
    assert backends.kernel_refusal(b4, b4) is None
    assert "E4M3 x E4M3 only" in backends.kernel_refusal(b5, b4)
    assert "E4M3 x E4M3 only" in backends.kernel_refusal(b4, b5)


# ------------------------------------------------------------------------------------------------
# 2. fp32 output where the kernel writes it
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gran,cuda,cap,cublas,want", [
    ("tensor", False, None, None, torch.float32),           # CPU per-tensor: float32
    ("tensor", True, (8, 9), 120400, torch.float32),       # Ada, old cuBLAS: per-tensor writes float32
    ("row", True, (9, 0), 120900, torch.float32),          # Hopper + cuBLAS 12.9: cuBLAS outer-vector scaling
    ("row", True, (9, 0), 130100, torch.float32),
    ("row", True, (9, 0), 120800, torch.bfloat16),         # cuBLAS 12.8: torch's CUTLASS kernel
    ("row", True, (8, 9), 130000, torch.bfloat16),         # Ada: CUTLASS
    ("row", True, (10, 0), 130000, torch.bfloat16),        # Blackwell: torch sends row-wise to CUTLASS
    ((1, 128), True, (9, 0), 120900, torch.float32),
    ((1, 128), True, (9, 0), None, torch.bfloat16),        # unknown cuBLAS: assume the old one
    ((1, 128), False, None, None, torch.bfloat16),
])
def test_kernel_out_dtype_decision(gran, cuda, cap, cublas, want):
    assert backends.kernel_out_dtype(gran, torch.float32, cuda, cap, cublas) == want
    for low in (torch.bfloat16, torch.float16):  # a bf16/fp16 request is always honoured
        assert backends.kernel_out_dtype(gran, low, cuda, cap, cublas) == low


def test_cublas_version_numbers():
    assert backends._version_number("12.9") == 120900
    assert backends._version_number("13.0") == 130000
    assert backends._version_number("12.9.1") == 120901
    assert backends._version_number("x") is None
    if torch.version.cuda is None:
        assert backends.cublas_version() is None  # a CPU-only torch has no cuBLAS


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
@pytest.mark.parametrize("facts,wgrad_dtype", [(((9, 0), 120900), torch.float32), (((9, 0), 120800), torch.bfloat16),
                                               (((8, 9), 130000), torch.bfloat16)])
def test_wgrad_asks_for_fp32_on_cublas(name, facts, wgrad_dtype, monkeypatch):
    """A float32 model on a (faked) GPU: every GEMM's output dtype follows kernel_out_dtype, and the float32
    wgrad is within the float32 bound of the emulation (bf16 elsewhere: within the bf16 bound)."""
    calls = []
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel(calls))
    monkeypatch.setattr(backends, "_device_facts", lambda device: (True, facts[0], facts[1]))
    recipe = get_recipe(name)
    x, w, gy = _data(128, 256, 128, seed=3)
    got = _step(recipe, "torch", x, w, gy)
    assert [c[6] for c in calls] == [wgrad_dtype] * 3  # forward, dgrad (float32 model) and wgrad
    assert got[2].dtype == torch.float32
    want = _step(recipe, "emulate", x, w, gy)
    hats = _hats(recipe, x, w, gy)
    for i, what in enumerate(("y", "dx", "dw")):
        _assert_gemm(got[i], want[i], *hats[what], wgrad_dtype, what)


def test_fp32_refused_by_the_kernel_falls_back_to_bf16_once(monkeypatch, caplog):
    """If a GPU's kernel refuses the float32 output kernel_out_dtype promised, the call is redone in bf16
    and bf16 is asked from then on (logged once)."""
    calls = []
    ref = reference_kernel(calls)

    def picky(*args, **kw):
        if args[6] == torch.float32:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return ref(*args, **kw)

    monkeypatch.setattr(backends, "scaled_mm_kernel", picky)
    monkeypatch.setattr(backends, "_device_facts", lambda device: (True, (9, 0), 120900))
    monkeypatch.setattr(backends, "_FP32_REFUSED", {})
    recipe = get_recipe("rowwise")
    x, w, gy = _data(64, 128, 128, seed=4)
    with caplog.at_level(logging.WARNING, logger="nemo_fp8rl.fp8.backends"):
        _step(recipe, "torch", x, w, gy)
        _step(recipe, "torch", x, w, gy)
    assert [c[6] for c in calls] == [torch.bfloat16] * 6
    assert caplog.text.count("refused a float32 output") == 1


# ------------------------------------------------------------------------------------------------
# 3. No float round trips; fast accumulation in the forward GEMM only
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fmt", [("tensorwise", "hybrid"), ("rowwise", "e4m3"), ("blockwise", "e4m3")])
def test_bf16_layer_stays_bf16_outside_the_gemm(name, fmt, monkeypatch):
    calls, seen = [], []
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel(calls))
    orig = torch_linear.quantize_operand_fp8

    def spy(t, role, *a, **kw):
        seen.append((role, t.dtype))
        return orig(t, role, *a, **kw)

    monkeypatch.setattr(torch_linear, "quantize_operand_fp8", spy)
    recipe = get_recipe(name, fp8_format=fmt, accumulation="fast")
    x, w, gy = _data(128, 256, 128, seed=5, dtype=torch.bfloat16)
    bias = torch.randn(128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    y, dx, dw, db = _step(recipe, "torch", x, w, gy, bias)
    assert y.dtype == dx.dtype == torch.bfloat16
    # every operand quantized from its own bf16 values, the output gradient included
    assert {r for r, _ in seen} == {"input", "weight", "grad_output"} and {d for _, d in seen} == {torch.bfloat16}
    fwd, dgrad, wgrad = calls
    assert fwd[6] == dgrad[6] == torch.bfloat16  # the model dtype, no float32 output cast back
    block = name == "blockwise"
    # the bias in the kernel's epilogue (per-tensor, row-wise); torch refuses fast accumulation with blocks
    assert (fwd[8] is not None) == (not block) and fwd[7] == (not block)
    assert not dgrad[7] and not wgrad[7] and dgrad[8] is None and wgrad[8] is None
    want = _step(recipe, "emulate", x, w, gy, bias)
    hats = _hats(recipe, x, w, gy)
    a_hat, b_hat = hats["y"]
    # forward: fast accumulation (emulated truncation vs the exact reference), bias, one or two bf16 roundings
    bound = 2 * gemm_error_bound(a_hat, b_hat, torch.float32, fast_accum=not block) \
        + 2 * 2.0 ** -8 * (a_hat.double().abs() @ b_hat.double().abs().t() + bias.double().abs())
    diff = (y.double() - want[0].double()).abs()
    assert bool((diff <= bound).all()), float((diff - bound).max())
    _assert_gemm(dx, want[1], *hats["dx"], torch.bfloat16, "dx")
    assert db.dtype == torch.bfloat16 and torch.equal(db, want[3])
    if not block:
        cuda_meta_check(calls)


# ------------------------------------------------------------------------------------------------
# 4. 1x128 scales with M % 4 != 0
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1000, 1001, 1003])
def test_1x128_rows_padded_to_a_multiple_of_4(m, monkeypatch):
    calls = []
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel(calls))
    recipe = get_recipe("blockwise")
    x, w, gy = _data(m, 256, 256, seed=m)  # K = N = 256: two 128-blocks in the forward and the dgrad
    got = _step(recipe, "torch", x, w, gy)
    fwd, dgrad = calls[0], calls[1]
    for c in (fwd, dgrad):
        mat_a, sa = c[0], c[2]
        m4 = -(-m // 4) * 4
        assert mat_a.shape[0] == m4 and sa.shape == (m4, 2) and sa.stride() == (1, m4)
        assert not bool(mat_a[m:].float().abs().sum())  # padded rows are zeros
    assert got[0].shape == (m, 256) and got[1].shape == (m, 256)
    cuda_meta_check(calls)
    want = _step(recipe, "emulate", x, w, gy)
    hats = _hats(recipe, x, w, gy)
    for i, what in enumerate(("y", "dx", "dw")):
        _assert_gemm(got[i], want[i], *hats[what], calls[i][6], what)


def test_scaled_mm_args_pads_rows_keeping_values():
    recipe = get_recipe("blockwise")
    g = torch.Generator().manual_seed(7)
    a = quantize_operand_fp8(torch.randn(1001, 256, generator=g), "input", recipe, None, False)
    b = quantize_operand_fp8(torch.randn(128, 256, generator=g), "weight", recipe, None, False)
    mat_a, _, sa, _ = scaled_mm_args(a, b)
    assert mat_a.shape == (1004, 256) and sa.shape == (1004, 2) and sa.stride() == (1, 1004)
    assert not bool(mat_a[1001:].float().abs().sum())
    assert torch.equal(mat_a[:1001].view(torch.uint8), a.data.view(torch.uint8))
    assert torch.equal(sa[:1001], a.scale_inv) and bool((sa[1001:] == 1).all())
    c = copy.deepcopy(a)
    c.data = c.data[:1000].contiguous()
    c.scale_inv = c.scale_inv[:1000]
    mat_c, _, sc, _ = scaled_mm_args(c, b)  # a multiple of 4: nothing copied
    assert mat_c.data_ptr() == c.data.data_ptr() and sc.shape == (1000, 2)


def test_kernels_refuse_tensors_of_another_gpu_than_the_current_one(monkeypatch, caplog):
    """Triton launches on the current CUDA device, so tensors on another GPU would fault there: the kernels
    step aside for them, with the fix (set_device) in the reason, logged once; the current device's run."""
    from nemo_fp8rl.fp8 import kernels

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kernels, "_import_error", lambda: None)  # as where Triton imports
    with caplog.at_level(logging.WARNING, logger="nemo_fp8rl.fp8.kernels"):
        why = kernels.kernel_unavailable(torch.device("cuda", 1))
        assert kernels.kernel_unavailable("cuda:1") == why
    assert "cuda:1" in why and "cuda:0" in why and "torch.cuda.set_device(1)" in why
    assert sum("FP8 kernels off" in r.getMessage() for r in caplog.records) <= 1
    assert kernels.kernel_unavailable(torch.device("cuda", 0)) is None
    assert kernels.kernel_unavailable("cuda") is None
    recipe = get_recipe("tensorwise")
    assert torch_linear.kernel_path_refusal(recipe, "cuda:1") == why
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # after set_device(1): decided again
    assert torch_linear.kernel_path_refusal(recipe, "cuda:1") is None
