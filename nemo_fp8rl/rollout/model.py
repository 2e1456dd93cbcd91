"""The rollout engine's own torch implementation of a Llama/Qwen decoder (weights in Hugging Face naming).

Why a second implementation of the policy: real RL stacks generate with an inference engine (vLLM,
SGLang) that loads the trainer's weights by name and runs its own kernels and its own FP8 scheme. The
trainer's log-probs and the engine's therefore differ even at identical weights; this module is that
second implementation, small enough to read, with the same HF weight names vLLM loads. Nothing here
imports Megatron.

Architecture (all of Llama-2/3, Qwen-2/2.5, Qwen-3 dense)::

    h_0 = E[tokens]                                                     E: [V, d]
    per layer i:
        x = RMSNorm(h, w_in)
        q, k, v = x W_q^T (+b_q), x W_k^T (+b_k), x W_v^T (+b_v)        [.., H*hd], [.., G*hd], [.., G*hd]
        (Qwen3) q, k = RMSNorm_per_head(q, w_qn), RMSNorm_per_head(k, w_kn)
        q, k = RoPE(q, pos), RoPE(k, pos)
        a = softmax(q k^T / sqrt(hd) + causal) v        (query head j uses KV head j // (H / G))
        h = h + a W_o^T
        x = RMSNorm(h, w_post)
        h = h + (silu(x W_gate^T) * (x W_up^T)) W_down^T
    logits = RMSNorm(h, w_final) W_lm^T                                  W_lm: [V, d]

RMSNorm(x, w) = x * rsqrt(mean(x^2) + eps) * w, computed in float32. RoPE uses the HF "rotate half"
convention (Megatron's default, ``rotary_interleaved=False``): with inv_freq_i = theta^(-2i/hd),
i = 0..hd/2-1, angles f = pos * inv_freq, cos = [cos f, cos f], sin = [sin f, sin f],
RoPE(x) = x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1].

FP8: every linear computes ``F.linear(scheme.quantize_activation(x), W_q, b)`` where ``W_q`` is the
weight quantized (and dequantized) once at weight sync. As vLLM does when it quantizes a BF16
checkpoint online, q/k/v and gate/up are *fused* before quantization (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` hold one weight tensor and ``scaled_fp8_quant`` gives it one per-tensor
scale), so a per-tensor scheme shares one scale across q, k and v. Embeddings, norms, attention
scores/softmax and the LM head stay in high precision (docs/design.md, "FP8").

With ``gemm="torch"`` (the torch engine on a GPU whose trainer runs real FP8, ``fp8.backend`` torch or
te) a linear whose scheme and shape torch can run keeps its weight as FP8 data + scales
(:class:`Fp8Weight`) and multiplies on torch's scaled GEMM: ``scaled_mm(activation_fp8(x), W_fp8)``,
the same FP8 values as the emulation, summed by the tensor cores.

FP8 KV cache (``kv``: a :class:`KvQuant`, ``rollout.fp8.kv_cache``): every quantized layer writes its keys
(after RoPE) and values to the cache as FP8 with the layer's float32 scales and attends to what it reads
back, ``float32(q8) * s``, as vLLM does (the rules and their sources: :mod:`nemo_fp8rl.fp8.kv_cache`);
with vLLM's CUDA kernels the query is quantized too. Prefill, decode and the no-cache reference path
all attend to the read-back values, so they agree. The cache then holds 1 byte per element.

High-precision edge layers (``high_precision_layers``, ``rollout.fp8.num_layers_at_start_in_bf16`` /
``num_layers_at_end_in_bf16``): those layers' linears run without the FP8 scheme and their KV cache stays
in the engine dtype, as in vLLM with the layers listed in the quantization config's ``ignored_layers`` and
in ``kv_cache_dtype_skip_layers``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.fp8.formats import get_format
from nemo_fp8rl.fp8.rollout import RolloutScheme
from nemo_fp8rl.rollout.fp8_setup import edge_layers
from nemo_fp8rl.fp8.kv_cache import (
    KvScales,
    dequantize_kv,
    fake_quantize_kv,
    fake_quantize_query,
    query_is_quantized,
    quantize_kv,
)

__all__ = [
    "KVCache",
    "KvQuant",
    "Fp8Weight",
    "LayerWeights",
    "ModelShape",
    "RolloutWeights",
    "WeightsArg",
    "apply_rope",
    "build_weights",
    "check_hf_state_dict",
    "checked_weight_stream",
    "edge_layers",
    "expected_hf_shapes",
    "forward_decode",
    "forward_full",
    "forward_prefill",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
]

_HIGH_PRECISION = RolloutScheme()
"""The scheme ``off``: linears of high-precision edge layers."""

WeightsArg = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""What a weight sync receives: a full HF-named state dict, or a stream of ``(name, tensor)`` pairs (e.g.
:meth:`nemo_fp8rl.models.FP8Actor.iter_weights`, which holds one tensor at a time)."""


