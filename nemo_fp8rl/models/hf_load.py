"""Hugging Face checkpoints in: safetensors -> this rank's megatron shards, and the trainer's ready policy.

A Hugging Face checkpoint directory holds ``config.json`` (the shape; :mod:`nemo_fp8rl.models.hf_config`
maps it to ``ModelConfig``), the weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, and usually the tokenizer and ``generation_config.json``.

:func:`load_hf_weights` reads, on each rank, only the tensors of its pipeline stage (safetensors,
lazily, in the stored dtype) and copies this rank's tensor-parallel shard into the model through
:meth:`~nemo_fp8rl.models.FP8Actor.load_weights`, i.e. through the one mapping in
:mod:`nemo_fp8rl.models.hf_weights` (QKV fused per KV group, gate/up fused per TP rank, vocabulary
padded, tied heads). Missing tensors, tensors the architecture does not have and shape mismatches are
refused before anything is copied, naming the tensor, its file and what config.json implies. With
``backend="auto"`` and ``megatron-bridge`` installed, a Transformer Engine model is loaded by
megatron-bridge's ``AutoBridge`` instead (see :func:`load_hf_weights`).

:func:`load_hf_policy` resolves the shape (:func:`~nemo_fp8rl.models.hf_config.resolve_model_config`),
builds the actor and loads the weights for the trainer. :class:`HFCheckpoint` is the directory's
weights (which file holds each tensor, shapes, lazy loading). Writing a policy back is
:mod:`nemo_fp8rl.models.hf_save`. Nothing here downloads: ``hf_path`` is a local directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.models.hf_config import (
    HFCheckpointError,
    hf_config_to_model_fields,
    read_hf_config,
    resolve_model_config,
    same_value,
)
from nemo_fp8rl.models.hf_weights import hf_names, hf_shape, stage_hf_names

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that are recomputed, never learned (old Llama exports).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFCheckpoint:
    """The weights of a checkpoint directory: which file holds each tensor, its shape, lazy loading.

    Reads ``model.safetensors.index.json`` when present (sharded checkpoints), else every
    ``*.safetensors`` file of the directory. Only headers are read until :meth:`load`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise HFCheckpointError(
                "reading Hugging Face checkpoints needs the 'safetensors' package: pip install 'nemo-fp8rl[hf]'"
            ) from e
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        self.file_of: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise HFCheckpointError(f"{index} lists shard files that are not in the directory: {missing[:5]}")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                others = sorted(p.name for p in self.path.iterdir() if p.name.endswith((".bin", ".pt", ".pth")))
                hint = (f" (found {others[:3]}: convert them with transformers: "
                        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir))") if others else ""
                raise HFCheckpointError(f"{self.path}: no *.safetensors weights{hint}")
        self.shapes: dict[str, tuple[int, ...]] = {}
        for fname in files:
            try:
                with safe_open(str(self.path / fname), framework="pt") as f:
                    for k in f.keys():  # noqa: SIM118 - safe_open is not iterable
                        self.file_of[k] = fname
                        self.shapes[k] = tuple(f.get_slice(k).get_shape())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise HFCheckpointError(f"{self.path / fname}: unreadable safetensors file ({e})") from None

    def names(self) -> list[str]:
        return sorted(self.file_of)

    def check(self, model_cfg: ModelConfig) -> None:
        """Every tensor the architecture needs is present with the shape config.json implies, and no others.

        ``lm_head.weight`` may be absent when embeddings are tied; old-style ``rotary_emb.inv_freq``
        buffers are ignored.

        Raises:
            HFCheckpointError: listing the missing / unexpected / mis-shaped tensors with their files.
        """
        tied = model_cfg.tied_embeddings
        expected = hf_names(model_cfg)
        have = {n for n in self.file_of if not n.endswith(_IGNORED_SUFFIXES)}
        missing = [n for n in expected if n not in have and not (tied and n == "lm_head.weight")]
        unexpected = sorted(have - set(expected))
        problems = []
        if missing:
            problems.append(f"{len(missing)} tensors missing, e.g. {missing[:5]}")
        if unexpected:
            problems.append(f"{len(unexpected)} tensors the architecture in config.json does not have, e.g. "
                            f"{[f'{n} ({self.file_of[n]})' for n in unexpected[:5]]}")
        for n in expected:
            if n in self.shapes and self.shapes[n] != hf_shape(model_cfg, n):
                problems.append(f"{n} in {self.file_of[n]} has shape {self.shapes[n]}, config.json implies "
                                f"{hf_shape(model_cfg, n)}")
                if len(problems) > 6:
                    break
        if problems:
            raise HFCheckpointError(
                f"{self.path}: the weights do not match config.json: " + "; ".join(problems)
                + ". Check that config.json belongs to these weights (and that no model.* override changed the shape)"
            )

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in their stored dtype on CPU (one open per file)."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            if n not in self.file_of:
                raise HFCheckpointError(f"{self.path}: tensor {n!r} is not in the checkpoint")
            by_file.setdefault(self.file_of[n], []).append(n)
        out = {}
        for fname, keys in by_file.items():
            with safe_open(str(self.path / fname), framework="pt") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out


