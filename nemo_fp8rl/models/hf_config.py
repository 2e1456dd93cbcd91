"""Hugging Face ``config.json`` <-> :class:`~nemo_fp8rl.config.model.ModelConfig`: Llama, Qwen2/2.5, Qwen3.

The one mapping between a checkpoint's shape and ours, used by the loader (:mod:`nemo_fp8rl.models.hf_load`),
the exporter (:mod:`nemo_fp8rl.models.hf_save`), the rollout engines and the launcher's memory plan. It
reads JSON only: no torch, no transformers, no weights.

:func:`resolve_model_config` reads ``config.json`` and fills ``ModelConfig``:

===================================  ==============================================================
config.json                          ModelConfig
===================================  ==============================================================
vocab_size                           vocab_size (the embedding rows; >= the tokenizer's size)
num_hidden_layers                    num_layers
hidden_size                          hidden_size
num_attention_heads                  num_attention_heads
num_key_value_heads (GQA)            num_query_groups
head_dim (else hidden / heads)       kv_channels
intermediate_size                    ffn_hidden_size
rope_theta (or rope_parameters)      rotary_base
rope_scaling {rope_type: llama3}     rope_scaling_factor (megatron's Llama-3.1 scaling: low/high
                                     frequency factors 1 and 4, original context 8192 - the only
                                     values megatron implements; anything else is refused)
rms_norm_eps                         norm_epsilon
tie_word_embeddings                  untie_embeddings_and_output_weights = not tie_word_embeddings
model_type qwen2                     add_qkv_bias = True (q/k/v biases, none on o_proj)
model_type qwen3                     qk_layernorm = True (per-head RMSNorm on q and k before RoPE)
===================================  ==============================================================

The conflict rule: a field whose value differs from the ``ModelConfig`` dataclass default counts
as *explicitly set*. Explicit values must equal the checkpoint's (else :class:`HFCheckpointError`
lists every differing key with both values); fields at their defaults are filled from config.json.
So ``model.hf_path=...`` alone is enough, a preset of the same model (``model=qwen3_8b``) is
accepted, and ``model.num_layers=2`` against a 36-layer checkpoint is refused. (An explicit value
that equals the dataclass default cannot be told from "not set"; it is overridden silently.)
``seq_length`` is the RL budget, not a checkpoint property: it stays as configured (a warning when
it exceeds ``max_position_embeddings``). Refused with the key to blame: other architectures,
sliding-window attention, other RoPE scalings, attention/MLP biases Llama-style (megatron's
``add_bias_linear`` would put one on every linear), activations other than SiLU, quantized
checkpoints.

The other direction, :func:`model_config_to_hf_config`, writes the ``config.json`` of an exported
policy (or of the rollout engine's vLLM model directory). Nothing here downloads: ``hf_path`` is a
local directory (or ``registry:NAME``, fetched by :mod:`nemo_fp8rl.models.registry`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.config.schema import ConfigError

log = logging.getLogger(__name__)

#: model_type -> the transformers class its checkpoints name in ``architectures``.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

#: ModelConfig fields that config.json determines (the conflict rule applies to these).
CHECKPOINT_FIELDS = (
    "vocab_size", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "rotary_base", "rope_scaling_factor", "normalization", "norm_epsilon", "activation",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
)

# Megatron's Llama-3.1 RoPE scaling has these constants built in (RotaryEmbedding._apply_scaling).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class HFCheckpointError(ConfigError):
    """A Hugging Face checkpoint directory that cannot be used: the message names the file or key and the fix."""


def read_hf_config(path: str | os.PathLike) -> dict:
    """``config.json`` of a local checkpoint directory, checked to be a supported architecture.

    Raises:
        HFCheckpointError: no such directory / config.json, invalid JSON, or an architecture other than
            Llama, Qwen2/2.5, Qwen3 (dense causal LMs).
    """
    d = Path(path)
    if not d.is_dir():
        raise HFCheckpointError(
            f"model.hf_path={str(path)!r} is not a directory; give a local Hugging Face checkpoint directory "
            "(config.json + *.safetensors). Nothing is downloaded: copy the model there first"
        )
    f = d / "config.json"
    if not f.is_file():
        raise HFCheckpointError(f"{f}: no config.json in model.hf_path; is this a Hugging Face checkpoint directory?")
    try:
        config_json = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{f}: invalid JSON ({e.msg} at line {e.lineno})") from None
    mt = config_json.get("model_type")
    if mt not in SUPPORTED_ARCHITECTURES:
        raise HFCheckpointError(
            f"{f}: model_type={mt!r} (architectures={config_json.get('architectures')}) is not supported; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)} ({', '.join(SUPPORTED_ARCHITECTURES.values())})"
        )
    archs = config_json.get("architectures") or [SUPPORTED_ARCHITECTURES[mt]]
    if SUPPORTED_ARCHITECTURES[mt] not in archs:
        raise HFCheckpointError(
            f"{f}: architectures={archs}; only the causal LM {SUPPORTED_ARCHITECTURES[mt]} of model_type {mt!r} "
            "is supported (a checkpoint of the bare model or another head has different tensor names)"
        )
    return config_json


def _rope(config_json: dict, where: str) -> tuple[float, float | None]:
    """(rope theta, Llama-3.1 scaling factor or None) from the legacy keys or transformers 5's rope_parameters."""
    params = config_json.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form
    scaling = config_json.get("rope_scaling")
    theta = config_json.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if theta is None:
        theta = 10000.0  # the transformers default for all three architectures
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFCheckpointError(
            f"{where}: rope_scaling type {kind!r} is not supported (megatron implements Llama-3.1 'llama3' "
            "scaling only); use a checkpoint without rope_scaling or remove it from config.json if the "
            "context you train on fits the original one"
        )
    bad = {k: scaling.get(k) for k, v in _LLAMA3_ROPE.items() if k in scaling and float(scaling[k]) != v}
    if bad:
        raise HFCheckpointError(
            f"{where}: llama3 rope_scaling with {bad}; megatron's Llama-3.1 scaling is fixed at {_LLAMA3_ROPE}"
        )
    return float(theta), float(scaling["factor"])


