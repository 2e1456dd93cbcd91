"""Megatron GPT <-> Hugging Face Llama/Qwen weights, for any TP/PP layout.

Hugging Face names (Llama, Qwen2/2.5, Qwen3), for layer i:

==============================================  ===========================================================
HF                                              megatron (this rank, TP rank r of tp, stage owning layer i)
==============================================  ===========================================================
model.embed_tokens.weight [V, h]                embedding.word_embeddings.weight [Vp/tp, h] (rows padded)
model.layers.i.input_layernorm.weight [h]       decoder.layers.j.input_layernorm.weight
                                                (TE spec: self_attention.linear_qkv.layer_norm_weight)
model.layers.i.self_attn.{q,k,v}_proj.* [.., h] self_attention.linear_qkv.* [ng/tp * (np/ng + 2) * hn, h]
model.layers.i.self_attn.{q,k}_norm.weight [hn] self_attention.{q,k}_layernorm.weight
model.layers.i.self_attn.o_proj.weight [h, np*hn] self_attention.linear_proj.weight [h, np*hn/tp]
model.layers.i.post_attention_layernorm.weight  decoder.layers.j.pre_mlp_layernorm.weight
                                                (TE spec: mlp.linear_fc1.layer_norm_weight)
model.layers.i.mlp.{gate,up}_proj.weight [f, h] mlp.linear_fc1.weight [2f/tp, h] = [gate_r; up_r]
model.layers.i.mlp.down_proj.weight [h, f]      mlp.linear_fc2.weight [h, f/tp]
model.norm.weight [h]                           decoder.final_layernorm.weight
lm_head.weight [V, h]                           output_layer.weight [Vp/tp, h] (= embedding when tied)
==============================================  ===========================================================

Megatron's fused QKV interleaves per KV group g (ng groups, np/ng query heads each, head dim hn):
rows ``[q_{g,0} .. q_{g,np/ng-1}, k_g, v_g]`` for g = 0..ng-1, i.e. the full weight viewed as
[ng, np/ng + 2, hn, h]; TP rank r holds groups [r ng/tp, (r+1) ng/tp). HF keeps q_proj (query head
order = group-major, the same GQA assignment head -> group h // (np/ng)), k_proj and v_proj apart.
Megatron's gated MLP keeps gate and up in one column-parallel weight whose *local* output is chunked
in two (``x_glu, x_linear = chunk(x, 2)``), so each rank stores [gate_r; up_r], not a slice of
[gate; up]. Biases follow their weights; norm weights (and the row-parallel biases) are replicated.

Also :func:`init_hf_state_dict`: a deterministic initialisation defined in HF space (each tensor drawn
from its own generator seeded by (seed, name)), so every TP/PP layout starts from identical weights.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.config.model import ModelConfig


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(np, ng, hn, h): query heads, KV groups, head dim, hidden size."""
    return cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size


def hf_layer_names(cfg: ModelConfig, i: int) -> list[str]:
    """HF names of layer i's tensors for this architecture."""
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if cfg.normalization == "LayerNorm":
        names += [p + "input_layernorm.bias", p + "post_attention_layernorm.bias"]
    for proj in ("q", "k", "v"):
        names.append(p + f"self_attn.{proj}_proj.weight")
        if cfg.qkv_bias:
            names.append(p + f"self_attn.{proj}_proj.bias")
    names.append(p + "self_attn.o_proj.weight")
    if cfg.qk_layernorm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.normalization == "LayerNorm":
            names += [p + "self_attn.q_norm.bias", p + "self_attn.k_norm.bias"]
    mlp = ("gate", "up", "down") if cfg.gated_mlp else ("up", "down")
    for proj in mlp:
        names.append(p + f"mlp.{proj}_proj.weight")
    if cfg.add_bias_linear:
        names.append(p + "self_attn.o_proj.bias")
        names += [p + f"mlp.{proj}_proj.bias" for proj in mlp]
    return names


