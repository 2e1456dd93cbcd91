"""Resume continues the exact trajectory: 2N steps == N steps + resume to 2N (CPU, bitwise metrics)."""

from ._cli import metrics, run_cli, strip_timing

ARM = ["fp8=tensorwise", "calibration=paper", "calibration.interval=2", "calibration.min_tokens=4",
       "algorithm.old_logprobs=rollout"]


def test_resume_is_exact(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_cli(full, *ARM, "trainer.max_steps=4", "trainer.checkpoint_interval=2")
    run_cli(part, *ARM, "trainer.max_steps=2", "trainer.checkpoint_interval=2")
    assert (part / "checkpoints" / "latest").read_text().strip() == "step_2"
    run_cli(part, *ARM, "trainer.max_steps=4", "trainer.checkpoint_interval=2", "resume=true")
    a, b = strip_timing(metrics(full)), strip_timing(metrics(part))
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert a == b


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
