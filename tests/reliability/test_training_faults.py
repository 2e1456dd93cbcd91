"""Faults during training: kill -9 + resume, non-finite updates, a full disk, an unwritable output dir."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_fp8rl.config.schema import TrainConfig
from nemo_fp8rl.trainer import RLTrainer, StopTraining, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "trainer"))
from _cli import DEMO_STEPS, TINY, demo_overrides, metrics, run_cli, signal_group_when, strip_timing  # noqa: E402


def test_kill9_mid_run_then_resume_keeps_every_step_once(demo_runs, tmp_path):
    """The demo's fp8_calibrated arm (tests/conftest.py: 4 steps, checkpoints at 2 and 4) killed with
    SIGKILL between the two checkpoints and resumed equals the uninterrupted arm, each step logged once."""
    arm = [*demo_overrides("fp8_calibrated"), "logger.tensorboard=true", f"warmup.cache_dir={demo_runs.warmup_cache}"]
    ref, out = demo_runs["fp8_calibrated"], tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *TINY, f"output_dir={out}", *arm]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # kill after step 3 was logged: past checkpoint 2, before 4 (the last step)
        if (out / "metrics.jsonl").exists() and len(read_metrics(str(out))) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_metrics(str(out))) >= 3 and (out / "checkpoints" / "latest").read_text().strip() == "step_2"
    run_cli(out, *arm, "resume=true")
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(DEMO_STEPS)), "each step exactly once"
    assert strip_timing(recs) == strip_timing(metrics(ref)), "the resumed trajectory equals the uninterrupted one"
    # TensorBoard: purged on resume, so no step is shown twice
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    steps = [e.step for e in ea.Scalars("reward/mean")]
    assert steps == list(range(DEMO_STEPS)), steps


def _tiny_cfg(out, **trainer):
    cfg = TrainConfig(output_dir=str(out), seed=3)
    cfg.algorithm.prompts_per_step, cfg.algorithm.group_size, cfg.algorithm.minibatches_per_step = 4, 4, 2
    cfg.warmup.steps = 0
    cfg.task.format_reward = 0.5
    cfg.rollout.max_new_tokens = 6
    cfg.logger.tensorboard = False
    cfg.logger.progress = "none"
    cfg.fp8.recipe = "tensorwise"
    cfg.algorithm.entropy_coef = 0.01  # a gradient on every step even when all rewards tie
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


def _nan_on(trainer: RLTrainer, steps):
    """Inject NaN into the policy loss on the given steps (a real non-finite loss and gradient)."""
    real = trainer.policy_loss

    def loss(*a, **kw):
        value, metrics = real(*a, **kw)
        if trainer.step_idx in steps:
            value = value * float("nan")
        return value, metrics

    trainer.policy_loss = loss


def test_nonfinite_updates_are_skipped_and_counted(tmp_path, close_trainer):
    tr = RLTrainer(_tiny_cfg(tmp_path / "a", max_steps=4, max_consecutive_skips=3))
    tr.setup()
    _nan_on(tr, {1, 2})
    before = {k: v.clone() for k, v in tr.actor.export_weights().items()}
    m0 = tr.step()
    after0 = tr.actor.export_weights()
    assert m0["train/skipped"] == 0 and any(not torch.equal(before[k], after0[k]) for k in before)
    m1 = tr.step()
    after1 = tr.actor.export_weights()
    assert m1["train/skipped"] == 1 and m1["train/skipped_steps"] == 1
    assert all(torch.equal(after0[k], after1[k]) for k in after0), "a skipped update must not touch the weights"
    tr.step()
    m3 = tr.step()
    assert m3["train/skipped"] == 0 and m3["train/skipped_steps"] == 2 and tr.consecutive_skips == 0
    close_trainer(tr)  # stepped by hand, never through fit


def test_repeated_nonfinite_updates_stop_with_a_checkpoint(tmp_path):
    out = tmp_path / "b"
    tr = RLTrainer(_tiny_cfg(out, max_steps=10, max_consecutive_skips=2, checkpoint_interval=0))
    tr.setup()
    _nan_on(tr, set(range(1, 10)))
    with pytest.raises(StopTraining, match="2 consecutive updates had a non-finite"):
        tr.fit()
    assert tr.ckpt.latest_step() == 3  # steps 0 (good), 1 and 2 (skipped): the weights are still step 0's
    assert [r["step"] for r in read_metrics(str(out))] == [0, 1, 2]


def test_unwritable_output_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli(blocker / "run", "trainer.max_steps=1", check=False)
    assert proc.returncode == 2
    assert "is not writable" in proc.stderr and "Traceback" not in proc.stderr


def test_disk_full_during_a_run_fails_clearly_and_keeps_metrics(small_tmpfs):
    mnt = small_tmpfs("2m")
    out = mnt / "run"
    proc = run_cli(out, "trainer.max_steps=2", "trainer.checkpoint_interval=1", check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "checkpoint failed" in proc.stderr and "partial checkpoint was removed" in proc.stderr
    assert [r["step"] for r in metrics(out)] == [0]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith((".tmp", "step_"))]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])
def test_preemption_signal_checkpoints_and_exits_cleanly(tmp_path, sig):
    """The signal goes to the trainer's whole process group (SLURM signals every process of a step, a
    terminal's Ctrl-C the foreground group), after periodic checkpoints have started megatron's
    results-queue manager: the trainer's final checkpoint still needs that process."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *TINY, f"output_dir={out}",
           f"warmup.cache_dir={tmp_path / '.warmup_cache'}", "trainer.max_steps=200", "trainer.checkpoint_interval=1"]
    rc, err = signal_group_when(cmd, lambda: (out / "checkpoints" / "step_2").is_dir(), sig)
    assert rc == 0, err[-2000:]
    logged = len(read_metrics(str(out)))
    assert 2 <= logged < 200
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{logged}"
    assert "checkpointing" in err
