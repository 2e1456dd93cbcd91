"""Helpers to run the real training CLI in a subprocess with tiny sizes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TINY = [
    "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.minibatches_per_step=2",
    "warmup.steps=8", "warmup.batch_size=16", "rollout.max_new_tokens=6", "task.format_reward=0.5",
    "logger.tensorboard=false", "logger.progress=lines", "parallel.micro_batch_size=8",
]


# The demo's three arms (nemo_fp8rl/demo.py: same seed and settings, differing only in precision and
# clipping) at test size: 4 RL steps, checkpoints at steps 2 and 4, calibration every 2 steps from 4 tokens,
# sample generations at the demo's first/middle/last steps (0, 1, 3), two per step. tests/conftest.py's
# ``demo_runs`` trains each arm once per session; the tests that need a trained run read those.
DEMO_STEPS = 4


def demo_overrides(arm: str, recipe: str = "tensorwise") -> list[str]:
    """``make demo``'s overrides of ``arm`` (bf16 | fp8 | fp8_calibrated), at the size of these tests."""
    from nemo_fp8rl.demo import ARMS, COMMON, sample_steps

    return [o.format(recipe=recipe) for o in ARMS[arm]] + COMMON + [
        f"trainer.max_steps={DEMO_STEPS}", "trainer.checkpoint_interval=2", "calibration.interval=2",
        "calibration.min_tokens=4", sample_steps(DEMO_STEPS), "logger.samples_per_step=2",
    ]


def run_cli(out: Path, *overrides: str, check: bool = True, timeout: int = 300, env_extra=None):
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *TINY, f"output_dir={out}",
           f"warmup.cache_dir={out.parent / '.warmup_cache'}", *overrides]
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"CLI failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def signal_group_when(cmd: list[str], ready, sig: int, timeout: float = 240) -> tuple[int, str]:
    """Start ``cmd`` in a session of its own, wait until ``ready()`` (or ``timeout`` seconds), send ``sig`` to its
    whole process group (as SLURM's scancel/preemption and a terminal's job control do: the trainer's helper
    processes get it too) and wait for the exit. Returns (exit code, stderr); the group is SIGKILLed after."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and not ready():
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, err


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def strip_timing(recs: list[dict]) -> list[dict]:
    """Metrics without wall-clock timings (the part of a trajectory that must be reproducible)."""
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in recs]


def train_in_process(out: Path, *overrides: str) -> dict:
    """What ``run_cli(out, *overrides)`` runs, in this process: Hydra composes ``conf/`` with the same
    overrides, then ``nemo_fp8rl.train``'s own ``to_train_config``, ``prepare`` and ``fit`` (the code the CLI
    calls). Returns the last step's metrics. ``prepare`` sets torch's thread count from
    ``trainer.cpu_threads``; the test process gets its own back afterwards."""
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_fp8rl.train import CONF_DIR, prepare, register_schema, to_train_config

    register_schema()
    GlobalHydra.instance().clear()
    threads = torch.get_num_threads()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            dict_cfg = compose("config", overrides=[*TINY, f"output_dir={out}",
                                                    f"warmup.cache_dir={out.parent / '.warmup_cache'}", *overrides])
        return prepare(to_train_config(dict_cfg)).fit()
    finally:
        GlobalHydra.instance().clear()
        torch.set_num_threads(threads)


def every_phase_config(out: Path, max_steps: int):
    """An in-process tiny FP8 run (``TrainConfig``: 4 prompts x 4 responses of up to 6 tokens, tensorwise, no
    warm-up, no checkpoint) whose every step has every phase: the weight sync and rollout, recomputed old
    log-probs, calibration's shadow forwards and push forward (calibration every step), the updates."""
    from nemo_fp8rl.config.schema import TrainConfig

    cfg = TrainConfig(output_dir=str(out), seed=3)
    cfg.algorithm.prompts_per_step, cfg.algorithm.group_size, cfg.algorithm.minibatches_per_step = 4, 4, 2
    cfg.algorithm.old_logprobs = "recompute"
    cfg.warmup.steps, cfg.rollout.max_new_tokens = 0, 6
    cfg.logger.tensorboard, cfg.logger.progress = False, "none"
    cfg.fp8.recipe = "tensorwise"
    cfg.calibration.enabled, cfg.calibration.interval, cfg.calibration.min_tokens = True, 1, 4
    cfg.trainer.max_steps, cfg.trainer.checkpoint_interval, cfg.trainer.save_final = max_steps, 0, False
    return cfg