def load_hf_state_dict(path: str | os.PathLike, model_cfg: ModelConfig | None = None,
                       names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint directory (all, or ``names``), checked against ``model_cfg`` when given
    (default: the config resolved from the directory's own config.json)."""
    ckpt = HFCheckpoint(path)
    if model_cfg is None:
        model_cfg = resolve_model_config(ModelConfig(hf_path=str(path)))
    ckpt.check(model_cfg)
    return ckpt.load(ckpt.names() if names is None else names)


def _bridge_usable(actor, config_json: dict) -> tuple[bool, str]:
    """Whether megatron-bridge's AutoBridge can load this model, and why not."""
    try:
        from megatron.bridge import AutoBridge  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, f"megatron-bridge not importable ({type(e).__name__})"
    if not actor.use_te:
        # The bridge can map the local spec once our FP8 parallel linears are registered with its
        # AutoMapping.register_module_type (a probe loaded tiny Qwen3/Llama exactly that way); we do not
        # register them: the native loader serves the CPU/emulated path (docs/models.md).
        return False, ("the model uses the local (CPU/emulated) layer spec, which the native loader serves "
                       "(megatron-bridge would need our FP8 parallel linears registered with its AutoMapping)")
    if actor.pp_size > 1 and actor.model_cfg.tied_embeddings:
        # We build without an embedding group (gpt.py); the tied head copy on the last stage is ours to fill.
        return False, "tied embeddings under pipeline parallelism"
    return True, ""


def _load_with_bridge(actor, path: Path) -> None:
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(path))
    bridge.load_hf_weights([actor.model])


def _spot_check(actor, ckpt: HFCheckpoint) -> None:
    """After a megatron-bridge load: replicated norm weights and this rank's embedding rows equal the
    checkpoint's (catches a wrong directory or a load that silently skipped tensors)."""
    m = actor.model
    checks = []
    if actor.is_last_stage:
        checks.append(("model.norm.weight", m.decoder.final_layernorm.weight))
    layer = m.decoder.layers[0]
    i = layer.layer_number - 1
    w = getattr(layer.self_attention.linear_qkv, "layer_norm_weight", None)
    if w is not None:
        checks.append((f"model.layers.{i}.input_layernorm.weight", w))
    names = [n for n, _ in checks]
    if actor.is_first_stage:
        names.append("model.embed_tokens.weight")
    ref = ckpt.load(names)
    for n, p in checks:
        if not torch.equal(p.detach().float().cpu(), ref[n].float()):
            raise RuntimeError(f"megatron-bridge loaded {n} differently from {ckpt.file_of[n]}")
    if actor.is_first_stage:
        emb = m.embedding.word_embeddings.weight.detach().float().cpu()
        start = actor.tp_rank * emb.shape[0]
        rows = ref["model.embed_tokens.weight"].float()[start:start + emb.shape[0]]
        if not torch.equal(emb[: rows.shape[0]], rows):
            raise RuntimeError("megatron-bridge loaded model.embed_tokens.weight differently from the checkpoint")


def load_hf_weights(actor, path: str | os.PathLike | None = None, *, backend: str = "auto") -> str:
    """Load a Hugging Face checkpoint into ``actor`` (every rank of the job calls it; no communication
    with the native backend). Returns the backend used: ``"native"`` or ``"megatron-bridge"``.

    ``backend``:

    - ``"native"``: this module: each rank reads its pipeline stage's tensors from the safetensors
      files and copies its TP shard via ``actor.load_weights`` (:mod:`~nemo_fp8rl.models.hf_weights`).
      Works on every layer spec and layout; the CPU path always uses it.
    - ``"megatron-bridge"``: ``AutoBridge.from_hf_pretrained(path).load_hf_weights([model])``; used with
      the Transformer Engine spec only (it could map the local spec too once our FP8 parallel linears are
      registered with its ``AutoMapping``, which we do not do: the native loader serves that path), and
      not for tied embeddings under PP. Spot-checked against the checkpoint afterwards.
    - ``"auto"`` (default): megatron-bridge when it is usable (installed, TE spec, not tied under PP),
      else native. If the bridge raises, the error is logged and the native loader runs.

    The checkpoint is always validated first (tensor names, shapes) against ``actor.model_cfg``.

    Raises:
        HFCheckpointError: missing/unsupported checkpoint, tensors missing, unexpected or mis-shaped.
    """
    path = path or actor.model_cfg.hf_path
    if not path:
        raise ValueError("load_hf_weights: no checkpoint directory given and actor.model_cfg.hf_path is not set")
    path = Path(path)
    if backend not in ("auto", "native", "megatron-bridge"):
        raise ValueError(f"backend={backend!r}; use 'auto', 'native' or 'megatron-bridge'")
    config_json = read_hf_config(path)
    fields = hf_config_to_model_fields(config_json, str(path / "config.json"))
    diff = [f"{k}: model {getattr(actor.model_cfg, k)!r} vs checkpoint {v!r}" for k, v in fields.items()
            if not same_value(getattr(actor.model_cfg, k), v)]
    if diff:
        raise HFCheckpointError(f"{path / 'config.json'} describes another model than the actor's: {diff}; "
                                "build the actor from resolve_model_config(...) of this checkpoint")
    ckpt = HFCheckpoint(path)
    ckpt.check(actor.model_cfg)
    t0 = time.time()
    if backend != "native":
        ok, why = _bridge_usable(actor, config_json)
        if not ok and backend == "megatron-bridge":
            raise ValueError(f"backend='megatron-bridge' is not usable here: {why}; use backend='native'")
        if ok:
            try:
                _load_with_bridge(actor, path)
                _spot_check(actor, ckpt)
                log.info("loaded %s with megatron-bridge AutoBridge in %.1fs", path, time.time() - t0)
                return "megatron-bridge"
            except Exception as e:
                if backend == "megatron-bridge":
                    raise
                log.warning("megatron-bridge could not load %s (%s: %s); using the native loader",
                            path, type(e).__name__, e)
        else:
            log.info("megatron-bridge not used: %s", why)
    names = stage_hf_names(actor.model, actor.model_cfg)
    if "lm_head.weight" in names and "lm_head.weight" not in ckpt.file_of:
        names = [n for n in names if n != "lm_head.weight"]  # tied: the head is the embedding
        if "model.embed_tokens.weight" not in names:
            names.append("model.embed_tokens.weight")
    sd = ckpt.load(names)
    actor.load_weights(sd)
    log.info("loaded %s (%d tensors of this pipeline stage) natively in %.1fs", path, len(sd), time.time() - t0)
    return "native"


def load_hf_policy(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    fp8_recipe=None,
    seed: int,
    lr: float,
    keep_reference: bool = False,
    backend: str = "auto",
    **build_kwargs: Any,
):
    """Build the :class:`~nemo_fp8rl.models.FP8Actor` of ``model_cfg.hf_path`` with the checkpoint's weights.

    ``model_cfg`` is resolved with :func:`resolve_model_config` (idempotent, so an already resolved
    config is fine), the actor is built by :func:`~nemo_fp8rl.models.build_actor` (``build_kwargs``:
    ``weight_decay``, ``adam_betas``, ``adam_eps``, ``grad_clip``, ``fp8_backend``, ``device``), the weights
    are loaded by :func:`load_hf_weights`, and only then is the reference policy snapshotted
    (``keep_reference``), so the reference is the checkpoint. ``actor.model_cfg`` keeps ``hf_path``
    (so :func:`save_hf_checkpoint` finds the tokenizer and config to copy). Collective over the job.

    Returns:
        the actor.
    """
    from nemo_fp8rl.models.actor import build_actor

    if not model_cfg.hf_path:
        raise ValueError("load_hf_policy needs model.hf_path (a local Hugging Face checkpoint directory)")
    resolved = resolve_model_config(model_cfg)
    actor = build_actor(dataclasses.replace(resolved, hf_path=None), parallel_cfg, fp8_recipe=fp8_recipe,
                        seed=seed, lr=lr, keep_reference=False, **build_kwargs)
    actor.model_cfg = resolved
    load_hf_weights(actor, resolved.hf_path, backend=backend)
    if keep_reference:
        actor.keep_reference()
    return actor


__all__ = [
    "HFCheckpoint",
    "load_hf_policy",
    "load_hf_state_dict",
    "load_hf_weights",
]
