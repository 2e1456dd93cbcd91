"""A readable Hugging Face-style Llama/Qwen forward on an HF-named state dict (test reference only).

Written from the published architecture, independent of megatron: RMSNorm, rotate-half RoPE
(optionally Llama-3.1 scaled), GQA with ``repeat_interleave`` KV heads, optional QKV bias (Qwen2)
and per-head QK RMSNorm (Qwen3), SwiGLU MLP, optionally tied head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nemo_fp8rl.config.model import ModelConfig


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _inv_freq(cfg: ModelConfig, hn: int) -> torch.Tensor:
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn))
    if cfg.rope_scaling_factor is None:
        return inv
    # Llama-3.1: factor, low_freq_factor 1, high_freq_factor 4, original context 8192.
    factor, lo, hi, old = cfg.rope_scaling_factor, 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(mid, (1 - smooth) * out / factor + smooth * out, out)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


@torch.no_grad()
def hf_logits(sd: dict, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> logits [B, T, V] (float32)."""
    np_ = cfg.num_attention_heads
    ng = cfg.num_query_groups or np_
    hn = cfg.kv_channels or cfg.hidden_size // np_
    B, T = tokens.shape
    eps = cfg.norm_epsilon
    x = sd["model.embed_tokens.weight"][tokens]
    pos = torch.arange(T, dtype=torch.float32)
    freqs = torch.outer(pos, _inv_freq(cfg, hn))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def lin(h, name):
            b = sd.get(p + name + ".bias")
            return F.linear(h, sd[p + name + ".weight"], b)

        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = lin(h, "self_attn.q_proj").view(B, T, np_, hn).transpose(1, 2)
        k = lin(h, "self_attn.k_proj").view(B, T, ng, hn).transpose(1, 2)
        v = lin(h, "self_attn.v_proj").view(B, T, ng, hn).transpose(1, 2)
        if cfg.qk_layernorm:
            q = _rms(q, sd[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, sd[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k = k.repeat_interleave(np_ // ng, dim=1)
        v = v.repeat_interleave(np_ // ng, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hn)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(B, T, np_ * hn)
        x = x + lin(o, "self_attn.o_proj")
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        x = x + lin(F.silu(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")
    x = _rms(x, sd["model.norm.weight"], eps)
    return x @ sd["lm_head.weight"].t()


def hf_logprobs(sd: dict, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Our convention: [B, T], column 0 = 0, lp[b, t] = log p(tokens[b, t] | tokens[b, :t])."""
    lsm = torch.log_softmax(hf_logits(sd, cfg, tokens)[:, :-1].float(), -1)
    lp = lsm.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(tokens.shape[0], 1), lp], 1)
