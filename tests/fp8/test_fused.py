"""The fused (torch.compile) quantizer against the eager one, bit for bit; the weight cache; autocast; stats.

Compiled kernels are cached on disk by Inductor (``TORCHINDUCTOR_CACHE_DIR``), so the first run of this
file in a fresh environment pays each kernel's compile once (the shapes below are few on purpose) and
later processes pay tracing only.
"""

import contextlib
import logging

import pytest
import torch

from nemo_fp8rl.fp8 import (
    Fp8Linear,
    collect_fp8_stats,
    convert_to_fp8,
    fake_quantize,
    fp8_weight_cache,
    fused,
    get_recipe,
    quantize,
)

RECIPES = ["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits; two NaNs count as equal whatever their sign bit (E4M3 has two)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((_bits(a) == _bits(b)) | both_nan).all())


@contextlib.contextmanager
def _mode(mode: str):
    with fused.compile_mode_set(mode):
        yield


@pytest.fixture(autouse=True)
def _compile_must_work():
    yield
    assert fused.compile_unavailable() is None, f"torch.compile failed here: {fused.compile_unavailable()}"


def _train_once(recipe_name: str, mode: str, dtype: torch.dtype, fmt: str):
    """Two forward+backward passes of one FP8 linear (delayed: the second uses the first's history)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384, bias=True).to(dtype)
    layer = Fp8Linear.from_linear(lin, get_recipe(recipe_name, fp8_format=fmt))
    outs = []
    with _mode(mode):
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            x = (torch.randn(3, 33, 256, generator=g) * 3).to(dtype).requires_grad_()  # 99 tokens: no block multiple
            y = layer(x)
            gy = torch.randn(y.shape, generator=g).to(dtype)
            y.backward(gy)
            outs += [y.detach(), x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()]
            lin.weight.grad = lin.bias.grad = None
    stats = collect_fp8_stats(torch.nn.Sequential(layer))
    return outs, {k: v for k, v in stats.items()}


# Every recipe, each with both FP8 formats in play (hybrid: E4M3 inputs/weights, E5M2 gradients; rowwise is
# E4M3 throughout, its only format): each compiled kernel costs a few seconds of C++ the first time, so the
# matrix is the set of distinct (granularity, dim, format) kernels, not every combination of names.
@pytest.mark.parametrize("recipe_name,fmt", [("delayed", "hybrid"), ("tensorwise", "hybrid"), ("rowwise", "e4m3"),
                                             ("blockwise", "hybrid"), ("mxfp8", "hybrid"), ("tensorwise", "e5m2")])
def test_compiled_linear_is_bit_equal_to_eager(recipe_name, fmt):
    """Forward output, dgrad, wgrad, bias grad and the FP8 counters are the same bits compiled or eager."""
    eager, eager_stats = _train_once(recipe_name, "false", torch.float32, fmt)
    comp, comp_stats = _train_once(recipe_name, "true", torch.float32, fmt)
    for i, (a, b) in enumerate(zip(eager, comp)):
        assert _same(a, b), f"{recipe_name}/{fmt}: output {i} differs"
    for k in eager_stats:
        assert torch.equal(eager_stats[k], comp_stats[k]), k


@pytest.mark.parametrize("recipe_name", ["tensorwise"])
def test_bf16_linear_compiled_is_eager_and_stays_bf16(recipe_name):
    """A bf16 layer: bf16 output and grads, the same bits compiled or not."""
    eager, _ = _train_once(recipe_name, "false", torch.bfloat16, "hybrid")
    comp, _ = _train_once(recipe_name, "true", torch.bfloat16, "hybrid")
    for a, b in zip(eager, comp):
        assert a.dtype == torch.bfloat16
        assert _same(a, b)


def _edge_tensor(dtype):
    """[130, 160]: an all-zero 1x128 row block and 128x128 tile, a tiny-amax row, inf, NaN, saturating values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, 160, generator=g) * 2
    x[:128, :128] = 0.0
    x[129, :] = x[129, :] * 1e-38
    x[128, 140] = float("inf")
    x[128, 150] = float("nan")
    x[129, 159] = 1e6
    return x.to(dtype)


