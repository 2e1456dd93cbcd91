"""Part distopt: ``optim.distributed=true`` on the GPU (NCCL, no Transformer Engine needed): BF16
parameters with float32 main-parameter shards, 3 train steps against torch AdamW on float32 master
weights (loss and log-prob gaps), Adam state bytes, a per-rank and a dist_checkpointing (format 2)
checkpoint round trip, and the CPU shims refusing to activate in the NCCL process (dry run: the same
on CPU with float32 parameters). Each stage's results are saved as it ends (``ctx.save()``), so a part
stopped by its timeout keeps the stages before."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch


def run(ctx) -> dict:
    dry = ctx.dry
    import io

    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.models.cpu_schedules import cpu_megatron
    from nemo_fp8rl.models.optim import chained

    dev = "cpu" if dry else "cuda"
    mc, pc = ModelConfig(vocab_size=16), ParallelConfig(micro_batch_size=8)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (8, 32), generator=g)
    mask = torch.zeros(8, 32)
    mask[:, 8:] = 1
    batch = {"tokens": tokens.to(dev), "mask": mask.to(dev), "advantages": torch.randn(8, generator=g).to(dev)}

    def loss_fn(mb, logprobs, entropy, *, global_tokens, global_seqs):
        loss = -(mb["advantages"][:, None] * logprobs * mb["mask"]).sum() / global_tokens
        return loss, {}

    d = build_actor(mc, pc, seed=0, lr=1e-4, device=dev, distributed_optimizer=True)
    r = build_actor(mc, pc, seed=0, lr=1e-4, device=dev, distributed_optimizer=False)
    res = ctx.res
    shards = [p for o in chained(d.optimizer) for grp in getattr(o, "shard_fp32_from_float16_groups", [])
              for p in grp]
    res.update(param_dtype=str(next(d.model.parameters()).dtype),
               main_param_dtypes=sorted({str(p.dtype) for p in shards}),
               optimizer_bytes={}, loss={"distributed": [], "adamw": []})
    ctx.save()
    for _ in range(3):
        res["loss"]["distributed"].append(float(d.train_step(batch, loss_fn)["train/loss"][0]))
        res["loss"]["adamw"].append(float(r.train_step(batch, loss_fn)["train/loss"][0]))
        ctx.save()
    res["optimizer_bytes"] = {"distributed": d.optimizer_state_bytes(), "adamw": r.optimizer_state_bytes()}
    m = batch["mask"].bool()
    res["logprob_gap_vs_adamw"] = float((d.get_logprobs(tokens.to(dev))[0] - r.get_logprobs(tokens.to(dev))[0])[m]
                                        .abs().mean())
    ctx.save()
    buf = io.BytesIO()
    torch.save(d.state_dict_for_checkpoint(), buf)
    d.train_step(batch, loss_fn)
    want = d.get_logprobs(tokens.to(dev))[0]
    e = build_actor(mc, pc, seed=5, lr=1e-4, device=dev, distributed_optimizer=True)
    buf.seek(0)
    e.load_checkpoint_state(torch.load(buf, weights_only=False))
    e.train_step(batch, loss_fn)
    res["resume_max_abs_diff"] = float((e.get_logprobs(tokens.to(dev))[0] - want).abs().max())
    ctx.save()
    # the layout-free (dist_checkpointing, format 2) checkpoint of the same state
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    ckdir = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt_"))
    try:
        buf.seek(0)
        f = build_actor(mc, pc, seed=0, lr=1e-4, device=dev, distributed_optimizer=True)
        f.load_checkpoint_state(torch.load(buf, weights_only=False))
        sharded, local = f.sharded_checkpoint_state()
        mgr = CheckpointManager(str(ckdir), device=dev)
        mgr.save(1, {"actor_local": local}, {}, sharded=sharded)
        g = build_actor(mc, pc, seed=6, lr=1e-4, device=dev, distributed_optimizer=True)
        ck = mgr.load(1, {})
        g.load_sharded_checkpoint([x["actor_local"] for x in ck.rank_states], ck.load_sharded)
        g.train_step(batch, loss_fn)
        res["dist_checkpoint_resume_max_abs_diff"] = float((g.get_logprobs(tokens.to(dev))[0] - want).abs().max())
        ctx.save()
    finally:
        shutil.rmtree(ckdir, ignore_errors=True)
    try:
        with cpu_megatron("optimizer", device="cpu"):
            pass
        res["cpu_shim_refused_on_nccl"] = False
    except RuntimeError:
        res["cpu_shim_refused_on_nccl"] = True
    problems = []
    if not dry and (res["param_dtype"] != "torch.bfloat16" or res["main_param_dtypes"] != ["torch.float32"]):
        problems.append("expected BF16 parameters with float32 main parameters")
    if not all(map(torch.isfinite, map(torch.tensor, res["loss"]["distributed"]))):
        problems.append("non-finite loss")
    if res["resume_max_abs_diff"] > 1e-3:
        problems.append(f"resume differs by {res['resume_max_abs_diff']:.3g}")
    if res["dist_checkpoint_resume_max_abs_diff"] > 1e-3:
        problems.append(f"dist_checkpointing resume differs by {res['dist_checkpoint_resume_max_abs_diff']:.3g}")
    if not dry and not res["cpu_shim_refused_on_nccl"]:
        problems.append("the CPU shims activated in an NCCL process")
    if problems:
        res["failed"] = "; ".join(problems)
    return res


def headline(res: dict) -> str:
    nan = float("nan")
    return (f"params {res.get('param_dtype')}, main {res.get('main_param_dtypes')}, "
            f"logprob gap vs AdamW {res.get('logprob_gap_vs_adamw', nan):.3g}, "
            f"resume diff {res.get('resume_max_abs_diff', nan):.3g} "
            f"(dist_checkpointing {res.get('dist_checkpoint_resume_max_abs_diff', nan):.3g}), "
            f"bytes {res.get('optimizer_bytes')}, shim refused {res.get('cpu_shim_refused_on_nccl')}")
