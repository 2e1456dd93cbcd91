"""The vllm_block weight sync into a real vLLM engine, on a CPU whose vLLM loads block FP8 (AMX).

vLLM computes FP8 rollout on NVIDIA GPUs only; on a CPU with AMX its block-FP8 linears run weight-only
(E4M3 weights dequantized per 128x128 block, BF16 activations), which is not the vllm_block scheme, so
the engine refuses it there unless built with ``allow_weight_only_fp8`` (a test hook). What such an
engine does check, for real: the names, shard offsets and dtypes of the E4M3 + ``weight_scale_inv``
stream, vLLM's in-place reload of an FP8 model from dummy weights, and that the weights vLLM holds after
a sync are ours bit for bit. vLLM's CPU kernel repacks the E4M3 weight for AMX
(``torch.ops._C.convert_weight_packed``, a byte permutation): we pack ours with the same op and compare
bytes. Skipped where vLLM has no CPU FP8 kernel (no AMX: e.g. the AVX2 CI machines) and on GPU
(tests/rollout/test_vllm_gpu.py runs the real scheme there).
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import SamplingParams
from nemo_fp8rl.rollout.vllm_support import vllm_available

from .conftest import random_hf_weights

EOS, PAD = 2, 0
# Qwen3-style, every fused-linear part a multiple of 128 rows (q 256, k/v 128, gate/up 384), tied embeddings
CFG = ModelConfig(name="qwen3", vocab_size=64, num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                  kv_channels=64, ffn_hidden_size=384, qk_layernorm=True, untie_embeddings_and_output_weights=False,
                  seq_length=128)
FUSED = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "self_attn.o_proj": ["self_attn.o_proj"],
         "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
         "mlp.down_proj": ["mlp.down_proj"]}


def _cpu_block_fp8_kernel() -> tuple[bool, str]:
    if not vllm_available():
        return False, "vLLM is not installed"
    if torch.cuda.is_available():
        return False, "GPU: tests/rollout/test_vllm_gpu.py checks the real scheme"
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    except ImportError as e:
        return False, f"vLLM has no CPU block-FP8 kernel here ({e})"
    ok, why = CPUFp8BlockScaledMMKernel.is_supported()
    return ok, f"vLLM's CPU block-FP8 kernel is unavailable: {why}"


def _weights(seed: int) -> dict[str, torch.Tensor]:
    sd = random_hf_weights(CFG, seed=seed)
    sd["model.embed_tokens.weight"] *= 0.12  # tied head: logits of std ~1.4 (see test_vllm_engine.py)
    return sd


@pytest.fixture(scope="module")
def engine():
    ok, why = _cpu_block_fp8_kernel()
    if not ok:
        pytest.skip(why)
    from nemo_fp8rl.rollout.vllm_engine import VllmEngine

    # a small bucket: the E4M3 tensors and their scales cross bucket boundaries
    e = VllmEngine(CFG, fp8_scheme="vllm_block", eos_id=EOS, pad_id=PAD, dtype=torch.bfloat16, sync_bucket_mb=0.05,
                   allow_weight_only_fp8=True)
    yield e
    e.close()


def _read_linears(worker):
    """On vLLM's worker: every linear's parameters (E4M3 weight as vLLM holds it, weight_scale_inv)."""
    model = worker.model_runner.get_model()
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in FUSED:
            mod = layer.get_submodule(name)
            out[f"model.layers.{i}.{name}"] = {n: p.detach().clone() for n, p in mod.named_parameters()}
    return out


def _assert_vllm_holds(engine, sd):
    from nemo_fp8rl.rollout.vllm_fp8 import vllm_block_fp8_weight

    held = engine.llm.collective_rpc(_read_linears)[0]
    for i in range(CFG.num_layers):
        for fused, parts in FUSED.items():
            qs = [vllm_block_fp8_weight(sd[f"model.layers.{i}.{p}.weight"]) for p in parts]
            q, s = torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs])
            got = held[f"model.layers.{i}.{fused}"]
            assert got["weight"].dtype == torch.float8_e4m3fn and got["weight_scale_inv"].dtype == torch.float32
            assert torch.equal(got["weight_scale_inv"], s), (i, fused)
            packed = torch.ops._C.convert_weight_packed(q)  # the AMX layout vLLM's CPU kernel stores
            assert torch.equal(got["weight"].view(torch.uint8), packed.view(torch.uint8)), (i, fused)


def test_the_engine_says_it_is_weight_only_here(engine):
    assert engine.fp8_kernels == ["CPUFp8BlockScaledMMKernel"]
    assert engine.fp8_problems and all("BF16 activations" in p for p in engine.fp8_problems)


def test_a_streamed_sync_loads_our_e4m3_weights_and_scales_bit_for_bit(engine):
    a, b = _weights(0), _weights(1)
    info = engine.update_weights(iter(a.items()))  # a stream, as actor.iter_weights() gives
    _assert_vllm_holds(engine, a)
    # bytes handed to vLLM: E4M3 linears (1 byte/element) + float32 scales + BF16 rest (tied: no lm_head)
    fp8 = sum(t.numel() for n, t in a.items() if n.endswith("_proj.weight"))
    scales = sum(((t.shape[0] + 127) // 128) * ((t.shape[1] + 127) // 128) for n, t in a.items()
                 if n.endswith("_proj.weight"))
    rest = sum(t.numel() for n, t in a.items() if not n.endswith("_proj.weight"))
    assert info["bytes"] == fp8 + 4 * scales + 2 * rest
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_on_eos=False)
    prompts = [[1, 3, 4, 5], [1, 7, 9]]
    before = engine.generate(prompts, params, torch.Generator().manual_seed(0))
    before.validate()
    engine.update_weights(b)  # a dict sync replaces every tensor
    _assert_vllm_holds(engine, b)
    after = engine.generate(prompts, params, torch.Generator().manual_seed(0))
    assert not torch.equal(after.rollout_logp, before.rollout_logp)
    engine.update_weights(iter(a.items()))
    again = engine.generate(prompts, params, torch.Generator().manual_seed(0))
    assert torch.equal(again.tokens, before.tokens) and torch.equal(again.rollout_logp, before.rollout_logp)


def test_weight_only_logprobs_are_those_of_the_dequantized_weights(engine):
    """vLLM's W8A16 forward = the high-precision forward of our dequantized weights, up to BF16 noise."""
    from nemo_fp8rl.rollout import get_rollout_engine
    from nemo_fp8rl.rollout.vllm_fp8 import dequantize_vllm_block, vllm_block_fp8_weight

    a = _weights(0)
    engine.update_weights(a)
    out = engine.generate([[1, 3, 4, 5], [1, 7, 9], [1, 11]], SamplingParams(temperature=1.0, max_new_tokens=8,
                                                                         stop_on_eos=False),
                          torch.Generator().manual_seed(3))
    deq = {n: dequantize_vllm_block(*vllm_block_fp8_weight(t)) if n.endswith("_proj.weight") else t for n, t in a.items()}
    ref = get_rollout_engine("torch", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    ref.update_weights(deq)
    exact = ref.logprobs(out.tokens) * out.mask
    ref16 = get_rollout_engine("torch", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, dtype=torch.bfloat16)
    ref16.update_weights(deq)
    bf16_noise = float(((ref16.logprobs(out.tokens) * out.mask) - exact).abs().max())
    d = float((out.rollout_logp - exact).abs().max())
    ref.update_weights(a)  # the weights before FP8 quantization
    quant_effect = float((ref.logprobs(out.tokens) * out.mask - exact).abs().max())
    # BF16 engines (ours and vLLM's) differ from float32 by rounding noise; the FP8 weights move log-probs
    # by far more, so a sync that loaded anything but our dequantized weights would not stay this close
    print(f"W8A16 vLLM vs dequantized float32: {d:.3g}; BF16 noise {bf16_noise:.3g}; FP8 weights move {quant_effect:.3g}")
    assert d < 4 * bf16_noise + 1e-3, (d, bf16_noise)
    assert quant_effect > 4 * bf16_noise + 1e-3, (quant_effect, bf16_noise)