@dataclass(frozen=True)
class ModelShape:
    """The shape the rollout model runs, resolved from a ``ModelConfig`` and checked against what this
    engine implements. The derived sizes (head dim, KV heads, biases, tied head) are ModelConfig's
    (:attr:`~nemo_fp8rl.config.model.ModelConfig.head_dim`, ``num_kv_heads``, ``qkv_bias``,
    ``tied_embeddings``); this only freezes them with the engine's field names."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int | None
    norm_epsilon: float
    rotary_base: float
    rope_scaling_factor: float | None
    qk_layernorm: bool
    qkv_bias: bool
    linear_bias: bool
    tied_embeddings: bool
    seq_length: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        """Resolve ``cfg`` (a :class:`nemo_fp8rl.config.model.ModelConfig`).

        Raises ``ValueError`` for shapes or options this engine does not implement, naming the key.
        """
        if cfg.normalization != "RMSNorm":
            raise ValueError(f"model.normalization={cfg.normalization!r}: the torch rollout engine implements "
                             "RMSNorm only")
        if cfg.activation != "swiglu":
            raise ValueError(f"model.activation={cfg.activation!r}: the torch rollout engine implements swiglu only")
        heads, groups = int(cfg.num_attention_heads), int(cfg.num_kv_heads)
        if heads % groups != 0:
            raise ValueError(
                f"model.num_attention_heads={heads} is not a multiple of model.num_query_groups={groups}"
            )
        if not cfg.kv_channels and cfg.hidden_size % heads != 0:
            raise ValueError(
                f"model.hidden_size={cfg.hidden_size} is not divisible by model.num_attention_heads={heads}; "
                "set model.kv_channels"
            )
        hd = int(cfg.head_dim)
        if hd % 2 != 0:
            raise ValueError(f"head dimension {hd} is odd; RoPE needs an even model.kv_channels")
        return cls(
            num_layers=int(cfg.num_layers),
            hidden_size=int(cfg.hidden_size),
            num_heads=heads,
            num_groups=groups,
            head_dim=hd,
            ffn_hidden_size=int(cfg.ffn_hidden_size),
            vocab_size=None if cfg.vocab_size is None else int(cfg.vocab_size),
            norm_epsilon=float(cfg.norm_epsilon),
            rotary_base=float(cfg.rotary_base),
            rope_scaling_factor=None if cfg.rope_scaling_factor is None else float(cfg.rope_scaling_factor),
            qk_layernorm=bool(cfg.qk_layernorm),
            qkv_bias=bool(cfg.qkv_bias),
            linear_bias=bool(cfg.add_bias_linear),
            tied_embeddings=bool(cfg.tied_embeddings),
            seq_length=int(cfg.seq_length),
        )


def expected_hf_shapes(shape: ModelShape, vocab_rows: int) -> dict[str, tuple[int, ...]]:
    """Every key ``update_weights`` must receive, with its shape (``vocab_rows`` = rows of the embedding).

    ``lm_head.weight`` is listed unless the embeddings are tied (then it is optional; see
    :func:`check_hf_state_dict`).
    """
    d, hd, H, G, f = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_groups, shape.ffn_hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_rows, d), "model.norm.weight": (d,)}
    if not shape.tied_embeddings:
        out["lm_head.weight"] = (vocab_rows, d)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        out[p + "self_attn.q_proj.weight"] = (H * hd, d)
        out[p + "self_attn.k_proj.weight"] = (G * hd, d)
        out[p + "self_attn.v_proj.weight"] = (G * hd, d)
        out[p + "self_attn.o_proj.weight"] = (d, H * hd)
        out[p + "mlp.gate_proj.weight"] = (f, d)
        out[p + "mlp.up_proj.weight"] = (f, d)
        out[p + "mlp.down_proj.weight"] = (d, f)
        if shape.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (H * hd,)
            out[p + "self_attn.k_proj.bias"] = (G * hd,)
            out[p + "self_attn.v_proj.bias"] = (G * hd,)
        if shape.linear_bias:
            out[p + "self_attn.o_proj.bias"] = (d,)
            out[p + "mlp.gate_proj.bias"] = (f,)
            out[p + "mlp.up_proj.bias"] = (f,)
            out[p + "mlp.down_proj.bias"] = (d,)
        if shape.qk_layernorm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
    return out


def check_hf_state_dict(shape: ModelShape, sd: Mapping[str, torch.Tensor]) -> int:
    """Validate a weight-sync state dict against the model shape; return the vocabulary rows V.

    Raises ``ValueError`` listing every missing, unexpected and mis-shaped key at once (so one failed
    sync tells the whole story), plus non-tensor or non-floating values and non-finite weights.
    """
    emb = sd.get("model.embed_tokens.weight")
    if not isinstance(emb, torch.Tensor) or emb.dim() != 2:
        raise ValueError(
            "weight sync: 'model.embed_tokens.weight' is missing or not a 2-D tensor; the state dict must use "
            f"Hugging Face Llama/Qwen names (got {len(sd)} keys, e.g. {sorted(sd)[:3]})"
        )
    rows = int(emb.shape[0])
    problems: list[str] = []
    if shape.vocab_size is not None and rows < shape.vocab_size:
        problems.append(f"model.embed_tokens.weight has {rows} rows < model.vocab_size={shape.vocab_size}")
    want = expected_hf_shapes(shape, rows)
    optional = {"lm_head.weight": (rows, shape.hidden_size)} if shape.tied_embeddings else {}
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want) - set(optional))
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing}")
    if extra:
        problems.append(
            f"unexpected keys ({len(extra)}): {extra} (check model.qk_layernorm, model.add_qkv_bias, "
            "model.add_bias_linear, model.untie_embeddings_and_output_weights, model.num_layers)"
        )
    flags = []
    for k, v in sd.items():
        exp = want.get(k, optional.get(k))
        if exp is None:
            continue
        problem = _check_tensor(k, v, exp)
        if problem:
            problems.append(problem)
        else:
            flags.append((k, torch.isfinite(v).all()))
    problems += [f"{k}: contains NaN or Inf" for k in _nonfinite(flags)]
    if problems:
        raise ValueError("weight sync rejected:\n  " + "\n  ".join(problems))
    return rows


def _check_tensor(name: str, v: Any, exp: tuple[int, ...]) -> str | None:
    """The problem with one synced tensor (not a floating tensor, wrong shape), or None. Finiteness is
    checked apart (:func:`_nonfinite`), all tensors of a sync at once."""
    if not isinstance(v, torch.Tensor) or not torch.is_floating_point(v):
        return (f"{name}: expected a floating-point tensor, got {type(v).__name__}"
                + (f" of dtype {v.dtype}" if isinstance(v, torch.Tensor) else ""))
    if tuple(v.shape) != exp:
        return f"{name}: shape {tuple(v.shape)}, expected {exp}"
    return None


def _nonfinite(flags: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names whose flag ``torch.isfinite(t).all()`` (a 0-d bool tensor, still on the tensor's device) is
    False, read with one host sync per device for the whole sync rather than one per tensor (issue 39: a
    GPU sync of a Qwen3-8B streams ~400 tensors)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, f in flags:
        by_device.setdefault(f.device, []).append((name, f))
    bad = []
    for pairs in by_device.values():
        ok = torch.stack([f for _, f in pairs]).tolist()
        bad += [name for (name, _), good in zip(pairs, ok) if not good]
    return bad


def checked_weight_stream(shape: ModelShape, weights: WeightsArg) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the ``(name, tensor)`` pairs of a weight sync, each checked before it is passed on.

    ``weights`` is a full state dict (checked at once by :func:`check_hf_state_dict`, so one error lists
    every problem) or a stream of pairs in any order (each pair is checked as it arrives: a known HF name
    not seen before, a floating tensor of the expected shape, finite; after the last pair, every expected
    name must have come; every tensor finite, read once for the whole stream after its last pair: one host
    sync per sync, not per tensor). A stream is never collected: the consumer holds what it keeps, nothing
    more.
    The vocabulary rows V are taken from the first of ``model.embed_tokens.weight`` / ``lm_head.weight``
    to arrive (V >= ``shape.vocab_size``); the other must match. ``lm_head.weight`` is optional when the
    embeddings are tied. Raises ``ValueError`` ("weight sync rejected: ...") at the first bad pair, or
    after the last one for missing names and non-finite tensors (all of them named): the consumer has then
    seen only part of the new weights, or bad ones, and must not be used until a complete sync
    (:func:`build_weights` raises before it returns, so an engine keeps its previous weights).
    """
    if isinstance(weights, Mapping):
        check_hf_state_dict(shape, weights)
        yield from weights.items()
        return
    seen: set[str] = set()
    flags: list[tuple[str, torch.Tensor]] = []
    want: dict[str, tuple[int, ...]] | None = None
    vocab_keys = ("model.embed_tokens.weight", "lm_head.weight")
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"weight sync rejected: a stream must yield (name, tensor) pairs, got {type(item).__name__}")
        name, v = item
        if want is None and name in vocab_keys:
            if not isinstance(v, torch.Tensor) or v.dim() != 2:
                raise ValueError(f"weight sync rejected: {name} is not a 2-D tensor")
            rows = int(v.shape[0])
            if shape.vocab_size is not None and rows < shape.vocab_size:
                raise ValueError(f"weight sync rejected: {name} has {rows} rows < model.vocab_size={shape.vocab_size}")
            want = expected_hf_shapes(shape, rows)
            want.setdefault("lm_head.weight", (rows, shape.hidden_size))
        if name in seen:
            raise ValueError(f"weight sync rejected: {name} arrived twice in one sync")
        # before the first vocabulary tensor, V is unknown; no other shape depends on it
        names = want if want is not None else expected_hf_shapes(shape, 1)
        if name not in names:
            raise ValueError(
                f"weight sync rejected: unexpected key {name} (check model.qk_layernorm, model.add_qkv_bias, "
                "model.add_bias_linear, model.untie_embeddings_and_output_weights, model.num_layers)"
            )
        problem = _check_tensor(name, v, names[name])
        if problem:
            raise ValueError("weight sync rejected: " + problem)
        flags.append((name, torch.isfinite(v).all()))
        seen.add(name)
        yield name, v
    bad = _nonfinite(flags)
    if bad:
        raise ValueError(f"weight sync rejected: {len(bad)} tensor(s) contain NaN or Inf: {bad[:8]}"
                         + (" ..." if len(bad) > 8 else ""))
    required = set(want if want is not None else expected_hf_shapes(shape, 1))
    if shape.tied_embeddings:
        required.discard("lm_head.weight")
    missing = sorted(required - seen)
    if missing:
        raise ValueError(f"weight sync rejected: the stream ended without {len(missing)} keys: {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2, -1) + eps) * weight``, computed in float32.

    Shapes: ``x`` [..., n], ``weight`` [n] -> [..., n] in ``x``'s dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rope_inv_freq(shape: ModelShape) -> torch.Tensor:
    """RoPE inverse frequencies, float32 [hd/2]: ``inv_freq_i = 1 / theta^(2i / hd)``.

    With ``rope_scaling_factor`` s (Llama-3.1 scaling, original context 8192, low/high frequency factors
    1 and 4, as Megatron and HF use by default): wavelength w_i = 2 pi / inv_freq_i; w_i > 8192 (low
    frequency) -> inv_freq_i / s; w_i < 8192 / 4 (high frequency) -> unchanged; in between blend with
    mu = (8192 / w_i - 1) / (4 - 1): (1 - mu) inv_freq_i / s + mu inv_freq_i.
    """
    hd = shape.head_dim
    inv = 1.0 / (shape.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    s = shape.rope_scaling_factor
    if s is None:
        return inv
    orig, lo_f, hi_f = 8192.0, 1.0, 4.0
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = orig / lo_f, orig / hi_f
    scaled = torch.where(wavelen > low_wl, inv / s, inv)
    mu = (orig / wavelen - lo_f) / (hi_f - lo_f)
    smooth = (1 - mu) * scaled / s + mu * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, smooth, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer ``positions`` [...] -> two float32 tensors [..., hd].

    f = positions[..., None] * inv_freq (float32), emb = [f, f], returns (cos emb, sin emb).
    """
    f = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin``, rotate_half([x1, x2]) = [-x2, x1].

    Shapes: ``x`` [B, T, n_heads, hd], ``cos``/``sin`` [B, T, hd] (broadcast over heads) -> [B, T, n_heads, hd].
    """
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c, s = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return x * c + rot * s


@dataclass
class Fp8Weight:
    """A linear weight kept in FP8 for torch's scaled GEMM: ``q`` (data [N, K] + scales) of the scheme."""

    q: Any  # nemo_fp8rl.fp8.backends.QuantizedOperand
    dtype: torch.dtype  # the engine's compute dtype (output of the GEMM)

    @property
    def shape(self) -> torch.Size:
        return self.q.data.shape


@dataclass
class LayerWeights:
    """One decoder layer's weights after sync. Linear weights are fused and FP8-quantized-dequantized."""

    input_norm: torch.Tensor  # [d]
    post_norm: torch.Tensor  # [d]
    w_qkv: torch.Tensor | Fp8Weight  # [(H + 2G) * hd, d] (the four linears: a tensor, or FP8 for torch GEMMs)
    b_qkv: torch.Tensor | None  # [(H + 2G) * hd]
    w_o: torch.Tensor  # [d, H * hd]
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor  # [2f, d]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [d, f]
    b_down: torch.Tensor | None
    q_norm: torch.Tensor | None  # [hd]
    k_norm: torch.Tensor | None  # [hd]
    high_precision: bool = False  # an edge layer kept out of FP8 (linears and KV cache)


@dataclass
class RolloutWeights:
    """All weights of the rollout model (on the engine's device and dtype)."""

    embed: torch.Tensor  # [V, d]
    lm_head: torch.Tensor  # [V, d] float32
    final_norm: torch.Tensor  # [d]
    layers: list[LayerWeights]
    inv_freq: torch.Tensor  # [hd/2] float32
    linear_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per fused linear, what the sync's quantization did: amax of the weight, the scale(s) the scheme
    reported when it exposes them, and the relative quantization error ||W_q - W|| / ||W||."""


def _quantize_linear(scheme: Any, name: str, w: torch.Tensor, stats: dict[str, dict[str, Any]],
                     dtype: torch.dtype, gemm: str = "emulate") -> torch.Tensor | Fp8Weight:
    """Quantize one (fused) linear weight [N, K] with the scheme and record what it did in ``stats``.

    ``w`` arrives in the dtype it was synced in (float32 from the CPU export; the engine dtype, e.g. BF16,
    from a colocated device-to-device sync) and is not copied to float32 here: the rollout schemes upcast
    inside their quantizer (the same bits from a BF16 weight as from its exact float32 copy), and the
    scheme ``off`` (BF16 arm, high-precision edge layers) keeps the weight as it came.

    Returns the read-back weight in ``dtype`` (emulated GEMM) or, with ``gemm="torch"`` where the scheme
    and shape run on torch's FP8 GEMM on this device, an :class:`Fp8Weight` (``stats[name]["gemm"]``
    says which; the fallback reason is in ``stats[name]["fallback"]``). The numbers in ``stats`` stay
    0-d tensors (no host sync per linear); :func:`build_weights` converts them all at once.
    """
    rec: dict[str, Any] = {"amax": w.detach().abs().amax()}
    off = not getattr(scheme, "enabled", True)  # the scheme off: W_q = W exactly, no quantizer call
    packed = None
    reason = None
    if gemm == "torch":
        support = getattr(scheme, "torch_gemm_support", None)
        reason = support(w.device, *w.shape) if callable(support) else "custom scheme without FP8 GEMM"
        if reason is None and not off:
            packed = scheme.weight_fp8(w)
    if off:
        wq = w
        rec["rel_err"] = torch.zeros((), device=w.device)
    else:
        wq = packed.dequantize() if packed is not None else scheme.quantize_weight(w)
        if tuple(wq.shape) != tuple(w.shape):
            raise ValueError(f"rollout FP8 scheme {scheme!r}.quantize_weight changed the shape of {name}: "
                             f"{tuple(w.shape)} -> {tuple(wq.shape)}")
        w32 = w.float()
        rec["rel_err"] = (wq.float() - w32).norm() / w32.norm().clamp_min(1e-30)
        del w32
    scale_fn = getattr(scheme, "weight_scales", None)  # optional hook: the scale(s) the scheme uses for w
    if callable(scale_fn):
        s = torch.as_tensor(scale_fn(w)).float()
        rec["scale"] = s.reshape(-1)[0] if s.numel() == 1 else s.mean()
        rec["num_scales"] = float(s.numel())
    if gemm == "torch":
        rec["gemm"] = "torch" if packed is not None else "emulate"
        if reason:
            rec["fallback"] = reason
    stats[name] = rec
    return Fp8Weight(packed, dtype) if packed is not None else wq.to(dtype)


def _stats_to_floats(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The 0-d tensors of :func:`_quantize_linear`'s records as Python floats, with one host sync."""
    keys = [(n, k) for n, rec in stats.items() for k, v in rec.items() if isinstance(v, torch.Tensor)]
    if keys:
        vals = torch.stack([stats[n][k].detach().float().reshape(()) for n, k in keys]).tolist()
        for (n, k), v in zip(keys, vals):
            stats[n][k] = v
    return stats


def _build_layer(
    shape: ModelShape, i: int, sd: Mapping[str, torch.Tensor], scheme: Any, device: torch.device, dtype: torch.dtype,
    stats: dict[str, dict[str, float]], gemm: str = "emulate", high_precision: bool = False,
) -> LayerWeights:
    """Layer ``i`` from its HF tensors (checked): fuse q/k/v and gate/up, quantize the four linears
    (``high_precision``: an edge layer, its linears keep their weights: the scheme ``off``)."""
    if high_precision:
        scheme, gemm = _HIGH_PRECISION, "emulate"
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."

    def t(key: str) -> torch.Tensor:  # linear weights: in the dtype they were synced in (_quantize_linear)
        return sd[key].detach().to(device=device)

    def hp(key: str) -> torch.Tensor:  # high-precision tensors (norms, biases)
        return sd[key].detach().to(device=device, dtype=dtype)

    w_qkv = torch.cat([t(a + "q_proj.weight"), t(a + "k_proj.weight"), t(a + "v_proj.weight")], dim=0)
    w_gu = torch.cat([t(m + "gate_proj.weight"), t(m + "up_proj.weight")], dim=0)
    return LayerWeights(
        input_norm=hp(p + "input_layernorm.weight"),
        post_norm=hp(p + "post_attention_layernorm.weight"),
        w_qkv=_quantize_linear(scheme, a + "qkv_proj", w_qkv, stats, dtype, gemm),
        b_qkv=torch.cat([hp(a + "q_proj.bias"), hp(a + "k_proj.bias"), hp(a + "v_proj.bias")])
        if shape.qkv_bias else None,
        w_o=_quantize_linear(scheme, a + "o_proj", t(a + "o_proj.weight"), stats, dtype, gemm),
        b_o=hp(a + "o_proj.bias") if shape.linear_bias else None,
        w_gate_up=_quantize_linear(scheme, m + "gate_up_proj", w_gu, stats, dtype, gemm),
        b_gate_up=torch.cat([hp(m + "gate_proj.bias"), hp(m + "up_proj.bias")]) if shape.linear_bias else None,
        w_down=_quantize_linear(scheme, m + "down_proj", t(m + "down_proj.weight"), stats, dtype, gemm),
        b_down=hp(m + "down_proj.bias") if shape.linear_bias else None,
        q_norm=hp(a + "q_norm.weight") if shape.qk_layernorm else None,
        k_norm=hp(a + "k_norm.weight") if shape.qk_layernorm else None,
        high_precision=high_precision,
    )


def build_weights(
    shape: ModelShape, weights: WeightsArg, scheme: Any, device: torch.device, dtype: torch.dtype,
    gemm: str = "emulate", high_precision_layers: Iterable[int] = (),
) -> RolloutWeights:
    """Validate the synced weights (HF names), fuse q/k/v and gate/up, quantize the linear weights with ``scheme``.

    ``weights``: a full state dict or a stream of ``(name, tensor)`` pairs in any order
    (:func:`checked_weight_stream`). A layer is built as soon as all of its tensors have arrived and its
    incoming tensors are dropped then, so a stream in layer order (``FP8Actor.iter_weights``) costs one
    layer of incoming tensors on top of the engine's own new weights, whatever the depth. The tensors
    may come in any floating dtype and on any device: a colocated sync sends them on ``device`` in
    ``dtype`` (nothing is then copied to the host or to float32 on the way, :func:`_quantize_linear`).
    ``scheme.quantize_weight`` runs once per fused linear weight per call (= per weight sync), on the
    weight as synced; the dequantized result is stored in ``dtype`` on ``device`` (``gemm="torch"``: FP8
    data + scales where torch's scaled GEMM runs the scheme, :func:`_quantize_linear`). The layers in
    ``high_precision_layers`` keep their weights (the scheme ``off``: BF16 edge layers).
    """
    hp_layers = frozenset(int(i) for i in high_precision_layers)
    per_layer = {i: 0 for i in range(shape.num_layers)}
    for k in expected_hf_shapes(shape, 1):
        if k.startswith("model.layers."):
            per_layer[int(k.split(".")[2])] += 1
    pending: dict[int, dict[str, torch.Tensor]] = {}
    layers: list[LayerWeights | None] = [None] * shape.num_layers
    layer_stats: list[dict[str, dict[str, float]]] = [{} for _ in range(shape.num_layers)]
    top: dict[str, torch.Tensor] = {}
    for name, v in checked_weight_stream(shape, weights):
        if not name.startswith("model.layers."):
            top[name] = v.detach().to(device=device, dtype=dtype)
            continue
        i = int(name.split(".")[2])
        got = pending.setdefault(i, {})
        got[name] = v
        if len(got) == per_layer[i]:
            layers[i] = _build_layer(shape, i, pending.pop(i), scheme, device, dtype, layer_stats[i], gemm,
                                     high_precision=i in hp_layers)
    assert not pending and all(lw is not None for lw in layers), "checked_weight_stream ensures every key came"
    embed = top["model.embed_tokens.weight"]
    return RolloutWeights(
        embed=embed,
        # float32 once per sync: the logits are float32 (_logits), and a BF16 engine would otherwise copy the
        # V x d head to float32 at every decoded token (a no-op for the float32 CPU engine)
        lm_head=top.get("lm_head.weight", embed).float(),
        final_norm=top["model.norm.weight"],
        layers=layers,  # type: ignore[arg-type]
        inv_freq=rope_inv_freq(shape).to(device),
        linear_stats=_stats_to_floats({k: v for st in layer_stats for k, v in st.items()}),
    )


@dataclass
class KvQuant:
    """The FP8 KV cache an engine emulates (:mod:`nemo_fp8rl.fp8.kv_cache`, vLLM's rules).

    ``fmt``: ``e4m3`` | ``e5m2``; ``kernel``: ``cuda`` | ``cpu`` (which vLLM cache writer, and whether the
    query is quantized too); ``scales``: per-layer float32 q/k/v scales (:class:`KvScales`);
    ``high_precision_layers``: layers whose cache stays in the engine dtype.
    """

    fmt: str
    kernel: str
    scales: KvScales
    high_precision_layers: frozenset[int] = frozenset()
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """device -> (the KvScales uploaded, its [3, L] float32 table there) (:meth:`scale_tensors`), and "host" ->
    (the KvScales read, its per-layer float triples) (:meth:`layer_scales`)."""

    def __post_init__(self) -> None:
        get_format(self.fmt)
        self.high_precision_layers = frozenset(int(i) for i in self.high_precision_layers)
        self.quantize_query = query_is_quantized(self.fmt, self.kernel)

    @property
    def dtype(self) -> torch.dtype:
        """The FP8 dtype of the stored codes."""
        return get_format(self.fmt).dtype

    def layer_scales(self, i: int) -> tuple[float, float, float] | None:
        """``(q_scale, k_scale, v_scale)`` of layer ``i`` as Python floats (the Triton decode kernel's
        arguments), or None when its cache is not quantized. Read from the scales once per set of scales (a
        ``float`` of a tensor element per layer and token would cost host time at every decode step)."""
        if i in self.high_precision_layers:
            return None
        hit = self._on_device.get("host")
        if hit is None or hit[0] is not self.scales:
            floats = list(zip(self.scales.q.tolist(), self.scales.k.tolist(), self.scales.v.tolist()))
            hit = self._on_device["host"] = (self.scales, floats)
        return hit[1][i]

    def scale_tensors(self, i: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(q_scale, k_scale, v_scale)`` of layer ``i`` as float32 0-d tensors on ``device`` (views of one
        [3, L] table uploaded once per device and set of scales), or None when its cache is not quantized.

        What the quantize/dequantize ops take on every decode step: on a GPU a Python float given to an op
        is uploaded each time (a blocking copy: a stream sync per layer and token, and an error inside a CUDA
        graph capture), and ATen's CUDA division by a Python scalar multiplies by its float32 reciprocal,
        not vLLM's ``x / s``. The values are the floats of :meth:`layer_scales`."""
        if i in self.high_precision_layers:
            return None
        t = self.scale_table(device)
        return t[0, i], t[1, i], t[2, i]

    def scale_table(self, device: torch.device) -> torch.Tensor:
        """The q/k/v scales of every layer, [3, L] float32 on ``device``: uploaded at the first call per device
        and set of scales (:meth:`scale_tensors`)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # one key for "cuda" and the tensors' "cuda:<i>"
            device = torch.device("cuda", torch.cuda.current_device())
        hit = self._on_device.get(device)
        if hit is None or hit[0] is not self.scales:  # set_kv_scales replaces the KvScales object
            table = torch.stack([self.scales.q, self.scales.k, self.scales.v]).to(device=device, dtype=torch.float32)
            hit = self._on_device[device] = (self.scales, table)
        return hit[1]

    def query(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s query as the attention sees it: quantized and read back (float32) where vLLM does
        (``cuda`` kernel, E4M3 cache, a quantized layer), else unchanged."""
        sc = self.scale_tensors(i, q.device)
        if sc is None:
            return q
        return fake_quantize_query(q, sc[0]) if self.quantize_query else q.float()

    def fake_quantize(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Layer ``i``'s (query, keys, values) as the attention sees them with an FP8 cache: the float32
        read-back values (the query quantized only with the ``cuda`` kernel, E4M3); unchanged for a
        high-precision layer."""
        sc = self.scale_tensors(i, k.device)
        if sc is None:
            return q, k, v
        _, ks, vs = sc
        return self.query(i, q), fake_quantize_kv(k, ks, self.fmt, self.kernel), fake_quantize_kv(v, vs, self.fmt, self.kernel)


@dataclass
class KVCache:
    """Preallocated keys and values per layer: ``k[i]``, ``v[i]`` of shape [B, G, S, hd].

    Row b holds the keys of its own sequence at positions 0..(its length - 1); positions beyond are
    stale and masked out by the attention until overwritten. With an FP8 cache (``kv``) a quantized
    layer's tensors hold the FP8 codes as ``uint8`` (1 byte per element; :meth:`write` and :meth:`read`
    convert), a high-precision layer's hold the engine dtype.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    kv: KvQuant | None = None

    @classmethod
    def empty(cls, shape: ModelShape, batch: int, max_len: int, device: torch.device, dtype: torch.dtype,
              kv: KvQuant | None = None) -> KVCache:
        dims = (batch, shape.num_groups, max_len, shape.head_dim)

        def dt(i: int) -> torch.dtype:
            return torch.uint8 if kv is not None and kv.layer_scales(i) is not None else dtype

        if kv is not None:  # upload the scales now, before any decode step (or CUDA graph capture) needs them
            kv.scale_table(device)
        return cls(
            k=[torch.zeros(dims, device=device, dtype=dt(i)) for i in range(shape.num_layers)],
            v=[torch.zeros(dims, device=device, dtype=dt(i)) for i in range(shape.num_layers)],
            kv=kv,
        )

    def write(self, i: int, index: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer ``i``'s keys and values at ``index`` of its [B, G, S, hd] tensors (FP8 codes when quantized)."""
        sc = None if self.kv is None else self.kv.scale_tensors(i, self.k[i].device)
        if sc is not None:
            _, ks, vs = sc
            k = quantize_kv(k, ks, self.kv.fmt, self.kv.kernel).view(torch.uint8)
            v = quantize_kv(v, vs, self.kv.fmt, self.kv.kernel).view(torch.uint8)
        self.k[i][index] = k
        self.v[i][index] = v

    def read(self, i: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values at positions [0, length): [B, G, length, hd], float32 read-back
        values (``float32(q8) * s``) for a quantized layer, else the stored tensors."""
        k, v = self.k[i][:, :, :length], self.v[i][:, :, :length]
        sc = None if self.kv is None else self.kv.scale_tensors(i, k.device)
        if sc is None:
            return k, v
        _, ks, vs = sc
        return dequantize_kv(k.view(self.kv.dtype), ks), dequantize_kv(v.view(self.kv.dtype), vs)

    def attend_decode(self, i: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Layer ``i``'s decode attention read straight from its FP8 codes, where the Triton kernel runs
        (:mod:`nemo_fp8rl.fp8.kernels.kv_attention`: CUDA; the interpreter in tests), else None (the caller
        reads the cache back with :meth:`read` and runs SDPA).

        ``softmax(q k_hat^T / sqrt(hd)) v_hat`` over positions 0..positions[b] of row b, k_hat / v_hat the
        read-back values ``float32(code) * s`` :meth:`read` would return. Shapes: q [B, H, 1, hd] (the query as
        :meth:`KvQuant.query` gives it), positions [B] -> [B, 1, H*hd] float32. Equal to the SDPA path within
        float32 rounding (another summation order), not bit for bit. None too for a high-precision layer or
        without an FP8 cache."""
        sc = None if self.kv is None else self.kv.layer_scales(i)
        if sc is None or q.shape[2] != 1:
            return None
        from nemo_fp8rl.fp8 import kernels

        if kernels.kernel_unavailable(q.device) is not None:
            return None
        _, ks, vs = sc
        o = kernels.kv_ops().decode_attention(q[:, :, 0], self.k[i], self.v[i], positions, ks, vs, self.kv.fmt)
        return o.reshape(q.shape[0], 1, -1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (LongTensor [B']) - used when sequences finish. One layer at a time,
        each old tensor freed as its copy replaces it: the peak is the cache plus one layer's rows, not two
        caches."""
        for i in range(len(self.k)):
            self.k[i] = self.k[i].index_select(0, rows)
            self.v[i] = self.v[i].index_select(0, rows)


def _linear(scheme: Any, x: torch.Tensor, w: torch.Tensor | Fp8Weight, b: torch.Tensor | None) -> torch.Tensor:
    """FP8 linear ``quantize_activation(x) @ W_q^T + b``; x [..., K], W_q [N, K] -> [..., N].

    Emulated (``w`` a tensor: the read-back weight) or on torch's scaled GEMM (``w`` an
    :class:`Fp8Weight`: the activation's FP8 data and scales from ``scheme.activation_fp8``).
    """
    if isinstance(w, Fp8Weight):
        from nemo_fp8rl.fp8.backends import scaled_gemm

        x2 = x.reshape(-1, x.shape[-1])
        y = scaled_gemm(scheme.activation_fp8(x2), w.q, w.dtype)
        if b is not None:
            y = y + b
        return y.reshape(*x.shape[:-1], w.shape[0])
    return F.linear(scheme.quantize_activation(x).to(w.dtype), w, b)


def _qkv(shape: ModelShape, lw: LayerWeights, scheme: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Project, (QK-)normalise and rotate: x [B, T, d] -> q [B, H, T, hd], k and v [B, G, T, hd]."""
    B, T, _ = x.shape
    H, G, hd = shape.num_heads, shape.num_groups, shape.head_dim
    qkv = _linear(scheme, rms_norm(x, lw.input_norm, shape.norm_epsilon), lw.w_qkv, lw.b_qkv)
    q, k, v = qkv.split([H * hd, G * hd, G * hd], dim=-1)
    q, k, v = q.view(B, T, H, hd), k.view(B, T, G, hd), v.view(B, T, G, hd)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, shape.norm_epsilon)
        k = rms_norm(k, lw.k_norm, shape.norm_epsilon)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _sdpa_supports_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5)."""
    try:
        x = torch.zeros(1, 2, 1, 2)
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


_SDPA_GQA = _sdpa_supports_gqa()
"""SDPA groups the KV heads itself (query head j reads KV head j // (H / G)), without the H / G repeated
copies of K and V that ``repeat_interleave`` writes at every layer and decode step; the same values bit for
bit on CPU (tests/rollout/test_decode_host_syncs.py)."""


def _sdpa_gqa(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`_attend` passes ``enable_gqa`` for query ``q`` (and ``mask``) rather than repeating K/V.

    On CUDA only FlashAttention takes grouped KV heads, and it takes neither an ``attn_mask`` nor float32:
    a masked decode step or the float32 attention of an FP8 KV cache's read-back would fall to SDPA's math
    kernel, which materializes the [B, H, Tq, S] float32 scores (tens of GiB for a prefill of 512 x 1024
    tokens). Repeated K/V keep those on the memory-efficient kernel. The CPU kernels take grouped heads
    with a mask and in float32."""
    if not _SDPA_GQA:
        return False
    if q.device.type != "cuda":
        return True
    return mask is None and q.dtype in (torch.float16, torch.bfloat16)


def _attend(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """softmax(q k^T / sqrt(hd) + mask) v with grouped KV heads; causal when ``mask`` is None.

    Shapes: q [B, H, Tq, hd]; k, v [B, G, S, hd]; mask bool [B, 1, Tq, S] (True = attend) -> [B, Tq, H*hd].
    SDPA's ``enable_gqa`` where a fused kernel takes it (:func:`_sdpa_gqa`), else K and V repeated per query
    head (query head j reads KV head j // (H / G), as ``repeat_interleave`` orders them).
    """
    rep = shape.num_heads // shape.num_groups
    kw = {}
    if rep > 1 and _sdpa_gqa(q, mask):
        kw["enable_gqa"] = True
    elif rep > 1:
        B, G, S, hd = k.shape
        # a broadcast view copied once: no repeat count tensor (no upload; CUDA graph safe)
        k = k[:, :, None].expand(B, G, rep, S, hd).reshape(B, G * rep, S, hd)
        v = v[:, :, None].expand(B, G, rep, S, hd).reshape(B, G * rep, S, hd)
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    B, _, Tq, _ = o.shape
    return o.transpose(1, 2).reshape(B, Tq, -1)


def _mlp_and_residual(shape: ModelShape, lw: LayerWeights, scheme: Any, h: torch.Tensor, a: torch.Tensor):
    """h + o_proj(a), then + down(silu(gate x) * up x) with x = RMSNorm(h). Shapes [B, T, d]."""
    h = h + _linear(scheme, a, lw.w_o, lw.b_o)
    x = rms_norm(h, lw.post_norm, shape.norm_epsilon)
    g, u = _linear(scheme, x, lw.w_gate_up, lw.b_gate_up).chunk(2, dim=-1)
    return h + _linear(scheme, F.silu(g) * u, lw.w_down, lw.b_down)


def _logits(shape: ModelShape, w: RolloutWeights, h: torch.Tensor) -> torch.Tensor:
    """Final RMSNorm and LM head in float32: h [..., d] -> logits [..., V] float32 (not quantized)."""
    return F.linear(rms_norm(h, w.final_norm, shape.norm_epsilon).float(), w.lm_head.float())


def _layer_scheme(lw: LayerWeights, scheme: Any) -> Any:
    """The FP8 scheme of a layer's linears: none for a high-precision edge layer."""
    return _HIGH_PRECISION if lw.high_precision else scheme


def forward_full(shape: ModelShape, w: RolloutWeights, scheme: Any, tokens: torch.Tensor,
                 kv: KvQuant | None = None) -> torch.Tensor:
    """No-cache causal forward of whole sequences: tokens [B, T] (positions 0..T-1) -> logits [B, T, V] fp32.

    The reference path: generation with the KV cache must reproduce these logits. With an FP8 cache
    (``kv``) each layer attends to its keys and values (and query) as the cache would give them back.
    """
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    cos, sin = rope_cos_sin(pos, w.inv_freq)
    h = w.embed[tokens]
    for i, lw in enumerate(w.layers):
        s = _layer_scheme(lw, scheme)
        q, k, v = _qkv(shape, lw, s, h, cos, sin)
        if kv is not None:
            q, k, v = kv.fake_quantize(i, q, k, v)
        h = _mlp_and_residual(shape, lw, s, h, _attend(shape, q, k, v, None).to(h.dtype))
    return _logits(shape, w, h)


def forward_prefill(
    shape: ModelShape, w: RolloutWeights, scheme: Any, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Run right-padded prompts, fill ``cache`` positions 0..P-1, return logits at each prompt's last token.

    Shapes: tokens [B, P] (row b valid for t < lengths[b]), lengths [B] -> logits [B, V] float32 at
    position lengths[b] - 1. Causal attention means the padding after a prompt never reaches its tokens.
    The prompt attends to its keys and values as read back from the cache (as vLLM's attention reads
    its paged cache, the current tokens included).
    """
    B, P = tokens.shape
    pos = torch.arange(P, device=tokens.device).expand(B, P)
    cos, sin = rope_cos_sin(pos, w.inv_freq)
    h = w.embed[tokens]
    for i, lw in enumerate(w.layers):
        s = _layer_scheme(lw, scheme)
        q, k, v = _qkv(shape, lw, s, h, cos, sin)
        cache.write(i, (slice(None), slice(None), slice(0, P)), k, v)
        if cache.kv is not None:
            k, v = cache.read(i, P)
            q = cache.kv.query(i, q)
        h = _mlp_and_residual(shape, lw, s, h, _attend(shape, q, k, v, None).to(h.dtype))
    last = h[torch.arange(B, device=h.device), lengths - 1]
    return _logits(shape, w, last)


def forward_decode(
    shape: ModelShape, w: RolloutWeights, scheme: Any, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
    length: int | None = None,
) -> torch.Tensor:
    """One incremental step: token ``tokens[b]`` at position ``positions[b]`` -> next-token logits [B, V].

    Writes the new keys/values at ``positions[b]`` of row b, then attends to cache positions
    0..positions[b] of that row (ragged rows: each has its own length). Shapes: tokens, positions [B].
    ``length``: the cache positions read, ``max(positions) + 1``; a caller that knows it on the host passes
    it (None reads it from ``positions``: a host sync per step on a GPU). With an FP8 cache a quantized layer
    attends straight from its codes where the Triton kernel runs (:meth:`KVCache.attend_decode`), else to the
    read-back values through SDPA.
    """
    B = tokens.shape[0]
    rows = torch.arange(B, device=tokens.device)
    cos, sin = rope_cos_sin(positions.unsqueeze(1), w.inv_freq)  # [B, 1, hd]
    S = int(positions.max()) + 1 if length is None else int(length)
    mask = (torch.arange(S, device=tokens.device).unsqueeze(0) <= positions.unsqueeze(1)).view(B, 1, 1, S)
    h = w.embed[tokens].unsqueeze(1)  # [B, 1, d]
    for i, lw in enumerate(w.layers):
        s = _layer_scheme(lw, scheme)
        q, k, v = _qkv(shape, lw, s, h, cos, sin)
        cache.write(i, (rows, slice(None), positions), k[:, :, 0], v[:, :, 0])
        a = None
        if cache.kv is not None:
            q = cache.kv.query(i, q)
            a = cache.attend_decode(i, q, positions)  # the codes read in the kernel, where it runs
        if a is None:
            kk, vv = cache.read(i, S)
            a = _attend(shape, q, kk, vv, mask)
        a = a.to(h.dtype)
        h = _mlp_and_residual(shape, lw, s, h, a)
    return _logits(shape, w, h[:, 0])
