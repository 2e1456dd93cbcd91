"""Megatron-core policy: build a GPT from our config, CPU/TE layer specs, and the ``FP8Actor``.

Entry points: :func:`build_actor` (what the trainer calls), :func:`init_distributed` /
:func:`destroy_distributed`; Hugging Face checkpoints: :func:`resolve_model_config`,
:func:`load_hf_policy`, :func:`save_hf_checkpoint` (:mod:`nemo_fp8rl.models.hf_config`, :mod:`~nemo_fp8rl.models.hf_load`, :mod:`~nemo_fp8rl.models.hf_save`).
Importing this package imports megatron-core.
"""

from nemo_fp8rl.models.actor import CHECKPOINT_FORMAT, FP8Actor, build_actor
from nemo_fp8rl.models.gpt import build_gpt_model, make_transformer_config, padded_vocab_size
from nemo_fp8rl.models.hf_config import HFCheckpointError, resolve_model_config
from nemo_fp8rl.models.hf_load import load_hf_policy, load_hf_weights
from nemo_fp8rl.models.hf_save import save_hf_checkpoint, save_hf_state_dict
from nemo_fp8rl.models.logprobs import token_logprobs_from_logits, vocab_parallel_logprobs
from nemo_fp8rl.models.parallel import destroy_distributed, init_distributed, validate_layout

__all__ = [
    "FP8Actor",
    "build_actor",
    "CHECKPOINT_FORMAT",
    "build_gpt_model",
    "make_transformer_config",
    "padded_vocab_size",
    "token_logprobs_from_logits",
    "vocab_parallel_logprobs",
    "init_distributed",
    "destroy_distributed",
    "validate_layout",
    "HFCheckpointError",
    "resolve_model_config",
    "load_hf_policy",
    "load_hf_weights",
    "save_hf_checkpoint",
    "save_hf_state_dict",
]
