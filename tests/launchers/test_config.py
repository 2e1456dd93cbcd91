"""Launcher config: shipped stages resolve to the intended jobs, overrides reach the training config,
and bad input stops with one message naming the key before anything is written or submitted."""

from pathlib import Path

import pytest

from nemo_fp8rl.launcher import LaunchError, parse_time_limit
from nemo_fp8rl.resources import checkout_dir, conf_dir, default_launcher_scripts_dir, launcher_conf_dir, shown_path

from ._launch import GPU_REQUIRED, REPO, launch_cli, plans

CONF = REPO / "launchers" / "conf"
STAGES = sorted(p.stem for p in (CONF / "rl").glob("*.yaml"))


# Every key of these YAMLs has a comment: tests/test_yaml_comments.py (one check for all shipped YAML).


def test_the_shipped_stages_are_there():
    # tiny CPU, Qwen3-8B GRPO, Qwen2.5-32B DAPO: FP8 + calibration and a BF16 baseline of each; the FP8 KV-cache
    # variant (the whole pipeline in FP8) of the tiny and the Qwen3-8B stage
    assert STAGES == ["qwen2_5_32b_dapo_bf16", "qwen2_5_32b_dapo_blockwise", "qwen3_8b_grpo_bf16",
                      "qwen3_8b_grpo_blockwise", "qwen3_8b_grpo_blockwise_kvfp8", "tiny_grpo_bf16",
                      "tiny_grpo_blockwise", "tiny_grpo_blockwise_kvfp8"]


# stage -> (nodes, tasks/node, gpus/node, TP, PP, DP, algorithm, model preset, fp8 recipe)
SHAPES = {
    "tiny_grpo_blockwise": (1, 2, 0, 2, 1, 1, "grpo", "tiny", "blockwise"),
    "tiny_grpo_bf16": (1, 2, 0, 2, 1, 1, "grpo", "tiny", None),
    "qwen3_8b_grpo_blockwise": (1, 8, 8, 4, 1, 2, "grpo", "qwen3_8b", "blockwise"),
    "qwen3_8b_grpo_blockwise_kvfp8": (1, 8, 8, 4, 1, 2, "grpo", "qwen3_8b", "blockwise"),
    "tiny_grpo_blockwise_kvfp8": (1, 2, 0, 2, 1, 1, "grpo", "tiny", "blockwise"),
    "qwen3_8b_grpo_bf16": (1, 8, 8, 4, 1, 2, "grpo", "qwen3_8b", None),
    "qwen2_5_32b_dapo_blockwise": (4, 8, 8, 8, 2, 2, "dapo", "qwen2_5_32b", "blockwise"),
    "qwen2_5_32b_dapo_bf16": (4, 8, 8, 8, 2, 2, "dapo", "qwen2_5_32b", None),
}


@pytest.mark.parametrize("stage", sorted(SHAPES))
def test_each_stage_plans_its_job(stage, tmp_path):
    extra = [] if stage.startswith("tiny") else GPU_REQUIRED
    (plan,) = plans(f"rl={stage}", f"base_results_dir={tmp_path}", *extra)
    nodes, tasks, gpus, tp, pp, dp, algo, model, recipe = SHAPES[stage]
    assert (plan.run.nodes, plan.run.ntasks_per_node, plan.run.gpus_per_node) == (nodes, tasks, gpus)
    assert (plan.tp, plan.pp, plan.dp, plan.world_size) == (tp, pp, dp, nodes * tasks)
    t = plan.train
    assert (t.algorithm.name, t.model.name, t.fp8.recipe) == (algo, model, recipe)
    # FP8 stages calibrate as in the paper; BF16 baselines have nothing to calibrate
    assert t.calibration.enabled == (recipe is not None)
    assert plan.results_dir == tmp_path / stage and t.output_dir == str(tmp_path / stage) and t.resume is True
    assert plan.job_name == f"nemo-fp8rl-{stage}"
    if stage.startswith("qwen"):
        assert t.model.hf_path == "/models/ckpt" and t.task.name == "math_jsonl" and t.task.path == "/data/math.jsonl"
        assert t.model.params_dtype == "bfloat16" and t.warmup.steps == 0 and t.parallel.sequence_parallel
        # vLLM generates, each GPU its share of the replica's batch, asleep while training
        assert t.rollout.engine == "vllm" and t.rollout.split_prompts is None and t.rollout.enable_sleep
        assert plan.memory is not None and plan.memory.fits and plan.memory.rollout.sleeps
        # 32B: one engine per 2 GPUs (half a model each), 8B: one per GPU
        assert t.rollout.tensor_parallel_size == (2 if "32b" in stage else 1)
    if stage == "qwen2_5_32b_dapo_blockwise":
        assert (t.algorithm.eps_high, t.algorithm.dynamic_sampling, t.rollout.fp8.scheme) == (0.28, True, "vllm_block")
    # the FP8 KV variants differ from their stage only by the rollout's KV cache (and edge layers on GPU)
    f = t.rollout.fp8
    assert (f.kv_cache, f.kv_scales) == (("e4m3", "calibrated") if stage.endswith("_kvfp8") else ("off", "static"))
    if stage == "qwen3_8b_grpo_blockwise_kvfp8":
        (base,) = plans("rl=qwen3_8b_grpo_blockwise", f"base_results_dir={tmp_path}", *extra)
        assert (f.num_layers_at_start_in_bf16, f.num_layers_at_end_in_bf16) == (1, 1)
        assert plan.memory.rollout.kv_cache == "e4m3"
        assert plan.memory.rollout.kv_per_sequence < 0.6 * base.memory.rollout.kv_per_sequence


