"""rollout/vllm_support.py: what the vllm engine can run, checked on a submit host without torch or vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.config.schema import ConfigError, TrainConfig
from nemo_fp8rl.rollout.model import ModelShape
from nemo_fp8rl.rollout.vllm_support import _Heads, check_rollout_config, check_vllm_supported

from .conftest import CONFIGS


def test_importing_it_loads_neither_torch_nor_vllm():
    code = ("import sys, nemo_fp8rl.rollout.vllm_support\n"
            "print(','.join(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm', 'numpy'})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"nemo_fp8rl.rollout.vllm_support imported {out.stdout.strip()}"


def test_vllm_checks_run_without_torch_on_the_submit_host():
    """check_vllm_supported with a model (the block-shape check included) does not need torch."""
    code = ("import sys\n"
            "from nemo_fp8rl.config.model import ModelConfig\n"
            "from nemo_fp8rl.rollout.vllm_support import check_vllm_supported\n"
            "m = ModelConfig(vocab_size=64, num_layers=1, hidden_size=256, num_attention_heads=2, num_query_groups=2,"
            " kv_channels=128, ffn_hidden_size=512)\n"
            "check_vllm_supported(fp8_scheme='vllm_block', tensor_parallel_size=2, installed=False, model_cfg=m)\n"
            "try:\n"
            "    check_vllm_supported(fp8_scheme='vllm_block', installed=False, model_cfg=ModelConfig(num_query_groups=2))\n"
            "except ValueError as e:\n"
            "    print('refused', 'k_proj/v_proj' in str(e))\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "True", "False"], out.stdout


@pytest.mark.parametrize("name", [*sorted(CONFIGS), "unset_as_zero"])
def test_shape_fields_are_the_rollout_models(name):
    cfg = ModelConfig(**CONFIGS.get(name, dict(CONFIGS["llama"], kv_channels=0, num_query_groups=0)))
    s, h = ModelShape.from_config(cfg), _Heads.from_config(cfg)
    assert (h.num_heads, h.num_groups, h.head_dim, h.ffn_hidden_size) == (
        s.num_heads, s.num_groups, s.head_dim, s.ffn_hidden_size)


@pytest.mark.parametrize("bad", [dict(normalization="LayerNorm"), dict(activation="gelu"),
                                 dict(num_attention_heads=4, num_query_groups=3), dict(hidden_size=66),
                                 dict(kv_channels=33)])
def test_models_the_rollout_engines_refuse_are_left_to_their_own_validation(bad):
    cfg = ModelConfig(**{**CONFIGS["llama"], **bad})
    with pytest.raises(ValueError):
        ModelShape.from_config(cfg)
    assert _Heads.from_config(cfg) is None
    check_vllm_supported(fp8_scheme="vllm_block", installed=False, model_cfg=cfg)  # no second message


def _cfg(**rollout) -> TrainConfig:
    cfg = TrainConfig()
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


@pytest.mark.parametrize("rollout, message", [
    (dict(engine="sglang"), r"rollout.engine='sglang' is not valid; choose one of \['torch', 'vllm'\]"),
    (dict(sync_bucket_mb=0), r"rollout.sync_bucket_mb=0 must be a number of MiB > 0"),
    (dict(sync_bucket_mb=float("nan")), r"rollout.sync_bucket_mb=nan must be"),
    (dict(tensor_parallel_size=0), r"rollout.tensor_parallel_size=0 must be an integer >= 1"),
    (dict(gpu_memory_utilization=1.5), r"rollout.gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    (dict(tensor_parallel_size=2), r"rollout.tensor_parallel_size=2 applies to rollout.engine=vllm"),
    (dict(engine="vllm", tensor_parallel_size=2), r"must divide the model-parallel ranks of a replica.* = 1 x 1 = 1"),
])
def test_check_rollout_config_names_the_key(rollout, message):
    with pytest.raises(ConfigError, match=message):
        check_rollout_config(_cfg(**rollout))


def test_check_rollout_config_vllm_refusals_are_config_errors():
    """The FP8-scheme refusals as validate() reports them are tested in test_vllm_engine.py
    (test_config_validation_accepts_fp8_rollout_with_vllm_on_a_host_without_gpu); here the ones it does not
    reach: the bf16 arm ignores the rollout scheme, and the rollout TP size must divide the heads."""
    cfg = _cfg(engine="vllm")
    check_rollout_config(cfg)  # FP8 off by default: fine without a GPU or vLLM
    cfg.rollout.fp8.scheme = "same_as_train"
    check_rollout_config(cfg)  # the bf16 arm: the rollout scheme is off, whatever it says
    cfg.fp8.recipe, cfg.rollout.fp8.scheme, cfg.parallel.tensor_model_parallel_size = "blockwise", "off", 8
    cfg.rollout.tensor_parallel_size = 8
    with pytest.raises(ConfigError, match="does not divide model.num_attention_heads=4"):
        check_rollout_config(cfg)
