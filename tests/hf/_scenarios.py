"""What the HF tests run in one process or in each of 2 gloo processes (``_dist.run_ranks``).

``run_policy`` loads a checkpoint into our megatron actor for a parallel layout and records the full
logits (TP-gathered, vocabulary padding cut, broadcast from the last pipeline stage), log-probs and
entropies, then takes one optimizer step and records them again; with ``export_to`` it writes the
trained policy as a Hugging Face directory (collective ``save_hf_checkpoint``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig


def full_logits(actor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, T, V] of the megatron model (every rank gets them), via megatron's schedule."""
    V = actor.model_cfg.vocab_size

    def collect(mb, output):  # output: this TP rank's [b, T, Vp/tp]
        if actor.tp_size > 1:
            parts = [torch.empty_like(output) for _ in range(actor.tp_size)]
            dist.all_gather(parts, output.contiguous(), group=actor.tp_group)
            output = torch.cat(parts, -1)
        return output.new_zeros(()), {"logits": output[..., :V].float()}

    with torch.no_grad():
        mbs = [{"tokens": tokens[i:i + actor.parallel_cfg.micro_batch_size]}
               for i in range(0, tokens.shape[0], actor.parallel_cfg.micro_batch_size)]
        store = actor._run_schedule(mbs, True, collect)
        out = torch.cat([d["logits"] for d in store], 0) if actor.is_last_stage else None
        return actor._broadcast_from_last_stage(out, (*tokens.shape, V))


def pg_loss(mb, logprobs, entropy, *, global_tokens, global_seqs):
    m = mb["mask"]
    loss = -(mb["advantages"][:, None] * logprobs * m).sum() / global_tokens
    return loss, {"loss/pg": (loss.detach(), "sum")}


def train_batch(tokens: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(11)
    mask = torch.zeros(tokens.shape, dtype=torch.float32)
    mask[:, 3:] = 1.0
    return {"tokens": tokens, "mask": mask, "advantages": torch.randn(tokens.shape[0], generator=g)}


def run_policy(ckpt: str, parallel_kw: dict, tokens: torch.Tensor, export_to: str | None = None,
               fp8: str | None = None, lr: float = 1e-2) -> dict:
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import load_hf_policy, resolve_model_config, save_hf_checkpoint

    cfg = resolve_model_config(ModelConfig(hf_path=ckpt))
    actor = load_hf_policy(cfg, ParallelConfig(**parallel_kw), fp8_recipe=get_recipe(fp8) if fp8 else None,
                           seed=0, lr=lr, grad_clip=100.0, device="cpu")
    out = {"layout": (actor.tp_size, actor.pp_size, actor.dp_size)}
    out["logits0"] = full_logits(actor, tokens)
    out["lp0"], out["ent0"] = actor.get_shadow_logprobs(tokens, with_entropy=True)
    out["weights0"] = actor.export_weights()
    m = actor.train_step(train_batch(tokens), pg_loss)
    out["loss"] = float(m["train/loss"][0])
    out["logits1"] = full_logits(actor, tokens)
    out["weights1"] = actor.export_weights()
    if export_to is not None:
        save_hf_checkpoint(actor, export_to)
    return out


def run_policies(ckpts: dict, parallel_kw: dict, tokens: dict, export_root: str | None = None) -> dict:
    """``run_policy`` for several checkpoints in one process (one process start for all architectures)."""
    res = {}
    for arch, path in ckpts.items():
        res[arch] = run_policy(path, parallel_kw, tokens[arch],
                               export_to=None if export_root is None else f"{export_root}/{arch}")
        res[arch].pop("weights0")
        res[arch].pop("weights1")
    return res
