"""The generated files against expected lines (no SLURM needed): sorted #SBATCH lines, exports, one srun,
the requeue decision; the resolved training config loads in the trainer's Hydra app unchanged."""

import os
import shlex
import subprocess
import sys

from ._launch import GPU_REQUIRED, launch_cli, plans


def _sbatch_block(text: str) -> list[str]:
    lines = text.splitlines()
    idx = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert idx == list(range(idx[0], idx[-1] + 1)), "the #SBATCH lines must form one block before any command"
    assert all(not line.strip() or line.startswith("#") for line in lines[:idx[0]])
    return [lines[i] for i in idx]


def _srun(text: str) -> list[str]:
    """The srun command of the script as tokens (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    (line,) = [ln for ln in joined.splitlines() if ln.startswith("srun ")]
    assert line.endswith(" &")
    return shlex.split(line[:-2])


def test_tiny_cpu_stage_script(tmp_path):
    from nemo_fp8rl.launcher import render_sbatch_script

    (plan,) = plans("rl=tiny_grpo_blockwise", f"base_results_dir={tmp_path}")
    d = tmp_path / "tiny_grpo_blockwise"
    text = render_sbatch_script(plan)
    assert text.startswith("#!/bin/bash\n")
    assert _sbatch_block(text) == [
        "#SBATCH --dependency=singleton",
        f"#SBATCH --error={d}/log-nemo-fp8rl-tiny_grpo_blockwise_%j.err",
        "#SBATCH --exclusive",
        "#SBATCH --job-name=nemo-fp8rl-tiny_grpo_blockwise",
        "#SBATCH --mem=0",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={d}/log-nemo-fp8rl-tiny_grpo_blockwise_%j.out",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@60",
        "#SBATCH --time=00:30:00",
    ]  # a CPU stage: no --gpus-per-node line; no partition/account when the cluster config has none
    lines = text.splitlines()
    for expected in (
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        "export PYTHONUNBUFFERED=1",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export TORCH_NCCL_AVOID_RECORD_STREAMS=1",
        "export NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0",  # blockwise: power-of-two scales, before TE is imported
        f"OUTPUT_DIR={d}",
        "MAX_STEPS=100",
        '    if scontrol requeue "$SLURM_JOB_ID"; then',
    ):
        assert expected in lines, expected
    assert _srun(text) == [
        "srun", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks-per-node=2",
        sys.executable, "-u", "-m", "nemo_fp8rl.train", f"--config-path={d}",
        "--config-name=nemo-fp8rl-tiny_grpo_blockwise_train_config",
    ]
    commands = [ln for ln in lines if not ln.lstrip().startswith("#")]
    assert sum(ln.startswith("srun ") for ln in commands) == 1
    assert not any("torchrun" in ln or "torch.distributed.run" in ln for ln in commands)  # ranks come from SLURM's variables
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_gpu_stage_script_with_cluster_settings_and_container(tmp_path):
    from nemo_fp8rl.launcher import render_sbatch_script

    (plan,) = plans(
        "rl=qwen2_5_32b_dapo_blockwise", f"base_results_dir={tmp_path}", *GPU_REQUIRED,
        "cluster.partition=batch", "cluster.account=llm_rl", 'cluster.nodelist="node[01-04]"',
        'container="nvcr.io#nvidia/nemo:25.07"', "container_mounts=[/lustre/models:/models]",
        'cluster.srun_args=["--mpi=pmix", "--cpu-bind none"]', "rl.run.dependency=afterok:1234",
        "+env_vars.NCCL_DEBUG=WARN", "env_vars.TORCH_NCCL_AVOID_RECORD_STREAMS=null",
    )
    d = tmp_path / "qwen2_5_32b_dapo_blockwise"
    job = "nemo-fp8rl-qwen2_5_32b_dapo_blockwise"
    text = render_sbatch_script(plan)
    assert _sbatch_block(text) == [
        "#SBATCH --account=llm_rl",
        "#SBATCH --dependency=afterok:1234",
        f"#SBATCH --error={d}/log-{job}_%j.err",
        "#SBATCH --exclusive",
        "#SBATCH --gpus-per-node=8",
        f"#SBATCH --job-name={job}",
        "#SBATCH --mem=0",
        "#SBATCH --nodelist=node[01-04]",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={d}/log-{job}_%j.out",
        "#SBATCH --partition=batch",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@900",
        "#SBATCH --time=04:00:00",
    ]
    assert _srun(text) == [
        "srun", "--kill-on-bad-exit=1", "--nodes=4", "--ntasks-per-node=8",
        "--container-image=nvcr.io#nvidia/nemo:25.07",
        f"--container-mounts=/lustre/models:/models,{tmp_path}:{tmp_path}", "--no-container-mount-home",
        "--mpi=pmix", "--cpu-bind", "none",
        "python", "-u", "-m", "nemo_fp8rl.train", f"--config-path={d}", f"--config-name={job}_train_config",
    ]
    exports = [ln for ln in text.splitlines() if ln.startswith("export ")]
    assert exports[2:] == ["export PYTHONUNBUFFERED=1", "export CUDA_DEVICE_MAX_CONNECTIONS=1",
                           "export NCCL_DEBUG=WARN",  # null values are skipped
                           "export NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0"]
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_recipe_env_follows_pow2_scales_and_yields_to_env_vars(tmp_path):
    from nemo_fp8rl.launcher import render_sbatch_script

    def exports(*overrides):
        (plan,) = plans("rl=tiny_grpo_blockwise", f"base_results_dir={tmp_path}", *overrides)
        return [ln for ln in render_sbatch_script(plan).splitlines() if ln.startswith("export NVTE_")]

    assert exports("+rl.fp8.pow2_scales=false") == ["export NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"]
    assert exports("+env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1") == ["export NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"]
    assert exports("rl.config_groups.fp8=tensorwise") == []


def test_resolved_training_config_is_what_the_trainer_loads(tmp_path):
    """The written <job>_train_config.yaml, composed by Hydra as nemo-fp8rl-train does, gives back the plan."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from nemo_fp8rl.validation import validate
    from nemo_fp8rl.launcher import write_stage
    from nemo_fp8rl.train import CONF_DIR, register_schema

    (plan,) = plans("rl=qwen3_8b_grpo_blockwise", f"base_results_dir={tmp_path}", *GPU_REQUIRED,
                    "rl.trainer.max_steps=123", "+rl.algorithm.eps_high=0.25", "launcher.dry_run=true")
    paths = write_stage(plan)
    assert paths["train_config"] == plan.train_config_path and paths["script"] == plan.submission_script_path
    assert plan.submission_script_path.stat().st_mode & 0o111  # executable
    register_schema()
    with initialize_config_dir(config_dir=str(plan.results_dir), version_base=None, job_name="train"):
        hydra_cfg = compose(config_name=plan.train_config_name, return_hydra_config=True).hydra
        cfg = compose(config_name=plan.train_config_name)
    assert hydra_cfg.run.dir == str(plan.results_dir) and hydra_cfg.output_subdir is None
    # Hydra's own settings are the trainer's (conf/config.yaml): same logging, no chdir
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None, job_name="train"):
        trainer_hydra = compose(config_name="config", return_hydra_config=True).hydra
    for key in ("job_logging", "hydra_logging", "output_subdir", "job.chdir"):
        assert OmegaConf.select(hydra_cfg, key) == OmegaConf.select(trainer_hydra, key), key
    loaded = validate(OmegaConf.to_object(cfg))
    assert loaded == plan.train
    assert (loaded.trainer.max_steps, loaded.algorithm.eps_high, loaded.resume) == (123, 0.25, True)
    assert loaded.output_dir == str(plan.results_dir)


