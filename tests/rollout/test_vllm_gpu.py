"""GPU (marker ``gpu``): FP8 rollout in vLLM against our emulation of the same scheme, on the same weights.

For each vLLM FP8 scheme (``vllm_block``: block-FP8 checkpoint format synced from our quantizer;
``vllm_w8a8``: vLLM's online ``fp8_per_tensor``):

- vLLM's log-probs of its own greedy tokens vs the torch engine's emulated scheme on the same tokens
  (both BF16 on this GPU), bounded as tests/_fp8_bounds.py explains: nearly every token within the noise
  of two BF16 implementations (``float_tol`` = 2x the torch engine's BF16-vs-float32 gap, FP8 off), none
  beyond the whole FP8 noise of the same quantity (emulated FP8 vs BF16, same tokens);
- a sync changes the tokens and reverting restores them;
- the weights vLLM holds after a sync are ours: for ``vllm_block`` bit for bit (E4M3 codes and
  ``weight_scale_inv`` read back from the running engine through ``collective_rpc``); for ``vllm_w8a8``
  vLLM quantizes itself, with its static kernel multiplying by ``1/s`` where our emulation divides by s:
  equal except on exact rounding ties (at most 1e-4 of the codes, each one code apart);
- sleep (level 2) frees GPU memory; the next sync wakes the engine and generation is as before.

Skipped without a GPU, without vLLM, or where vLLM cannot run FP8 (compute capability < 8.9); the
reason is the engine's own message. The weights are BF16-representable, so vLLM's BF16 copy of them
(what ``vllm_w8a8`` quantizes) equals the float32 weights our emulation quantizes.
"""

from __future__ import annotations

import gc

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import SamplingParams
from tests._fp8_bounds import assert_fp8_paths_agree, fp8_noise_bound

from .conftest import random_hf_weights

pytestmark = pytest.mark.gpu

EOS, PAD = 2, 0
# Qwen3-style, untied LM head; every fused-linear part a multiple of 128 rows (vllm_block needs it)
CFG = ModelConfig(name="qwen3", vocab_size=512, num_layers=4, hidden_size=512, num_attention_heads=4,
                  num_query_groups=2, kv_channels=128, ffn_hidden_size=1024, qk_layernorm=True,
                  untie_embeddings_and_output_weights=True, seq_length=512)
PROMPTS = [[1, 3 + i, 5 + 2 * i, 7 + 3 * i] for i in range(16)] + [[1] + list(range(10, 150))]
RERUN_TOL = 1e-2  # same weights, same batch, rerun: BF16 run-to-run noise at most, far below a weight change
LINEARS = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
           "self_attn.o_proj": ["self_attn.o_proj"],
           "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
           "mlp.down_proj": ["mlp.down_proj"]}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    sd = random_hf_weights(CFG, seed=seed, logit_scale=4.0)
    return {k: v.bfloat16().float() for k, v in sd.items()}  # BF16-representable (module docstring)


@pytest.fixture(scope="module")
def weights():
    return {"a": _weights(0), "b": _weights(1)}


@pytest.fixture(scope="module", params=["vllm_block", "vllm_w8a8"])
def engine(request):
    from nemo_fp8rl.rollout.vllm_engine import VllmEngine
    from nemo_fp8rl.rollout.vllm_support import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (pip install vllm)")
    try:
        e = VllmEngine(CFG, fp8_scheme=request.param, eos_id=EOS, pad_id=PAD, sync_bucket_mb=1.0,
                       gpu_memory_utilization=0.3, max_num_seqs=32)
    except ValueError as err:  # where vLLM cannot run this scheme: the engine's message is the reason
        pytest.skip(str(err))
    print(f"\n{request.param}: vLLM FP8 kernels {e.fp8_kernels}")
    yield e
    e.close()  # free it before the next scheme's engine
    del e
    gc.collect()
    torch.cuda.empty_cache()


def _torch_logp(scheme, dtype, sd, tokens, mask):
    from nemo_fp8rl.rollout import get_rollout_engine

    t = get_rollout_engine("torch", CFG, fp8_scheme=scheme, eos_id=EOS, pad_id=PAD, device="cuda", dtype=dtype)
    t.update_weights(sd)
    with torch.no_grad():
        return t.logprobs(tokens.cuda()).float().cpu() * mask


def test_fp8_logprobs_match_the_emulated_scheme(engine, weights):
    engine.update_weights(iter(weights["a"].items()))
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=32, stop_on_eos=False),
                          torch.Generator().manual_seed(0))
    out.validate()
    m = out.mask
    emulated = _torch_logp(engine.scheme_name, torch.bfloat16, weights["a"], out.tokens, m)
    hp16 = _torch_logp("off", torch.bfloat16, weights["a"], out.tokens, m)
    hp32 = _torch_logp("off", torch.float32, weights["a"], out.tokens, m)
    fp8_noise = fp8_noise_bound(emulated, hp16, m)
    float_tol = max(2 * fp8_noise_bound(hp16, hp32, m), 1e-3)
    stats = assert_fp8_paths_agree(out.rollout_logp, emulated, fp8_noise=fp8_noise, float_tol=float_tol, mask=m,
                                   max_flip_frac=0.25, what=f"vLLM {engine.scheme_name} vs emulation")
    vllm_vs_hp = fp8_noise_bound(out.rollout_logp, hp16, m)
    print(f"{engine.scheme_name}: |vLLM FP8 - emulated FP8| max {stats['max_diff']:.4g}, "
          f"{stats['beyond_float_noise']}/{stats['n']} tokens beyond BF16 noise {float_tol:.3g}; "
          f"FP8 noise (emulated vs BF16) {fp8_noise:.4g}; vLLM FP8 vs BF16 {vllm_vs_hp:.4g}")
    # vLLM really quantizes: its distance from BF16 is FP8-sized, not BF16-sized
    assert vllm_vs_hp > float_tol


