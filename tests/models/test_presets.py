"""conf/model presets: valid ModelConfig overrides, published sizes, workable TP/PP (comments on every key:
tests/test_yaml_comments.py)."""

import dataclasses
import re
import time
from pathlib import Path

import pytest
import yaml

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.models.gpt import padded_vocab_size
from nemo_fp8rl.models.hf_weights import count_parameters
from nemo_fp8rl.models.parallel import validate_layout

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
PRESETS = ["tiny", "smollm2_135m", "llama3_8b", "qwen3_8b", "qwen2_5_32b", "qwen3_32b"]
# Parameter counts of the published checkpoints (sum of the safetensors tensors' sizes).
PUBLISHED = {
    "llama3_8b": 8_030_261_248,
    "qwen3_8b": 8_190_735_360,
    "qwen2_5_32b": 32_763_876_352,
    "qwen3_32b": 32_762_123_264,
}
SUGGEST = re.compile(r"parallel\.tensor_model_parallel_size=(\d+) parallel\.pipeline_model_parallel_size=(\d+)")


def _load(name: str) -> tuple[dict, list[str]]:
    text = (CONF / f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}, text.splitlines()


def test_every_preset_exists():
    assert sorted(p.stem for p in CONF.glob("*.yaml")) == sorted(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_keys_are_modelconfig_fields(name):
    data, _ = _load(name)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(data) <= fields, set(data) - fields
    assert data.get("name") == name
    ModelConfig(**data)  # types accepted by the schema


@pytest.mark.parametrize("name", PRESETS)
def test_suggested_layout_divides_the_model(name):
    data, lines = _load(name)
    cfg = ModelConfig(**{"vocab_size": 16, **data})  # tiny takes its vocabulary from the task
    suggestions = [tuple(map(int, m.groups())) for line in lines for m in SUGGEST.finditer(line)]
    assert suggestions, f"{name}.yaml must name a starting TP/PP"
    for tp, pp in suggestions:
        validate_layout(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                        world_size=tp * pp * 2, model_cfg=cfg)
        assert padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp) % tp == 0


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_the_published_model(name):
    data, _ = _load(name)
    assert count_parameters(ModelConfig(**data)) == PUBLISHED[name]


def test_tiny_is_the_modelconfig_default_and_builds_in_seconds():
    from nemo_fp8rl.models import build_actor

    data, _ = _load("tiny")
    cfg = ModelConfig(**data, vocab_size=16)
    assert dataclasses.replace(cfg, name="tiny") == ModelConfig(vocab_size=16)
    t0 = time.perf_counter()
    actor = build_actor(cfg, ParallelConfig(), seed=0, lr=1e-4, device="cpu")
    assert time.perf_counter() - t0 < 20.0
    assert actor.num_parameters() == count_parameters(cfg)