def hf_config_to_model_fields(config_json: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The :data:`CHECKPOINT_FIELDS` of ``ModelConfig`` that ``config_json`` (a parsed config.json) implies.

    Raises:
        HFCheckpointError: a feature megatron's GPT (as we build it) does not reproduce, naming the key.
    """
    mt = config_json.get("model_type")
    if mt not in SUPPORTED_ARCHITECTURES:
        raise HFCheckpointError(f"{where}: model_type={mt!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")

    def need(key):
        if key not in config_json or config_json[key] is None:
            raise HFCheckpointError(f"{where}: required key {key!r} is missing")
        return config_json[key]

    if config_json.get("quantization_config"):
        raise HFCheckpointError(
            f"{where}: quantization_config={config_json['quantization_config'].get('quant_method', '?')!r}: quantized "
            "checkpoints are not supported; start from the BF16/FP32 checkpoint (training FP8 comes from fp8=...)"
        )
    act = config_json.get("hidden_act", "silu")
    if act != "silu":
        raise HFCheckpointError(f"{where}: hidden_act={act!r}; only SiLU (SwiGLU MLP) is supported")
    if config_json.get("use_sliding_window"):
        raise HFCheckpointError(
            f"{where}: use_sliding_window=true; sliding-window attention is not supported (set it to false "
            "if sequences are shorter than sliding_window)"
        )
    if config_json.get("attention_bias") or config_json.get("mlp_bias"):
        raise HFCheckpointError(
            f"{where}: attention_bias={config_json.get('attention_bias')} mlp_bias={config_json.get('mlp_bias')}: biases on "
            "o_proj/MLP are not supported (Qwen2's q/k/v biases are)"
        )
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = config_json.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise HFCheckpointError(f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                                    "and head_dim is not given")
        head_dim = hidden // heads
    theta, scaling = _rope(config_json, where)
    kv = config_json.get("num_key_value_heads")
    return {
        "vocab_size": int(need("vocab_size")),
        "num_layers": int(need("num_hidden_layers")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(kv) if kv is not None else heads,
        "kv_channels": int(head_dim),
        "ffn_hidden_size": int(need("intermediate_size")),
        "rotary_base": theta,
        "rope_scaling_factor": scaling,
        "normalization": "RMSNorm",
        "norm_epsilon": float(config_json.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "add_bias_linear": False,
        "add_qkv_bias": mt == "qwen2",
        "qk_layernorm": mt == "qwen3",
        "untie_embeddings_and_output_weights": not bool(config_json.get("tie_word_embeddings", False)),
    }


def same_value(a, b) -> bool:
    """Equal config values: floats within 1e-9 relative (config.json round trips), None only equals None."""
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def resolve_model_config(model_cfg: ModelConfig) -> ModelConfig:
    """``model_cfg`` with its shape filled from ``model_cfg.hf_path``'s config.json (unchanged without hf_path).

    ``hf_path: registry:NAME`` is first replaced by the cached directory of registry model NAME
    (:func:`nemo_fp8rl.models.registry.resolve_hf_path`; fetched on first use).
    Fields still at the ``ModelConfig`` dataclass default are filled; explicitly set fields must agree
    with the checkpoint. ``name`` becomes the checkpoint's ``model_type`` when it is still the default.
    Idempotent.

    Raises:
        HFCheckpointError: unreadable/unsupported checkpoint, or explicit overrides that conflict with
            it (every differing key listed with both values).
    """
    if not model_cfg.hf_path:
        return model_cfg
    if model_cfg.hf_path.startswith("registry:"):  # a registry model: its cached directory (fetched once)
        from nemo_fp8rl.models.registry import resolve_hf_path

        model_cfg = dataclasses.replace(model_cfg, hf_path=resolve_hf_path(model_cfg.hf_path))
    config_json = read_hf_config(model_cfg.hf_path)
    where = str(Path(model_cfg.hf_path) / "config.json")
    fields = hf_config_to_model_fields(config_json, where)
    defaults = ModelConfig()
    conflicts = []
    for k, v in fields.items():
        mine = getattr(model_cfg, k)
        if not same_value(mine, getattr(defaults, k)) and not same_value(mine, v):
            conflicts.append(f"model.{k}={mine!r} (checkpoint: {v!r})")
    if conflicts:
        raise HFCheckpointError(
            f"model.hf_path={model_cfg.hf_path!r}: explicit model settings conflict with {where}: "
            + ", ".join(conflicts)
            + ". Remove these overrides (the shape comes from the checkpoint) or point model.hf_path at the "
            "checkpoint you meant"
        )
    out = dataclasses.replace(model_cfg, **fields)
    if out.name == defaults.name:
        out = dataclasses.replace(out, name=str(config_json["model_type"]))
    max_pos = config_json.get("max_position_embeddings")
    if max_pos is not None and out.seq_length > int(max_pos):
        log.warning("model.seq_length=%d exceeds the checkpoint's max_position_embeddings=%s (%s)",
                    out.seq_length, max_pos, where)
    return out


def hf_architecture(model_cfg: ModelConfig) -> str:
    """The Hugging Face ``model_type`` a ``ModelConfig`` is exported as: qwen3 (QK norm), qwen2 (QKV bias), llama.

    Raises:
        ValueError: features no supported Hugging Face architecture has (naming the key).
    """
    bad = []
    if model_cfg.normalization != "RMSNorm":
        bad.append(f"model.normalization={model_cfg.normalization}")
    if model_cfg.activation != "swiglu":
        bad.append(f"model.activation={model_cfg.activation}")
    if model_cfg.add_bias_linear:
        bad.append("model.add_bias_linear=true")
    if model_cfg.qk_layernorm and model_cfg.add_qkv_bias:
        bad.append("model.qk_layernorm=true with model.add_qkv_bias=true")
    if bad:
        raise ValueError(f"no Hugging Face Llama/Qwen2/Qwen3 architecture has {', '.join(bad)}; cannot export")
    if model_cfg.qk_layernorm:
        return "qwen3"
    return "qwen2" if model_cfg.add_qkv_bias else "llama"


def model_config_to_hf_config(model_cfg: ModelConfig, *, dtype: str = "float32",
                              base: Mapping[str, Any] | None = None) -> dict:
    """A ``config.json`` dict for ``model_cfg``.

    With ``base`` (the source checkpoint's config.json) the source is kept (token ids, rope settings,
    max_position_embeddings, ...) and only ``dtype`` changes; its shape must equal ``model_cfg``'s.
    Without it a config is written from scratch in the legacy ``rope_theta``/``rope_scaling`` form that
    transformers 4 and 5 (and vLLM) read.
    """
    arch = hf_architecture(model_cfg)
    if base is not None:
        if base.get("model_type") != arch:
            raise ValueError(f"source config.json has model_type={base.get('model_type')!r} but the model is {arch!r}")
        fields = hf_config_to_model_fields(base, "source config.json")
        diff = [k for k, v in fields.items() if not same_value(getattr(model_cfg, k), v)]
        if diff:
            raise ValueError(f"model config differs from the source config.json in {diff}; export without a source")
        out = dict(base)
        out.pop("torch_dtype", None)
        out["dtype" if "dtype" in base else "torch_dtype"] = dtype
        return out
    out = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.hidden_size,
        "intermediate_size": model_cfg.ffn_hidden_size,
        "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": model_cfg.num_attention_heads,
        "num_key_value_heads": model_cfg.num_kv_heads,
        "head_dim": model_cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model_cfg.seq_length,
        "rms_norm_eps": model_cfg.norm_epsilon,
        "rope_theta": model_cfg.rotary_base,
        "rope_scaling": None,
        "tie_word_embeddings": model_cfg.tied_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
    }
    if arch != "qwen2":
        out.update(attention_bias=False)
    if arch == "llama":
        out.update(mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    if model_cfg.rope_scaling_factor is not None:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": float(model_cfg.rope_scaling_factor), **_LLAMA3_ROPE}
        out["max_position_embeddings"] = max(model_cfg.seq_length, _LLAMA3_ROPE["original_max_position_embeddings"] + 1)
    return out


def resolve_readable_model_config(model_cfg: ModelConfig) -> ModelConfig:
    """The model the ranks will build, as far as this machine can tell: :func:`resolve_model_config` when
    ``model_cfg.hf_path`` is readable here (a ``registry:`` model, fetched on first use, or an existing
    directory), else ``model_cfg`` unchanged (e.g. a path that exists only inside the job's container:
    the trainer resolves it where it runs). The launcher's checks and the memory plan use it.

    Raises:
        HFCheckpointError: as :func:`resolve_model_config` for a readable but unusable checkpoint.
    """
    hf_path = model_cfg.hf_path
    if hf_path and (hf_path.startswith("registry:") or Path(hf_path).is_dir()):
        return resolve_model_config(model_cfg)
    return model_cfg


__all__ = [
    "CHECKPOINT_FIELDS",
    "SUPPORTED_ARCHITECTURES",
    "HFCheckpointError",
    "hf_architecture",
    "hf_config_to_model_fields",
    "model_config_to_hf_config",
    "read_hf_config",
    "resolve_model_config",
    "resolve_readable_model_config",
    "same_value",
]
