"""Hugging Face checkpoints in, trained policies out: Llama, Qwen2/2.5 and Qwen3 dense models.

A Hugging Face checkpoint directory holds ``config.json`` (the shape), the weights as
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, and usually the tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with the chat template) and ``generation_config.json``.
This module turns such a directory into our megatron policy and writes a trained policy back as one.

Three steps, each usable alone:

1. **Shape.** :func:`resolve_model_config` reads ``config.json`` and fills ``ModelConfig``:

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

2. **Weights in.** :func:`load_hf_weights` reads, on each rank, only the tensors of its pipeline
   stage (safetensors, lazily, in the stored dtype) and copies this rank's tensor-parallel shard into
   the model through :meth:`~nemo_fp8rl.models.FP8Actor.load_weights`, i.e. through the one mapping
   in :mod:`nemo_fp8rl.models.hf_weights` (QKV fused per KV group, gate/up fused per TP rank,
   vocabulary padded, tied heads). Missing tensors, tensors the architecture does not have and
   shape mismatches are refused before anything is copied, naming the tensor, its file and what
   config.json implies. With ``backend="auto"`` and ``megatron-bridge`` installed, a Transformer
   Engine model is loaded by megatron-bridge's ``AutoBridge`` instead (see :func:`load_hf_weights`).

3. **Weights out.** :func:`save_hf_checkpoint` (collective) gathers the full model with
   :meth:`~nemo_fp8rl.models.FP8Actor.export_weights` and rank 0 writes a directory
   ``transformers.AutoModelForCausalLM.from_pretrained`` loads: ``config.json`` (the source's, or one
   written from the ``ModelConfig``), safetensors shards (+ index), and the source's tokenizer and
   generation files. Tied models omit ``lm_head.weight`` as Hugging Face does.

:func:`load_hf_policy` does 1 and 2 for the trainer and returns a ready :class:`FP8Actor`.
Nothing here downloads: ``hf_path`` is a local directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.config.schema import ConfigError
from nemo_fp8rl.models.hf_weights import hf_names, hf_shape, stage_hf_names

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

# Files of a checkpoint directory that describe weights (not copied on export).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Tensors some checkpoints carry that are recomputed, never learned (old Llama exports).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCheckpointError(ConfigError):
    """A Hugging Face checkpoint directory that cannot be used: the message names the file or key and the fix."""


# --------------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# --------------------------------------------------------------------------------------------------


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


def _same(a, b) -> bool:
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
        if not _same(mine, getattr(defaults, k)) and not _same(mine, v):
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
        diff = [k for k, v in fields.items() if not _same(getattr(model_cfg, k), v)]
        if diff:
            raise ValueError(f"model config differs from the source config.json in {diff}; export without a source")
        out = dict(base)
        out.pop("torch_dtype", None)
        out["dtype" if "dtype" in base else "torch_dtype"] = dtype
        return out
    heads = model_cfg.num_attention_heads
    out = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.hidden_size,
        "intermediate_size": model_cfg.ffn_hidden_size,
        "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": model_cfg.num_query_groups or heads,
        "head_dim": model_cfg.kv_channels or model_cfg.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": model_cfg.seq_length,
        "rms_norm_eps": model_cfg.norm_epsilon,
        "rope_theta": model_cfg.rotary_base,
        "rope_scaling": None,
        "tie_word_embeddings": not model_cfg.untie_embeddings_and_output_weights,
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


# --------------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------------


class HFCheckpoint:
    """The weights of a checkpoint directory: which file holds each tensor, its shape, lazy loading.

    Reads ``model.safetensors.index.json`` when present (sharded checkpoints), else every
    ``*.safetensors`` file of the directory. Only headers are read until :meth:`load`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise HFCheckpointError(
                "reading Hugging Face checkpoints needs the 'safetensors' package: pip install 'nemo-fp8rl[hf]'"
            ) from e
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        self.file_of: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise HFCheckpointError(f"{index} lists shard files that are not in the directory: {missing[:5]}")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                others = sorted(p.name for p in self.path.iterdir() if p.name.endswith((".bin", ".pt", ".pth")))
                hint = (f" (found {others[:3]}: convert them with transformers: "
                        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir))") if others else ""
                raise HFCheckpointError(f"{self.path}: no *.safetensors weights{hint}")
        self.shapes: dict[str, tuple[int, ...]] = {}
        for fname in files:
            try:
                with safe_open(str(self.path / fname), framework="pt") as f:
                    for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                        self.file_of[k] = fname
                        self.shapes[k] = tuple(f.get_slice(k).get_shape())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise HFCheckpointError(f"{self.path / fname}: unreadable safetensors file ({e})") from None

    def names(self) -> list[str]:
        return sorted(self.file_of)

    def check(self, model_cfg: ModelConfig) -> None:
        """Every tensor the architecture needs is present with the shape config.json implies, and no others.

        ``lm_head.weight`` may be absent when embeddings are tied; old-style ``rotary_emb.inv_freq``
        buffers are ignored.

        Raises:
            HFCheckpointError: listing the missing / unexpected / mis-shaped tensors with their files.
        """
        tied = not model_cfg.untie_embeddings_and_output_weights
        expected = hf_names(model_cfg)
        have = {n for n in self.file_of if not n.endswith(_IGNORED_SUFFIXES)}
        missing = [n for n in expected if n not in have and not (tied and n == "lm_head.weight")]
        unexpected = sorted(have - set(expected))
        problems = []
        if missing:
            problems.append(f"{len(missing)} tensors missing, e.g. {missing[:5]}")
        if unexpected:
            problems.append(f"{len(unexpected)} tensors the architecture in config.json does not have, e.g. "
                            f"{[f'{n} ({self.file_of[n]})' for n in unexpected[:5]]}")
        for n in expected:
            if n in self.shapes and self.shapes[n] != hf_shape(model_cfg, n):
                problems.append(f"{n} in {self.file_of[n]} has shape {self.shapes[n]}, config.json implies "
                                f"{hf_shape(model_cfg, n)}")
                if len(problems) > 6:
                    break
        if problems:
            raise HFCheckpointError(
                f"{self.path}: the weights do not match config.json: " + "; ".join(problems)
                + ". Check that config.json belongs to these weights (and that no model.* override changed the shape)"
            )

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in their stored dtype on CPU (one open per file)."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            if n not in self.file_of:
                raise HFCheckpointError(f"{self.path}: tensor {n!r} is not in the checkpoint")
            by_file.setdefault(self.file_of[n], []).append(n)
        out = {}
        for fname, keys in by_file.items():
            with safe_open(str(self.path / fname), framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out


def load_hf_state_dict(path: str | os.PathLike, model_cfg: ModelConfig | None = None,
                       names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint directory (all, or ``names``), checked against ``model_cfg`` when given
    (default: the config resolved from the directory's own config.json)."""
    ckpt = HFCheckpoint(path)
    if model_cfg is None:
        model_cfg = resolve_model_config(ModelConfig(hf_path=str(path)))
    ckpt.check(model_cfg)
    return ckpt.load(ckpt.names() if names is None else names)


# --------------------------------------------------------------------------------------------------
# Into the actor
# --------------------------------------------------------------------------------------------------


def _bridge_usable(actor, config_json: dict) -> tuple[bool, str]:
    """Whether megatron-bridge's AutoBridge can load this model, and why not."""
    try:
        from megatron.bridge import AutoBridge  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, f"megatron-bridge not importable ({type(e).__name__})"
    if not actor.use_te:
        # The bridge can map the local spec once our FP8 parallel linears are registered with its
        # AutoMapping.register_module_type (a probe loaded tiny Qwen3/Llama exactly that way); we do not
        # register them: the native loader serves the CPU/emulated path (docs/models.md).
        return False, ("the model uses the local (CPU/emulated) layer spec, which the native loader serves "
                       "(megatron-bridge would need our FP8 parallel linears registered with its AutoMapping)")
    if actor.pp_size > 1 and not actor.model_cfg.untie_embeddings_and_output_weights:
        # We build without an embedding group (gpt.py); the tied head copy on the last stage is ours to fill.
        return False, "tied embeddings under pipeline parallelism"
    return True, ""


def _load_with_bridge(actor, path: Path) -> None:
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(path))
    bridge.load_hf_weights([actor.model])


def _spot_check(actor, ckpt: HFCheckpoint) -> None:
    """After a megatron-bridge load: replicated norm weights and this rank's embedding rows equal the
    checkpoint's (catches a wrong directory or a load that silently skipped tensors)."""
    m = actor.model
    checks = []
    if actor.is_last_stage:
        checks.append(("model.norm.weight", m.decoder.final_layernorm.weight))
    layer = m.decoder.layers[0]
    i = layer.layer_number - 1
    w = getattr(layer.self_attention.linear_qkv, "layer_norm_weight", None)
    if w is not None:
        checks.append((f"model.layers.{i}.input_layernorm.weight", w))
    names = [n for n, _ in checks]
    if actor.is_first_stage:
        names.append("model.embed_tokens.weight")
    ref = ckpt.load(names)
    for n, p in checks:
        if not torch.equal(p.detach().float().cpu(), ref[n].float()):
            raise RuntimeError(f"megatron-bridge loaded {n} differently from {ckpt.file_of[n]}")
    if actor.is_first_stage:
        emb = m.embedding.word_embeddings.weight.detach().float().cpu()
        start = actor.tp_rank * emb.shape[0]
        rows = ref["model.embed_tokens.weight"].float()[start:start + emb.shape[0]]
        if not torch.equal(emb[: rows.shape[0]], rows):
            raise RuntimeError("megatron-bridge loaded model.embed_tokens.weight differently from the checkpoint")


def load_hf_weights(actor, path: str | os.PathLike | None = None, *, backend: str = "auto") -> str:
    """Load a Hugging Face checkpoint into ``actor`` (every rank of the job calls it; no communication
    with the native backend). Returns the backend used: ``"native"`` or ``"megatron-bridge"``.

    ``backend``:

    - ``"native"``: this module: each rank reads its pipeline stage's tensors from the safetensors
      files and copies its TP shard via ``actor.load_weights`` (:mod:`~nemo_fp8rl.models.hf_weights`).
      Works on every layer spec and layout; the CPU path always uses it.
    - ``"megatron-bridge"``: ``AutoBridge.from_hf_pretrained(path).load_hf_weights([model])``; used with
      the Transformer Engine spec only (it could map the local spec too once our FP8 parallel linears are
      registered with its ``AutoMapping``, which we do not do: the native loader serves that path), and
      not for tied embeddings under PP. Spot-checked against the checkpoint afterwards.
    - ``"auto"`` (default): megatron-bridge when it is usable (installed, TE spec, not tied under PP),
      else native. If the bridge raises, the error is logged and the native loader runs.

    The checkpoint is always validated first (tensor names, shapes) against ``actor.model_cfg``.

    Raises:
        HFCheckpointError: missing/unsupported checkpoint, tensors missing, unexpected or mis-shaped.
    """
    path = path or actor.model_cfg.hf_path
    if not path:
        raise ValueError("load_hf_weights: no checkpoint directory given and actor.model_cfg.hf_path is not set")
    path = Path(path)
    if backend not in ("auto", "native", "megatron-bridge"):
        raise ValueError(f"backend={backend!r}; use 'auto', 'native' or 'megatron-bridge'")
    config_json = read_hf_config(path)
    fields = hf_config_to_model_fields(config_json, str(path / "config.json"))
    diff = [f"{k}: model {getattr(actor.model_cfg, k)!r} vs checkpoint {v!r}" for k, v in fields.items()
            if not _same(getattr(actor.model_cfg, k), v)]
    if diff:
        raise HFCheckpointError(f"{path / 'config.json'} describes another model than the actor's: {diff}; "
                                "build the actor from resolve_model_config(...) of this checkpoint")
    ckpt = HFCheckpoint(path)
    ckpt.check(actor.model_cfg)
    t0 = time.time()
    if backend != "native":
        ok, why = _bridge_usable(actor, config_json)
        if not ok and backend == "megatron-bridge":
            raise ValueError(f"backend='megatron-bridge' is not usable here: {why}; use backend='native'")
        if ok:
            try:
                _load_with_bridge(actor, path)
                _spot_check(actor, ckpt)
                log.info("loaded %s with megatron-bridge AutoBridge in %.1fs", path, time.time() - t0)
                return "megatron-bridge"
            except Exception as e:
                if backend == "megatron-bridge":
                    raise
                log.warning("megatron-bridge could not load %s (%s: %s); using the native loader",
                            path, type(e).__name__, e)
        else:
            log.info("megatron-bridge not used: %s", why)
    names = stage_hf_names(actor.model, actor.model_cfg)
    if "lm_head.weight" in names and "lm_head.weight" not in ckpt.file_of:
        names = [n for n in names if n != "lm_head.weight"]  # tied: the head is the embedding
        if "model.embed_tokens.weight" not in names:
            names.append("model.embed_tokens.weight")
    sd = ckpt.load(names)
    actor.load_weights(sd)
    log.info("loaded %s (%d tensors of this pipeline stage) natively in %.1fs", path, len(sd), time.time() - t0)
    return "native"


def load_hf_policy(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    fp8_recipe=None,
    seed: int,
    lr: float,
    keep_reference: bool = False,
    backend: str = "auto",
    **build_kwargs: Any,
):
    """Build the :class:`~nemo_fp8rl.models.FP8Actor` of ``model_cfg.hf_path`` with the checkpoint's weights.

    ``model_cfg`` is resolved with :func:`resolve_model_config` (idempotent, so an already resolved
    config is fine), the actor is built by :func:`~nemo_fp8rl.models.build_actor` (``build_kwargs``:
    ``weight_decay``, ``adam_betas``, ``adam_eps``, ``grad_clip``, ``fp8_backend``, ``device``), the weights
    are loaded by :func:`load_hf_weights`, and only then is the reference policy snapshotted
    (``keep_reference``), so the reference is the checkpoint. ``actor.model_cfg`` keeps ``hf_path``
    (so :func:`save_hf_checkpoint` finds the tokenizer and config to copy). Collective over the job.

    Returns:
        the actor.
    """
    from nemo_fp8rl.models.actor import build_actor

    if not model_cfg.hf_path:
        raise ValueError("load_hf_policy needs model.hf_path (a local Hugging Face checkpoint directory)")
    resolved = resolve_model_config(model_cfg)
    actor = build_actor(dataclasses.replace(resolved, hf_path=None), parallel_cfg, fp8_recipe=fp8_recipe,
                        seed=seed, lr=lr, keep_reference=False, **build_kwargs)
    actor.model_cfg = resolved
    load_hf_weights(actor, resolved.hf_path, backend=backend)
    if keep_reference:
        actor.keep_reference()
    return actor


# --------------------------------------------------------------------------------------------------
# Out of the actor
# --------------------------------------------------------------------------------------------------


def _source_dtype(src_cfg: Mapping[str, Any] | None) -> str:
    d = (src_cfg or {}).get("dtype") or (src_cfg or {}).get("torch_dtype") or "float32"
    return d if d in _DTYPES else "float32"


def save_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write a Hugging Face checkpoint directory from the full HF-named model (not collective).

    Args:
        state_dict: the full model in HF naming, as a mapping (e.g. ``actor.export_weights()``) or as a
            stream of ``(name, tensor)`` pairs (e.g. ``actor.iter_weights()``). Shards are planned from
            the model config in name order and each is written as soon as all its tensors have arrived,
            so a stream in layer order holds about one shard (plus one layer) at a time. Names the
            checkpoint does not store (``lm_head.weight`` of a tied model) are skipped.
        model_cfg: its shape.
        out_dir: written atomically: a temporary sibling is filled, then renamed over ``out_dir``.
        source: a checkpoint directory whose config.json is kept (dtype updated) and whose tokenizer,
            generation config, chat template and other non-weight files are copied. Default:
            ``model_cfg.hf_path``. Without one, config.json is written from ``model_cfg``.
        dtype: float32 | bfloat16 | float16; default the source's dtype, else float32.
        max_shard_bytes: shard the safetensors above this size (with ``model.safetensors.index.json``).

    Raises:
        KeyError: tensors missing (named); ValueError: a tensor's shape differs from the config's.
    """
    from safetensors.torch import save_file

    source = source if source is not None else model_cfg.hf_path
    src_cfg = read_hf_config(source) if source else None
    dtype = dtype or _source_dtype(src_cfg)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; use one of {sorted(_DTYPES)}")
    config = model_config_to_hf_config(model_cfg, dtype=dtype, base=src_cfg)
    tied = not model_cfg.untie_embeddings_and_output_weights
    names = [n for n in hf_names(model_cfg) if not (tied and n == "lm_head.weight")]
    if isinstance(state_dict, Mapping):
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise KeyError(f"save_hf_state_dict: state dict lacks {len(missing)} tensors, e.g. {missing[:5]}")
        items: Iterable[tuple[str, torch.Tensor]] = ((n, state_dict[n]) for n in names)
    else:
        items = state_dict

    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # shards of at most max_shard_bytes, in name order, planned from the config's shapes
    shards: list[list[str]] = [[]]
    size = 0
    tdtype = _DTYPES[dtype]
    nbytes = {n: math.prod(hf_shape(model_cfg, n)) * torch.empty((), dtype=tdtype).element_size() for n in names}
    for n in names:
        if shards[-1] and size + nbytes[n] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    shard_of = {n: i for i, shard in enumerate(shards) for n in shard}
    left = [len(shard) for shard in shards]
    pending: dict[str, torch.Tensor] = {}
    weight_map = {}
    try:
        for n, t in items:
            if n not in shard_of:
                continue
            if tuple(t.shape) != hf_shape(model_cfg, n):
                raise ValueError(f"save_hf_state_dict: {n} has shape {tuple(t.shape)}, "
                                 f"the model config implies {hf_shape(model_cfg, n)}")
            if n in pending or n in weight_map:
                raise ValueError(f"save_hf_state_dict: {n} appears twice")
            pending[n] = t.detach().to(device="cpu", dtype=tdtype).contiguous()
            i = shard_of[n]
            left[i] -= 1
            if left[i] == 0:
                fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file({m: pending.pop(m) for m in shards[i]}, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({m: fname for m in shards[i]})
        missing = [n for n in names if n not in weight_map]
        if missing:
            raise KeyError(f"save_hf_state_dict: the stream lacked {len(missing)} tensors, e.g. {missing[:5]}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source:
        for p in sorted(Path(source).iterdir()):
            if p.is_file() and p.name != "config.json" and p.name not in _WEIGHT_INDEXES \
                    and not p.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(p, tmp / p.name)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)
    return out


def save_hf_checkpoint(actor, out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None,
                       dtype: str | None = None, max_shard_bytes: int = 5 * 2**30) -> Path | None:
    """Export the actor's current weights as a Hugging Face checkpoint directory.

    Collective: every rank iterates the streamed export (``actor.iter_weights()``: TP shards gathered
    and PP stages broadcast one tensor at a time); global rank 0 writes each safetensors shard as soon
    as its tensors arrived (:func:`save_hf_state_dict`), so it holds about one shard, not the model.
    Returns the directory on rank 0, None elsewhere. ``source`` defaults to ``actor.model_cfg.hf_path``
    (config, tokenizer, generation config copied from there).
    """
    import torch.distributed as dist

    stream = actor.iter_weights()
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = None
    err: BaseException | None = None
    if rank == 0:
        try:
            out = save_hf_state_dict(stream, actor.model_cfg, out_dir, source=source, dtype=dtype,
                                     max_shard_bytes=max_shard_bytes)
        except BaseException as e:  # noqa: BLE001 - re-raised after the barrier so other ranks do not hang
            err = e
    for _ in stream:  # the other ranks (and rank 0 after an error) finish the collective stream
        pass
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if err is not None:
        raise err
    return out


__all__ = [
    "CHECKPOINT_FIELDS",
    "SUPPORTED_ARCHITECTURES",
    "HFCheckpoint",
    "HFCheckpointError",
    "hf_architecture",
    "hf_config_to_model_fields",
    "load_hf_policy",
    "load_hf_state_dict",
    "load_hf_weights",
    "model_config_to_hf_config",
    "read_hf_config",
    "resolve_model_config",
    "save_hf_checkpoint",
    "save_hf_state_dict",
]