@pytest.mark.parametrize(
    "dtype,fmt,gran,dim,pow2,eps",
    [(torch.float32, "e4m3", "tensor", -1, False, 0.0), (torch.float32, "e5m2", (1, 128), 0, True, 0.0),
     (torch.bfloat16, "e4m3", (1, 128), 1, False, 0.0), (torch.float32, "e4m3", (1, 128), 1, False, 1e-12),
     (torch.bfloat16, "e4m3", (128, 128), -1, False, 0.0), (torch.float32, "e5m2", "mx", 1, False, 0.0),
     (torch.float32, "e4m3", "row", -1, True, 0.0)],
)
def test_compiled_quantize_edge_cases_are_bit_equal(dtype, fmt, gran, dim, pow2, eps):
    """quantize (data and scale_inv) and fake_quantize, compiled vs eager, on zero/tiny/inf/NaN groups."""
    x = _edge_tensor(dtype)
    with _mode("false"):
        q0, s0 = quantize(x, fmt, gran, dim=dim, pow2_scales=pow2, eps=eps)
        f0 = fake_quantize(x, fmt, gran, dim=dim, pow2_scales=pow2, eps=eps, out_dtype=torch.float32)
    with _mode("true"):
        q1, s1 = quantize(x, fmt, gran, dim=dim, pow2_scales=pow2, eps=eps)
        f1 = fake_quantize(x, fmt, gran, dim=dim, pow2_scales=pow2, eps=eps, out_dtype=torch.float32)
    assert _same(q0, q1) and _same(s0, s1) and _same(f0, f1)


def test_compile_failure_falls_back_to_eager_once(monkeypatch, caplog):
    """A compile that raises: one warning naming the cause, the eager result, eager from then on."""
    fused.reset()

    def broken(fn, **kw):
        def call(*a):
            raise RuntimeError("no C++ compiler found")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    x = torch.randn(64, 64)
    with _mode("false"):
        ref = fake_quantize(x, "e4m3")
    try:
        with _mode("true"), caplog.at_level(logging.WARNING, logger="nemo_fp8rl.fp8.fused"):
            out = fake_quantize(x, "e4m3")
            out2 = fake_quantize(x, "e4m3")
        assert _same(out, ref) and _same(out2, ref)
        warnings_ = [r for r in caplog.records if "torch.compile of the FP8 quantizer failed" in r.getMessage()]
        assert len(warnings_) == 1 and "no C++ compiler found" in warnings_[0].getMessage()
        assert "no C++ compiler found" in fused.compile_unavailable()
        assert not fused.wants_compile(x)
    finally:
        fused.reset()


def test_graphs_compile_with_eager_division_and_denormals(monkeypatch):
    """Triton's default float32 division is approximate and it flushes denormals (Inductor's
    ``eager_numerics``): every quantizer graph asks for exact division and kept denormals, which the
    running torch must accept as options (an unknown one makes ``torch.compile`` raise)."""
    from torch._inductor import config as inductor_config

    opts = fused.compile_options()
    assert set(opts) <= set(fused.EXACT_NUMERICS) and all(v is True for v in opts.values())
    if hasattr(inductor_config, "eager_numerics"):  # torch 2.13: both exist
        assert set(opts) == set(fused.EXACT_NUMERICS)
    seen = []

    def capture(fn, **kw):
        seen.append(kw)
        return fn

    fused.reset()
    monkeypatch.setattr(torch, "compile", capture)
    try:
        with _mode("true"):
            fake_quantize(torch.randn(8, 8), "e4m3")
    finally:
        fused.reset()
    assert seen and all(kw.get("options") == opts for kw in seen)


def test_auto_mode_compiles_large_cpu_tensors_only():
    with _mode("auto"):
        assert not fused.wants_compile(torch.empty(16, 16))
        assert fused.wants_compile(torch.empty(fused.AUTO_MIN_NUMEL))
    with _mode("false"):
        assert not fused.wants_compile(torch.empty(fused.AUTO_MIN_NUMEL))
    with _mode("true"):
        assert fused.wants_compile(torch.empty(1))
    with pytest.raises(ValueError, match="fp8.compile"):
        fused.set_compile_mode("sometimes")


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed", "rowwise", "mxfp8"])
def test_weight_cache_quantizes_a_weight_once_per_step(recipe_name, monkeypatch):
    """Inside fp8_weight_cache the weight is quantized once per reduction dim, whatever the micro-batch count,
    and the results equal the uncached run for a weight that does not change (delayed: the weight's amax is
    recorded by the first quantization only, as Transformer Engine's first-micro-batch caching does)."""
    from nemo_fp8rl.fp8 import linear as linear_mod

    calls = []
    real = linear_mod._quantize_impl

    def counting(t, f, gran, dim, *a):
        calls.append((tuple(t.shape), dim))
        return real(t, f, gran, dim, *a)

    monkeypatch.setattr(linear_mod, "_quantize_impl", counting)

    def run(cached: bool):
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 96)
        layer = Fp8Linear.from_linear(lin, get_recipe(recipe_name))
        calls.clear()
        ctx = fp8_weight_cache(layer) if cached else contextlib.nullcontext()
        outs = []
        with ctx:
            for mb in range(3):
                x = torch.randn(20, 64, generator=torch.Generator().manual_seed(mb), requires_grad=True)
                layer(x).sum().backward()
                outs.append(x.grad)
        weight_calls = [c for c in calls if c[0] == (96, 64)]
        return outs, lin.weight.grad, weight_calls

    outs_c, gw_c, w_calls_c = run(True)
    outs_u, gw_u, w_calls_u = run(False)
    dims = {d for _, d in w_calls_u}
    assert len(w_calls_u) == 3 * len(dims)  # uncached: every micro-batch quantizes the weight
    # cached: the forward's copy (along K) once for per-tensor and 2-D tile recipes; rowwise/mxfp8 weights
    # keep no float32 copy between GEMMs (the memory plan counts none) and are re-quantized per use
    cached = recipe_name in ("tensorwise", "delayed")
    assert [d for _, d in w_calls_c].count(1) == (1 if cached else 3)
    assert [d for _, d in w_calls_c].count(0) == (3 if 0 in dims else 0)
    if recipe_name != "delayed":  # delayed: the cached weight keeps micro-batch 1's scale, as TE does
        for a, b in zip(outs_c, outs_u):
            assert torch.equal(a, b)
        assert torch.equal(gw_c, gw_u)


