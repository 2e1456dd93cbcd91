"""``fp8.backend=torch``: the FP8 data of our quantizer on torch's scaled GEMM, checked on CPU.

What runs for real here: torch's CPU ``_scaled_mm`` (per-tensor scales: ``tensorwise``, ``delayed``).
What cannot run on a CPU (row-wise and block-scaled kernels) is checked in two ways that need no GPU:
the arguments we build pass torch's own CUDA shape/stride checks (its meta registration of
``_scaled_mm_v2``, run with the device taken as CUDA), and a readable reference kernel that reads those
arguments the way torch documents them reproduces the emulation through forward, dgrad and wgrad.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from nemo_fp8rl.fp8 import Fp8Linear, Fp8LinearState, convert_to_fp8, fp8_linear, get_recipe, quantize_operand
from nemo_fp8rl.fp8 import backends
from nemo_fp8rl.fp8.backends import (
    gemm_error_bound,
    resolve_fp8_backend,
    scaled_mm_args,
    torch_gemm_support,
)
from nemo_fp8rl.fp8.torch_linear import quantize_operand_fp8

from tests._scaled_mm_reference import cuda_meta_check, reference_kernel


def _grads(recipe, backend, x, w, b, gys, state=None):
    """Run len(gys) forward/backward steps (the state carries the delayed-scaling history).

    Returns ((y, dx, dW, db) of the last step, the state after it, a copy of the state before it).
    """
    state = state if state is not None else Fp8LinearState(recipe)
    out = before = None
    for gy in gys:
        before = copy.deepcopy(state)
        xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bb = b.detach().clone().requires_grad_() if b is not None else None
        y = fp8_linear(xx, ww, bb, recipe, state, backend=backend)
        y.backward(gy)
        out = (y.detach(), xx.grad, ww.grad, bb.grad if bb is not None else None)
    return out, state, before


def _operands(recipe, x, w, gy, state=None):
    """The emulation's dequantized operands of one step's three GEMMs, as (A [M, K], B [N, K]) pairs.

    ``state``: the FP8 state that step started from (delayed scaling); None = a fresh one.
    """
    def q(t, role, dim):
        st = copy.deepcopy(state) if state is not None else Fp8LinearState(recipe)
        return quantize_operand(t.float(), role, dim, recipe, st, False)

    return {"y": (q(x, "input", 1), q(w, "weight", 1)), "dx": (q(gy, "grad_output", 1), q(w, "weight", 0).t()),
            "dw": (q(gy, "grad_output", 0).t(), q(x, "input", 0).t())}


def _assert_within(e, t, a_hat, b_hat, dtype, extra=0.0, what=""):
    """|e - t| <= both paths' accumulation bound + up to three roundings to ``dtype`` of |result| <= S."""
    base = 2 * gemm_error_bound(a_hat, b_hat, torch.float32)
    s = a_hat.double().abs() @ b_hat.double().abs().t()
    u_out = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    bound = base + 3 * u_out * (s + extra + base)
    diff = (e.double() - t.double()).abs()
    assert bool((diff <= bound).all()), (what, float((diff - bound).max()), float(diff.max()))


