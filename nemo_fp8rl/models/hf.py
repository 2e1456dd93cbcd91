"""Hugging Face checkpoints (Llama, Qwen2/2.5, Qwen3 dense): the names of the three modules in one import.

- :mod:`nemo_fp8rl.models.hf_config`: ``config.json`` <-> ``ModelConfig`` (JSON only, no torch);
- :mod:`nemo_fp8rl.models.hf_load`: safetensors -> this rank's megatron shards, :func:`load_hf_policy`;
- :mod:`nemo_fp8rl.models.hf_save`: the actor's weights -> a checkpoint directory.

This module holds no code. ``nemo_fp8rl.models.hf`` is the import path docs/models.md names and that
``nemo_fp8rl.models``, the trainer, ``train.py``, the vLLM rollout engine, the GGUF converter and the
benchmarks import from; new code imports from the module that does the job.
"""

from nemo_fp8rl.models.hf_config import (
    CHECKPOINT_FIELDS,
    SUPPORTED_ARCHITECTURES,
    HFCheckpointError,
    hf_architecture,
    hf_config_to_model_fields,
    model_config_to_hf_config,
    read_hf_config,
    resolve_model_config,
)
from nemo_fp8rl.models.hf_load import HFCheckpoint, load_hf_policy, load_hf_state_dict, load_hf_weights
from nemo_fp8rl.models.hf_save import save_hf_checkpoint, save_hf_state_dict

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