def test_weight_cache_misses_after_an_in_place_update_and_is_dropped_on_exit():
    lin = torch.nn.Linear(32, 48)
    layer = Fp8Linear.from_linear(lin, get_recipe("tensorwise"))
    x = torch.randn(8, 32)
    with fp8_weight_cache(layer):
        y0 = layer(x)
        with torch.no_grad():
            lin.weight.mul_(2.0)  # bumps the version counter: the cache must not serve the old weight
        y1 = layer(x)
    assert not torch.equal(y0, y1)
    assert torch.allclose(y1, Fp8Linear.from_linear(lin, get_recipe("tensorwise"))(x))
    assert layer.fp8_state.weight_cache.entries == {} and not layer.fp8_state.weight_cache.active


def test_emulated_gemm_ignores_autocast():
    """An autocast region (Megatron wraps the forward in one) must not round the FP8 operands to bf16."""
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 64), get_recipe("tensorwise"))
    x = torch.randn(16, 64)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.float32 and torch.equal(out, ref)


def test_collect_fp8_stats_sums_every_layer():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    convert_to_fp8(model, get_recipe("delayed"), module_filter_fn=None)
    model(torch.randn(4, 32) * 1e4).sum().backward()  # first delayed step: scale 1 -> overflow counted
    stats = collect_fp8_stats(model)
    # per layer: x [4, 32], W [32, 32], dy [4, 32] once (per-tensor operands are reused across GEMMs)
    assert stats["fp8/quantized"].item() == 2 * (4 * 32 + 32 * 32 + 4 * 32)
    assert stats["fp8/saturated"].item() > 0 and stats["fp8/nonfinite_amax"].item() == 0
    again = collect_fp8_stats(model)  # reset by the first call
    assert again["fp8/quantized"].item() == 0


def test_fp8_compile_config_key_is_checked():
    from nemo_fp8rl.config.schema import ConfigError, TrainConfig, check_values

    cfg = TrainConfig()
    cfg.fp8.recipe = "tensorwise"
    cfg.fp8.compile = "sometimes"
    with pytest.raises(ConfigError, match=r"fp8\.compile='sometimes'"):
        check_values(cfg)
    cfg.fp8.compile = "False"  # what OmegaConf makes of a YAML false in a str field
    check_values(cfg)


def test_forward_fast_accumulation_is_the_real_backends_default():
    """TE and torchao run the forward GEMM with fast accumulation; the emulation stays exact unless asked."""
    from nemo_fp8rl.fp8.torch_linear import forward_fast_accum

    assert get_recipe("tensorwise").accumulation is None
    assert forward_fast_accum(get_recipe("tensorwise"))
    assert forward_fast_accum(get_recipe("tensorwise", accumulation="fast"))
    assert not forward_fast_accum(get_recipe("tensorwise", accumulation="fp32"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    default = Fp8Linear.from_linear(lin, get_recipe("tensorwise"))(x)
    exact = Fp8Linear.from_linear(lin, get_recipe("tensorwise", accumulation="fp32"))(x)
    assert torch.equal(default, exact)


def test_a_dispatch_mode_runs_eager_without_disabling_compile():
    """Inside a TorchDispatchMode (here torch's FlopCounterMode) the quantizer runs its eager ops, and the
    fused path stays available afterwards."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(64, 64)
    with _mode("false"):
        ref = fake_quantize(x, "e4m3")
    with _mode("true"):
        with FlopCounterMode(display=False):
            assert _same(fake_quantize(x, "e4m3"), ref)
        assert fused.compile_unavailable() is None and fused.wants_compile(x)
