"""Megatron layer specs: the CPU/emulated spec (SDPA attention + FP8-emulating linears) and the TE spec.

A megatron ``ModuleSpec`` names the class of each sub-module of a ``TransformerLayer``. Two specs:

``local_fp8_layer_spec`` (CPU default; also valid on GPU without Transformer Engine)
    megatron's local modules (``SelfAttention``, ``MLP``, torch ``RMSNorm``/``LayerNorm`` through
    ``WrappedTorchNorm``, built in ``params_dtype`` by :class:`TorchNorm`) with two replacements:

    * core attention = :class:`SdpaCoreAttention`, built on
      ``torch.nn.functional.scaled_dot_product_attention`` (megatron's ``DotProductAttention``
      allocates its score buffer with ``torch.cuda.current_device()`` and cannot run on CPU);
    * ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` =
      :class:`~nemo_fp8rl.fp8.megatron.Fp8ColumnParallelLinear` /
      :class:`~nemo_fp8rl.fp8.megatron.Fp8RowParallelLinear` (megatron's linears plus the emulated
      FP8 switch; with FP8 off they run megatron's own code).

    :func:`local_fp8_block_spec` is the whole decoder block of this stage: those layers and a
    :class:`TorchNorm` as the final norm (megatron would pick TE's, apex's or its float32 torch norm by
    what is importable).

``te_layer_spec`` (GPU)
    megatron's Transformer Engine spec: fused ``TELayerNormColumnParallelLinear`` for QKV and FC1,
    ``TEDotProductAttention``, ``TERowParallelLinear``; FP8 comes from TE autocast driven by the
    ``TransformerConfig`` FP8 fields.

Also here: :class:`CpuRotaryEmbedding`, megatron's RoPE without the move of ``inv_freq`` to CUDA
(megatron's ``RotaryEmbedding.get_emb`` calls ``torch.cuda.current_device()``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import divide

from nemo_fp8rl.fp8.megatron import Fp8ColumnParallelLinear, Fp8RowParallelLinear


class SdpaCoreAttention(MegatronModule):
    """Causal core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Same constructor and forward signature as megatron's ``DotProductAttention`` so it drops into
    ``SelfAttentionSubmodules.core_attention``. For each head h (np/tp per rank) with KV group
    g(h) = h // (np/ng) (GQA: query heads of a group are adjacent, as in megatron and Hugging Face):

        out[t] = sum_{u <= t} softmax_u(q_t . k_u * scale) v_u,   scale = softmax_scale or 1/sqrt(hn)

    Shapes: query [sq, b, np/tp, hn], key/value [sk, b, ng/tp, hn] -> [sq, b, (np/tp) * hn].
    Only causal self-attention without a mask tensor is supported: right-padded batches need none,
    since no valid token comes after a pad. The softmax runs in float32 for half-precision inputs.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SdpaCoreAttention does not support context parallelism; use the TE spec")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaCoreAttention supports causal self-attention only, got {attn_mask_type}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """[sq, b, np, hn], [sk, b, ng, hn], [sk, b, ng, hn] -> [sq, b, np * hn]."""
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaCoreAttention runs causal attention only: pass attention_mask=None, "
                             "no attention bias and no packed sequences")
        rep = self.heads_per_partition // self.groups_per_partition
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        # SDPA wants [b, heads, s, hn].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out_dtype = q.dtype
        if q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cpu":
            q, k, v = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        sq, b = query.shape[0], query.shape[1]
        return out.to(out_dtype).permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)


class CpuRotaryEmbedding(RotaryEmbedding):
    """megatron's ``RotaryEmbedding`` (non-interleaved = Hugging Face rotate-half) kept on its device.

    get_emb(S) -> [S, 1, 1, hn] with emb[t] = concat(t * inv_freq, t * inv_freq),
    inv_freq_i = base^(-2i/hn) (Llama-3.1 scaling applied by the parent when ``rope_scaling``).
    """

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [S, hn/2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


class TorchNorm:
    """megatron's ``WrappedTorchNorm`` (torch ``LayerNorm`` or ``RMSNorm`` by ``config.normalization``)
    with its weight (and bias) in ``config.params_dtype``.

    megatron builds the torch norm without a dtype, i.e. float32 whatever ``params_dtype`` says (its own
    trainers cast the whole model afterwards with ``Float16Module``). With BF16 parameters a float32
    norm weight makes ``torch.rms_norm`` skip its fused kernel for a ~20-kernel composite, and leaves
    the distributed optimizer a float32 buffer beside the BF16 one.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        return WrappedTorchNorm(config, hidden_size, eps, **kwargs).to(dtype=config.params_dtype)


def local_fp8_layer_spec(qk_layernorm: bool) -> ModuleSpec:
    """TransformerLayer spec with megatron local modules, SDPA attention and FP8-emulating linears."""
    norm = TorchNorm  # torch LayerNorm or RMSNorm (config.normalization), in config.params_dtype
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=Fp8ColumnParallelLinear,
                    core_attention=SdpaCoreAttention,
                    linear_proj=Fp8RowParallelLinear,
                    q_layernorm=norm if qk_layernorm else IdentityOp,
                    k_layernorm=norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=Fp8ColumnParallelLinear, linear_fc2=Fp8RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def local_fp8_block_spec(config: TransformerConfig, qk_layernorm: bool) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder block: :func:`local_fp8_layer_spec` layers and a :class:`TorchNorm`
    final norm (megatron's parallel state must be initialised: it gives the stage's layer count)."""
    layer = local_fp8_layer_spec(qk_layernorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=TorchNorm)


def te_layer_spec(qk_layernorm: bool) -> ModuleSpec:
    """megatron's Transformer Engine TransformerLayer spec (needs transformer_engine)."""
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        import transformer_engine  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without TE on GPU machines
        raise RuntimeError(
            f"the Transformer Engine layer spec needs transformer_engine ({e}); install the GPU extra "
            "(pip install 'nemo-fp8rl[gpu]') or build with use_te=False (emulated FP8 spec)"
        ) from e
    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)


__all__ = ["SdpaCoreAttention", "CpuRotaryEmbedding", "TorchNorm", "local_fp8_layer_spec", "local_fp8_block_spec",
           "te_layer_spec"]
