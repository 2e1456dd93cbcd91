"""Recipes registry, emulated FP8 linear (forward and gradients), delayed scaling, converter, disable_fp8."""

import dataclasses
import logging
import warnings

import pytest
import torch

from nemo_fp8rl.fp8 import (
    E4M3,
    E5M2,
    Fp8Linear,
    Fp8LinearState,
    collect_fp8_stats,
    convert_to_fp8,
    disable_fp8,
    fake_quantize,
    fp8_gemm,
    fp8_linear,
    get_recipe,
    get_rollout_scheme,
    list_recipes,
    register_fp8_recipe,
)

RECIPES = ["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"]


def test_registry_names_aliases_and_errors():
    assert list_recipes() == sorted(RECIPES)
    assert get_recipe("bf16_with_fp8_subchannel_scaling_mixed").scaling == "blockwise"
    assert get_recipe("bf16_with_mxfp8_mixed").scaling == "mxfp8"
    assert get_recipe("bf16_with_fp8_delayed_scaling_mixed").scaling == "delayed"
    assert get_recipe("bf16_with_fp8_current_scaling_mixed").scaling == "tensorwise"
    with pytest.raises(ValueError, match="valid recipes: .*blockwise"):
        get_recipe("nvfp4")
    with pytest.raises(ValueError, match="unknown FP8 recipe field"):
        get_recipe("tensorwise", margn=1)
    with pytest.raises(ValueError, match="first_last_layers_bf16"):
        get_recipe("delayed", first_last_layers_bf16=True)
    custom = get_recipe("blockwise").replace(name="blockwise_fp32", pow2_scales=False)
    register_fp8_recipe("blockwise_fp32_test", custom)
    assert get_recipe("blockwise_fp32_test").pow2_scales is False
    with pytest.raises(ValueError, match="already registered"):
        register_fp8_recipe("blockwise_fp32_test", custom)
    assert get_recipe("blockwise").pow2_scales is True  # default: power-of-two scales


def test_to_megatron_kwargs_are_transformer_config_fields():
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name in ["delayed", "tensorwise", "blockwise", "mxfp8"]:
        kw = get_recipe(name, first_last_layers_bf16=(name != "delayed")).to_megatron_kwargs()
        assert set(kw) <= fields, set(kw) - fields
        assert kw["fp8_recipe"] == name
    assert get_recipe("delayed").to_megatron_kwargs()["fp8"] == "hybrid"
    assert get_recipe("blockwise").te_env() == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    with pytest.raises(ValueError, match="rowwise"):
        get_recipe("rowwise").to_megatron_kwargs()


def test_formats_per_role():
    r = get_recipe("tensorwise")
    assert r.format_for("input") is E4M3 and r.format_for("grad_output") is E5M2
    assert get_recipe("tensorwise", fp8_format="e4m3").format_for("grad_output") is E4M3
    all_e5m2 = get_recipe("tensorwise", fp8_format="e5m2")
    assert all_e5m2.format_for("input") is E5M2 and all_e5m2.format_for("weight") is E5M2
    with pytest.raises(ValueError, match="emulation-only"):
        all_e5m2.to_megatron_kwargs()


