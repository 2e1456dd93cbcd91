"""Under torchrun (2 gloo ranks): the vllm engine at ``tensor_parallel_size=2`` against a whole-model one.

Usage: ``torchrun --nproc_per_node=2 _vllm_tp_main.py OUT`` writes ``OUT.<rank>.pt`` with what each rank
saw (batches, vLLM's groups, timings, the errors of the refusals). Run by tests/rollout/test_vllm_tp.py,
which asserts on the files. In order, on both ranks:

1. the T=2 engine (``external_launcher``, one vLLM group of ranks 0 and 1): sync weights "a", generate
   greedy and sampled; sync "b", generate greedy; rank-dependent prompts (refused);
2. close it (the trainer's process group must survive) and build a T=1 engine on each rank, same calls;
3. the torch engine's log-probs of the T=2 engine's tokens;
4. the build rendezvous: settings that differ between ranks (both refuse), then a rank that does not
   build (the other one names it after a 3 s timeout).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import random_hf_weights

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine

EOS, PAD = 2, 0
# tests/rollout/test_vllm_engine.py's model: Qwen3-style, GQA (2 KV heads: one per TP rank), tied embeddings
CFG = ModelConfig(name="qwen3", vocab_size=64, num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, untie_embeddings_and_output_weights=False,
                  seq_length=320)
RAGGED = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13, 14], [1, 15, 3]] * 2
# a prompt longer than one KV block (16 tokens on CPU): the prefix cache must be reset after a sync
RAGGED.append([1] + [(5 * i) % 60 + 3 for i in range(40)])
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, stop_on_eos=False)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, stop_on_eos=False)


def weights(seed: int) -> dict[str, torch.Tensor]:
    sd = random_hf_weights(CFG, seed=seed)
    sd["model.embed_tokens.weight"] *= 0.12  # logits of std ~1.4: real choices (see test_vllm_engine.py)
    return sd


def calls(engine) -> dict:
    """The same calls on every engine; fresh generators, so each batch depends only on weights and seeds."""
    out = {}
    t = time.perf_counter()
    engine.update_weights(weights(0))
    out["sync_s"] = time.perf_counter() - t
    t = time.perf_counter()
    out["greedy_a"] = engine.generate(RAGGED, GREEDY, torch.Generator().manual_seed(0))
    out["gen_s"] = time.perf_counter() - t
    out["sampled_a"] = engine.generate(RAGGED, SAMPLED, torch.Generator().manual_seed(1))
    engine.update_weights(weights(1))
    t = time.perf_counter()
    out["greedy_b"] = engine.generate(RAGGED, GREEDY, torch.Generator().manual_seed(0))
    out["gen2_s"] = time.perf_counter() - t
    engine.update_weights(weights(0))
    out["greedy_a_again"] = engine.generate(RAGGED, GREEDY, torch.Generator().manual_seed(0))
    return out


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded and asserted on by the test
        return f"{type(e).__name__}: {e}"
    return None


def main(out_prefix: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec: dict = {}
    t0 = time.perf_counter()
    tp2 = get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, tensor_parallel_size=2,
                             sync_bucket_mb=0.05)
    rec["build_tp2_s"] = time.perf_counter() - t0
    rec["tp_group_ranks"] = tp2.tp_group_ranks
    rec["tp2"] = calls(tp2)
    rec["mixed_prompts_error"] = error_of(
        lambda: tp2.generate(RAGGED[rank:], GREEDY, torch.Generator().manual_seed(0)))
    tp2.close()
    rec["process_group_kept"] = dist.is_initialized()
    dist.barrier()  # the trainer's group still works

    t0 = time.perf_counter()
    tp1 = get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, sync_bucket_mb=0.05)
    rec["build_tp1_s"] = time.perf_counter() - t0
    rec["tp1"] = calls(tp1)
    tp1.close()

    ref = get_rollout_engine("torch", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    ref.update_weights(weights(0))
    for k, temperature in (("greedy_a", 1.0), ("sampled_a", 1.0)):
        b = rec["tp2"][k]
        rec[f"torch_logp_{k}"] = ref.logprobs(b.tokens, temperature=temperature) * b.mask

    import nemo_fp8rl.rollout.vllm_spmd as spmd

    rec["differing_settings_error"] = error_of(lambda: get_rollout_engine(
        "vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, tensor_parallel_size=2, max_num_seqs=64 + rank))
    dist.barrier()
    if rank == 0:
        spmd.BUILD_RENDEZVOUS_S = 3.0
        rec["missing_rank_error"] = error_of(lambda: get_rollout_engine(
            "vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, tensor_parallel_size=2))
    dist.barrier()
    torch.save(rec, f"{out_prefix}.{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
