"""Resume continues the exact trajectory: 2N steps == N steps + resume to 2N (CPU, bitwise metrics)."""

import math
import re
import shutil

import pytest

from ._cli import metrics, run_cli, strip_timing

ARM = ["fp8=tensorwise", "calibration=paper", "calibration.interval=2", "calibration.min_tokens=4",
       "algorithm.old_logprobs=rollout"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 4-step run and a 2-step run checkpointed at step 2 (shared by the resume tests)."""
    root = tmp_path_factory.mktemp("resume")
    full, part = root / "full", root / "part"
    run_cli(full, *ARM, "trainer.max_steps=4", "trainer.checkpoint_interval=2")
    run_cli(part, *ARM, "trainer.max_steps=2", "trainer.checkpoint_interval=2")
    return full, part


def test_resume_is_exact(runs, tmp_path):
    full, stopped = runs
    part = tmp_path / "part"
    shutil.copytree(stopped, part)
    assert (part / "checkpoints" / "latest").read_text().strip() == "step_2"
    run_cli(part, *ARM, "trainer.max_steps=4", "trainer.checkpoint_interval=2", "resume=true")
    a, b = strip_timing(metrics(full)), strip_timing(metrics(part))
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert a == b


def test_resume_switches_fp8_backend(runs, tmp_path):
    """A run written by the emulation resumes on torch's FP8 GEMMs (fp8.backend=torch; CPU: tensorwise runs
    real FP8 GEMMs): same checkpoint keys, the step-2 rollout is the uninterrupted run's exactly (the rollout
    engine does not use the trainer's GEMMs, so it sees the restored weights and RNG streams), and training
    goes on with finite metrics within the FP8 noise of the emulated run."""
    full, stopped = runs
    part = tmp_path / "part"
    shutil.copytree(stopped, part)
    proc = run_cli(part, *ARM, "trainer.max_steps=4", "trainer.checkpoint_interval=2", "resume=true",
                   "fp8.backend=torch")
    # the tiny model's linears are multiples of 16: every converted linear runs torch's FP8 GEMM
    assert re.search(r"converted (\d+)/\1 linear layers .*backend=torch: \1 on torch FP8 GEMMs, 0 emulated",
                     proc.stderr), proc.stderr[-2000:]
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    rollout_keys = [k for k in a[2] if k.startswith(("reward/", "rollout/", "response/"))]
    assert rollout_keys
    assert {k: a[2][k] for k in rollout_keys} == {k: b[2][k] for k in rollout_keys}
    for rec in b[2:]:
        assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float)), rec


def test_existing_run_is_never_overwritten_without_resume(tmp_path):
    out = tmp_path / "run"
    run_cli(out, "trainer.max_steps=1")
    proc = run_cli(out, "trainer.max_steps=2", check=False)
    assert proc.returncode != 0
    assert "resume=true" in proc.stderr and "nothing was overwritten" in proc.stderr
    assert len(metrics(out)) == 1


def test_resume_refuses_model_changes(tmp_path):
    out = tmp_path / "run"
    run_cli(out, "trainer.max_steps=1")
    proc = run_cli(out, "trainer.max_steps=2", "resume=true", "model.hidden_size=64", "model.ffn_hidden_size=192",
                   check=False)
    assert proc.returncode != 0
    assert "model.hidden_size: checkpoint=128 now=64" in proc.stderr
