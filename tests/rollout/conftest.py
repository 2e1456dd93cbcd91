"""Random Hugging Face-named weights for the rollout tests (real tensors, shapes from ModelConfig)."""

from __future__ import annotations

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout.model import ModelShape, expected_hf_shapes


def random_hf_weights(cfg: ModelConfig, seed: int = 0, logit_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A full HF state dict for ``cfg``: linears ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2).

    ``logit_scale`` multiplies the LM head so the next-token distributions are peaked (like a trained
    model's) rather than near-uniform.
    """
    shape = ModelShape.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, s in expected_hf_shapes(shape, cfg.vocab_size).items():
        if k.endswith("norm.weight") or "layernorm" in k:
            sd[k] = 1.0 + 0.1 * torch.randn(s, generator=g)
        elif k.endswith(".bias"):
            sd[k] = 0.1 * torch.randn(s, generator=g)
        elif k == "model.embed_tokens.weight":
            sd[k] = torch.randn(s, generator=g)
        elif k == "lm_head.weight":
            sd[k] = logit_scale * torch.randn(s, generator=g) / s[1] ** 0.5
        else:
            sd[k] = torch.randn(s, generator=g) / s[1] ** 0.5
    return sd


def check_rows_end_at_eos(b, eos: int, pad: int = 0) -> None:
    """A sampled batch with EOS stops: some rows but not all ended; a row holds no EOS but possibly its last
    token, is finished iff it ends on one, and records nothing (pad, log-prob 0) after its response."""
    rows = b.tokens.shape[0]
    assert 0 < int(b.finished.sum()) < rows
    for r in range(rows):
        p, n = int(b.prompt_lens[r]), int(b.response_lens[r])
        resp = b.tokens[r, p: p + n].tolist()
        assert eos not in resp[:-1] and bool(b.finished[r]) == (resp[-1] == eos)
        assert (b.tokens[r, p + n:] == pad).all() and (b.rollout_logp[r, p + n:] == 0).all()


CONFIGS = {
    # Llama-style: multi-head attention, no biases.
    "llama": dict(vocab_size=16, num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128),
    # Qwen2-style: grouped-query attention and a QKV bias.
    "qwen2": dict(vocab_size=16, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, add_qkv_bias=True),
    # Qwen3-style: GQA with per-head QK RMSNorm, explicit head dim != d / heads, tied embeddings.
    "qwen3": dict(vocab_size=16, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=1,
                  kv_channels=32, ffn_hidden_size=128, qk_layernorm=True, untie_embeddings_and_output_weights=False),
    # Llama-3.1 RoPE scaling with a large theta.
    "llama31": dict(vocab_size=16, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, rotary_base=500000.0, rope_scaling_factor=8.0),
}


@pytest.fixture(params=sorted(CONFIGS))
def arch_cfg(request) -> ModelConfig:
    return ModelConfig(name=request.param, **CONFIGS[request.param])
