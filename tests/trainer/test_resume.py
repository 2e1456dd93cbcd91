"""Resume continues the exact trajectory: 2N steps == N steps + resume to 2N (CPU, bitwise metrics).

The uninterrupted run is the demo's fp8_calibrated arm (tests/conftest.py ``demo_runs``: 4 steps,
checkpoints at 2 and 4); the interrupted one ran the same settings to ``trainer.max_steps=2`` (its last
checkpoint at step 2). The kill -9 variant (a run killed between checkpoints) is
tests/reliability/test_training_faults.py.
"""

import logging
import math
import re
import shutil

import pytest

from ._cli import demo_overrides, metrics, run_cli, strip_timing, train_in_process

ARM = "fp8_calibrated"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, demo_runs):
    """The demo arm's settings run to step 2 by the CLI (shared by the resume tests: copy before resuming)."""
    part = tmp_path_factory.mktemp("resume") / "part"
    run_cli(part, *demo_overrides(ARM), "trainer.max_steps=2", f"warmup.cache_dir={demo_runs.warmup_cache}")
    assert (part / "checkpoints" / "latest").read_text().strip() == "step_2"
    return part


def test_resume_is_exact(demo_runs, stopped, tmp_path):
    """Through the CLI: a run that ended at max_steps=2, resumed with max_steps=4, is the 4-step run."""
    part = tmp_path / "part"
    shutil.copytree(stopped, part)
    run_cli(part, *demo_overrides(ARM), "resume=true")
    a, b = strip_timing(metrics(demo_runs[ARM])), strip_timing(metrics(part))
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert a == b


def test_resume_switches_fp8_backend(demo_runs, stopped, tmp_path, caplog):
    """A run written by the emulation resumes on torch's FP8 GEMMs (fp8.backend=torch; CPU: tensorwise runs
    real FP8 GEMMs): same checkpoint keys, the step-2 rollout is the uninterrupted run's exactly (the rollout
    engine does not use the trainer's GEMMs, so it sees the restored weights and RNG streams), and training
    goes on with finite metrics within the FP8 noise of the emulated run. In this process (the CLI's
    prepare + fit): the CLI's own resume is test_resume_is_exact."""
    part = tmp_path / "part"
    shutil.copytree(stopped, part)
    caplog.set_level(logging.INFO)
    train_in_process(part, *demo_overrides(ARM), "resume=true", "fp8.backend=torch")
    # the tiny model's linears are multiples of 16: every converted linear runs torch's FP8 GEMM
    assert re.search(r"converted (\d+)/\1 linear layers .*backend=torch: \1 on torch FP8 GEMMs, 0 emulated",
                     caplog.text), caplog.text[-2000:]
    a, b = metrics(demo_runs[ARM]), metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    rollout_keys = [k for k in a[2] if k.startswith(("reward/", "rollout/", "response/"))]
    assert rollout_keys
    assert {k: a[2][k] for k in rollout_keys} == {k: b[2][k] for k in rollout_keys}
    for rec in b[2:]:
        assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float)), rec


def test_existing_run_is_never_overwritten_without_resume(demo_runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(demo_runs["bf16"], out)
    before = (out / "metrics.jsonl").read_bytes()
    proc = run_cli(out, *demo_overrides("bf16"), check=False)
    assert proc.returncode != 0
    assert "resume=true" in proc.stderr and "nothing was overwritten" in proc.stderr
    assert (out / "metrics.jsonl").read_bytes() == before


def test_resume_refuses_model_changes(demo_runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(demo_runs["bf16"], out)
    proc = run_cli(out, *demo_overrides("bf16"), "trainer.max_steps=5", "resume=true", "model.hidden_size=64",
                   "model.ffn_hidden_size=192", check=False)
    assert proc.returncode != 0
    assert "model.hidden_size: checkpoint=128 now=64" in proc.stderr