@pytest.mark.parametrize("name,fmt", [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("delayed", "hybrid")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_torch_gemm_equals_emulation(name, fmt, dtype):
    """Real CPU FP8 GEMMs: y, dx, dW within the accumulation bound of the emulation's; same db, same FP8 state."""
    recipe = get_recipe(name, fp8_format=fmt)
    g = torch.Generator().manual_seed(3)
    m, k, n = 37, 64, 48  # 37 tokens: the wgrad reduction is padded to 48
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    gys = [torch.randn(m, n, generator=g).to(dtype) for _ in range(3)]
    (y_e, dx_e, dw_e, db_e), st_e, before = _grads(recipe, "emulate", x, w, b, gys)
    (y_t, dx_t, dw_t, db_t), st_t, _ = _grads(recipe, "torch", x, w, b, gys)
    # same quantizer, same recorded amaxes: the delayed-scaling state is identical
    sd_e, sd_t = st_e.state_dict(), st_t.state_dict()
    assert sd_e.keys() == sd_t.keys()
    for role in sd_e:
        for key in sd_e[role]:
            assert torch.equal(sd_e[role][key], sd_t[role][key]), (role, key)
    assert torch.equal(db_e, db_t)  # bias gradient: the same high-precision sum
    ops = _operands(recipe, x, w, gys[-1], before)
    _assert_within(y_e, y_t, *ops["y"], dtype, extra=b.double().abs(), what="y")
    _assert_within(dx_e, dx_t, *ops["dx"], dtype, what="dx")
    _assert_within(dw_e, dw_t, *ops["dw"], dtype, what="dw")


def test_quantized_operands_bit_equal_every_recipe():
    """The torch path's FP8 data, read back, is the emulation's FP8 value of every element (all recipes)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(256, 384, generator=g) * torch.logspace(-2, 2, 384)  # outlier channels
    for name in ("tensorwise", "delayed", "rowwise", "blockwise"):
        for fmt in ("e4m3", "hybrid"):
            recipe = get_recipe(name, fp8_format=fmt)
            for role in ("input", "weight", "grad_output"):
                st = Fp8LinearState(recipe)
                emu = quantize_operand(t, role, 1, recipe, st, False)
                q = quantize_operand_fp8(t, role, recipe, Fp8LinearState(recipe), False)
                assert q.data.dtype == backends.torch_fp8_dtype(recipe.format_for(role))
                assert q.data.is_contiguous() and q.data.shape == t.shape
                assert torch.equal(q.dequantize(), emu), (name, fmt, role)


# ------------------------------------------------------------------------------------------------
# Row-wise and block-scaled kernels: a readable reference of torch's scaled GEMM, and torch's own checks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fmt", [("rowwise", "e4m3"), ("blockwise", "e4m3"), ("blockwise", "hybrid"),
                                      ("tensorwise", "hybrid")])
def test_scaled_mm_layouts_against_reference_kernel(name, fmt, monkeypatch):
    """Every GEMM's arguments, read as torch documents them, give the emulation's results."""
    if not hasattr(torch.nn.functional, "ScalingType"):
        pytest.skip("this torch has no torch.nn.functional.ScalingType")
    calls = []
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel(calls))
    recipe = get_recipe(name, fp8_format=fmt)
    g = torch.Generator().manual_seed(1)
    m, k, n = 130, 256, 128  # tokens not a multiple of 128: wgrad pads them
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)
    w = torch.randn(n, k, generator=g) * 0.05
    gy = torch.randn(m, n, generator=g)
    (y_e, dx_e, dw_e, _), _, _ = _grads(recipe, "emulate", x, w, None, [gy])
    (y_t, dx_t, dw_t, _), _, _ = _grads(recipe, "torch", x, w, None, [gy])
    # blockwise + hybrid: torch's block-scaled kernels take no E5M2 operand, so dgrad and wgrad run in
    # float32 on the dequantized operands (the emulation's numbers) and only the forward reaches the kernel
    on_kernel = ("y",) if (name, fmt) == ("blockwise", "hybrid") else ("y", "dx", "dw")
    assert len(calls) == len(on_kernel)
    ops = _operands(recipe, x, w, gy)
    kernel_out = dict(zip(on_kernel, (c[6] for c in calls)))
    for what, e, t in (("y", y_e, y_t), ("dx", dx_e, dx_t), ("dw", dw_e, dw_t)):
        od = kernel_out.get(what, torch.float32)
        a_hat, b_hat = ops[what]
        # the reference kernel is exact in float64 and rounds once to its output dtype
        bound = gemm_error_bound(a_hat, b_hat, torch.float32) + gemm_error_bound(a_hat, b_hat, od)
        diff = (e.double() - t.double()).abs()
        assert bool((diff <= bound).all()), (name, fmt, what, float((diff - bound).max()))
    cuda_meta_check(calls)


def test_meta_check_rejects_a_wrong_layout():
    """The meta check used above is a real check: a row-major 1x128 scale (wrong stride) is refused."""
    if not hasattr(torch.nn.functional, "ScalingType"):
        pytest.skip("this torch has no torch.nn.functional.ScalingType")
    recipe = get_recipe("blockwise")
    g = torch.Generator().manual_seed(2)
    a = quantize_operand_fp8(torch.randn(128, 256, generator=g), "input", recipe, None, False)
    b = quantize_operand_fp8(torch.randn(128, 256, generator=g), "weight", recipe, None, False)
    mat_a, mat_b, sa, sb = scaled_mm_args(a, b)
    st = torch.nn.functional.ScalingType
    good = [(mat_a, mat_b, sa, st.BlockWise1x128, sb, st.BlockWise128x128, torch.bfloat16, False, None)]
    cuda_meta_check(good)
    bad = [(mat_a, mat_b, sa.contiguous(), st.BlockWise1x128, sb, st.BlockWise128x128, torch.bfloat16, False, None)]
    with pytest.raises(RuntimeError):
        cuda_meta_check(bad)


# ------------------------------------------------------------------------------------------------
# Selection, fallbacks, conversion
# ------------------------------------------------------------------------------------------------


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_fp8_backend(None, cpu) == "emulate"
    assert resolve_fp8_backend("torch", cpu) == "torch"
    assert resolve_fp8_backend("emulate", cpu) == "emulate"
    with pytest.raises(ValueError, match="fp8.backend=te needs a GPU"):
        resolve_fp8_backend("te", cpu)
    with pytest.raises(ValueError, match="valid"):
        resolve_fp8_backend("cutlass", cpu)


def test_torch_gemm_support_reasons_on_cpu():
    cpu = torch.device("cpu")
    assert torch_gemm_support(get_recipe("tensorwise"), cpu, 48, 64) is None
    assert torch_gemm_support(get_recipe("delayed"), cpu, 48, 64) is None
    assert "per-tensor scales only" in torch_gemm_support(get_recipe("rowwise"), cpu, 128, 128)
    assert "per-tensor scales only" in torch_gemm_support(get_recipe("blockwise"), cpu, 128, 128)
    assert "sm100" in torch_gemm_support(get_recipe("mxfp8"), cpu, 128, 128)
    assert "not a multiple of 16" in torch_gemm_support(get_recipe("tensorwise"), cpu, 40, 64)
    assert "E5M2 x E5M2" in torch_gemm_support(get_recipe("tensorwise", fp8_format="e5m2"), cpu, 48, 64)


def test_convert_counts_torch_layers_and_fallbacks(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40))
    with caplog.at_level(logging.INFO, logger="nemo_fp8rl.fp8.linear"):
        convert_to_fp8(model, get_recipe("tensorwise"), module_filter_fn=None, backend="torch")
    conv = model.fp8_conversion
    assert conv["converted"] == 2 and conv["backend"] == "torch"
    assert conv["torch_gemm"] == 1 and conv["emulated_fallback"] == 1
    assert conv["fallback_reasons"] == {"shape [40, 48] is not a multiple of 16": 1}
    assert model[0].fp8_backend == "torch" and model[2].fp8_backend == "emulate"
    assert "1 on torch FP8 GEMMs, 1 emulated" in caplog.text
    y = model(torch.randn(5, 64))  # a mixed model runs
    assert y.shape == (5, 40) and bool(torch.isfinite(y).all())
    with pytest.raises(ValueError, match="per-layer FP8 backend"):
        convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16)), get_recipe("tensorwise"), backend="te")


def test_backend_switch_keeps_state_and_trajectory():
    """Delayed scaling trained 2 steps on one backend, its state saved and resumed on the other: the third
    step is the uninterrupted run's within the GEMM bound (same state keys and values either way)."""
    recipe = get_recipe("delayed")
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g) * 0.1
    gys = [torch.randn(32, 48, generator=g) for _ in range(3)]
    for first, then in (("emulate", "torch"), ("torch", "emulate")):
        lin = Fp8Linear.from_linear(torch.nn.Linear(64, 48, bias=False), recipe, backend=first)
        _, st, _ = _grads(recipe, first, x, w, None, gys[:2], state=lin.fp8_state)
        resumed = Fp8LinearState(recipe)
        resumed.load_state_dict(st.state_dict())  # a checkpoint's FP8 state, whatever backend wrote it
        (y_r, dx_r, dw_r, _), _, before = _grads(recipe, then, x, w, None, gys[2:], state=resumed)
        (y_u, dx_u, dw_u, _), _, _ = _grads(recipe, first, x, w, None, gys)
        ops = _operands(recipe, x, w, gys[2], before)
        _assert_within(y_r, y_u, *ops["y"], torch.float32, what=f"{first}->{then} y")
        _assert_within(dx_r, dx_u, *ops["dx"], torch.float32, what=f"{first}->{then} dx")
        _assert_within(dw_r, dw_u, *ops["dw"], torch.float32, what=f"{first}->{then} dw")