@pytest.mark.parametrize("name", RECIPES)
def test_forward_and_gradients_are_quantized(name):
    """fp8_linear equals the GEMMs of hand-quantized operands, each along its reduction dim."""
    torch.manual_seed(0)
    r = get_recipe(name)
    x = (torch.randn(2, 5, 256) * 2).requires_grad_()
    w = (torch.randn(160, 256) * 0.05).requires_grad_()
    b = torch.randn(160, requires_grad=True)
    state = Fp8LinearState(r)
    if name == "delayed":  # a first step with gradients of the same size sets non-trivial scales
        y0 = fp8_linear(x, w, b, r, state)
        y0.backward(torch.randn_like(y0))
        x.grad = w.grad = b.grad = None
    y = fp8_linear(x, w, b, r, state)
    gy = torch.randn_like(y)
    y.backward(gy)

    def q(t, role, dim):
        if name == "delayed":
            return None
        return fake_quantize(t, r.format_for(role), r.granularity_for(role), dim=dim,
                             pow2_scales=r.pow2_scales, block=r.mx_block)

    x2, g2 = x.detach().reshape(-1, 256), gy.reshape(-1, 160)
    if name != "delayed":
        y_ref = q(x2, "input", 1) @ q(w.detach(), "weight", 1).t() + b.detach()
        assert torch.equal(y.detach().reshape(-1, 160), y_ref)
        dx_ref = q(g2, "grad_output", 1) @ q(w.detach(), "weight", 0)
        dw_ref = q(g2, "grad_output", 0).t() @ q(x2, "input", 0)
        assert torch.allclose(x.grad.reshape(-1, 256), dx_ref, rtol=0, atol=1e-6)
        assert torch.allclose(w.grad, dw_ref, rtol=0, atol=1e-5)
    assert torch.allclose(b.grad, g2.sum(0))
    # quantized, not exact: gradients differ from the high-precision ones but stay close
    x_hp = x.detach().clone().requires_grad_()
    w_hp = w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x_hp, w_hp, b.detach()).backward(gy)
    rel = (x.grad - x_hp.grad).norm() / x_hp.grad.norm()
    assert 1e-4 < rel < 0.2, rel
    relw = (w.grad - w_hp.grad).norm() / w_hp.grad.norm()
    assert 1e-4 < relw < 0.2, relw


def test_wgrad_high_precision_option():
    torch.manual_seed(0)
    r = get_recipe("tensorwise", wgrad_fp8=False)
    x = torch.randn(8, 64)
    w = torch.randn(32, 64, requires_grad=True)
    gy = torch.randn(8, 32)
    fp8_linear(x, w, None, r).backward(gy)
    assert torch.allclose(w.grad, gy.t() @ x)


def test_delayed_scaling_history():
    r = get_recipe("delayed", amax_history_len=3, amax_compute_algo="max", fp8_format="e4m3")
    st = Fp8LinearState(r)
    w = torch.ones(16, 16, requires_grad=True)
    meta = st.delayed["input"]
    assert meta.scale.item() == 1.0  # first step: s = 1
    # evaluation forwards never touch the history or the scale
    with torch.no_grad():
        fp8_linear(torch.full((2, 16), 7.0), w, None, r, st)
    assert meta.scale.item() == 1.0 and meta.amax_history.abs().sum() == 0
    # step 1 is quantized with s = 1: 1000 saturates to 448
    y = fp8_linear(torch.full((1, 16), 1000.0), w, None, r, st)
    assert y[0, 0].item() == 448.0 * 16
    assert meta.scale.item() == pytest.approx(448.0 / 1000.0)
    for a in (2.0, 4.0):
        fp8_linear(torch.full((1, 16), a), w, None, r, st)
    assert meta.scale.item() == pytest.approx(448.0 / 1000.0)  # 1000 is still in the 3-step window
    fp8_linear(torch.full((1, 16), 1.0), w, None, r, st)  # 1000 leaves the 3-step window
    assert meta.scale.item() == pytest.approx(448.0 / 4.0)
    r2 = get_recipe("delayed", fp8_format="e4m3", margin=1)  # megatron default: history 1, most_recent
    st2 = Fp8LinearState(r2)
    fp8_linear(torch.full((1, 16), 8.0), w, None, r2, st2)
    fp8_linear(torch.full((1, 16), 2.0), w, None, r2, st2)
    assert st2.delayed["input"].scale.item() == pytest.approx(448.0 / 2 / 2.0)
    # state round trip and mismatch error
    sd = st.state_dict()
    st3 = Fp8LinearState(r)
    st3.load_state_dict(sd)
    assert torch.equal(st3.delayed["input"].amax_history, meta.amax_history)
    with pytest.raises(ValueError, match="amax_history_len"):
        Fp8LinearState(get_recipe("delayed", amax_history_len=5)).load_state_dict(sd)


