"""Helpers: run the real launcher (CLI or library entry point) with a tiny training override set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Tiny sizes for the tiny CPU stage (cf. tests/trainer/_cli.py): keys the stage YAML lists are plain
# overrides, the others are added with ++ (add or override).
TINY = [
    "rl.algorithm.prompts_per_step=4", "rl.algorithm.group_size=4", "++rl.warmup.steps=8",
    "++rl.warmup.batch_size=16", "++rl.rollout.max_new_tokens=6", "++rl.task.format_reward=0.5",
    "++rl.logger.tensorboard=false", "++rl.parallel.micro_batch_size=8", "++rl.calibration.min_tokens=4",
]
# Required keys of the GPU stages, for planning them here.
GPU_REQUIRED = ["rl.model.hf_path=/models/ckpt", "rl.task.path=/data/math.jsonl"]


def launch_cli(*overrides: str, timeout: int = 300, console_script: bool = False) -> subprocess.CompletedProcess:
    """Run ``nemo-fp8rl-launch`` (``python -m nemo_fp8rl.launch``, or the installed console script)."""
    if console_script:
        cmd = [str(Path(sys.executable).parent / "nemo-fp8rl-launch")]
    else:
        cmd = [sys.executable, "-m", "nemo_fp8rl.launch"]
    return subprocess.run([*cmd, *overrides], capture_output=True, text=True, timeout=timeout, cwd=str(REPO), check=False,
                          env=dict(os.environ, HYDRA_FULL_ERROR="0"))


def plans(*overrides: str):
    """The checked stage plans, through the same code path as the CLI (no files written)."""
    from nemo_fp8rl.launch import plans_from_overrides

    return plans_from_overrides(list(overrides))


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def job_id(stdout: str) -> str:
    for line in stdout.splitlines():
        if line.startswith("Submitted batch job "):
            return line.split()[-1]
    raise AssertionError(f"no 'Submitted batch job' line in:\n{stdout}")
