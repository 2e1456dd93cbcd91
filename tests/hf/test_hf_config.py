"""config.json -> ModelConfig, the model.hf_path conflict rule, and the errors for bad checkpoints."""

import dataclasses
import json
import shutil

import pytest

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.models.hf_config import (
    HFCheckpointError,
    hf_config_to_model_fields,
    model_config_to_hf_config,
    resolve_model_config,
)
from nemo_fp8rl.models.hf_load import HFCheckpoint, load_hf_state_dict

# The published config.json of Qwen3-8B and Llama-3.1-8B (legacy rope_theta / rope_scaling form).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def write_config(tmp_path, cfg, name="ckpt"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def load_preset(name, **kw):
    """A conf/model preset as a ModelConfig (the YAML holds only overrides)."""
    from pathlib import Path

    import yaml

    path = Path(__file__).resolve().parents[2] / "conf" / "model" / f"{name}.yaml"
    return ModelConfig(**{**yaml.safe_load(path.read_text()), **kw})


def test_published_configs_match_our_presets(tmp_path):
    """A published config.json and our preset of the same model give the same ModelConfig, so
    `model=qwen3_8b model.hf_path=...` is accepted (no conflicts) and equals `model.hf_path=...` alone."""
    for cfg, name in [(QWEN3_8B, "qwen3_8b"), (LLAMA31_8B, "llama3_8b")]:
        d = write_config(tmp_path, cfg, name)
        alone = resolve_model_config(ModelConfig(hf_path=str(d)))
        with_preset = resolve_model_config(load_preset(name, hf_path=str(d)))
        for k in ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "ffn_hidden_size", "rotary_base", "rope_scaling_factor", "norm_epsilon", "qk_layernorm",
                  "add_qkv_bias", "untie_embeddings_and_output_weights"):
            assert getattr(alone, k) == getattr(with_preset, k), (name, k)
    q = resolve_model_config(ModelConfig(hf_path=str(tmp_path / "qwen3_8b")))
    assert (q.name, q.num_query_groups, q.kv_channels, q.qk_layernorm, q.rotary_base) == ("qwen3", 8, 128, True, 1e6)
    ll = resolve_model_config(ModelConfig(hf_path=str(tmp_path / "llama3_8b")))
    assert (ll.rope_scaling_factor, ll.rotary_base, ll.norm_epsilon, ll.kv_channels) == (8.0, 500000.0, 1e-5, 128)
    assert resolve_model_config(q) == q  # idempotent


def test_conflicting_overrides_are_refused_with_every_key(tmp_path):
    d = write_config(tmp_path, QWEN3_8B)
    with pytest.raises(HFCheckpointError) as e:
        resolve_model_config(ModelConfig(hf_path=str(d), num_layers=2, hidden_size=256, qk_layernorm=True,
                                         num_query_groups=4))
    msg = str(e.value)
    assert "model.num_layers=2 (checkpoint: 36)" in msg
    assert "model.hidden_size=256 (checkpoint: 4096)" in msg
    assert "model.num_query_groups=4 (checkpoint: 8)" in msg
    assert "qk_layernorm" not in msg  # explicit and equal: fine
    # fields left at their defaults are filled; non-checkpoint fields are kept
    cfg = resolve_model_config(ModelConfig(hf_path=str(d), seq_length=1024, make_vocab_size_divisible_by=128))
    assert (cfg.num_layers, cfg.seq_length, cfg.make_vocab_size_divisible_by) == (36, 1024, 128)


def test_unchanged_without_hf_path():
    cfg = ModelConfig(num_layers=5)
    assert resolve_model_config(cfg) is cfg


def test_rope_parameters_form_of_transformers_5(tmp_path):
    new = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert hf_config_to_model_fields(new) == hf_config_to_model_fields(LLAMA31_8B)
    q = {k: v for k, v in QWEN3_8B.items() if k not in ("rope_theta", "rope_scaling")}
    q["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert hf_config_to_model_fields(q) == hf_config_to_model_fields(QWEN3_8B)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type='mistral'"),
    ({"architectures": ["Qwen3Model"]}, "only the causal LM Qwen3ForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}}, "high_freq_factor"),
    ({"use_sliding_window": True}, "use_sliding_window=true"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints are not supported"),
    ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
])
def test_unsupported_checkpoints_name_the_key(tmp_path, change, match):
    d = write_config(tmp_path, {**QWEN3_8B, **change})
    with pytest.raises(HFCheckpointError, match=match) as e:
        resolve_model_config(ModelConfig(hf_path=str(d)))
    assert str(d / "config.json") in str(e.value) or "model_type" in match


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(HFCheckpointError, match="is not a directory"):
        resolve_model_config(ModelConfig(hf_path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFCheckpointError, match="no config.json"):
        resolve_model_config(ModelConfig(hf_path=str(tmp_path / "empty")))
    d = write_config(tmp_path, QWEN3_8B)
    with pytest.raises(HFCheckpointError, match="no \\*.safetensors weights"):
        HFCheckpoint(d)
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(HFCheckpointError, match="convert them with transformers"):
        HFCheckpoint(d)
    bad = write_config(tmp_path, QWEN3_8B, "badjson")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="invalid JSON"):
        resolve_model_config(ModelConfig(hf_path=str(bad)))


def test_weights_that_do_not_match_config_json(checkpoints, tmp_path):
    src = checkpoints["qwen2"]  # sharded: model.safetensors.index.json + shards
    d = tmp_path / "q2"
    shutil.copytree(src, d)
    # config.json says 3 layers but the weights have 2
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(HFCheckpointError, match=r"tensors missing, e.g. \['model.layers.2"):
        load_hf_state_dict(d)
    # ... or a wider FFN than the tensors have: the shape error names the tensor and its shard file
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(HFCheckpointError, match=r"mlp.down_proj.weight in model-000\d\d-of-000\d\d.safetensors has "
                                                r"shape \(64, 96\), config.json implies \(64, 128\)"):
        load_hf_state_dict(d)
    # ... or 1 layer: the second layer's tensors are unexpected
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(HFCheckpointError, match="the architecture in config.json does not have, e.g. .'model.layers.1"):
        load_hf_state_dict(d)
    # an index that names a shard file which is not there
    (d / "config.json").write_text(json.dumps(cfg))
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(HFCheckpointError, match="lists shard files that are not in the directory"):
        load_hf_state_dict(d)


def test_load_into_actor_of_another_shape_is_refused(checkpoints):
    from nemo_fp8rl.config.model import ParallelConfig
    from nemo_fp8rl.models import build_actor, load_hf_weights

    cfg = resolve_model_config(ModelConfig(hf_path=str(checkpoints["llama"])))
    other = dataclasses.replace(cfg, hf_path=None, ffn_hidden_size=128)
    actor = build_actor(other, ParallelConfig(micro_batch_size=2), seed=0, lr=1e-3, device="cpu")
    with pytest.raises(HFCheckpointError, match="ffn_hidden_size: model 128 vs checkpoint 96"):
        load_hf_weights(actor, checkpoints["llama"])


def test_written_config_reads_back(tmp_path):
    for cfg in (QWEN3_8B, LLAMA31_8B):
        mc = resolve_model_config(ModelConfig(hf_path=str(write_config(tmp_path, cfg, cfg["model_type"]))))
        fresh = model_config_to_hf_config(mc, dtype="bfloat16")
        assert hf_config_to_model_fields(fresh) == hf_config_to_model_fields(cfg)
        kept = model_config_to_hf_config(mc, dtype="float32", base=cfg)
        assert kept["torch_dtype"] == "float32" and kept["eos_token_id"] == cfg["eos_token_id"]
