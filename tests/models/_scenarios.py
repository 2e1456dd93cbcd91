"""Actor scenarios shared by the single-process reference and the 2-process gloo runs.

``run_actor`` builds an actor for a layout, records its initial weights, log-probs and entropies,
takes optimizer steps on a fixed minibatch (split over DP ranks), and records metrics and log-probs
after each step. Comparing its output across layouts is the TP/PP/DP equivalence test.
"""

from __future__ import annotations

import torch

from nemo_fp8rl.algorithms.metrics import metrics_to_floats
from nemo_fp8rl.config.model import ModelConfig, ParallelConfig

# GQA (4 query heads, 2 KV groups) + QKV bias + untied head; vocabulary padded differently at TP 1/2.
CFG_A = dict(vocab_size=21, make_vocab_size_divisible_by=8, num_layers=4, hidden_size=64,
             num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, seq_length=32,
             add_qkv_bias=True)
# Tied embeddings (a head copy on the last stage under PP) + Qwen3-style QK RMSNorm.
CFG_B = dict(vocab_size=19, make_vocab_size_divisible_by=4, num_layers=2, hidden_size=64,
             num_attention_heads=4, ffn_hidden_size=96, seq_length=32, qk_layernorm=True,
             untie_embeddings_and_output_weights=False, norm_epsilon=1e-6)


