"""Write a stage's files, submit them with ``sbatch`` or run them locally with torchrun."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from nemo_fp8rl.launcher.plan import StagePlan
from nemo_fp8rl.launcher.scripts import (
    render_local_script,
    render_nsys_wrapper,
    render_sbatch_script,
    render_train_config,
)

_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")


class SubmitError(RuntimeError):
    """sbatch is missing or refused the job; the message carries sbatch's own words."""


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_stage(plan: StagePlan) -> dict[str, Path]:
    """Write the resolved training config and the job script of ``plan`` into its results directory.

    Returns:
        ``{"train_config": path, "script": path}`` (the sbatch script for ``slurm``, the torchrun
        script for ``local``), and ``"nsys_wrapper": path`` with ``trainer.profile.kind=nsys``.
    """
    plan.results_dir.mkdir(parents=True, exist_ok=True)
    _write(plan.train_config_path, render_train_config(plan))
    written = {"train_config": plan.train_config_path}
    if plan.nsys_ranks:  # before the script that runs it
        _write(plan.nsys_wrapper_path, render_nsys_wrapper(plan), 0o755)
        written["nsys_wrapper"] = plan.nsys_wrapper_path
    if plan.cluster_type == "slurm":
        script, text = plan.submission_script_path, render_sbatch_script(plan)
    else:
        script, text = plan.local_script_path, render_local_script(plan)
    _write(script, text, 0o755)
    return {**written, "script": script}


def submit(script: Path, *, cwd: Path) -> str:
    """``sbatch --parsable <script>`` from ``cwd``; returns the job id.

    Raises:
        SubmitError: sbatch is not on PATH or exits non-zero (its stderr is in the message).
    """
    if shutil.which("sbatch") is None:
        raise SubmitError(
            "sbatch is not on PATH: submit from a SLURM login node, start a one-node cluster on this machine "
            "with scripts/slurm_local.sh, write the files only with launcher.dry_run=true, or run here with "
            "cluster_type=local"
        )
    proc = subprocess.run(["sbatch", "--parsable", str(script)], cwd=str(cwd), capture_output=True, text=True,
                          check=False)
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out or not _JOB_ID.match(out[-1].strip()):
        detail = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}")
        raise SubmitError(f"sbatch {script} failed: {detail}")
    return _JOB_ID.match(out[-1].strip()).group(1)


def run_local(script: Path, *, cwd: Path) -> int:
    """Run the local torchrun script in the foreground (its output goes to this terminal)."""
    return subprocess.run(["bash", str(script)], cwd=str(cwd), check=False).returncode


__all__ = ["SubmitError", "run_local", "submit", "write_stage"]