def test_local_script_runs_the_same_command_under_torchrun(tmp_path):
    from nemo_fp8rl.launcher import render_local_script

    (plan,) = plans("rl=tiny_grpo_bf16", f"base_results_dir={tmp_path}", "cluster_type=local")
    d = tmp_path / "tiny_grpo_bf16"
    text = render_local_script(plan)
    (exec_line,) = [ln for ln in text.splitlines() if ln.startswith("exec ")]
    assert shlex.split(exec_line)[1:] == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        "-m", "nemo_fp8rl.train", f"--config-path={d}", "--config-name=nemo-fp8rl-tiny_grpo_bf16_train_config",
    ]
    assert "export PYTHONUNBUFFERED=1" in text.splitlines() and "#SBATCH" not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_dry_run_writes_and_submits_nothing(tmp_path):
    proc = launch_cli(f"base_results_dir={tmp_path}", "rl=qwen3_8b_grpo_bf16", *GPU_REQUIRED, "launcher.dry_run=true",
                      "+rl.trainer.profile.kind=nsys", "+rl.trainer.profile.ranks=[0,4]",  # + the nsys wrapper
                      console_script=True)  # the installed entry point
    assert proc.returncode == 0, proc.stderr
    d = tmp_path / "qwen3_8b_grpo_bf16"
    job = "nemo-fp8rl-qwen3_8b_grpo_bf16"
    assert sorted(p.name for p in d.iterdir()) == [f"{job}_nsys.sh", f"{job}_submission.sh", f"{job}_train_config.yaml"]
    assert f"nsys wrapper:      {d}/{job}_nsys.sh (ranks [0, 4] under nsys profile; reports in {d}/profile)" in proc.stdout
    out = proc.stdout
    assert "rl/qwen3_8b_grpo_bf16 -> job nemo-fp8rl-qwen3_8b_grpo_bf16: 1 node x 8 tasks = 8 ranks " \
           "(TP=4 x PP=1 x DP=2), 8 GPUs/node" in out
    assert f"dry run: nothing was started; start it with: sbatch {d}/{job}_submission.sh" in out
    assert "Submitted batch job" not in out


def _fake_nsys(tmp_path):
    """A stand-in for Nsight Systems (there is none on a CPU machine): it records its arguments and runs
    nothing, so the test sees exactly what the wrapper hands to ``nsys``."""
    fake = tmp_path / "bin" / "fake-nsys"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$NSYS_CALLED"\n')
    fake.chmod(0o755)
    return fake


