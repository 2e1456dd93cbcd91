"""cluster_type=local: the same resolved config and training command, run here under torchrun."""

from ._launch import TINY, launch_cli, metrics_steps


def test_local_run_with_torchrun_and_relaunch_continues(tmp_path, warm_cache):
    base = tmp_path / "results"
    common = [f"base_results_dir={base}", "cluster_type=local", "rl=tiny_grpo_bf16", *TINY,
              f"rl.warmup.cache_dir={warm_cache}",
              "rl.parallel.tensor_model_parallel_size=1"]  # 2 ranks as DP=2 (the SLURM tests use TP=2)
    proc = launch_cli(*common, "rl.trainer.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    d = base / "tiny_grpo_bf16"
    assert "1 node x 2 tasks = 2 ranks (TP=1 x PP=1 x DP=2), CPU" in proc.stdout
    assert (d / "nemo-fp8rl-tiny_grpo_bf16_local.sh").is_file()
    assert metrics_steps(d) == [0, 1]
    assert (d / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert "rank 1 of 2 (torchrun)" in proc.stderr  # torchrun's variables set up the ranks

    # the same command again, with more steps: resume=true continues from the latest checkpoint
    proc = launch_cli(*common, "rl.trainer.max_steps=3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {d}/checkpoints/step_2" in proc.stderr
    assert metrics_steps(d) == [0, 1, 2]
    assert (d / "checkpoints" / "latest").read_text().strip() == "step_3"
