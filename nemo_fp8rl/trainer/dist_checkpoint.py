"""megatron ``dist_checkpointing`` I/O of a checkpoint's ``dist/`` directory: save, asynchronous save, load.

A format-2 checkpoint holds the model, optimizer and reference weights as megatron sharded tensors
(global keys: any TP/PP/DP layout loads them) in ``<step dir>/dist/``. The functions here run
megatron's writer and reader on one such directory (collective: every rank calls them together),
inside :func:`~nemo_fp8rl.models.cpu_schedules.cpu_megatron` so that a CPU model works too;
publishing the step directory around it is :mod:`nemo_fp8rl.trainer.atomic_publish`'s job.

Asynchronous save (:func:`dist_save_async`): the shards are staged in host memory and handed to a
forked writer process; :func:`finalize_async_saves` later runs megatron's collective check that every
rank's writer finished. Two guards keep a ``kill -9`` of the trainer from leaving processes behind:
megatron's results-queue manager and the forked writer are both made to die with the trainer. Both
ignore the job's stop signals (SIGTERM, SIGUSR1, SIGINT), which SLURM sends to every process of the
trainer's group: the trainer's handler writes one last checkpoint through them.

megatron is imported inside the functions: importing this module does not import megatron.
"""

from __future__ import annotations

import os
from pathlib import Path

from nemo_fp8rl.trainer.atomic_publish import rank, sha256_file, world_size

DIST_DIR = "dist"


