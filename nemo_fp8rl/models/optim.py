"""The actor's two optimizer paths: torch AdamW (``optim.distributed=false``) and megatron-core's
``DistributedDataParallel`` + distributed optimizer (``optim.distributed=true``).

Both minimise the same objective with the same update (AdamW, decoupled weight decay on matrices
only, global-norm clipping ``g <- g * min(1, clip / (||g|| + 1e-6))``) and the same gradient
convention (the gradient of the *sum* of all microbatch losses over DP, see
:mod:`nemo_fp8rl.models.actor`); they differ in where the state lives:

- AdamW: every DP rank holds float32 parameters, gradients and both moments of every parameter of its
  TP x PP shard: 16 bytes/parameter, replicated over DP.
- Distributed: megatron's ``DistributedDataParallel`` keeps gradients in contiguous float32 buckets
  (``grad_reduce_in_fp32``) and reduce-scatters them over DP; ``DistributedOptimizer`` gives each DP
  rank 1/DP of the flattened buffer: the float32 main parameters of that range and their two Adam
  moments, steps them, and all-gathers the updated parameters. On GPU the model parameters are BF16
  (2 bytes) and the main parameters float32: 2 + 4 (grad) + 12/DP bytes/parameter. On CPU the model
  parameters stay float32 (the CPU path emulates FP8 on float32 weights, and its layout tests compare
  float32 trajectories), so the main parameters *are* the parameter shards (views, no copy) and only
  the two moments are sharded: 4 + 4 + 8/DP bytes/parameter.

With ``calculate_per_token_loss=True`` megatron's DDP scales gradients by 1 (not 1/DP), so the
reduce-scatter sums over DP, our convention. ``finalize_model_grads`` also all-reduces QK-norm (and
sequence-parallel norm) gradients over TP and tied-embedding gradients over the first/last stage.

On CPU every megatron call here runs inside :func:`~nemo_fp8rl.models.cpu_schedules.cpu_megatron`
(scope ``optimizer``); megatron falls back to torch's AdamW without TE/apex.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_fp8rl.models.cpu_schedules import cpu_megatron


def build_distributed_optimizer(model, *, lr: float, weight_decay: float, adam_betas, adam_eps: float,
                                grad_clip: float, device: torch.device):
    """Wrap ``model`` in megatron's DDP and build its distributed optimizer.

    Returns:
        ``(ddp, optimizer)``: the ``DistributedDataParallel`` wrapper (use it for training forwards)
        and megatron's (chained) optimizer over it.
    """
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = next(model.parameters()).dtype == torch.bfloat16
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False,
        overlap_param_gather=False,
    )
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=float(adam_betas[0]),
        adam_beta2=float(adam_betas[1]), adam_eps=adam_eps, clip_grad=grad_clip, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=True,
    )
    with cpu_megatron("optimizer", device=device):
        ddp = DistributedDataParallel(model.config, ddp_cfg, model)
        # On the gloo backend every megatron group is already a gloo group: no duplicates.
        optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=dist.get_backend() != "gloo")
    # megatron marks norms and biases with wd_mult=0 and leaves applying it (and the lr) to its
    # OptimizerParamScheduler, which a constant-lr run does not need: apply both here, so that weight
    # decay touches matrices only, as on the AdamW path.
    for opt in chained(optimizer):
        for group in opt.optimizer.param_groups:
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
            group["lr"] = lr * group.get("lr_mult", 1.0)
    return ddp, optimizer


def chained(optimizer) -> list:
    """The per-buffer megatron optimizers inside ``optimizer`` (a ChainedOptimizer or one optimizer)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def zero_grads(ddp, optimizer) -> None:
    """Clear DDP's gradient buckets and the main-parameter gradients."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)


def finish_grads(ddp, optimizer, device: torch.device) -> torch.Tensor:
    """After backward: DP reduce-scatter (sum) of the buckets, TP/embedding all-reduces, copy into the
    float32 main gradients; returns the global gradient norm ``sqrt(sum_p sum_i g_{p,i}^2)`` over
    every parameter counted once (megatron's ``get_grad_norm_fp32`` over the DP x TP x PP shards), a
    float32 0-dim tensor, the same on every rank."""
    from megatron.core.distributed import finalize_model_grads

    with cpu_megatron("optimizer", device=device):
        finalize_model_grads([ddp])
        optimizer.prepare_grads()
        norm = optimizer.get_grad_norm()
    return torch.tensor(float(norm), dtype=torch.float32)


def clip_and_step(optimizer, grad_norm: torch.Tensor, grad_clip: float, device: torch.device) -> None:
    """Scale the main gradients by ``min(1, grad_clip / (grad_norm + 1e-6))`` (megatron's
    ``clip_grad_by_total_norm_fp32``), step Adam on this rank's shard, all-gather the parameters."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    with cpu_megatron("optimizer", device=device):
        if grad_clip and grad_clip > 0:
            for opt in chained(optimizer):
                params = opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=grad_clip, total_norm=float(grad_norm))
        optimizer.step_with_ready_grads()


