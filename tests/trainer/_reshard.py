"""Helpers for the layout-change resume tests: the real CLI under torchrun, and a checkpoint cut back.

``torchrun_cli`` launches ``python -m nemo_fp8rl.train`` on ``nproc`` gloo ranks with the tiny sizes of
``_cli.TINY`` (one warm-up cache per test directory, one intra-op thread per rank so two ranks share the
two cores). ``cut_back_to`` turns a finished run directory into the one a run killed right after its
step-``step`` checkpoint leaves behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ._cli import TINY


def torchrun_cli(out: Path, nproc: int, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``nemo-fp8rl-train`` on ``nproc`` ranks (torchrun, gloo); raises with both ranks' logs on failure."""
    logs = out.parent / f"{out.name}_torchrun_logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--log-dir", str(logs), "--redirects", "3", "-m", "nemo_fp8rl.train", *TINY, f"output_dir={out}",
           f"warmup.cache_dir={out.parent / '.warmup_cache'}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        errs = "\n".join(p.read_text()[-3000:] for p in sorted(logs.glob("*/attempt_0/*/stderr.log")))
        raise AssertionError(f"torchrun CLI failed ({proc.returncode}):\n{proc.stderr[-2000:]}\n{errs}")
    return proc


def cut_back_to(src: Path, dst: Path, step: int) -> None:
    """Copy run directory ``src`` to ``dst`` and drop every checkpoint after ``step``, pointing ``latest``
    at it: on disk, the run a ``kill -9`` right after the step-``step`` checkpoint leaves (its
    ``metrics.jsonl`` still holds later steps, which a resume drops)."""
    shutil.copytree(src, dst)
    ckpts = dst / "checkpoints"
    for p in ckpts.glob("step_*"):
        if int(p.name.split("_")[1]) > step:
            shutil.rmtree(p)
    (ckpts / "latest").write_text(f"step_{step}\n")


def rank_state(out: Path, step: int, rank: int = 0) -> dict:
    """The local state (trainer counters, data position, RNG, calibration) rank ``rank`` saved at ``step``."""
    return torch.load(out / "checkpoints" / f"step_{step}" / f"rank_{rank}.pt", map_location="cpu",
                      weights_only=False)
