"""Process groups: torch.distributed from torchrun/SLURM env vars, then Megatron's TP/PP/DP groups.

One entry point, :func:`init_distributed`, serves every launch mode:

- ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
- ``srun`` sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` (the master address comes from
  ``MASTER_ADDR`` if the launcher exported it, else from ``SLURM_LAUNCH_NODE_IPADDR``; the port from
  ``MASTER_PORT``, else derived from ``SLURM_JOB_ID`` so concurrent jobs on a node do not collide);
- a plain ``python`` process with none of these is a world of size 1 on a free local port.

Backend: ``parallel.backend`` if set, else NCCL when CUDA is available and gloo otherwise (CPU tests).
Megatron's groups use the order ``tp-cp-ep-dp-pp`` (its default): the TP ranks of one model replica are
adjacent, the PP stages are ``world_size / PP`` ranks apart, and DP size = world / (TP x PP).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig

log = logging.getLogger(__name__)

_LAYOUT: Optional[tuple[int, int]] = None  # (tp, pp) of the Megatron groups we initialised
_WE_STARTED_PROCESS_GROUP = False


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_launch_env(environ: Optional[dict] = None) -> LaunchEnv:
    """Read rank/world size/master address from torchrun or SLURM variables (torchrun wins).

    Raises:
        ValueError: SLURM variables are present but no master address can be found.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
        if not addr:
            raise ValueError(
                "running under SLURM but neither MASTER_ADDR nor SLURM_LAUNCH_NODE_IPADDR is set; "
                "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) in the "
                "submission script"
            )
        port = env.get("MASTER_PORT")
        if port is None:
            port = 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=addr,
            master_port=int(port),
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", _free_port(), "single")


def validate_layout(parallel_cfg: ParallelConfig, world_size: int, model_cfg: Optional[ModelConfig] = None):
    """Check that TP x PP divides the world and that the model's heads/groups/FFN/layers split evenly.

    Raises:
        ValueError: naming the offending ``parallel.*`` or ``model.*`` key and the fix.
    """
    tp, pp = parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size
    for key, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                   ("micro_batch_size", parallel_cfg.micro_batch_size)):
        if v < 1:
            raise ValueError(f"parallel.{key}={v} must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size ({tp}) x "
            f"parallel.pipeline_model_parallel_size ({pp}) = {tp * pp}; launch a multiple of {tp * pp} "
            f"processes or change the two sizes"
        )
    if parallel_cfg.sequence_parallel and tp == 1:
        raise ValueError("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1; "
                         "set it to false")
    if model_cfg is None:
        return
    groups = model_cfg.num_kv_heads
    checks = [
        ("num_attention_heads", model_cfg.num_attention_heads, tp, "tensor_model_parallel_size"),
        ("num_query_groups", groups, tp, "tensor_model_parallel_size"),
        ("ffn_hidden_size", model_cfg.ffn_hidden_size, tp, "tensor_model_parallel_size"),
        ("num_layers", model_cfg.num_layers, pp, "pipeline_model_parallel_size"),
    ]
    for mkey, mval, size, pkey in checks:
        if mval % size != 0:
            raise ValueError(
                f"model.{mkey}={mval} is not divisible by parallel.{pkey}={size}; choose a "
                f"parallel.{pkey} that divides {mval}"
            )
    if model_cfg.num_attention_heads % groups != 0:
        raise ValueError(
            f"model.num_attention_heads={model_cfg.num_attention_heads} is not a multiple of "
            f"model.num_query_groups={groups}; GQA needs whole query heads per KV head"
        )


def resolve_device(device: "str | torch.device | None" = None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``; ``"cpu"`` forces the CPU path on a GPU machine."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu' (or None)")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
    return d


def default_backend(parallel_cfg: ParallelConfig, device: "str | torch.device | None" = None) -> str:
    """``parallel.backend`` if set, else ``nccl`` for a CUDA model and ``gloo`` for a CPU model."""
    if parallel_cfg.backend:
        return parallel_cfg.backend
    return "nccl" if resolve_device(device).type == "cuda" else "gloo"


def init_distributed(parallel_cfg: ParallelConfig, model_cfg: Optional[ModelConfig] = None,
                     device: "str | torch.device | None" = None) -> LaunchEnv:
    """Initialise torch.distributed (if needed) and Megatron's model-parallel groups. Idempotent.

    Calling it again with the same TP/PP is a no-op; with a different TP/PP it rebuilds Megatron's
    groups over the same processes (tests switch layouts this way).

    Returns:
        The :class:`LaunchEnv` this process was started with.
    """
    global _LAYOUT, _WE_STARTED_PROCESS_GROUP
    from megatron.core import parallel_state

    env = read_launch_env()
    backend = default_backend(parallel_cfg, device)
    if not dist.is_initialized():
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("parallel.backend=nccl needs CUDA; set parallel.backend=gloo on CPU")
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        if env.source == "single":
            # One process: an in-memory store, no TCP port and no MASTER_* variables leaking into
            # child processes (a child inheriting MASTER_PORT would collide with this process's store).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
            dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)
        _WE_STARTED_PROCESS_GROUP = True
        log.info("torch.distributed: %s backend, rank %d of %d (%s)", backend, env.rank,
                 env.world_size, env.source)
    world = dist.get_world_size()
    validate_layout(parallel_cfg, world, model_cfg)

    layout = (parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        if _LAYOUT == layout:
            return env
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout[0],
        pipeline_model_parallel_size=layout[1],
        # On gloo every group is already a gloo group; duplicates would only cost sockets.
        create_gloo_process_groups=dist.get_backend() != "gloo",
    )
    _LAYOUT = layout
    return env


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the process group that :func:`init_distributed` started."""
    global _LAYOUT, _WE_STARTED_PROCESS_GROUP
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _LAYOUT = None
    if dist.is_initialized() and _WE_STARTED_PROCESS_GROUP:
        dist.destroy_process_group()
    _WE_STARTED_PROCESS_GROUP = False


def comm_device() -> torch.device:
    """Device that collectives of the default backend need their tensors on."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = [
    "LaunchEnv",
    "read_launch_env",
    "validate_layout",
    "resolve_device",
    "default_backend",
    "init_distributed",
    "destroy_distributed",
    "comm_device",
]