def make_batch(vocab: int, B: int = 6, T: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response batch: tokens [B, T], mask [B, T] (1 on response), advantages [B]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b in range(B):
        prompt = 3 + b % 3
        end = T - (b % 4)  # some sequences end early (right padding)
        mask[b, prompt:end] = 1.0
        tokens[b, end:] = 0
    adv = torch.randn(B, generator=g)
    return {"tokens": tokens, "mask": mask, "advantages": adv}


def pg_loss(mb, logprobs, entropy, *, global_tokens, global_seqs):
    """Token-mean policy gradient with an entropy bonus, normalised by global token count."""
    m = mb["mask"]
    pg = -(mb["advantages"][:, None] * logprobs * m).sum() / global_tokens
    ent = (entropy * m).sum() / global_tokens
    seq_lp = ((logprobs * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / global_seqs
    loss = pg - 0.01 * ent
    return loss, {"loss/pg": (pg.detach(), "sum"), "loss/entropy": (ent.detach(), "sum"),
                  "loss/seq_logp": (seq_lp.detach(), "sum"), "loss/max_adv": (mb["advantages"].max(), "max")}


def run_actor(model_kw: dict, parallel_kw: dict, *, fp8: str | None = None, steps: int = 2, lr: float = 1e-3,
              seed: int = 0, batch_seed: int = 1, distributed: bool = False) -> dict:
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    mc = ModelConfig(**model_kw)
    pc = ParallelConfig(**parallel_kw)
    actor = build_actor(mc, pc, fp8_recipe=get_recipe(fp8) if fp8 else None, seed=seed, lr=lr,
                        weight_decay=0.01, grad_clip=1.0, device="cpu", distributed_optimizer=distributed)
    batch = make_batch(mc.vocab_size, seed=batch_seed)
    n = batch["tokens"].shape[0] // actor.dp_size
    part = {k: v[actor.dp_rank * n:(actor.dp_rank + 1) * n] for k, v in batch.items()}
    out = {"init": actor.export_weights(), "metrics": [], "logprobs": []}
    out["lp0"], out["ent0"] = actor.get_logprobs(batch["tokens"], with_entropy=True)
    out["lp0_t"], _ = actor.get_logprobs(batch["tokens"], temperature=0.7)
    for _ in range(steps):
        m = actor.train_step(part, pg_loss)
        out["metrics"].append(metrics_to_floats(m))
        out["logprobs"].append(actor.get_logprobs(batch["tokens"])[0])
    out["final"] = actor.export_weights()
    # the colocated-engine sync's stream: BF16, across pipeline stages too (one manifest per stage)
    out["stream_bf16"] = dict(actor.iter_weights(dtype=torch.bfloat16))
    out["layout"] = (actor.tp_size, actor.pp_size, actor.dp_size, actor.dp_rank)
    out["optimizer_bytes"] = actor.optimizer_state_bytes()
    return out


LAYOUTS = {
    "A_tp2": (CFG_A, dict(tensor_model_parallel_size=2, micro_batch_size=4), None),
    "A_pp2": (CFG_A, dict(pipeline_model_parallel_size=2, micro_batch_size=2), None),
    "A_dp2": (CFG_A, dict(micro_batch_size=2), None),
    # FP8 current scaling depends on each microbatch's amax: compare at equal microbatch size.
    "A_pp2_fp8": (CFG_A, dict(pipeline_model_parallel_size=2, micro_batch_size=3), "tensorwise"),
    # MXFP8 1x32 blocks line up with the TP=2 shards of CFG_A (every sharded dim is a multiple of 32),
    # so each FP8 GEMM sees the same blocks as at TP=1: exercises the FP8 path's TP communication.
    "A_tp2_mxfp8": (CFG_A, dict(tensor_model_parallel_size=2, micro_batch_size=3), "mxfp8"),
    "B_tp2": (CFG_B, dict(tensor_model_parallel_size=2, micro_batch_size=3), None),
    "B_pp2": (CFG_B, dict(pipeline_model_parallel_size=2, micro_batch_size=4), None),
}
# Reference layout (1 process) for each: same model, TP = PP = DP = 1, one microbatch size.
REFERENCES = {
    "A": (CFG_A, dict(micro_batch_size=6), None),
    "A_fp8": (CFG_A, dict(micro_batch_size=3), "tensorwise"),
    "A_mxfp8": (CFG_A, dict(micro_batch_size=3), "mxfp8"),
    "B": (CFG_B, dict(micro_batch_size=6), None),
}


# megatron DDP + distributed optimizer (optim.distributed=true) against the same references: DP=2
# shards the Adam state; TP=2 / PP=2 with tied embeddings and QK norms go through finalize_model_grads.
DIST_LAYOUTS = {
    "A_dp2_dist": (CFG_A, dict(micro_batch_size=2), None),
    "B_tp2_dist": (CFG_B, dict(tensor_model_parallel_size=2, micro_batch_size=3), None),
    "B_pp2_dist": (CFG_B, dict(pipeline_model_parallel_size=2, micro_batch_size=4), None),
}


def distributed_optimizer_layouts() -> dict:
    """Every 2-process distributed-optimizer scenario in one launch."""
    return {name: run_actor(cfg, par, fp8=fp8, distributed=True) for name, (cfg, par, fp8) in DIST_LAYOUTS.items()}


def vocab_parallel_case() -> dict:
    """TP=2 split of random logits: our log-probs/entropy and their grads vs a full log_softmax."""
    import torch.distributed as dist

    from nemo_fp8rl.models import init_distributed
    from nemo_fp8rl.models.logprobs import vocab_parallel_logprobs

    init_distributed(ParallelConfig(tensor_model_parallel_size=2), device="cpu")
    from megatron.core import parallel_state as ps

    rank = ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(0)
    V, Vp = 13, 16  # 3 padded columns on rank 1
    full = torch.randn(5, 7, Vp, generator=g, dtype=torch.float64).float() * 3
    target = torch.randint(0, V, (5, 7), generator=g)
    w_lp, w_ent = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    local = full[..., rank * 8:(rank + 1) * 8].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(local, target, vocab_start=rank * 8, vocab_size=V,
                                      group=ps.get_tensor_model_parallel_group(), with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grads = [torch.empty_like(local.grad) for _ in range(2)]
    dist.all_gather(grads, local.grad.contiguous(), group=ps.get_tensor_model_parallel_group())
    return {"full": full, "target": target, "w_lp": w_lp, "w_ent": w_ent, "lp": lp.detach(),
            "ent": ent.detach(), "grad": torch.cat(grads, -1), "V": V}


def all_layouts() -> dict:
    """Every 2-process scenario in one launch (megatron import and gloo set-up paid once)."""
    out = {"vocab_parallel": vocab_parallel_case()}
    for name, (cfg, par, fp8) in LAYOUTS.items():
        out[name] = run_actor(cfg, par, fp8=fp8)
    return out


# ------------------------------------------------------------------ layout-free checkpoints
RESHARD_CFG = CFG_A  # untied, GQA, QKV bias; vocabulary padded to 24 rows at TP=1 and 32 at TP=2


def _ckpt_actor(parallel_kw: dict, distributed: bool, seed: int = 0, cfg: dict = RESHARD_CFG):
    from nemo_fp8rl.models import build_actor

    return build_actor(ModelConfig(**cfg), ParallelConfig(**parallel_kw), seed=seed, lr=1e-3,
                       weight_decay=0.01, grad_clip=1.0, device="cpu", distributed_optimizer=distributed,
                       keep_reference=True)


def _dp_part(actor, batch):
    n = batch["tokens"].shape[0] // actor.dp_size
    return {k: v[actor.dp_rank * n:(actor.dp_rank + 1) * n] for k, v in batch.items()}


def _save(actor, directory: str, step: int):
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    sharded, local = actor.sharded_checkpoint_state()
    CheckpointManager(directory).save(step, {"actor_local": local}, {"model": "A"}, sharded=sharded)


def _resume(actor, directory: str, step: int) -> None:
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    ck = CheckpointManager(directory).load(step, {"model": "A"})
    actor.load_sharded_checkpoint([s["actor_local"] for s in ck.rank_states], ck.load_sharded)


def _after_resume(actor, batch) -> dict:
    """What the resumed actor holds, then one more step: weights at the checkpoint, the reference
    policy's log-probs, the next step's metrics and weights."""
    out = {"loaded": actor.export_weights(), "ref_lp": actor.get_reference_logprobs(batch["tokens"])[0]}
    out["metrics"] = metrics_to_floats(actor.train_step(_dp_part(actor, batch), pg_loss))
    out["final"] = actor.export_weights()
    out["layout"] = (actor.tp_size, actor.pp_size, actor.dp_size, actor.distributed_optimizer)
    return out


def reshard_uninterrupted(cfg: dict = RESHARD_CFG) -> dict:
    """One process, TP=PP=DP=1: two steps with a checkpoint-free trajectory (the reference)."""
    actor = _ckpt_actor(dict(micro_batch_size=6), distributed=False, cfg=cfg)
    batch = make_batch(cfg["vocab_size"])
    actor.train_step(batch, pg_loss)
    out = {"at_ckpt": actor.export_weights(), "ref_lp": actor.get_reference_logprobs(batch["tokens"])[0]}
    out["metrics"] = metrics_to_floats(actor.train_step(batch, pg_loss))
    out["final"] = actor.export_weights()
    return out


def reshard_checkpoints(directory: str) -> dict:
    """2 ranks: one step at TP=2 (AdamW), save; resume at TP=1 x DP=2, at PP=2, and at DP=2 with the
    distributed optimizer; that run saves again (distributed optimizer, DP=2) and TP=2 resumes it."""
    import os

    batch = make_batch(RESHARD_CFG["vocab_size"])
    out = {}
    first = os.path.join(directory, "tp2")
    a = _ckpt_actor(dict(tensor_model_parallel_size=2, micro_batch_size=3), distributed=False)
    a.train_step(_dp_part(a, batch), pg_loss)
    out["saved"] = a.export_weights()
    _save(a, first, 1)
    for name, par, distributed in (("tp1_dp2", dict(micro_batch_size=3), False),
                                   ("pp2", dict(pipeline_model_parallel_size=2, micro_batch_size=3), False),
                                   ("dp2_dist", dict(micro_batch_size=3), True)):
        actor = _ckpt_actor(par, distributed=distributed, seed=11)  # other initial weights: the load must replace them
        _resume(actor, first, 1)
        if name == "dp2_dist":
            _save(actor, os.path.join(directory, "dp2_dist"), 1)  # before its step: the same state again
        out[name] = _after_resume(actor, batch)
    actor = _ckpt_actor(dict(tensor_model_parallel_size=2, micro_batch_size=3), distributed=False, seed=11)
    _resume(actor, os.path.join(directory, "dp2_dist"), 1)
    out["dist_to_tp2"] = _after_resume(actor, batch)
    # Tied embeddings + QK norms: saved at PP=2 (the head copy on the last stage), resumed at TP=2.
    tied = os.path.join(directory, "tied_pp2")
    b = _ckpt_actor(dict(pipeline_model_parallel_size=2, micro_batch_size=3), distributed=False, cfg=CFG_B)
    b.train_step(_dp_part(b, batch_b := make_batch(CFG_B["vocab_size"])), pg_loss)
    out["tied_saved"] = b.export_weights()
    _save(b, tied, 1)
    b = _ckpt_actor(dict(tensor_model_parallel_size=2, micro_batch_size=3), distributed=False, seed=11, cfg=CFG_B)
    _resume(b, tied, 1)
    out["tied_pp2_to_tp2"] = _after_resume(b, batch_b)
    # Delayed-scaling FP8 state: saved per TP shard at TP=2, merged when resumed at TP=1 x DP=2.
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.fp8.megatron import fp8_states
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.models.checkpointing import _to_global

    fp8_dir = os.path.join(directory, "fp8_tp2")
    for tp, seed in ((2, 0), (1, 11)):
        c = build_actor(ModelConfig(**RESHARD_CFG), ParallelConfig(tensor_model_parallel_size=tp, micro_batch_size=3),
                        seed=seed, lr=1e-3, fp8_recipe=get_recipe("delayed", amax_history_len=4), device="cpu",
                        distributed_optimizer=False)
        if tp == 2:
            c.train_step(_dp_part(c, batch), pg_loss)
            out["fp8_saved"] = _to_global(c.model, fp8_states(c.model))
            _save(c, fp8_dir, 1)
        else:
            _resume(c, fp8_dir, 1)
            out["fp8_loaded"] = _to_global(c.model, fp8_states(c.model))
    return out
