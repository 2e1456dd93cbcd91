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

    # ------------------------------------------------------------------ derived shape (not config keys)
    # The one place the defaults of the optional shape fields are resolved; megatron's TransformerConfig
    # does the same (kv_channels = h / n_q, num_query_groups = n_q when unset). An unset value is None
    # (or 0, read the same way).

    @property
    def head_dim(self) -> int:
        """Per-head dimension d = ``kv_channels``, else ``hidden_size // num_attention_heads``.

        Floor division: whether h divides evenly is a check (model.kv_channels must then be set), not
        part of the derivation."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        """KV heads n_kv = ``num_query_groups``, else ``num_attention_heads`` (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def q_width(self) -> int:
        """Width of the query projection n_q d (not always h: Qwen3-32B has 64 x 128 = 8192 > h = 5120);
        also the input width of the output projection."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the key projection (= the value projection) n_kv d."""
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """Biases on q, k and v: ``add_qkv_bias`` (Qwen2), or ``add_bias_linear`` (a bias on every linear)."""
        return self.add_qkv_bias or self.add_bias_linear

    @property
    def gated_mlp(self) -> bool:
        """SwiGLU: the first MLP linear computes gate and up, [2f, h] (GeLU: [f, h])."""
        return self.activation == "swiglu"

    @property
    def tied_embeddings(self) -> bool:
        """The LM head is the input embedding (``untie_embeddings_and_output_weights`` false)."""
        return not self.untie_embeddings_and_output_weights

    def padded_vocab(self, tp: int) -> int:
        """Rows of the embedding and the LM head at tensor-parallel size ``tp`` (Megatron's padding)::

            Vp = ceil(V / m) m,    m = max(1, make_vocab_size_divisible_by) x tp

        so every TP rank holds Vp / tp whole rows. Raises ValueError when ``vocab_size`` is unset."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is not set (it is taken from the task's tokenizer); set "
                             "model.vocab_size to pad the vocabulary")
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: smallest multiple of ``max(1, divisible_by) * tp`` that is >= ``vocab_size``
    (:meth:`ModelConfig.padded_vocab` for a config)."""
    multiple = max(1, divisible_by) * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


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


__all__ = ["ModelConfig", "ParallelConfig", "padded_vocab_size"]