def test_a_whole_bf16_32b_engine_per_gpu_is_refused_on_80gb_gpus_naming_why(tmp_path):
    """The BF16 32B stage at rollout.tensor_parallel_size=1: its vLLM engine would hold the whole BF16 model
    (61 GiB) on each GPU; the plan refuses an H100 before anything is written, saying that training fits
    and the engine does not, and what to do; an H200 takes it."""
    one = ["rl.rollout.tensor_parallel_size=1", "rl.rollout.gpu_memory_utilization=0.6"]
    with pytest.raises(LaunchError) as e:
        plans("rl=qwen2_5_32b_dapo_bf16", f"base_results_dir={tmp_path}", *GPU_REQUIRED, *one)
    msg = str(e.value)
    assert "does not fit h100" in msg and "training fits, the rollout engine does not" in msg, msg
    assert "+launcher.memory_plan=h200" in msg and not (tmp_path / "qwen2_5_32b_dapo_bf16").exists()
    (plan,) = plans("rl=qwen2_5_32b_dapo_bf16", f"base_results_dir={tmp_path}", *GPU_REQUIRED, *one,
                    "+launcher.memory_plan=h200")
    assert plan.memory.fits


def test_overrides_flow_into_the_training_config(tmp_path):
    (plan,) = plans(
        "rl=tiny_grpo_blockwise", f"base_results_dir={tmp_path}",
        "rl.trainer.max_steps=7",                 # a key the stage lists
        "+rl.optim.lr=3e-5",                      # a key it does not list: added with +
        "rl.config_groups.fp8=mxfp8",             # another training config group
        "rl.config_groups.calibration=measure",
        "rl.run.name=my_run", "rl.seed=5",
    )
    t = plan.train
    assert t.trainer.max_steps == 7 and t.optim.lr == 3e-5 and t.seed == 5
    assert t.fp8.recipe == "mxfp8" and t.calibration.enabled and not t.calibration.apply
    # untouched keys keep the stage's values, then the group presets, then the schema defaults
    assert t.trainer.checkpoint_interval == 10 and t.algorithm.eps_low == 0.2 and t.optim.weight_decay == 0.0
    assert plan.results_dir == tmp_path / "my_run" and plan.job_name == "nemo-fp8rl-my_run"
    assert t.warmup.cache_dir == str(tmp_path / ".warmup_cache")


def test_relative_results_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (plan,) = plans("rl=tiny_grpo_bf16", "base_results_dir=runs/launch")
    assert plan.results_dir == tmp_path / "runs" / "launch" / "tiny_grpo_bf16"


def test_checkout_defaults_and_the_paths_messages_name():
    # wheel installs (no checkout): tests/packaging/test_wheel_install.py
    assert checkout_dir() == REPO
    assert default_launcher_scripts_dir() == REPO / "launchers"
    (plan,) = plans("rl=tiny_grpo_bf16")  # no base_results_dir: launcher_scripts_path's results/
    assert plan.results_dir == REPO / "launchers" / "results" / "tiny_grpo_bf16"
    assert shown_path(launcher_conf_dir() / "rl" / "x.yaml") == "nemo_fp8rl/launcher/conf/rl/x.yaml"
    assert shown_path(conf_dir() / "fp8") == "nemo_fp8rl/conf/fp8"
    assert (REPO / shown_path(conf_dir() / "config.yaml")).is_file()
    with pytest.raises(ValueError, match="not inside the package directory"):
        shown_path(REPO / "README.md")


