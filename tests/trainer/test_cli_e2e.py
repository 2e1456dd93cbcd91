"""End-to-end: the real CLI runs a few steps of each demo arm; metrics are present, finite and sane."""

import math

import pytest

from ._cli import DEMO_STEPS, metrics, run_cli


@pytest.mark.parametrize("arm", ["bf16", "fp8", "fp8_calibrated"])
def test_each_arm_runs_and_logs(demo_runs, arm):
    out = demo_runs[arm]  # tests/conftest.py: the demo's arm, trained once per session by the CLI
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(DEMO_STEPS))
    for r in recs:
        for k in ("reward/mean", "reward/accuracy", "policy/entropy", "train/loss", "train/grad_norm",
                  "clip/lower", "clip/upper", "clip/low_frac", "clip/high_frac", "rollout/invalid_frac",
                  "rollout/response_len", "timing/rollout", "timing/train", "timing/step"):
            assert k in r and r[k] is not None and math.isfinite(r[k]), (k, r.get(k))
        assert 0.5 <= r["clip/lower"] <= 0.8 + 1e-9 and 1.2 - 1e-9 <= r["clip/upper"] <= 3.0
    calib_steps = [r for r in recs if "calib/alpha_bf16" in r]
    if arm == "bf16":
        assert not calib_steps
        assert all(r["clip/lower"] == 0.8 and r["clip/upper"] == 1.2 for r in recs)
        assert "fp8/saturation_frac" not in recs[0]
    else:
        assert [r["step"] for r in calib_steps] == [0, 2]  # calibration.interval=2
        for r in calib_steps:
            for k in ("calib/alpha_bf16", "calib/alpha_fp8_nominal", "calib/false_clip_rate", "calib/tokens",
                      "calib/lower_raw", "calib/upper_raw", "calib/balance_bf16", "calib/balance_fp8"):
                assert k in r, k
            assert r["calib/skipped"] == 0.0 and r["calib/tokens"] >= 4
            assert 0.0 <= r["calib/alpha_bf16"] <= 1.0
        assert "timing/shadow" in recs[0] and recs[0]["timing/shadow"] > 0
        assert recs[0]["fp8/saturation_frac"] == 0.0
        if arm == "fp8":  # measurement only: bounds stay nominal
            assert all(r["clip/lower"] == 0.8 and r["clip/upper"] == 1.2 for r in recs)
        else:  # calibrated bounds apply from the step after the first calibration
            assert recs[0]["clip/lower"] == 0.8
            # the first calibration sets the bounds (no smoothing yet): the raw values within the guards
            c0 = recs[0]
            assert recs[1]["clip/lower"] == pytest.approx(min(max(c0["calib/lower_raw"], 0.5), 0.8))
            assert recs[1]["clip/upper"] == pytest.approx(min(max(c0["calib/upper_raw"], 1.2), 3.0))
    ckpts = out / "checkpoints"
    assert (out / "config.yaml").is_file() and (ckpts / "latest").read_text().strip() == f"step_{DEMO_STEPS}"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_2", "step_4"]  # trainer.checkpoint_interval=2


def test_dapo_preset_with_dynamic_sampling_and_recompute(tmp_path):
    out = tmp_path / "dapo"
    run_cli(out, "algorithm=dapo", "algorithm.prompts_per_step=4", "algorithm.group_size=4",
            "algorithm.overlong_buffer_len=2", "fp8=blockwise", "calibration=paper", "calibration.interval=1",
            "calibration.min_tokens=4", "trainer.max_steps=2", "algorithm.old_logprobs=recompute")
    recs = metrics(out)
    assert len(recs) == 2
    r = recs[-1]
    assert 0.0 <= r["rollout/dynamic_kept_frac"] <= 1.0
    assert r["clip/upper"] >= 1.28 - 1e-9  # clip-higher preset
    assert "mismatch/logp_abs_diff_mean" in r and r["mismatch/logp_abs_diff_mean"] > 0  # FP8 rollout vs trainer
    assert "mismatch/fp8_bf16_logp_abs_diff_mean" in recs[0]


def test_invalid_config_is_one_clear_message(tmp_path):
    proc = run_cli(tmp_path / "bad", "algorithm.eps_low=1.5", check=False)
    assert proc.returncode == 2
    assert "algorithm.eps_low=1.5" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(tmp_path / "bad2", "calibration=paper", check=False)  # FP8 off + calibration
    assert proc.returncode == 2 and "calibration is on but training FP8 is off" in proc.stderr


def test_multirun_gives_each_job_its_own_run_dir(tmp_path):
    import subprocess
    import sys

    from ._cli import TINY

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", "-m", *TINY, "seed=1,2", "trainer.max_steps=1",
           "warmup.steps=2", f"warmup.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(metrics(sweep / "0")) == 1 and len(metrics(sweep / "1")) == 1
    assert metrics(sweep / "0")[0]["reward/mean"] is not None


def test_stability_action_stop_checkpoints_and_stops_on_garbled_output(tmp_path):
    """A barely warmed-up model (8 warm-up steps) answers mostly garbage: with stability.action=stop and
    patience 2, the run stops after the second garbled step with exit code 3, a checkpoint of that step
    and the flags in metrics.jsonl; resuming continues the count (restored from the checkpoint)."""
    out = tmp_path / "run"
    proc = run_cli(out, "stability.action=stop", "stability.patience=2", "trainer.max_steps=10", check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "stability.action=stop" in proc.stderr and "Checkpoint saved at step 2" in proc.stderr
    recs = metrics(out)
    assert [r["stability/garbled"] for r in recs] == [1.0, 1.0]
    assert [r["stability/unstable_steps"] for r in recs] == [1.0, 2.0]
    assert all(r["rollout/invalid_frac"] > 0.5 for r in recs)
    assert (out / "checkpoints" / "step_2").is_dir()
    again = run_cli(out, "stability.action=stop", "stability.patience=2", "trainer.max_steps=10", "resume=true",
                    check=False)
    assert again.returncode == 3 and "3 consecutive steps flagged unstable" in again.stderr

def test_stability_action_warn_only_logs_the_same_garbled_start(demo_runs):
    """With the default action (warn), the demo's bf16 arm (the same tiny warm-up, FP8 off) starts with
    the same garbled steps: it warns, counts past the patience at which ``stop`` stopped, and goes on."""
    recs = metrics(demo_runs["bf16"])
    assert [r["stability/garbled"] for r in recs[:2]] == [1.0, 1.0]
    assert [r["stability/unstable_steps"] for r in recs[:2]] == [1.0, 2.0]
    assert "unstable (garbled output)" in demo_runs.stderr("bf16")
    assert len(recs) == DEMO_STEPS


def test_save_final_false_with_no_interval_writes_no_checkpoint(tmp_path):
    """``trainer.checkpoint_interval=0 trainer.save_final=false``: the run ends without a checkpoint (the
    GPU benchmark's GRPO arms: an 8B model's final checkpoint with its optimizer is ~5 GB)."""
    out = tmp_path / "nockpt"
    run_cli(out, "warmup.steps=0", "trainer.max_steps=2", "trainer.checkpoint_interval=0", "trainer.save_final=false")
    assert [r["step"] for r in metrics(out)] == [0, 1]
    assert not list((out / "checkpoints").glob("step_*")) and not (out / "checkpoints" / "latest").exists()
