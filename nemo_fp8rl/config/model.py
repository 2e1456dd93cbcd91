"""Model and parallel-layout schema (the only home of their defaults).

Field names follow megatron-core's ``TransformerConfig`` so a Megatron user reads them without a
glossary; ``conf/model/*.yaml`` presets override them with a comment per key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ModelConfig:
    """Shape of a Llama/Qwen-style decoder-only GPT (RMSNorm, RoPE, SwiGLU, GQA)."""

    name: str = "tiny"
    """Preset name (informational; the shape fields below are what builds the model)."""
    vocab_size: Optional[int] = None
    """Vocabulary size. None = taken from the task's tokenizer at build time."""
    make_vocab_size_divisible_by: int = 16
    """Pad the embedding/LM-head rows to a multiple of this x TP (Megatron's rule)."""
    num_layers: int = 3
    """Number of transformer layers."""
    hidden_size: int = 128
    """Model width d."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """KV heads for grouped-query attention; None = num_attention_heads (multi-head attention)."""
    kv_channels: Optional[int] = None
    """Per-head dimension; None = hidden_size // num_attention_heads."""
    ffn_hidden_size: int = 384
    """Inner width of the SwiGLU MLP."""
    seq_length: int = 64
    """Maximum sequence length (prompt + response) the model is trained on."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_scaling_factor: Optional[float] = None
    """Llama-3.1 style RoPE scaling factor (None = no scaling)."""
    normalization: str = "RMSNorm"
    """RMSNorm or LayerNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    activation: str = "swiglu"
    """MLP activation: swiglu or gelu."""
    add_bias_linear: bool = False
    """Biases on all linear layers (False for Llama/Qwen)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (True for Qwen2/2.5)."""
    qk_layernorm: bool = False
    """RMSNorm on per-head queries and keys (True for Qwen3)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate LM-head weight (False = tied to the input embedding)."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of weights."""
    params_dtype: str = "float32"
    """Parameter dtype: float32 (CPU default) or bfloat16 (GPU)."""
    hf_path: Optional[str] = None
    """Hugging Face checkpoint directory to load the shape and weights from."""


@dataclass
class ParallelConfig:
    """Megatron parallel layout. Data parallel size = world_size / (TP x PP)."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (shards heads, FFN and vocab)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (splits layers into stages)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1)."""
    backend: Optional[str] = None
    """torch.distributed backend; None = nccl on CUDA, gloo on CPU."""
    micro_batch_size: int = 8
    """Sequences per microbatch in the train step (and per logprob forward chunk)."""


__all__ = ["ModelConfig", "ParallelConfig"]
