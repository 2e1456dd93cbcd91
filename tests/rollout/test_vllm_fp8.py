"""The vLLM block-FP8 sync format (E4M3 + weight_scale_inv) against our emulated ``vllm_block`` weights."""

from __future__ import annotations

import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.fp8 import get_rollout_scheme
from nemo_fp8rl.rollout.vllm_fp8 import dequantize_vllm_block, vllm_block_fp8_state_dict, vllm_block_fp8_weight

from .conftest import random_hf_weights


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    w[0, :3] *= 200.0  # an outlier: its tile gets a larger scale than the others
    w[-1] = 0.0  # an all-zero row (and, for n % 128 == 1, an all-zero edge tile)
    return w


def test_dequantized_sync_weights_equal_the_emulated_vllm_block_weights_bit_for_bit():
    scheme = get_rollout_scheme("vllm_block")
    for n, k, seed in [(256, 384, 0), (129, 200, 1), (64, 48, 2), (384, 1024, 3)]:
        w = _weight(n, k, seed)
        q, s = vllm_block_fp8_weight(w)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
        assert s.dtype == torch.float32 and s.shape == ((n + 127) // 128, (k + 127) // 128)
        assert torch.equal(dequantize_vllm_block(q, s), scheme.quantize_weight(w)), (n, k)
        if s.numel() > 1:
            assert float(s.max()) > 10 * float(s.min())  # the outlier tile has its own scale


def test_sync_of_split_qkv_equals_the_torch_engine_fused_quantization():
    """vLLM concatenates q/k/v blocks; the torch engine quantizes the fused weight: the same tiles when
    each part has a multiple of 128 rows."""
    scheme = get_rollout_scheme("vllm_block")
    parts = [_weight(256, 256, 10), _weight(128, 256, 11), _weight(128, 256, 12)]
    deq = [dequantize_vllm_block(*vllm_block_fp8_weight(p)) for p in parts]
    assert torch.equal(torch.cat(deq), scheme.quantize_weight(torch.cat(parts)))


def test_sync_stream_names():
    cfg = ModelConfig(name="q", vocab_size=64, num_layers=1, hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=256, add_qkv_bias=True)
    sd = random_hf_weights(cfg)
    out = dict(vllm_block_fp8_state_dict(sd))
    p = "model.layers.0."
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"):
        assert out[p + n + ".weight"].dtype == torch.float8_e4m3fn
        assert out[p + n + ".weight_scale_inv"].dtype == torch.float32
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", p + "self_attn.q_proj.bias"):
        assert out[n] is sd[n]
    assert len(out) == len(sd) + 7