def reload_main_params(optimizer, device: torch.device) -> None:
    """Copy the model parameters into the float32 main parameters (after weights were loaded into
    the model; a no-op copy when the main parameters are views of float32 parameters)."""
    with cpu_megatron("optimizer", device=device):
        optimizer.reload_model_params()


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state held by this rank: Adam moments (and step counters) plus float32 main
    parameters that are copies (not views) of the model parameters."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for opt in chained(optimizer):
        inner = getattr(opt, "optimizer", opt)
        for st in inner.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    add(v)
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            for p in group:
                add(p)
    return total


def adamw_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's per-parameter state (AdamW: the two moments and step counters)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v))


def shard_state_dict(optimizer) -> dict:
    """This rank's distributed-optimizer state for a same-layout (per-rank) checkpoint: for each
    chained optimizer, its inner torch optimizer's ``state_dict()`` (the Adam moments and steps of this
    rank's shard) and the float32 main-parameter shards that are copies of BF16 parameters."""
    out = []
    for opt in chained(optimizer):
        inner = getattr(opt, "optimizer", opt)
        main = [p.detach().clone() for g in getattr(opt, "shard_fp32_from_float16_groups", []) or [] for p in g]
        out.append({"inner": inner.state_dict(), "main_params": main})
    return {"kind": "megatron_distributed", "chained": out}


def load_shard_state_dict(optimizer, sd: dict, where: str = "checkpoint") -> None:
    """Inverse of :func:`shard_state_dict` (same TP/PP/DP layout); raises ValueError naming ``where``."""
    chain = chained(optimizer)
    if sd.get("kind") != "megatron_distributed" or len(sd.get("chained", [])) != len(chain):
        raise ValueError(f"{where}: optimizer state is not a distributed-optimizer shard of this layout; resume "
                         "with the optim.distributed value and parallel layout it was saved with")
    for opt, part in zip(chain, sd["chained"]):
        inner = getattr(opt, "optimizer", opt)
        inner.load_state_dict(part["inner"])
        mains = [p for g in getattr(opt, "shard_fp32_from_float16_groups", []) or [] for p in g]
        if len(mains) != len(part["main_params"]):
            raise ValueError(f"{where}: {len(part['main_params'])} main-parameter shards saved, {len(mains)} here")
        with torch.no_grad():
            for dst, src in zip(mains, part["main_params"]):
                dst.copy_(src)


def resolve_distributed(distributed: Optional[bool], device: torch.device) -> bool:
    """``optim.distributed`` for a model on ``device``: None -> True for a CUDA model, False on CPU
    (:func:`~nemo_fp8rl.config.schema.resolve_distributed_optimizer`; see docs/megatron.md)."""
    from nemo_fp8rl.config.schema import resolve_distributed_optimizer

    return resolve_distributed_optimizer(distributed, torch.device(device).type == "cuda")


__all__ = [
    "build_distributed_optimizer",
    "chained",
    "zero_grads",
    "finish_grads",
    "clip_and_step",
    "reload_main_params",
    "optimizer_state_bytes",
    "adamw_state_bytes",
    "resolve_distributed",
    "shard_state_dict",
    "load_shard_state_dict",
]