def hf_names(cfg: ModelConfig, layers: Optional[Iterable[int]] = None, *, embed: bool = True,
             final: bool = True) -> list[str]:
    """HF names of the whole model (or of the given layers / ends)."""
    names = ["model.embed_tokens.weight"] if embed else []
    for i in range(cfg.num_layers) if layers is None else layers:
        names += hf_layer_names(cfg, i)
    if final:
        names.append("model.norm.weight")
        if cfg.normalization == "LayerNorm":
            names.append("model.norm.bias")
        names.append("lm_head.weight")
    return names


def hf_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """Shape of an HF tensor of this architecture."""
    hn, h, q, kv = cfg.head_dim, cfg.hidden_size, cfg.q_width, cfg.kv_width
    f, v = cfg.ffn_hidden_size, cfg.vocab_size
    leaf = name.split(".")[-2] + "." + name.split(".")[-1]
    table = {
        "embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "o_proj.weight": (h, q), "o_proj.bias": (h,),
        "q_norm.weight": (hn,), "k_norm.weight": (hn,), "q_norm.bias": (hn,), "k_norm.bias": (hn,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
        "gate_proj.bias": (f,), "up_proj.bias": (f,), "down_proj.bias": (h,),
    }
    if leaf in table:
        return table[leaf]
    if "norm" in leaf:  # input/post_attention layernorm, final norm
        return (h,)
    raise KeyError(f"unknown HF tensor name {name!r}")


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the architecture as a Hugging Face checkpoint holds them (no vocabulary padding;
    a tied head counted once): sum of ``prod(hf_shape(name))`` over :func:`hf_names`."""
    total = 0
    for n in hf_names(cfg):
        if n == "lm_head.weight" and cfg.tied_embeddings:
            continue
        total += math.prod(hf_shape(cfg, n))
    return total


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_hf_state_dict(
    cfg: ModelConfig,
    seed: int,
    names: Optional[Iterable[str]] = None,
    device: "torch.device | str" = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Deterministic initial weights in HF naming, independent of any parallel layout.

    Each tensor W_name is drawn from a generator seeded with ``seed * 1000003 + crc32(name)``:
    norms = 1, biases = 0, o_proj/down_proj ~ N(0, (std / sqrt(2 L))^2) (megatron's scaled init of
    output layers), every other matrix ~ N(0, std^2) with std = ``init_method_std``, L = num_layers.
    When embeddings are tied, ``lm_head.weight`` is the same tensor values as ``embed_tokens``.
    """
    std = cfg.init_method_std
    out_std = std / math.sqrt(2.0 * cfg.num_layers)
    names = list(hf_names(cfg) if names is None else names)
    out = {}
    for name in names:
        shape = hf_shape(cfg, name)
        src = name
        if name == "lm_head.weight" and cfg.tied_embeddings:
            src = "model.embed_tokens.weight"
        if name.endswith(".bias"):
            out[name] = torch.zeros(shape, device=device, dtype=dtype)
        elif "norm" in name.rsplit(".", 2)[-2]:
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(_seed_for(seed, src))
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            out[name] = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(s).to(dtype)
    return out


# --------------------------------------------------------------------------------------------------
# Megatron module access (local spec and TE spec name things differently)
# --------------------------------------------------------------------------------------------------


def _get(module: torch.nn.Module, *paths: str) -> Optional[torch.Tensor]:
    """First existing, non-empty tensor among dotted ``paths`` relative to ``module``."""
    for path in paths:
        obj = module
        ok = True
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                ok = False
                break
        # Transformer Engine keeps an empty tensor (not None) as the bias of a bias-free layer.
        if ok and isinstance(obj, torch.Tensor) and obj.numel() > 0:
            return obj
    return None


def _layer_tensors(layer) -> dict[str, Optional[torch.Tensor]]:
    """This rank's tensors of one megatron TransformerLayer, by role."""
    return {
        "ln1.weight": _get(layer, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        "ln1.bias": _get(layer, "input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
        "qkv.weight": _get(layer, "self_attention.linear_qkv.weight"),
        "qkv.bias": _get(layer, "self_attention.linear_qkv.bias"),
        "q_norm.weight": _get(layer, "self_attention.q_layernorm.weight"),
        "q_norm.bias": _get(layer, "self_attention.q_layernorm.bias"),
        "k_norm.weight": _get(layer, "self_attention.k_layernorm.weight"),
        "k_norm.bias": _get(layer, "self_attention.k_layernorm.bias"),
        "proj.weight": _get(layer, "self_attention.linear_proj.weight"),
        "proj.bias": _get(layer, "self_attention.linear_proj.bias"),
        "ln2.weight": _get(layer, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
        "ln2.bias": _get(layer, "pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
        "fc1.weight": _get(layer, "mlp.linear_fc1.weight"),
        "fc1.bias": _get(layer, "mlp.linear_fc1.bias"),
        "fc2.weight": _get(layer, "mlp.linear_fc2.weight"),
        "fc2.bias": _get(layer, "mlp.linear_fc2.bias"),
    }


# How each role is laid out across TP: "rep" replicated, "col" split on dim 0, "row" split on dim 1,
# "qkv" grouped split on dim 0, "glu" per-rank [gate_r; up_r].
_LAYOUT = {
    "ln1.weight": "rep", "ln1.bias": "rep", "ln2.weight": "rep", "ln2.bias": "rep",
    "q_norm.weight": "rep", "q_norm.bias": "rep", "k_norm.weight": "rep", "k_norm.bias": "rep",
    "qkv.weight": "qkv", "qkv.bias": "qkv",
    "proj.weight": "row", "proj.bias": "rep",
    "fc1.weight": "col", "fc1.bias": "col",
    "fc2.weight": "row", "fc2.bias": "rep",
}


class _Tp:
    """TP rank/size/group plus an all-gather that concatenates along a dimension."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.size > 1 else 0

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    def gather_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The TP parts of ``t`` concatenated along ``dim``; ``t`` itself (no copy) without TP."""
        parts = self.gather(t)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _qkv_to_hf(full: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron full QKV [ng (np/ng + 2) hn, *rest] -> q [np hn, *rest], k, v [ng hn, *rest]."""
    np_, ng, hn, _ = _dims(cfg)
    qpg = np_ // ng
    rest = full.shape[1:]
    x = full.reshape(ng, qpg + 2, hn, *rest)
    q = x[:, :qpg].reshape(np_ * hn, *rest)
    k = x[:, qpg].reshape(ng * hn, *rest)
    v = x[:, qpg + 1].reshape(ng * hn, *rest)
    return q, k, v


def _hf_to_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of :func:`_qkv_to_hf`."""
    np_, ng, hn, _ = _dims(cfg)
    qpg = np_ // ng
    rest = q.shape[1:]
    x = torch.cat([q.reshape(ng, qpg, hn, *rest), k.reshape(ng, 1, hn, *rest), v.reshape(ng, 1, hn, *rest)], 1)
    return x.reshape(ng * (qpg + 2) * hn, *rest)


def _hf_keys_for(role: str, prefix: str, cfg: ModelConfig) -> list[str]:
    kind = role.split(".")[1]  # weight / bias
    glu = cfg.gated_mlp
    return {
        "ln1": [f"{prefix}input_layernorm.{kind}"],
        "ln2": [f"{prefix}post_attention_layernorm.{kind}"],
        "q_norm": [f"{prefix}self_attn.q_norm.{kind}"],
        "k_norm": [f"{prefix}self_attn.k_norm.{kind}"],
        "qkv": [f"{prefix}self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")],
        "proj": [f"{prefix}self_attn.o_proj.{kind}"],
        "fc1": [f"{prefix}mlp.{p}_proj.{kind}" for p in (("gate", "up") if glu else ("up",))],
        "fc2": [f"{prefix}mlp.down_proj.{kind}"],
    }[role.split(".")[0]]


def iter_stage_hf(
    model, cfg: ModelConfig, tp_group, *, device: "str | torch.device" = "cpu", dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of this pipeline stage one at a time, ``(name, tensor)``, TP-gathered (every TP rank
    gets each), in stage order: embedding, layers in order, final norm, head.

    Each tensor is a copy the caller owns, on ``device`` in ``dtype``: float32 on the CPU by default
    (file writers, the vLLM sync). A rollout engine colocated with the model asks for its own device and
    dtype (e.g. the GPU and BF16): the copy is then one device-to-device copy in that dtype, with no host
    round trip and no float32 copy. The TP gather runs in the parameters' own dtype either way.

    Collective over ``tp_group``: every TP rank of the stage must iterate it to the end. Extra memory:
    the tensor being gathered (its TP parts and the full tensor), nothing of earlier tensors unless the
    caller keeps them.
    """
    tp = _Tp(tp_group)
    glu = cfg.gated_mlp
    device = torch.device(device)

    def put(name, t):
        return name, t.detach().to(device=device, dtype=dtype, copy=True)

    if getattr(model, "pre_process", False):
        emb = tp.gather_cat(model.embedding.word_embeddings.weight.detach(), 0)
        yield put("model.embed_tokens.weight", emb[: cfg.vocab_size])
        del emb
    for layer in model.decoder.layers:
        i = layer.layer_number - 1
        prefix = f"model.layers.{i}."
        for role, t in _layer_tensors(layer).items():
            if t is None:
                continue
            keys = _hf_keys_for(role, prefix, cfg)
            layout = _LAYOUT[role]
            t = t.detach()
            if layout == "rep":
                yield put(keys[0], t)
            elif layout == "row":
                yield put(keys[0], tp.gather_cat(t, 1))
            elif layout == "qkv":
                for key, part in zip(keys, _qkv_to_hf(tp.gather_cat(t, 0), cfg)):
                    yield put(key, part)
            elif layout == "col" and glu:
                parts = [p.chunk(2, 0) for p in tp.gather(t)]
                yield put(keys[0], parts[0][0] if len(parts) == 1 else torch.cat([g for g, _ in parts], 0))
                yield put(keys[1], parts[0][1] if len(parts) == 1 else torch.cat([u for _, u in parts], 0))
                del parts
            else:  # col, not gated
                yield put(keys[0], tp.gather_cat(t, 0))
    if getattr(model, "post_process", False):
        fn = model.decoder.final_layernorm
        yield put("model.norm.weight", fn.weight)
        if getattr(fn, "bias", None) is not None:
            yield put("model.norm.bias", fn.bias)
        head = model.output_layer.weight
        if head is None:  # tied on a single stage: the head is the embedding
            head = model.embedding.word_embeddings.weight
        yield put("lm_head.weight", tp.gather_cat(head.detach(), 0)[: cfg.vocab_size])


def export_stage_hf(model, cfg: ModelConfig, tp_group) -> dict[str, torch.Tensor]:
    """HF tensors of this pipeline stage, TP-gathered (every TP rank gets them), float32 on CPU
    (:func:`iter_stage_hf` collected). Collective over ``tp_group``."""
    return dict(iter_stage_hf(model, cfg, tp_group))


def stage_hf_names(model, cfg: ModelConfig) -> list[str]:
    """HF names this pipeline stage holds (embedding on the first, norm/head on the last)."""
    layers = [layer.layer_number - 1 for layer in model.decoder.layers]
    return hf_names(cfg, layers, embed=getattr(model, "pre_process", False),
                    final=getattr(model, "post_process", False))


def stage_hf_manifest(model, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape)]`` of the full (TP-gathered) HF tensors :func:`iter_stage_hf` yields for this
    pipeline stage, in the order it yields them, from the model's structure alone (no gather, no
    collective): the same walk over the stage's layers and roles, shapes from :func:`hf_shape`."""
    out = []
    if getattr(model, "pre_process", False):
        out.append("model.embed_tokens.weight")
    for layer in model.decoder.layers:
        prefix = f"model.layers.{layer.layer_number - 1}."
        for role, t in _layer_tensors(layer).items():
            if t is not None:
                out += _hf_keys_for(role, prefix, cfg)
    if getattr(model, "post_process", False):
        out.append("model.norm.weight")
        if getattr(model.decoder.final_layernorm, "bias", None) is not None:
            out.append("model.norm.bias")
        out.append("lm_head.weight")
    return [(n, hf_shape(cfg, n)) for n in out]


@torch.no_grad()
def load_stage_hf(model, cfg: ModelConfig, hf: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    """Copy this rank's shard of the HF tensors into the megatron stage (inverse of export).

    Raises:
        KeyError: a tensor this stage needs is missing from ``hf`` (lists the missing names).
        ValueError: a tensor has the wrong shape for the configured architecture.
    """
    missing = [n for n in stage_hf_names(model, cfg) if n not in hf]
    if "lm_head.weight" in missing and "model.embed_tokens.weight" in hf and \
            cfg.tied_embeddings:
        missing.remove("lm_head.weight")  # tied checkpoints usually omit the head
    if missing:
        raise KeyError(f"load_weights: {len(missing)} tensors missing, e.g. {missing[:5]}")
    for n in stage_hf_names(model, cfg):
        if n in hf and tuple(hf[n].shape) != hf_shape(cfg, n):
            raise ValueError(f"load_weights: {n} has shape {tuple(hf[n].shape)}, the model config expects "
                             f"{hf_shape(cfg, n)}; check model.* against the checkpoint's config.json")
    glu = cfg.gated_mlp

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp_size, dim)[tp_rank]

    def copy(dst: torch.Tensor, src: torch.Tensor, what: str):
        if dst.shape != src.shape:
            raise ValueError(f"load_weights: {what} shard shape {tuple(src.shape)} != parameter {tuple(dst.shape)}")
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))

    def vocab_rows(t: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        padded = dst.shape[0] * tp_size
        full = torch.zeros(padded, t.shape[1], dtype=t.dtype, device=t.device)
        full[: t.shape[0]] = t
        return shard(full, 0)

    if getattr(model, "pre_process", False):
        w = model.embedding.word_embeddings.weight
        copy(w, vocab_rows(hf["model.embed_tokens.weight"], w), "embedding")
    for layer in model.decoder.layers:
        prefix = f"model.layers.{layer.layer_number - 1}."
        for role, dst in _layer_tensors(layer).items():
            if dst is None:
                continue
            keys = _hf_keys_for(role, prefix, cfg)
            layout = _LAYOUT[role]
            if layout == "rep":
                src = hf[keys[0]]
            elif layout == "row":
                src = shard(hf[keys[0]], 1)
            elif layout == "qkv":
                src = shard(_hf_to_qkv(*(hf[k] for k in keys), cfg), 0)
            elif layout == "col" and glu:
                src = torch.cat([shard(hf[keys[0]], 0), shard(hf[keys[1]], 0)], 0)
            else:
                src = shard(hf[keys[0]], 0)
            copy(dst, src, prefix + role)
    if getattr(model, "post_process", False):
        fn = model.decoder.final_layernorm
        copy(fn.weight, hf["model.norm.weight"], "model.norm.weight")
        if getattr(fn, "bias", None) is not None:
            copy(fn.bias, hf["model.norm.bias"], "model.norm.bias")
        head = model.output_layer.weight
        if head is not None:
            # A tied model's last stage (PP > 1) keeps its own copy of the embedding as the head.
            src = hf.get("lm_head.weight", hf.get("model.embed_tokens.weight"))
            if src is None:
                raise KeyError("load_weights: neither lm_head.weight nor model.embed_tokens.weight is given")
            copy(head, vocab_rows(src, head), "lm_head")


__all__ = [
    "hf_names",
    "hf_layer_names",
    "hf_shape",
    "count_parameters",
    "init_hf_state_dict",
    "export_stage_hf",
    "iter_stage_hf",
    "stage_hf_manifest",
    "stage_hf_names",
    "load_stage_hf",
]