def test_nsys_profile_wraps_the_listed_ranks_only(tmp_path):
    """trainer.profile.kind=nsys: srun starts every rank through <job>_nsys.sh, which puts `nsys profile`
    (capture range = the trainer's cudaProfilerStart/Stop) in front of the listed ranks only."""
    from nemo_fp8rl.launcher import render_sbatch_script, write_stage

    fake = _fake_nsys(tmp_path)
    (plan,) = plans("rl=qwen3_8b_grpo_bf16", f"base_results_dir={tmp_path}", *GPU_REQUIRED, "launcher.dry_run=true",
                    "+rl.trainer.profile.kind=nsys", "+rl.trainer.profile.start_step=5", "+rl.trainer.profile.end_step=6",
                    "+rl.trainer.profile.ranks=[4,0]", f"launcher.nsys={fake}", 'launcher.nsys_args=["--cuda-memory-usage=true"]')
    paths = write_stage(plan)
    wrapper = plan.nsys_wrapper_path
    assert paths["nsys_wrapper"] == wrapper and wrapper.stat().st_mode & 0o111 and plan.nsys_ranks == (0, 4)
    d = plan.results_dir
    assert _srun(render_sbatch_script(plan))[4:] == [
        "bash", str(wrapper), sys.executable, "-u", "-m", "nemo_fp8rl.train", f"--config-path={d}",
        f"--config-name={plan.train_config_name}"]
    subprocess.run(["bash", "-n", str(wrapper)], check=True)

    def rank(env: dict) -> tuple[str, list[str] | None]:
        called = tmp_path / "called"
        called.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(wrapper), "echo", "the command", "as is"], capture_output=True, text=True,
                              check=True, env={"PATH": "/usr/bin:/bin", "NSYS_CALLED": str(called), **env})
        return proc.stdout, called.read_text().splitlines() if called.exists() else None

    out, args = rank({"SLURM_PROCID": "4"})
    assert out == "" and args[:-4] == [
        "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--trace=cuda,nvtx,osrt",
        "--sample=none", "--cpuctxsw=none", "--cuda-memory-usage=true"]
    assert args[-4].startswith(f"--output={d}/profile/nsys_rank4_") and args[-3:] == ["echo", "the command", "as is"]
    assert (d / "profile").is_dir()
    assert rank({"SLURM_PROCID": "1"}) == ("the command as is\n", None)  # not listed: runs unwrapped
    # a missing nsys stops the profiled rank with the key to set, not bash's "command not found"
    fake.rename(fake.with_name("moved"))
    proc = subprocess.run(["bash", str(wrapper), "echo", "x"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "SLURM_PROCID": "0"})
    assert proc.returncode == 2 and f"rank 0: launcher.nsys={fake} is not a command on" in proc.stderr
    fake.with_name("moved").rename(fake)
    # torchrun's RANK wins over SLURM's, as in read_launch_env (a local launch inside an allocation)
    assert rank({"SLURM_PROCID": "0", "RANK": "3", "WORLD_SIZE": "8"}) == ("the command as is\n", None)
    assert rank({"SLURM_PROCID": "3", "RANK": "0", "WORLD_SIZE": "8"})[1][-4].startswith(
        f"--output={d}/profile/nsys_rank0_")


def test_nsys_profile_under_torchrun_wraps_each_rank(tmp_path):
    """cluster_type=local with kind=nsys: torchrun --no-python starts the wrapper per rank, with RANK set."""
    from nemo_fp8rl.launcher import write_stage
    from nemo_fp8rl.launcher.scripts import local_command

    fake = _fake_nsys(tmp_path)
    (plan,) = plans("rl=qwen3_8b_grpo_bf16", f"base_results_dir={tmp_path}", *GPU_REQUIRED, "cluster_type=local",
                    "launcher.dry_run=true", "+rl.trainer.profile.kind=nsys", "+rl.trainer.profile.ranks=[1]",
                    f"launcher.nsys={fake}")
    write_stage(plan)
    cmd = local_command(plan)
    train = [sys.executable, "-u", "-m", "nemo_fp8rl.train", f"--config-path={plan.results_dir}",
             f"--config-name={plan.train_config_name}"]
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=8"]
    assert cmd[6:] == ["--no-python", "bash", str(plan.nsys_wrapper_path), *train]
    # the same chain for real, with a command that prints its rank instead of training (no GPU here)
    real = cmd[:5] + ["--nproc-per-node=2"] + cmd[6:9] + [sys.executable, "-c", "import os; print('rank', os.environ['RANK'])"]
    called = tmp_path / "called"
    proc = subprocess.run(real, capture_output=True, text=True, timeout=120, env={**os.environ, "NSYS_CALLED": str(called)})
    assert proc.returncode == 0, proc.stderr
    assert "rank 0" in proc.stdout and "rank 1" not in proc.stdout  # rank 1 went to (fake) nsys instead
    args = called.read_text().splitlines()
    assert args[-3:] == [sys.executable, "-c", "import os; print('rank', os.environ['RANK'])"]
    assert args[-4].startswith(f"--output={plan.results_dir}/profile/nsys_rank1_")