def test_delayed_first_step_weight_max_window():
    """The max window really holds the large amax until it rolls out."""
    r = get_recipe("delayed", amax_history_len=2, amax_compute_algo="max", fp8_format="e4m3")
    st = Fp8LinearState(r)
    w = torch.ones(16, 16)
    for a, want in [(100.0, 100.0), (1.0, 100.0), (1.0, 1.0)]:
        fp8_linear(torch.full((1, 16), a, requires_grad=True), w, None, r, st)
        assert st.delayed["input"].scale.item() == pytest.approx(448.0 / want)


def test_fast_accumulation_truncates():
    torch.manual_seed(0)
    a = torch.randn(16, 256)
    b = torch.randn(8, 256)
    exact = a @ b.t()
    fast = fp8_gemm(a, b, get_recipe("tensorwise", accumulation="fast"), fast=True)
    err = (fast - exact).abs() / exact.abs().clamp(min=1)
    assert err.max() > 1e-6 and err.max() < 1e-2
    # 24 bits kept = exact float32 chunked sum
    full = fp8_gemm(a, b, get_recipe("tensorwise", accumulation="fast", accumulation_bits=24), fast=True)
    assert torch.allclose(full, exact, atol=1e-4)


def _toy():
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
        torch.nn.Linear(48, 10),  # 10 not divisible by 16: skipped
    )


def test_convert_counts_and_logs(caplog):
    m = _toy()
    with caplog.at_level(logging.INFO, logger="nemo_fp8rl.fp8.linear"):
        convert_to_fp8(m, get_recipe("tensorwise"))
    assert "converted 2/3 linear layers" in caplog.text
    assert m.fp8_conversion == {"converted": 2, "total": 3, "skipped": 1, "backend": "emulate", "torch_gemm": 0,
                                "emulated_fallback": 0, "fallback_reasons": {}, "auto_kept": {}}
    assert isinstance(m[0], Fp8Linear) and not isinstance(m[3], Fp8Linear)
    m2 = _toy()
    convert_to_fp8(m2, get_recipe("tensorwise"), module_filter_fn=lambda mod, fqn: fqn == "0")
    assert m2.fp8_conversion["converted"] == 1
    head = torch.nn.Module()
    head.lm_head = torch.nn.Linear(32, 32)
    convert_to_fp8(head, get_recipe("tensorwise"))
    assert head.fp8_conversion["converted"] == 0  # LM head stays high precision


def test_disable_fp8_restores_exact_high_precision():
    torch.manual_seed(0)
    m = _toy()
    x = torch.randn(4, 32)
    ref = m(x)
    params = [p for p in m.parameters()]
    convert_to_fp8(m, get_recipe("blockwise"))
    assert [p for p in m.parameters()] == params  # shared, not copied
    y8 = m(x)
    assert not torch.equal(y8, ref)
    with disable_fp8(m):
        assert torch.equal(m(x), ref)
    assert torch.equal(m(x), y8)
    with pytest.raises(RuntimeError):
        with disable_fp8(m):
            raise RuntimeError("boom")
    assert all(mod.fp8_enabled for mod in m.modules() if hasattr(mod, "fp8_enabled"))


def test_saturation_stats():
    r = get_recipe("delayed", fp8_format="e4m3")  # first step s = 1: values > 448 saturate
    m = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False)), r)
    x = torch.full((2, 16), 1.0)
    x[0, :4] = 1000.0
    m(x)
    s = collect_fp8_stats(m)
    assert s["fp8/saturated"].item() == 4
    assert s["fp8/quantized"].item() == 32 + 256
    assert s["fp8/saturation_frac"].item() == pytest.approx(4 / 288)
    assert collect_fp8_stats(m)["fp8/saturated"].item() == 0  # reset after collection
    x[1, 0] = float("nan")
    m2 = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16)), get_recipe("tensorwise"))
    m2(x)
    assert collect_fp8_stats(m2)["fp8/nonfinite_amax"].item() == 1


