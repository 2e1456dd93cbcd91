"""Atomic, multi-rank checkpoints: ``<output_dir>/checkpoints/step_<N>/`` plus a ``latest`` pointer.

Two formats share one directory protocol:

- format 1 (``save(step, state, fingerprint)``): each rank's state in ``rank_<r>.pt``; resuming needs
  the same world and the same config, ``parallel.*`` included;
- format 2 (``save(..., sharded=...)``, what the trainer writes): the model, optimizer and reference
  weights as megatron ``dist_checkpointing`` sharded tensors in ``dist/`` (global keys: any TP/PP/DP
  layout loads them), plus each rank's small local state (FP8 scaling, RNG, data position) in
  ``rank_<r>.pt``; resuming may change ``parallel.*`` and the world size. :meth:`load` returns a
  :class:`ShardedCheckpoint` (every rank's local state, and ``load_sharded(template)``).

Write protocol (a kill at any moment leaves either the previous checkpoint or the new one, never a
half-written one that looks complete):

1. every rank writes ``rank_<r>.pt`` into ``checkpoints/.tmp-step_<N>/`` (write to a temporary file,
   flush, fsync, rename into place) and, in format 2, its shards into ``.tmp-step_<N>/dist/``
   (megatron's writer); rank 0 then writes ``meta.json`` (step, world layout, size and SHA-256 of
   every file, the model-shaping config) last;
2. barrier; rank 0 fsyncs the directory and renames ``.tmp-step_<N>`` to ``step_<N>`` (atomic on one
   filesystem), then rewrites ``latest`` (temp file + rename) and prunes to the last K;
   With ``async_save`` (format 2 only) step 1's ``dist/`` part is megatron's asynchronous save: the
   shards are staged in host memory and handed to a forked writer process before :meth:`save`
   returns, and ``meta.json``, the rename and ``latest`` (step 2) run in the finalize step
   (:meth:`CheckpointManager.poll` / :meth:`~CheckpointManager.wait`), after megatron's collective
   check that every rank's writer finished; until then ``latest`` names the previous checkpoint;
3. loading checks that ``meta.json`` exists, that every file is present with the recorded size and
   hash (format 2: the ranks split the ``dist/`` files between them), and that the config matches,
   and raises naming the file otherwise.

The directory protocol (temporary directory, fsync, rename, ``latest``, keep last K) is
:mod:`nemo_fp8rl.trainer.atomic_publish`; megatron's reads and writes of ``dist/`` are
:mod:`nemo_fp8rl.trainer.dist_checkpoint`; this module holds the formats and the
:class:`CheckpointManager` that the trainer uses.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.trainer import atomic_publish
from nemo_fp8rl.trainer.atomic_publish import atomic_write_bytes, barrier, rank, sha256_file, world_size
from nemo_fp8rl.trainer.dist_checkpoint import (
    DIST_DIR,
    async_calls_queue,
    dist_load,
    dist_save,
    dist_save_async,
    dist_write_error,
    finalize_async_saves,
    hash_dist_files,
)

logger = logging.getLogger(__name__)
# Config keys a format-2 checkpoint may change on resume (the sharded state is layout-free).
RESHARDABLE_PREFIXES = ("parallel.",)
# How to move a format-1 run to another layout (named by both of its layout errors).
FORMAT1_WAY_OUT = ("resume once with the saved parallel.* values and the same number of ranks (TP x PP x DP); "
                   "the next checkpoint that run writes is in the sharded format 2, which resumes at any layout")


def infer_device(sharded: Any) -> torch.device:
    """The device a sharded state dict's model lives on, for megatron's ``dist_checkpointing`` calls
    (a CPU model's run inside the CPU shims of :mod:`nemo_fp8rl.models.cpu_schedules`, any other model's
    run megatron's code untouched).

    CUDA in a process whose default process group is NCCL (a CUDA run: the shims refuse to run there);
    otherwise the device of the first tensor in ``sharded`` that is not on the CPU (a tensor, or the
    ``.data`` of a megatron ``ShardedTensor``/``ShardedTensorFactory``); otherwise the CPU.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda")
    stack = [sharded]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        else:
            t = x if isinstance(x, torch.Tensor) else getattr(x, "data", None)
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                return t.device
    return torch.device("cpu")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the mismatch."""


@dataclass
class ShardedCheckpoint:
    """A verified format-2 checkpoint: every saved rank's local state and the sharded-state loader.

    ``rank_states[r]`` is what rank r passed as ``state`` to :meth:`CheckpointManager.save`;
    ``load_sharded(template)`` runs megatron's ``dist_checkpointing.load`` of ``template`` (a sharded
    state dict of this run's layout) from ``directory/dist`` (collective: every rank calls it).
    """

    step: int
    directory: Path
    saved_world_size: int
    rank_states: List[Dict[str, Any]]
    load_sharded: Callable[[dict], dict] = field(repr=False)
    format: int = 2


@dataclass
class _PendingSave:
    """An asynchronous save whose ``dist/`` is being written: published by CheckpointManager.wait/poll."""

    step: int
    tmp: Path
    final: Path
    meta: dict
    scheduled_at: float  # time.perf_counter() when save() returned
    schedule_s: float  # how long save() spent planning, staging and forking
    device: Any  # the saved model's device (the finalize runs megatron on it too)


class CheckpointManager:
    """Save/load/prune checkpoints of one run directory (all ranks call save and load together)."""

    def __init__(self, output_dir: str, keep_last: int = 3, device=None, async_save: bool = False) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        # Where the model lives: a CPU model's sharded save/load runs megatron inside the CPU shims.
        # None: inferred from each saved state / load template and the process group (infer_device).
        self.device = device
        # Format-2 saves write dist/ in a forked writer while training goes on (trainer.async_save).
        self.async_save = async_save
        self._calls = None  # megatron's AsyncCallsQueue, built at the first async save
        self._pending: Optional[_PendingSave] = None

    # ------------------------------------------------------------------ discovery
    def steps(self) -> list[int]:
        """Complete checkpoints on disk (those with a meta.json), ascending."""
        return atomic_publish.complete_steps(self.root)

    def latest_step(self) -> Optional[int]:
        """Step named by ``latest`` if it is complete, else the newest complete checkpoint, else None."""
        return atomic_publish.latest_step(self.root)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Dict[str, Any], fingerprint: Dict[str, Any], *,
             sharded: Optional[dict] = None) -> Path:
        """Write this rank's ``state`` for ``step`` (and, format 2, its part of ``sharded``, a megatron
        sharded state dict saved collectively with ``dist_checkpointing``); returns the final directory.

        ``fingerprint``: the config keys that shape the model and layout (compared on load).

        With ``async_save`` and ``sharded``, this returns once the shards are staged and the writer is
        forked: the checkpoint is published (``meta.json``, rename, ``latest``) by a later :meth:`poll`
        or :meth:`wait`, and a write error is raised there. A pending save is finalized first
        (blocking), so at most one is in flight.
        """
        self.wait()
        me, world = rank(), world_size()
        tmp, final = atomic_publish.make_tmp_dir(self.root, step)
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        try:
            atomic_write_bytes(tmp / f"rank_{me}.pt", data)
        except OSError as e:
            # Disk full / quota / permissions: drop the partial directory, keep every older checkpoint.
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"writing {tmp / f'rank_{me}.pt'} ({len(data)} bytes) failed: {e.strerror or e}; the partial "
                f"checkpoint was removed and older checkpoints in {self.root} are intact. Free space or move output_dir."
            ) from e
        digest = hashlib.sha256(data).hexdigest()
        files = [None] * world
        if world > 1:
            dist.all_gather_object(files, {"name": f"rank_{me}.pt", "bytes": len(data), "sha256": digest})
        else:
            files = [{"name": "rank_0.pt", "bytes": len(data), "sha256": digest}]
        meta = {"step": step, "world_size": world, "files": files, "fingerprint": dict(fingerprint),
                "format": 1 if sharded is None else 2}
        if sharded is not None and self.async_save:
            t0 = time.perf_counter()
            device = self._device_of(sharded)
            self._schedule_sharded(tmp, sharded, device)
            self._pending = _PendingSave(step, tmp, final, meta, time.perf_counter(), time.perf_counter() - t0,
                                         device)
            return final
        if sharded is not None:
            meta["dist_files"] = self._save_sharded(tmp, sharded, self._device_of(sharded))
        return self._publish(tmp, final, meta)

    def _device_of(self, sharded: dict):
        """The device given to the constructor, else the one ``sharded`` lives on (:func:`infer_device`)."""
        return self.device if self.device is not None else infer_device(sharded)

    def _publish(self, tmp: Path, final: Path, meta: dict) -> Path:
        """Steps 1 (``meta.json``, rank 0) and 2 of the write protocol, once every file is in ``tmp``."""
        return atomic_publish.publish(self.root, tmp, final, meta, self.keep_last)

    def _save_sharded(self, tmp: Path, sharded: dict, device) -> list:
        """megatron's collective sharded save into ``tmp/dist``; rank 0 returns [{name, bytes, sha256}]
        of every file written there. A failure on any rank removes ``tmp`` and raises on every rank."""
        self._in_dist_dir(tmp, lambda d: dist_save(sharded, d, device))
        return hash_dist_files(tmp)

    def _in_dist_dir(self, tmp: Path, write) -> None:
        """Create ``tmp/dist`` (rank 0), then ``write(tmp/dist)`` on every rank (collective); a failure on
        any rank removes ``tmp`` and raises on every rank."""
        d = tmp / DIST_DIR
        err = ""
        try:
            if rank() == 0:
                d.mkdir()
            barrier()
            write(d)
        except BaseException as e:  # noqa: BLE001
            err = dist_write_error(d, e)
        self._raise_if_any_failed(tmp, err)

    def _schedule_sharded(self, tmp: Path, sharded: dict, device) -> None:
        """Plan megatron's asynchronous save into ``tmp/dist`` and fork its writer (collective); a
        planning failure on any rank removes ``tmp`` and raises on every rank."""
        def write(d: Path) -> None:
            if self._calls is None:
                self._calls = async_calls_queue()
            dist_save_async(sharded, d, device, self._calls)

        self._in_dist_dir(tmp, write)

    # ------------------------------------------------------------------ async finalize
    @property
    def pending_step(self) -> Optional[int]:
        """The step of the asynchronous save still being written (not yet published), or None."""
        return self._pending.step if self._pending is not None else None

    def poll(self) -> Optional[Path]:
        """Publish the pending asynchronous save if every rank's writer has finished; do not wait.

        Collective when a save is pending (one all-reduce of a flag): all ranks call it together, e.g.
        once per training step. Returns the published directory, or None. Raises
        :class:`CheckpointError` (on every rank) if the write failed; ``latest`` then stays on the
        previous checkpoint."""
        return self._finalize(blocking=False)

    def wait(self) -> Optional[Path]:
        """Wait for the pending asynchronous save and publish it (collective; a no-op when none is
        pending): before another save, at the end of training, before exiting on a signal."""
        return self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> Optional[Path]:
        p = self._pending
        if p is None:
            return None
        d = p.tmp / DIST_DIR
        err, done = "", False
        try:
            done = finalize_async_saves(self._calls, p.device, blocking)
        except BaseException as e:  # noqa: BLE001
            err, done = dist_write_error(d, e), True
        if not done:  # the same answer on every rank (megatron's all-reduce)
            return None
        self._pending = None
        self._raise_if_any_failed(p.tmp, err)
        meta = dict(p.meta, dist_files=hash_dist_files(p.tmp))
        out = self._publish(p.tmp, p.final, meta)
        if rank() == 0:
            logger.info("checkpoint %s published: asynchronous save (save() took %.2f s to stage and fork the "
                        "writer; published %.2f s later)", out, p.schedule_s, time.perf_counter() - p.scheduled_at)
        return out

    def _raise_if_any_failed(self, tmp: Path, err: str) -> None:
        """Collective: if any rank reports ``err``, remove ``tmp`` and raise CheckpointError everywhere."""
        errs = [err]
        if world_size() > 1:
            errs = [None] * world_size()
            dist.all_gather_object(errs, err)
        bad = [e for e in errs if e]
        if bad:
            barrier()
            if rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            try:
                free = f" ({shutil.disk_usage(self.root).free} bytes free there)"
            except OSError:
                free = ""
            raise CheckpointError(
                f"{bad[0]}; the partial checkpoint was removed and older checkpoints in {self.root}{free} are "
                "intact. Free space or move output_dir."
            )
        barrier()

    def prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop stale temporary directories."""
        atomic_publish.prune(self.root, self.keep_last)

    # ------------------------------------------------------------------ load
    def load(self, step: int, fingerprint: Dict[str, Any]):
        """Verify and load ``step``; raise :class:`CheckpointError` naming the problem.

        Format 1: this rank's state dict (same world size and config required). Format 2: a
        :class:`ShardedCheckpoint` (``parallel.*`` keys and the world size may differ).
        """
        d = self.root / f"step_{step}"
        meta_path = d / "meta.json"
        if not meta_path.is_file():
            raise CheckpointError(f"{meta_path} is missing: {d} is not a complete checkpoint")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{meta_path} is unreadable ({e}); delete {d} to resume from an older checkpoint") from e
        fmt = meta.get("format", 1)
        if fmt not in (1, 2):
            raise CheckpointError(f"{meta_path}: unknown checkpoint format {fmt!r}; this nemo_fp8rl reads formats 1 and 2")
        world = world_size()
        if fmt == 1 and meta.get("world_size") != world:
            raise CheckpointError(
                f"{meta_path}: saved with world size {meta.get('world_size')}, resuming with {world}; this is a "
                f"per-rank (format 1) checkpoint, which cannot change layout: {FORMAT1_WAY_OUT}"
            )
        diff = diff_fingerprints(meta.get("fingerprint", {}), fingerprint)
        if fmt == 2:
            diff = [x for x in diff if not x[0].startswith(RESHARDABLE_PREFIXES)]
        if diff:
            lines = "; ".join(f"{k}: checkpoint={a!r} now={b!r}" for k, a, b in diff)
            if all(k.startswith(RESHARDABLE_PREFIXES) for k, _, _ in diff):  # format 1, layout only
                raise CheckpointError(
                    f"{meta_path}: the parallel layout changed ({lines}); this is a per-rank (format 1) checkpoint, "
                    f"which cannot change layout: {FORMAT1_WAY_OUT}"
                )
            raise CheckpointError(
                f"{meta_path}: the config changed in keys that shape the model or the run ({lines}); "
                "resume with the original values or start a new output_dir"
            )
        me = rank()
        if fmt == 1:
            return self._read_rank_file(d, meta["files"][me], f"rank {me} shard of step {step}")
        # Format 2: the dist/ files are verified by the ranks in turn (file i by rank i mod world); the
        # first problem any rank found is raised on every rank.
        err = ""
        try:
            for i, entry in enumerate(meta.get("dist_files", [])):
                if i % world == me:
                    self._verify_file(d, entry)
            states = [self._read_rank_file(d, entry, f"local state of saved rank {r}")
                      for r, entry in enumerate(meta["files"])]
        except CheckpointError as e:
            err = str(e)
        errs = [err]
        if world > 1:
            errs = [None] * world
            dist.all_gather_object(errs, err)
        bad = [e for e in errs if e]
        if bad:
            raise CheckpointError(bad[0])
        return ShardedCheckpoint(step=step, directory=d, saved_world_size=meta["world_size"], rank_states=states,
                                 load_sharded=lambda template: dist_load(template, d / DIST_DIR,
                                                                          self._device_of(template)))

    @staticmethod
    def _verify_file(d: Path, entry: dict) -> None:
        path = d / entry["name"]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        n, h = sha256_file(path)
        if n != entry["bytes"]:
            raise CheckpointError(f"{path} is truncated or altered: {n} bytes, meta.json records {entry['bytes']}")
        if h != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupt: its SHA-256 does not match meta.json")

    @staticmethod
    def _read_rank_file(d: Path, entry: dict, what: str) -> Dict[str, Any]:
        path = d / entry["name"]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing ({what})")
        data = path.read_bytes()
        if len(data) != entry["bytes"]:
            raise CheckpointError(
                f"{path} is truncated or altered: {len(data)} bytes, meta.json records {entry['bytes']}"
            )
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupt: its SHA-256 does not match meta.json")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path} could not be deserialised: {e}") from e


def diff_fingerprints(saved: Dict[str, Any], now: Dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Keys whose values differ between two flat fingerprints, as (key, saved, now)."""
    keys = sorted(set(saved) | set(now))
    return [(k, saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)]
