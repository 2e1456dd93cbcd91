"""Run in a fresh process (megatron + torch.distributed state stays out of the pytest process).

Builds the Megatron actor twice (FP8 off; FP8 ``tensorwise``) on the same peaked random weights, syncs
its ``export_weights()`` into the torch rollout engine with each rollout scheme, samples, and saves
the rollout log-probs next to the trainer's teacher-forced log-probs of the same tokens.

Usage: python _actor_parity.py OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import random_hf_weights  # noqa: E402 (after the sys.path insert)

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig  # noqa: E402 (after the sys.path insert)
from nemo_fp8rl.fp8 import get_recipe  # noqa: E402 (after the sys.path insert)
from nemo_fp8rl.models import build_actor  # noqa: E402 (after the sys.path insert)
from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine  # noqa: E402 (after the sys.path insert)

EOS, PAD = 2, 0
# vocab 21 is padded to 24 rows inside Megatron: the trainer's log-softmax must ignore the padding, as
# the engine (which receives the 21 real rows) does.
CFG = dict(vocab_size=21, make_vocab_size_divisible_by=8, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=128, seq_length=32, add_qkv_bias=True)
PROMPTS = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13, 14], [1, 15, 3, 20]] * 4


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    cfg = ModelConfig(**CFG)
    sd = random_hf_weights(cfg, seed=5, logit_scale=6.0)
    out = {}
    for arm, recipe in (("bf16", None), ("fp8", get_recipe("tensorwise"))):
        actor = build_actor(cfg, ParallelConfig(micro_batch_size=len(PROMPTS)), fp8_recipe=recipe, seed=0, lr=1e-4)
        actor.load_weights(sd)
        exported = actor.export_weights()
        out[f"{arm}/export_max_err"] = max(float((exported[k] - sd[k]).abs().max()) for k in sd)
        # The bf16 arm runs its rollout in high precision (as the trainer does); the FP8 arm tries all.
        for scheme in ("off",) if recipe is None else ("off", "vllm_w8a8", "same_as_train"):
            eng = get_rollout_engine("torch", cfg, fp8_scheme=scheme, train_recipe=recipe, eos_id=EOS, pad_id=PAD)
            eng.update_weights(exported)
            batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10), torch.Generator().manual_seed(0))
            out[f"{arm}/{scheme}/mask"] = batch.mask
            out[f"{arm}/{scheme}/rollout_logp"] = batch.rollout_logp
            out[f"{arm}/{scheme}/trainer_logp"] = actor.get_logprobs(batch.tokens)[0]
            out[f"{arm}/{scheme}/shadow_logp"] = actor.get_shadow_logprobs(batch.tokens)[0]
            out[f"{arm}/{scheme}/engine_full_logp"] = eng.logprobs(batch.tokens)
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