@pytest.mark.parametrize("torchao_recipe,ours", [("rowwise", "rowwise"), ("tensorwise", "tensorwise")])
def test_matches_torchao_float8linear_emulate(torchao_recipe, ours):
    warnings.filterwarnings("ignore")
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(torchao_recipe), emulate=True)
    lin = torch.nn.Linear(256, 128, bias=False)
    ao = Float8Linear.from_float(torch.nn.Linear(256, 128, bias=False), config=cfg)
    ao.weight = torch.nn.Parameter(lin.weight.detach().clone())
    x = torch.randn(64, 256) * 3
    y_ao = ao(x)
    # torchao's convention (divide by the scale): equal bit for bit
    assert torch.equal(y_ao, fp8_linear(x, lin.weight, None, get_recipe(ours, dequant="divide")))
    y_te = fp8_linear(x, lin.weight, None, get_recipe(ours))
    if ours == "rowwise":  # power-of-two scales: the conventions coincide
        assert torch.equal(y_ao, y_te)
    else:  # TE's convention (multiply by fp32(1/s)): within one float32 ulp per element of each operand
        ulp = torch.finfo(torch.float32).eps * y_ao.abs().max()
        assert (y_ao - y_te).abs().max() <= 8 * ulp
    # gradients agree too (torchao rowwise: E4M3 grads; tensorwise: E5M2 grads = our hybrid)
    xa = x.clone().requires_grad_()
    xo = x.clone().requires_grad_()
    w = torch.nn.Parameter(lin.weight.detach().clone())
    gy = torch.randn(64, 128)
    ao(xa).backward(gy)
    fp8_linear(xo, w, None, get_recipe(ours, dequant="divide")).backward(gy)
    assert torch.allclose(xa.grad, xo.grad, rtol=0, atol=1e-6)
    assert torch.allclose(ao.weight.grad, w.grad, rtol=1e-6, atol=1e-5)


def test_rollout_schemes():
    torch.manual_seed(0)
    w = torch.randn(256, 256) * 0.02
    x = torch.randn(3, 256)
    x[0] *= 100  # one loud token: per-token scales keep the others fine
    off = get_rollout_scheme("off")
    assert torch.equal(off.quantize_weight(w), w) and not off.enabled
    w8 = get_rollout_scheme("vllm_w8a8")
    s = w.abs().max() / 448
    # vLLM's scaled_fp8_quant multiplies by fp32(1/s) (dividing by s rounds ties differently on some bf16
    # weights; tests/fp8/test_upstream_references.py has the bit-exact port)
    want = (w * (1 / s)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(w8.quantize_weight(w), want)
    xa = w8.quantize_activation(x)
    for t in range(3):
        st = x[t].abs().max() / 448
        assert torch.equal(xa[t], (x[t] / st).to(torch.float8_e4m3fn).float() * st)
    tiny = w8.quantize_activation(torch.full((1, 4), 1e-9))
    assert torch.isfinite(tiny).all()  # floor 1/(448*512) on the scale
    blk = get_rollout_scheme("vllm_block")
    wb = blk.quantize_weight(w)
    assert (wb - w).abs().max() < (w8.quantize_weight(w) - w).abs().max() * 1.01
    assert blk.quantize_activation(torch.randn(2, 3, 200)).shape == (2, 3, 200)
    same = get_rollout_scheme("same_as_train", get_recipe("delayed"))
    assert same.recipe.scaling == "tensorwise"
    assert torch.equal(same.quantize_weight(w), fake_quantize(w, E4M3, "tensor"))
    assert not get_rollout_scheme("same_as_train", None).enabled
    with pytest.raises(ValueError, match="rollout.fp8.scheme"):
        get_rollout_scheme("int8")
