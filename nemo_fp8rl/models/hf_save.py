"""Trained policies out: the actor's weights -> a Hugging Face checkpoint directory.

:func:`save_hf_checkpoint` (collective) streams the full model out of the actor
(:meth:`~nemo_fp8rl.models.FP8Actor.iter_weights`: TP shards gathered, PP stages broadcast one tensor at a
time) and rank 0 writes a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads:
``config.json`` (the source's, or one written from the ``ModelConfig`` by
:func:`~nemo_fp8rl.models.hf_config.model_config_to_hf_config`), safetensors shards (+ index), and the
source's tokenizer and generation files. Tied models omit ``lm_head.weight`` as Hugging Face does.
:func:`save_hf_state_dict` is the writer (not collective). Reading checkpoints is
:mod:`nemo_fp8rl.models.hf_load`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.models.hf_config import model_config_to_hf_config, read_hf_config
from nemo_fp8rl.models.hf_weights import hf_names, hf_shape

# Files of a checkpoint directory that describe weights (not copied on export).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _source_dtype(src_cfg: Mapping[str, Any] | None) -> str:
    d = (src_cfg or {}).get("dtype") or (src_cfg or {}).get("torch_dtype") or "float32"
    return d if d in _DTYPES else "float32"


def save_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write a Hugging Face checkpoint directory from the full HF-named model (not collective).

    Args:
        state_dict: the full model in HF naming, as a mapping (e.g. ``actor.export_weights()``) or as a
            stream of ``(name, tensor)`` pairs (e.g. ``actor.iter_weights()``). Shards are planned from
            the model config in name order and each is written as soon as all its tensors have arrived,
            so a stream in layer order holds about one shard (plus one layer) at a time. Names the
            checkpoint does not store (``lm_head.weight`` of a tied model) are skipped.
        model_cfg: its shape.
        out_dir: written atomically: a temporary sibling is filled, then renamed over ``out_dir``.
        source: a checkpoint directory whose config.json is kept (dtype updated) and whose tokenizer,
            generation config, chat template and other non-weight files are copied. Default:
            ``model_cfg.hf_path``. Without one, config.json is written from ``model_cfg``.
        dtype: float32 | bfloat16 | float16; default the source's dtype, else float32.
        max_shard_bytes: shard the safetensors above this size (with ``model.safetensors.index.json``).

    Raises:
        KeyError: tensors missing (named); ValueError: a tensor's shape differs from the config's.
    """
    from safetensors.torch import save_file

    source = source if source is not None else model_cfg.hf_path
    src_cfg = read_hf_config(source) if source else None
    dtype = dtype or _source_dtype(src_cfg)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; use one of {sorted(_DTYPES)}")
    config = model_config_to_hf_config(model_cfg, dtype=dtype, base=src_cfg)
    tied = model_cfg.tied_embeddings
    names = [n for n in hf_names(model_cfg) if not (tied and n == "lm_head.weight")]
    if isinstance(state_dict, Mapping):
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise KeyError(f"save_hf_state_dict: state dict lacks {len(missing)} tensors, e.g. {missing[:5]}")
        items: Iterable[tuple[str, torch.Tensor]] = ((n, state_dict[n]) for n in names)
    else:
        items = state_dict

    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # shards of at most max_shard_bytes, in name order, planned from the config's shapes
    shards: list[list[str]] = [[]]
    size = 0
    tdtype = _DTYPES[dtype]
    nbytes = {n: math.prod(hf_shape(model_cfg, n)) * torch.empty((), dtype=tdtype).element_size() for n in names}
    for n in names:
        if shards[-1] and size + nbytes[n] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    shard_of = {n: i for i, shard in enumerate(shards) for n in shard}
    left = [len(shard) for shard in shards]
    pending: dict[str, torch.Tensor] = {}
    weight_map = {}
    try:
        for n, t in items:
            if n not in shard_of:
                continue
            if tuple(t.shape) != hf_shape(model_cfg, n):
                raise ValueError(f"save_hf_state_dict: {n} has shape {tuple(t.shape)}, "
                                 f"the model config implies {hf_shape(model_cfg, n)}")
            if n in pending or n in weight_map:
                raise ValueError(f"save_hf_state_dict: {n} appears twice")
            pending[n] = t.detach().to(device="cpu", dtype=tdtype).contiguous()
            i = shard_of[n]
            left[i] -= 1
            if left[i] == 0:
                fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file({m: pending.pop(m) for m in shards[i]}, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({m: fname for m in shards[i]})
        missing = [n for n in names if n not in weight_map]
        if missing:
            raise KeyError(f"save_hf_state_dict: the stream lacked {len(missing)} tensors, e.g. {missing[:5]}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source:
        for p in sorted(Path(source).iterdir()):
            if p.is_file() and p.name != "config.json" and p.name not in _WEIGHT_INDEXES \
                    and not p.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(p, tmp / p.name)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)
    return out


def save_hf_checkpoint(actor, out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None,
                       dtype: str | None = None, max_shard_bytes: int = 5 * 2**30) -> Path | None:
    """Export the actor's current weights as a Hugging Face checkpoint directory.

    Collective: every rank iterates the streamed export (``actor.iter_weights()``: TP shards gathered
    and PP stages broadcast one tensor at a time); global rank 0 writes each safetensors shard as soon
    as its tensors arrived (:func:`save_hf_state_dict`), so it holds about one shard, not the model.
    Returns the directory on rank 0, None elsewhere. ``source`` defaults to ``actor.model_cfg.hf_path``
    (config, tokenizer, generation config copied from there).
    """
    import torch.distributed as dist

    stream = actor.iter_weights()
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = None
    err: BaseException | None = None
    if rank == 0:
        try:
            out = save_hf_state_dict(stream, actor.model_cfg, out_dir, source=source, dtype=dtype,
                                     max_shard_bytes=max_shard_bytes)
        except BaseException as e:  # noqa: BLE001 - re-raised after the barrier so other ranks do not hang
            err = e
    for _ in stream:  # the other ranks (and rank 0 after an error) finish the collective stream
        pass
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if err is not None:
        raise err
    return out


__all__ = [
    "save_hf_checkpoint",
    "save_hf_state_dict",
]
