"""The vllm engine over the trainer's processes (``rollout.tensor_parallel_size`` T > 1, verl's SPMD mode).

Every trainer rank builds an engine with ``distributed_executor_backend="external_launcher"``. vLLM reuses
the trainer's process group and makes its own groups over it, laid out "external DP x TP": blocks of T
consecutive global ranks form one tensor-parallel engine, and the blocks generate independently. What
that takes, each piece here:

- :func:`rollout_share_layout`: which share of its replica's batch a rank's engine generates (the
  trainer's side of the layout), refused when a vLLM group would span two replicas.
- :func:`check_every_rank_builds`: the build is a collective; a key-value-store rendezvous first checks
  that every rank builds, with the same settings (otherwise the others would block inside vLLM).
- :func:`launcher_env`: ``RANK`` / ``LOCAL_RANK`` as vLLM's ``external_launcher`` reads them.
- :func:`check_group_agrees`: ``generate`` is collective over a group; its ranks must pass the same
  requests (one digest all-gather per call).
- :func:`keep_default_process_group`: vLLM's shutdown would destroy the trainer's default group.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BUILD_RENDEZVOUS_S",
    "check_every_rank_builds",
    "check_group_agrees",
    "keep_default_process_group",
    "launcher_env",
    "rollout_share_layout",
]

BUILD_RENDEZVOUS_S = 600.0
"""How long a rank waits for the others to start building a tensor-parallel engine (:func:`check_every_rank_builds`)."""
_BUILDS = 0


def rollout_share_layout(replicas: Sequence[Sequence[int]], rank: int, tp: int) -> tuple[int, int, bool]:
    """Which share of its replica's rollout batch ``rank`` generates: ``(share, n_shares, leader)``.

    ``replicas[r]``: the global ranks of rank r's model-parallel group (its replica's TP x PP ranks, in
    group order), for every rank r of the job. vLLM's ``external_launcher`` makes blocks of ``tp``
    consecutive global ranks into one tensor-parallel engine (``vllm/distributed/parallel_state.py``,
    layout "external DP x DP x PP x PCP x TP" with vLLM's own DP and PP at 1): a replica's M ranks hold
    M / tp engines, and the block of rank r is share k of M / tp, k counted over the replica's blocks in
    group order. ``leader``: rank r is the first rank of its block (the one whose batch is gathered).
    ``tp`` = 1 gives share = the rank's place in its group, M shares, every rank a leader.

    Raises ``ValueError`` (naming ``rollout.tensor_parallel_size`` and ``parallel.*``) when ``tp`` does not
    divide M or a block mixes ranks of two replicas (they draw different prompts, and a vLLM group must
    generate one batch together). Every rank gets the same verdict from the same ``replicas``.
    """
    mine = list(replicas[rank])
    M, world = len(mine), len(replicas)
    if tp == 1:
        return mine.index(rank), M, True
    if M % tp or world % tp:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp} must divide the model-parallel size of a replica, "
            f"parallel.tensor_model_parallel_size x parallel.pipeline_model_parallel_size = {M} (and the {world} "
            "processes): a vLLM tensor-parallel group generates for one replica"
        )
    for start in range(0, world, tp):
        block = list(range(start, start + tp))
        if any(set(replicas[r]) != set(replicas[start]) for r in block):
            raise ValueError(
                f"rollout.tensor_parallel_size={tp}: vLLM puts the consecutive ranks {block} in one tensor-parallel "
                f"group, but they belong to different data-parallel replicas (model-parallel groups "
                f"{sorted({tuple(replicas[r]) for r in block})}), which generate different prompts. Choose a "
                "rollout.tensor_parallel_size that divides parallel.tensor_model_parallel_size, or run with one "
                "data-parallel replica (world size = parallel.tensor_model_parallel_size x "
                "parallel.pipeline_model_parallel_size)"
            )
    leaders = [r for r in mine if r % tp == 0]
    return leaders.index(rank - rank % tp), M // tp, rank % tp == 0


def check_every_rank_builds(tp: int, fingerprint: str, timeout_s: float | None = None) -> None:
    """Before a ``tensor_parallel_size`` > 1 build: every trainer rank is building an engine, with the same settings.

    vLLM's build is a collective over all trainer ranks (``new_group`` for every group of its layout, a MIN
    all-reduce of free memory): a rank that builds no engine, or one with another size or model, would
    leave the others blocked inside vLLM without a word. This rendezvous runs on the default process
    group's key-value store (no collective): every rank posts ``fingerprint``, waits up to ``timeout_s``
    (default :data:`BUILD_RENDEZVOUS_S`) for all the others, and all of them raise, naming the missing
    ranks or the differing settings, when something is off.
    """
    global _BUILDS
    _BUILDS += 1
    timeout = timedelta(seconds=BUILD_RENDEZVOUS_S if timeout_s is None else timeout_s)
    store = dist.distributed_c10d._get_default_store()
    world, rank = dist.get_world_size(), dist.get_rank()
    key = f"nemo_fp8rl/vllm_tp_build/{_BUILDS}"
    posted = [f"{key}/cfg/{r}" for r in range(world)]
    store.set(posted[rank], fingerprint)
    try:
        store.wait(posted, timeout)
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError (a RuntimeError) or its base
        missing = [r for r in range(world) if not store.check([posted[r]])]
        raise RuntimeError(
            f"rollout.tensor_parallel_size={tp}: building the vLLM engine is collective over all {world} trainer "
            f"ranks, but rank(s) {missing[:32]} did not start building one within {timeout.total_seconds():.0f} s "
            f"({type(e).__name__}); every rank must build the rollout engine at the same point"
        ) from None
    ref = store.get(posted[0]).decode()
    store.add(f"{key}/differ", int(ref != fingerprint))
    seen = [f"{key}/seen/{r}" for r in range(world)]
    store.set(seen[rank], "1")
    store.wait(seen, timeout)
    n = store.add(f"{key}/differ", 0)
    if n:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp}: {n} of the {world} trainer ranks build the vLLM engine with settings "
            f"other than rank 0's (rank 0: {ref}; rank {rank}: {fingerprint}); every rank needs the same rollout "
            "and model config"
        )


@contextlib.contextmanager
def launcher_env(tp: int):
    """``RANK`` and ``LOCAL_RANK`` as vLLM's ``external_launcher`` reads them, for the build only.

    vLLM takes its worker's rank and local rank from the environment (torchrun's variables). They are set
    from the trainer's process group (SLURM launches set neither) and, on GPU, ``LOCAL_RANK`` to the device
    the trainer uses (vLLM's worker takes ``cuda:LOCAL_RANK``); the previous values come back afterwards.
    """
    if tp <= 1:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK")}
    os.environ["RANK"] = str(dist.get_rank())
    if torch.cuda.is_available():
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    else:
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_group_agrees(prompts: Sequence[Sequence[int]], seeds: list[int], params: Any, *, tp: int,
                       group_ranks: Sequence[int]) -> None:
    """Raise unless every rank of this vLLM tensor-parallel group generates the same requests.

    With ``rollout.tensor_parallel_size`` = ``tp`` > 1 each rank runs its own scheduler and sampler on logits
    that vLLM all-gathers: the group stays in step only if all of its ranks submit the same prompts, seeds
    and sampling parameters (different ones deadlock in a layer's all-reduce or return another rank's
    batch). One all-gather of a digest over vLLM's CPU group per call. ``group_ranks``: the group's global
    ranks, for the message.
    """
    from vllm.distributed.parallel_state import get_tp_group

    h = hashlib.sha256(repr(([list(map(int, p)) for p in prompts], seeds, params)).encode()).hexdigest()
    group = get_tp_group()
    digests: list[Any] = [None] * group.world_size
    dist.all_gather_object(digests, h, group=group.cpu_group)
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"rollout.tensor_parallel_size={tp}: the ranks {list(group_ranks)} of this vLLM "
            "tensor-parallel group called generate with different prompts, sampling parameters or generator "
            "states; they must generate the same batch together (the trainer gives each vLLM group one share "
            "of its replica's prompts and one share generator)"
        )


@contextlib.contextmanager
def keep_default_process_group(keep: bool):
    """Around vLLM's engine shutdown: do not let it destroy the trainer's default process group.

    ``EngineCore.shutdown`` ends in ``cleanup_dist_env_and_memory``, which destroys vLLM's own groups and
    then calls ``torch.distributed.destroy_process_group()``: the default group, which is the trainer's
    when the trainer initialized torch.distributed before building the engine. The default-group call is
    skipped then (vLLM's own groups are still destroyed).
    """
    if not keep:
        yield
        return
    original = dist.destroy_process_group

    def destroy(group: Any = None) -> None:
        if group is not None:
            original(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = original