def test_time_limit_forms():
    assert parse_time_limit(30) == 1800
    assert parse_time_limit("45") == 2700
    assert parse_time_limit("10:30") == 630
    assert parse_time_limit("04:00:00") == 14400
    assert parse_time_limit("1-00") == 86400
    assert parse_time_limit("1-02:03") == 86400 + 2 * 3600 + 3 * 60
    assert parse_time_limit("2-00:00:10") == 2 * 86400 + 10
    for bad in ("UNLIMITED", "1h", "", None, True, 0, "00:00:00"):
        with pytest.raises(LaunchError, match="run.time_limit"):
            parse_time_limit(bad)


BAD = [
    # (overrides, words the one message must contain)
    (["rl=qwen3_8b_grpo_blockwise"],
     ["missing required key(s)", "rl.model.hf_path", "rl.task.path",
      "(from nemo_fp8rl/launcher/conf/rl/qwen3_8b_grpo_blockwise.yaml)"]),
    (["stages=[rl,sft]"], ["stages: unknown stage 'sft'", "['rl']"]),
    (["stages=[]"], ["stages=[]", "non-empty"]),
    (["rl.run.ntasks_per_node=3"],
     ["rl.run.nodes=1 x rl.run.ntasks_per_node=3 = 3 processes", "rl.parallel.tensor_model_parallel_size (2)"]),
    (["rl.run.nodes=2", "rl.parallel.tensor_model_parallel_size=1", "rl.algorithm.prompts_per_step=6"],
     ["DP = 4 / (TP=1 x PP=1) = 4", "rl.algorithm.prompts_per_step=6"]),
    (["rl.parallel.pipeline_model_parallel_size=3"],  # 2 ranks, TP=2 x PP=3 = 6
     ["= 2 processes", "rl.parallel.pipeline_model_parallel_size (3)"]),
    (["rl.parallel.pipeline_model_parallel_size=2"],  # the schema: 3 layers do not split in 2 stages
     ["tiny_grpo_blockwise.yaml", "rl.parallel.pipeline_model_parallel_size=2 must divide rl.model.num_layers=3"]),
    (["rl.run.time_limit=soon"], ["rl.run.time_limit='soon'"]),
    (["rl.run.signal_time=1800"], ["rl.run.signal_time=1800s", "rl.run.time_limit"]),
    (["rl.run.nodes=0"], ["rl.run.nodes=0 must be an integer >= 1"]),
    (["rl.run.name=null"], ["rl.run.name is required"]),
    (["rl.run.name=a/b"], ["rl.run.name='a/b'"]),
    (["+rl.run.nodez=2"], ["rl.run: unknown key(s) ['nodez']"]),
    (["+rl.output_dir=/tmp/x"], ["rl.output_dir cannot be set", "rl.run.results_dir"]),
    (["+rl.resume=false"], ["rl.resume cannot be set", "resume=true"]),
    (["+rl.trainer.max_stepz=5"], ["rl.trainer.max_stepz", "Key 'max_stepz' not in 'TrainerConfig'",
                                   "nemo_fp8rl/config/schema.py"]),
    (["rl.trainer.max_steps=many"], ["rl.trainer.max_steps", "'many'", "Integer"]),
    (["+rl.algorithm.eps_low=1.5"], ["rl.algorithm.eps_low=1.5 must be in (0, 1)", "tiny_grpo_blockwise.yaml"]),
    (["rl.config_groups.fp8=fp4"],
     ["rl.config_groups.fp8=fp4: there is no nemo_fp8rl/conf/fp8/fp4.yaml;", "'blockwise'"]),
    (["+rl.config_groups.optimizer=adam"],
     ["rl.config_groups.optimizer: nemo_fp8rl/conf/ has no config group 'optimizer'"]),
    (["rl.config_groups.fp8=off"], ["calibration is on but training FP8 is off"]),
    (["cluster_type=k8s"], ["cluster_type='k8s'", "['slurm', 'local']"]),
    (["cluster.partition=a b"], ["cluster.partition='a b'", "whitespace"]),
    (["+cluster.gpu_per_node=8"], ["cluster: unknown key(s) ['gpu_per_node']"]),
    (["+env_vars.BAD-NAME=x"], ["env_vars.BAD-NAME", "not a valid environment variable name"]),
    (["rl=qwen3_8b_grpo_blockwise", *GPU_REQUIRED, "rl.run.ntasks_per_node=4"],
     ["rl.run.ntasks_per_node=4", "rl.run.gpus_per_node=8", "one task per GPU"]),
    (["rl=qwen2_5_32b_dapo_blockwise", *GPU_REQUIRED, "rl.run.nodes=3"],
     ["rl.run.nodes=3 x rl.run.ntasks_per_node=8 = 24 processes", "16"]),
    (["+rl.trainer.profile.kind=nsys"], ["rl.trainer.profile.kind=nsys needs a GPU stage", "kind=torch"]),
    (["+rl.trainer.profile.kind=torch", "+rl.trainer.profile.ranks=[0,2]"],
     ["rl.trainer.profile.ranks=[0, 2]: the job has 2 rank(s)", "[2] would profile nothing"]),
    (["launcher.nsys=my nsys"], ["launcher.nsys='my nsys'", "without spaces"]),
    (["launcher.nsys_args=[trace]"], ["launcher.nsys_args=['trace']", "nsys profile options"]),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_clear_error(overrides, words, tmp_path):
    with pytest.raises(LaunchError) as e:
        plans(f"base_results_dir={tmp_path}", *overrides)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_input_on_the_command_line_exits_2_before_writing_anything(tmp_path):
    base = tmp_path / "results"
    proc = launch_cli(f"base_results_dir={base}", "rl.run.ntasks_per_node=3")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("nemo-fp8rl-launch: invalid launch config: rl.run.nodes=1 x rl.run.ntasks_per_node=3")
    assert "Traceback" not in proc.stderr and "Submitted" not in proc.stdout
    assert not base.exists()  # nothing written, nothing submitted

    proc = launch_cli(f"base_results_dir={base}", "rl=tiny_fp4")  # a stage config that does not exist
    assert proc.returncode == 2
    assert "rl=tiny_fp4: there is no nemo_fp8rl/launcher/conf/rl/tiny_fp4.yaml; choose one of [" in proc.stderr
    assert "'tiny_grpo_blockwise'" in proc.stderr and not base.exists()

    proc = launch_cli(f"base_results_dir={base}", "rl=qwen2_5_32b_dapo_blockwise")
    assert proc.returncode == 2 and "rl.model.hf_path" in proc.stderr and "rl.task.path" in proc.stderr
    assert not base.exists()


def test_container_mounts_the_results_and_uses_the_image_python(tmp_path):
    (plan,) = plans("rl=qwen3_8b_grpo_blockwise", f"base_results_dir={tmp_path}", *GPU_REQUIRED,
                    'container="nvcr.io#nvidia/nemo:25.07"', "container_mounts=[/lustre/data:/data]")
    assert plan.container == "nvcr.io#nvidia/nemo:25.07"
    assert plan.container_mounts == ("/lustre/data:/data", f"{tmp_path}:{tmp_path}")
    assert plan.python == "python"
    (host,) = plans("rl=tiny_grpo_bf16", f"base_results_dir={tmp_path}")
    import sys

    assert host.container is None and host.python == sys.executable
    assert Path(host.python).is_file()


QWEN3_8B_CONFIG = {  # the published Qwen/Qwen3-8B config.json (the keys that shape the model)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rope_theta": 1000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def test_a_readable_checkpoint_is_checked_before_submission(tmp_path):
    import json

    ckpt = tmp_path / "Qwen3-8B"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    base = [f"base_results_dir={tmp_path / 'r'}", "rl=qwen3_8b_grpo_blockwise", f"rl.model.hf_path={ckpt}",
            "rl.task.path=/data/math.jsonl"]
    (plan,) = plans(*base)
    assert plan.train.model.hf_path == str(ckpt) and (plan.tp, plan.dp) == (4, 2)
    # a checkpoint that is not the preset's model: refused here, not after the queue wait
    (ckpt / "config.json").write_text(json.dumps(dict(QWEN3_8B_CONFIG, num_hidden_layers=28)))
    with pytest.raises(LaunchError) as e:
        plans(*base)
    assert f"rl.model.hf_path={str(ckpt)!r}" in str(e.value) and "config.json" in str(e.value)
    assert "rl.model.num_layers=36 (checkpoint: 28)" in str(e.value)


def test_launcher_package_imports_no_hydra_and_nothing_heavy():
    """docs/design.md, "Layout": only the CLI entry points import Hydra; importing the launcher is cheap."""
    import subprocess
    import sys

    code = ("import sys, nemo_fp8rl.launcher\n"
            "print(','.join(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'hydra', 'omegaconf', 'torch', 'megatron'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