def _signal_when_parent_dies(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (prctl PR_SET_PDEATHSIG); a no-op
    where libc has no prctl."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _outlive_stop_signals_not_the_trainer(trainer_pid: int) -> None:
    """In a helper process of the trainer (megatron's results-queue manager, the forked async writer):
    ignore the job's stop signals and die (SIGKILL) with the trainer.

    SLURM (scancel, preemption, ``--signal``) and a terminal's Ctrl-C signal every process of the trainer's
    process group; the trainer's handler then writes one last checkpoint, which goes through these helpers.
    After a ``kill -9`` of the trainer nothing can use them: they must not live on. Exits at once if the
    trainer (``trainer_pid``) died before the prctl."""
    import signal

    for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    _signal_when_parent_dies(signal.SIGKILL)
    if os.getppid() != trainer_pid:
        os._exit(1)


def _manager_server_init() -> None:
    """Runs in megatron's results-queue manager process (a spawned server) before it serves. CPython's
    server ignores only SIGINT: SIGTERM or SIGUSR1 to the job killed it, and the trainer's last checkpoint
    failed with "Broken pipe"."""
    import multiprocessing as mp

    _outlive_stop_signals_not_the_trainer(mp.parent_process().pid)


_manager = None  # the SyncManager serving megatron's results queue in this process


def _ensure_results_queue() -> None:
    """megatron's writer lazily starts a multiprocessing Manager (a spawned server process) for its
    results queue, caches the queue in a module global and never stops it: after a ``kill -9`` of the
    trainer it lives on (~270 MB each, one per killed run), and if it dies first every later save fails
    with "Broken pipe". Start that manager ourselves with :func:`_manager_server_init` (ignores the
    job's stop signals, dies with the trainer), hand megatron its queue, and start a new one if the
    server is gone (killed from outside, e.g. by the OOM killer) before a save."""
    global _manager
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    ours_died = _manager is not None and not _manager._process.is_alive()
    if queue is None or ours_died:
        _manager = SyncManager(ctx=mp.get_context("spawn"))  # what megatron's ctx.Manager() starts
        _manager.start(initializer=_manager_server_init)
        filesystem_async._results_queue = _manager.Queue()


def _save_strategy():
    """megatron's default sharded save strategy; with several ranks, each writes a share of the
    replicated tensors (megatron's usual setting)."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy()
    if world_size() > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy)
    return strategy


def dist_save(sharded: dict, directory: Path, device) -> None:
    """megatron's synchronous sharded save of ``sharded`` into ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    from nemo_fp8rl.models.cpu_schedules import cpu_megatron

    _ensure_results_queue()
    with cpu_megatron("checkpoint", device=device):
        dist_checkpointing.save(sharded, str(directory), sharded_strategy=_save_strategy())


def _writer_dies_with_trainer(trainer_pid: int, write_fn, *args, **kwargs):
    """Runs in megatron's forked async writer: die (SIGKILL) with the trainer that forked it (``trainer_pid``,
    bound before the fork: a trainer dead before this line is then seen), then write.

    After a ``kill -9`` of the trainer nothing can publish this checkpoint any more; a writer living on
    would only keep filling ``.tmp-step_<N>/`` (which the next run removes and may recreate). The
    preemption signals the trainer handles are ignored here (the fork inherited its handlers): the
    trainer finishes its step, waits for this write and exits."""
    _outlive_stop_signals_not_the_trainer(trainer_pid)
    write_fn(*args, **kwargs)


def async_calls_queue():
    """megatron's ``AsyncCallsQueue`` for :func:`dist_save_async`: a fork per save (the CPU snapshot)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue(persistent=False)


def dist_save_async(sharded: dict, directory: Path, device, calls) -> None:
    """megatron's asynchronous sharded save, scheduled on ``calls`` (an ``AsyncCallsQueue``).

    ``dist_checkpointing.save(..., async_sharded_save=True)`` plans collectively, writes ``common.pt``
    and returns an ``AsyncRequest``; scheduling it runs its ``preload_fn`` (CUDA tensors copied to host
    memory), ``torch.cuda.synchronize()`` and forks the writer (megatron's ``TemporalAsyncCaller``).
    The snapshot: on GPU the host copies; on CPU the forked writer's copy-on-write image of the
    parameters, taken before this returns (megatron does not clone whole CPU tensors). A persistent
    (spawned) writer would receive CPU tensors through shared memory and see later updates, so it is
    not used. Collective."""
    from functools import partial

    from megatron.core import dist_checkpointing

    from nemo_fp8rl.models.cpu_schedules import cpu_megatron

    _ensure_results_queue()
    with cpu_megatron("checkpoint", device=device):
        request = dist_checkpointing.save(sharded, str(directory), sharded_strategy=_save_strategy(),
                                          async_sharded_save=True)
        if request.async_fn is not None:
            request = request._replace(async_fn=partial(_writer_dies_with_trainer, os.getpid(), request.async_fn))
        calls.schedule_async_request(request)


def finalize_async_saves(calls, device, blocking: bool) -> bool:
    """Whether the save scheduled on ``calls`` has finished everywhere (collective; the same answer on
    every rank). megatron all-reduces "is any writer alive", then runs the request's finalize functions
    (gather of the write results, torch's .metadata and metadata.json on rank 0, failure broadcast: a
    CheckpointException on every rank if any rank's writer failed)."""
    from nemo_fp8rl.models.cpu_schedules import cpu_megatron

    with cpu_megatron("checkpoint", device=device):
        return bool(calls.maybe_finalize_async_calls(blocking=blocking))


def dist_load(template: dict, directory: Path, device) -> dict:
    """megatron's ``dist_checkpointing.load`` of ``template`` (a sharded state dict of this run's
    layout) from ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    from nemo_fp8rl.models.cpu_schedules import cpu_megatron

    with cpu_megatron("checkpoint", device=device):
        return dist_checkpointing.load(template, str(directory))


def dist_write_error(d: Path, e: BaseException) -> str:
    """The one-line reason a sharded write into ``d`` failed (KeyboardInterrupt/SystemExit re-raised)."""
    # megatron's writer reports an OSError (disk full) as torch's CheckpointException, a BaseException
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e
    return f"writing {d} failed: {getattr(e, 'strerror', None) or (str(e).splitlines() or [type(e).__name__])[-1][:500]}"


def hash_dist_files(tmp: Path) -> list:
    """Rank 0: [{name, bytes, sha256}] of every file megatron wrote to ``tmp/dist`` (names relative to
    ``tmp``, sorted); others: []."""
    if rank() != 0:
        return []
    out = []
    for p in sorted(x for x in (tmp / DIST_DIR).rglob("*") if x.is_file()):
        n, h = sha256_file(p)
        out.append({"name": str(p.relative_to(tmp)), "bytes": n, "sha256": h})
    return out
