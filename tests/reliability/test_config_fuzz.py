"""Config fuzzing: random override sets either start the run or fail with one clear, key-naming message.

Overrides go through the real Hydra composition of ``conf/`` (as the CLI does), then the schema
validation, then the trainer's construction (model build, parallel layout, task). Only ConfigError /
ValueError carrying the offending key, or Hydra's own override errors naming the key, are allowed:
never an AttributeError/TypeError/KeyError from deep inside the trainer.
"""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_fp8rl.config.schema import ConfigError

CHOICES = {
    "algorithm": ["grpo", "dapo", "ppo"],
    "fp8": ["off", "delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"],
    "calibration": ["off", "paper", "measure"],
    "algorithm.eps_low": ["-0.1", "0.0", "0.2", "0.99", "1.0", "2"],
    "algorithm.eps_high": ["-1", "0", "0.28", "5"],
    "algorithm.group_size": ["0", "1", "2", "4", "abc"],
    "algorithm.prompts_per_step": ["0", "1", "3", "4"],
    "algorithm.minibatches_per_step": ["0", "1", "2", "3", "8"],
    "algorithm.dual_clip": ["null", "0.5", "3.0"],
    "algorithm.agg_mode": ["token-mean", "seq-mean-token-sum-norm", "bogus"],
    "algorithm.rollout_correction": ["tis", "icepop", "none", "bogus"],
    "algorithm.old_logprobs": ["recompute", "rollout", "cached"],
    "algorithm.kl_coef": ["-0.1", "0.0", "0.05"],
    "fp8.recipe": ["nvfp4", "bf16_with_mxfp8_mixed"],
    "fp8.fp8_format": ["e4m3", "hybrid", "e3m4"],
    "fp8.first_last_layers_bf16": ["true", "false"],
    "calibration.interval": ["0", "1", "20"],
    "calibration.ema": ["-0.5", "0", "0.99", "1.0"],
    "calibration.upper_mode": ["balance", "quantile", "proportional", "fixed", "bogus"],
    "calibration.lower_min": ["0.1", "0.9"],
    "rollout.temperature": ["0", "1.0", "-1"],
    "rollout.top_p": ["0", "0.5", "1.5"],
    "rollout.max_new_tokens": ["0", "6"],
    "rollout.fp8.scheme": ["off", "vllm_w8a8", "vllm_block", "same_as_train", "int4"],
    "parallel.tensor_model_parallel_size": ["1", "2", "3"],
    "parallel.pipeline_model_parallel_size": ["1", "2"],
    "parallel.micro_batch_size": ["0", "4"],
    "optim.lr": ["1e-4", "0", "-1"],
    "model.num_layers": ["1", "2", "3"],
    "model.num_query_groups": ["null", "1", "2", "3"],
    "task.digits": ["0", "2", "3", "12"],
    "trainer.max_steps": ["-1", "0", "2"],
    "logger.progress": ["auto", "fancy"],
}
KEYS = sorted(CHOICES)


@st.composite
def override_sets(draw):
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
    return [f"{k}={draw(st.sampled_from(CHOICES[k]))}" for k in keys]


@pytest.fixture(scope="module")
def compose():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_fp8rl.train import CONF_DIR, register_schema

    register_schema()
    GlobalHydra.instance().clear()
    ctx = initialize_config_dir(config_dir=CONF_DIR, version_base=None)
    ctx.__enter__()
    yield lambda overrides: hydra_compose("config", overrides=overrides)
    ctx.__exit__(None, None, None)
    GlobalHydra.instance().clear()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=override_sets())
def test_fuzzed_overrides_start_or_fail_clearly(compose, tmp_path_factory, close_trainer, overrides):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from nemo_fp8rl.train import to_train_config
    from nemo_fp8rl.trainer import RLTrainer

    close_trainer.check()  # no earlier example left a trainer open
    out = tmp_path_factory.mktemp("fuzz")
    keys = [o.split("=", 1)[0] for o in overrides]
    try:
        dict_cfg = compose(overrides + [f"output_dir={out}", "warmup.steps=0", "logger.tensorboard=false"])
    except (HydraException, OmegaConfBaseException) as e:  # Hydra's one-line override error
        assert any(k in str(e) or k.split(".")[-1] in str(e) for k in keys), str(e)
        return
    try:
        cfg = to_train_config(dict_cfg)
        trainer = RLTrainer(cfg)  # the run starts: model, rollout engine, task, calibration
        try:
            trainer.check_run_dir()
        finally:  # built, never fit: its signal handlers and task are torn down here (the fixture checks)
            close_trainer(trainer)
    except (ConfigError, ValueError) as e:
        msg = str(e)
        named = re.findall(r"[a-z_0-9]+\.[a-z_0-9.]+", msg)
        assert named, f"message names no config key: {msg}"
        assert "\n" not in msg.strip() or len(msg) < 600
