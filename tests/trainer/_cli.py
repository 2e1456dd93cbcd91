"""Helpers to run the real training CLI in a subprocess with tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = [
    "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.minibatches_per_step=2",
    "warmup.steps=8", "warmup.batch_size=16", "rollout.max_new_tokens=6", "task.format_reward=0.5",
    "logger.tensorboard=false", "logger.progress=lines", "parallel.micro_batch_size=8",
]


def run_cli(out: Path, *overrides: str, check: bool = True, timeout: int = 300, env_extra=None):
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *TINY, f"output_dir={out}",
           f"warmup.cache_dir={out.parent / '.warmup_cache'}", *overrides]
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"CLI failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def strip_timing(recs: list[dict]) -> list[dict]:
    """Metrics without wall-clock timings (the part of a trajectory that must be reproducible)."""
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in recs]