def test_sync_changes_tokens_and_reverting_restores_them(engine, weights):
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_on_eos=False)
    engine.update_weights(weights["a"])
    before = engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    engine.update_weights(iter(weights["b"].items()))
    after = engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    assert after.responses() != before.responses()
    engine.update_weights(iter(weights["a"].items()))
    again = engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    assert again.responses() == before.responses()
    # the same batch again: GPU kernels may reduce in another order from run to run (not bitwise)
    assert float((again.rollout_logp - before.rollout_logp).abs().max()) < RERUN_TOL


def _read_linears(worker):
    """On vLLM's worker: each linear's FP8 tensors as vLLM holds them after processing (to CPU)."""
    out = {}
    for i, layer in enumerate(worker.model_runner.get_model().model.layers):
        for name in LINEARS:
            mod = layer.get_submodule(name)
            out[f"{i}.{name}"] = {n: p.detach().cpu().clone() for n, p in mod.named_parameters()
                                  if n in ("weight", "weight_scale_inv", "weight_scale")}
    return out


def test_weights_inside_vllm_are_ours(engine, weights):
    from nemo_fp8rl.fp8 import get_rollout_scheme
    from nemo_fp8rl.rollout.vllm_fp8 import dequantize_vllm_block, vllm_block_fp8_weight

    sd = weights["b"]
    engine.update_weights(iter(sd.items()))
    held = engine.llm.collective_rpc(_read_linears)[0]
    ours = get_rollout_scheme(engine.scheme_name)
    flips, total = 0, 0
    for i in range(CFG.num_layers):
        for fused, parts in LINEARS.items():
            w = torch.cat([sd[f"model.layers.{i}.{p}.weight"] for p in parts])
            got = held[f"{i}.{fused}"]
            where = f"layer {i} {fused}: {({k: (v.dtype, tuple(v.shape)) for k, v in got.items()})}"
            if engine.scheme_name == "vllm_block":
                q, s = vllm_block_fp8_weight(w)
                gw, gs = got["weight"], got["weight_scale_inv"]
                assert gw.shape == q.shape and gs.shape[0] >= s.shape[0] and gs.shape[1] >= s.shape[1], where
                gs = gs[: s.shape[0], : s.shape[1]].float()  # a kernel may pad the scale rows (TMA alignment)
                assert torch.equal(gw.view(torch.uint8), q.view(torch.uint8)), where
                assert torch.equal(gs, s), where
                assert torch.equal(dequantize_vllm_block(gw, gs), ours.quantize_weight(w)), where
            else:
                # vLLM 0.32's online per-tensor method stores the E4M3 weight transposed, [K, N]
                gw, gs = got["weight"].t(), got["weight_scale"]
                assert gw.shape == w.shape and gs.numel() == 1, where
                s = float(gs.float().reshape(()))
                assert s == float(w.abs().amax() / 448.0), where  # amax / 448 of the fused weight, as ours
                mine, theirs = ours.quantize_weight(w), gw.float() * s
                diff = theirs != mine
                flips += int(diff.sum())
                total += diff.numel()
                # a rounding tie decided the other way: one E4M3 code apart (relative 2^-3, or 2^-9 s subnormal)
                gap = (mine - theirs).abs()[diff]
                step = torch.maximum(mine.abs(), theirs.abs())[diff] * 0.125 + s * 2.0**-9
                assert bool((gap <= step).all()), where
    if engine.scheme_name == "vllm_w8a8":
        print(f"vllm_w8a8: {flips}/{total} weight codes differ from the emulation (multiply-by-1/s vs divide)")
        assert flips <= 1e-4 * total, (flips, total)


def test_sleep_frees_memory_and_the_next_sync_wakes_the_engine(engine, weights):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_on_eos=False)
    engine.update_weights(weights["a"])
    before = engine.generate(PROMPTS, params, torch.Generator().manual_seed(2))
    free0 = torch.cuda.mem_get_info()[0]
    assert engine.sleep() is True
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed > 0, freed
    with pytest.raises(RuntimeError, match="put to sleep"):
        engine.generate(PROMPTS, params, torch.Generator().manual_seed(2))
    engine.update_weights(iter(weights["a"].items()))  # wakes weights, syncs, wakes the KV cache
    again = engine.generate(PROMPTS, params, torch.Generator().manual_seed(2))
    assert again.responses() == before.responses()
    assert float((again.rollout_logp - before.rollout_logp).abs().max()) < RERUN_TOL
    # explicit wake_up after sleep: memory back, weights still to be synced
    assert engine.sleep() is True and engine.wake_up() is True
    with pytest.raises(RuntimeError, match="put to sleep"):
        engine.generate(PROMPTS, params, torch.Generator().manual_seed(2))
    engine.update_weights(weights["a"])
    print(f"{engine.scheme_name}: sleep freed {freed / 2**30:.2f} GiB")
