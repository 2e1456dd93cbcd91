"""Atomic publishing of step directories: ``<root>/step_<N>/`` plus a ``latest`` pointer, last K kept.

A kill at any moment leaves either the previous checkpoint or the new one, never a half-written one
that looks complete. The protocol (the files a checkpoint holds are the caller's business):

1. :func:`make_tmp_dir` (rank 0) creates an empty ``<root>/.tmp-step_<N>/``; every rank writes its
   files into it, each with :func:`atomic_write_bytes` (write to a temporary file, flush, fsync,
   rename into place); :func:`publish` then has rank 0 write ``meta.json`` last and fsync the
   directory;
2. barrier; rank 0 renames ``.tmp-step_<N>`` to ``step_<N>`` (atomic on one filesystem), rewrites
   ``latest`` (temporary file + rename) and prunes to the last K (:func:`prune`);
3. a directory counts as complete only once it is named ``step_<N>`` and holds ``meta.json``
   (:func:`complete_steps`, :func:`latest_step`); hidden ``.tmp-step_<N>`` / ``.old-step_<N>``
   directories left by a kill are removed by the next :func:`prune`.

The rank helpers work without ``torch.distributed`` initialised (one process: rank 0 of 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

STEP_RE = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------ ranks
def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------ files
def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a rename into it is durable); a no-op where it cannot be opened."""
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


def sha256_file(path: Path) -> tuple[int, str]:
    """``(size in bytes, SHA-256 hex digest)`` of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


# ------------------------------------------------------------------ discovery
def complete_steps(root: Path) -> list[int]:
    """Complete checkpoints under ``root`` (``step_<N>`` directories with a meta.json), ascending."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def latest_step(root: Path) -> int | None:
    """Step named by ``latest`` if it is complete, else the newest complete checkpoint, else None."""
    ptr = root / "latest"
    if ptr.is_file():
        name = ptr.read_text().strip()
        m = STEP_RE.match(name)
        if m and (root / name / "meta.json").is_file():
            return int(m.group(1))
    steps = complete_steps(root)
    return steps[-1] if steps else None


# ------------------------------------------------------------------ write and publish
def make_tmp_dir(root: Path, step: int) -> tuple[Path, Path]:
    """``(tmp, final)`` for ``step``: rank 0 creates ``root`` and an empty ``tmp`` (removing one left by
    an earlier attempt); every rank returns after a barrier (collective)."""
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    return tmp, final


def publish(root: Path, tmp: Path, final: Path, meta: dict, keep_last: int) -> Path:
    """Steps 1 (``meta.json``, last) and 2 of the protocol, once every rank's files are in ``tmp``
    (collective): rank 0 writes ``meta.json`` (``meta["step"]`` is the step), renames ``tmp`` to
    ``final`` (replacing an older copy of the step), points ``latest`` at it and prunes to
    ``keep_last``. Returns ``final``."""
    step = meta["step"]
    if rank() == 0:
        atomic_write_bytes(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
    barrier()
    if rank() == 0:
        if final.exists():  # re-saving a step (e.g. after a resume): replace the old copy
            old = root / f".old-step_{step}"
            shutil.rmtree(old, ignore_errors=True)  # left by an earlier kill
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
        atomic_write_bytes(root / "latest", f"step_{step}\n".encode())
        fsync_dir(root)
        prune(root, keep_last)
    barrier()
    return final


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; drop stale temporary directories."""
    for p in root.iterdir():
        if p.name.startswith((".tmp-step_", ".old-step_")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    for s in complete_steps(root)[: -keep_last]:
        # Rename first (atomic), then delete: a kill during the slow delete leaves a hidden
        # directory, never a step_<N> that looks complete but lost files.
        doomed = root / f".old-step_{s}"
        os.replace(root / f"step_{s}", doomed)
        shutil.rmtree(doomed, ignore_errors=True)
