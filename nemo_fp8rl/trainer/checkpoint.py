"""Atomic, multi-rank checkpoints: ``<output_dir>/checkpoints/step_<N>/`` plus a ``latest`` pointer.

Write protocol (a kill at any moment leaves either the previous checkpoint or the new one, never a
half-written one that looks complete):

1. every rank writes ``rank_<r>.pt`` into ``checkpoints/.tmp-step_<N>/`` (write to a temporary file,
   flush, fsync, rename into place), plus rank 0 writes ``meta.json`` (step, world layout, per-file
   sizes and SHA-256, the model-shaping config) last;
2. barrier; rank 0 fsyncs the directory and renames ``.tmp-step_<N>`` to ``step_<N>`` (atomic on one
   filesystem), then rewrites ``latest`` (temp file + rename) and prunes to the last K;
3. loading checks that ``meta.json`` exists, that every rank file is present with the recorded size
   and hash, and that the layout and model config match, and raises naming the file otherwise.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the mismatch."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync, rename.

    On failure (e.g. ENOSPC) the temporary file is removed and ``path`` is left as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Save/load/prune checkpoints of one run directory (all ranks call save and load together)."""

    def __init__(self, output_dir: str, keep_last: int = 3) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last

    # ------------------------------------------------------------------ discovery
    def steps(self) -> list[int]:
        """Complete checkpoints on disk (those with a meta.json), ascending."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and (p / "meta.json").is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> Optional[int]:
        """Step named by ``latest`` if it is complete, else the newest complete checkpoint, else None."""
        ptr = self.root / "latest"
        if ptr.is_file():
            name = ptr.read_text().strip()
            m = STEP_RE.match(name)
            if m and (self.root / name / "meta.json").is_file():
                return int(m.group(1))
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Dict[str, Any], fingerprint: Dict[str, Any]) -> Path:
        """Write this rank's ``state`` for ``step``; returns the final directory.

        ``fingerprint``: the config keys that shape the model and layout (compared on load).
        """
        rank, world = _rank(), _world()
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp-step_{step}"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        try:
            atomic_write_bytes(tmp / f"rank_{rank}.pt", data)
        except OSError as e:
            # Disk full / quota / permissions: drop the partial directory, keep every older checkpoint.
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"writing {tmp / f'rank_{rank}.pt'} ({len(data)} bytes) failed: {e.strerror or e}; the partial "
                f"checkpoint was removed and older checkpoints in {self.root} are intact. Free space or move output_dir."
            ) from e
        digest = hashlib.sha256(data).hexdigest()
        files = [None] * world
        if world > 1:
            dist.all_gather_object(files, {"name": f"rank_{rank}.pt", "bytes": len(data), "sha256": digest})
        else:
            files = [{"name": "rank_0.pt", "bytes": len(data), "sha256": digest}]
        if rank == 0:
            meta = {"step": step, "world_size": world, "files": files, "fingerprint": fingerprint, "format": 1}
            atomic_write_bytes(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
        _barrier()
        if rank == 0:
            if final.exists():  # re-saving a step (e.g. after a resume): replace the old copy
                old = self.root / f".old-step_{step}"
                shutil.rmtree(old, ignore_errors=True)  # left by an earlier kill
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
            atomic_write_bytes(self.root / "latest", f"step_{step}\n".encode())
            _fsync_dir(self.root)
            self.prune()
        _barrier()
        return final

    def prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop stale temporary directories."""
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-step_", ".old-step_")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
        for s in self.steps()[: -self.keep_last]:
            # Rename first (atomic), then delete: a kill during the slow delete leaves a hidden
            # directory, never a step_<N> that looks complete but lost files.
            doomed = self.root / f".old-step_{s}"
            os.replace(self.root / f"step_{s}", doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, step: int, fingerprint: Dict[str, Any]) -> Dict[str, Any]:
        """Verify and load this rank's state of ``step``; raise :class:`CheckpointError` naming the problem."""
        d = self.root / f"step_{step}"
        meta_path = d / "meta.json"
        if not meta_path.is_file():
            raise CheckpointError(f"{meta_path} is missing: {d} is not a complete checkpoint")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{meta_path} is unreadable ({e}); delete {d} to resume from an older checkpoint") from e
        world = _world()
        if meta.get("world_size") != world:
            raise CheckpointError(
                f"{meta_path}: saved with world size {meta.get('world_size')}, resuming with {world}; "
                "resume with the same number of ranks (TP x PP x DP)"
            )
        diff = diff_fingerprints(meta.get("fingerprint", {}), fingerprint)
        if diff:
            lines = "; ".join(f"{k}: checkpoint={a!r} now={b!r}" for k, a, b in diff)
            raise CheckpointError(
                f"{meta_path}: the config changed in keys that shape the model or the run ({lines}); "
                "resume with the original values or start a new output_dir"
            )
        rank = _rank()
        entry = meta["files"][rank]
        path = d / entry["name"]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (rank {rank} shard of step {step})")
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
