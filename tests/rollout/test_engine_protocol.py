"""The RolloutEngine protocol (rollout/base.py): every engine has its methods, and sleep / wake_up / close
behave as documented. The torch engine is exercised here; the vllm engine's behaviour is exercised on its
module-wide engine in test_vllm_engine.py (building vLLM takes ~30 s)."""

from __future__ import annotations

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import RolloutEngine, SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine
from nemo_fp8rl.rollout.vllm_engine import VllmEngine

from .conftest import CONFIGS, random_hf_weights

EOS, PAD = 2, 0
RAGGED = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13, 14], [1, 15, 3]]
PROTOCOL = ("update_weights", "generate", "sleep", "wake_up", "close")


@pytest.mark.parametrize("cls", [TorchRolloutEngine, VllmEngine])
def test_every_engine_class_has_the_protocol_methods(cls):
    """Structural: the class defines each method of RolloutEngine (no vLLM build needed for the vllm engine)."""
    assert issubclass(cls, RolloutEngine)
    for name in PROTOCOL:
        assert callable(getattr(cls, name, None)), name


def _engine(scheme: str = "off"):
    cfg = ModelConfig(**CONFIGS["qwen2"])
    eng = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=EOS, pad_id=PAD)
    eng.update_weights(random_hf_weights(cfg, seed=0, logit_scale=4.0))
    return eng


@pytest.mark.parametrize("scheme", ["off", "vllm_w8a8"])
def test_torch_engine_generates_the_same_after_sleep_and_wake_up(scheme):
    eng = _engine(scheme)
    assert isinstance(eng, RolloutEngine)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_on_eos=False)
    want = eng.generate(RAGGED, params, torch.Generator().manual_seed(3))
    assert eng.sleep() is False and eng.sleep() is False  # nothing to free between rollouts; idempotent
    assert eng.wake_up() is False and eng.wake_up() is False
    got = eng.generate(RAGGED, params, torch.Generator().manual_seed(3))
    for f in ("tokens", "mask", "rollout_logp", "response_lens", "finished"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_torch_engine_close_drops_the_weights_and_is_idempotent():
    eng = _engine()
    eng.close()
    assert eng.weights is None
    eng.close()  # a second close is fine
    assert eng.sleep() is False and eng.wake_up() is False
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(RAGGED, SamplingParams(max_new_tokens=2), torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="closed"):
        eng.update_weights(random_hf_weights(ModelConfig(**CONFIGS["qwen2"])))


def test_torch_engine_close_before_any_sync():
    """Closing an engine that never received weights (e.g. the run failed before its first step) is fine."""
    eng = get_rollout_engine("torch", ModelConfig(**CONFIGS["llama"]), fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    eng.close()
    eng.close()


def test_the_engine_registry_refuses_a_second_engine_under_a_taken_name():
    from nemo_fp8rl.rollout import register_rollout_engine, rollout_engine_names

    assert rollout_engine_names() == ["torch", "vllm"]
    with pytest.raises(ValueError, match="rollout engine 'torch' is already registered"):
        register_rollout_engine("torch")(lambda model_cfg, **kw: None)
    assert rollout_engine_names() == ["torch", "vllm"]
