"""The vllm engine's weight sync: the actor's tensors, checked, in vLLM's format, in bounded buckets.

One sync is one ``collective_rpc("reload_weights", weights_iterator=...)`` fed by a generator built here,
so the tensors flow from the trainer into vLLM one at a time, never as a second full copy of the model:

1. :func:`sync_stream`: the HF-named pairs of the sync, checked (a state dict all at once before vLLM is
   touched, a stream pair by pair as it arrives), the vocabulary rows against the engine's, the tied LM
   head dropped (vLLM's is the embedding), and for ``vllm_block`` each linear weight turned into E4M3 +
   ``weight_scale_inv`` (:func:`nemo_fp8rl.rollout.vllm_fp8.vllm_block_fp8_stream`).
2. :func:`iter_weight_buckets`: each tensor converted to the engine dtype and device and handed on in
   buckets of at most ``rollout.sync_bucket_mb`` MiB.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from nemo_fp8rl.rollout.model import ModelShape, WeightsArg, check_hf_state_dict, checked_weight_stream

__all__ = ["iter_weight_buckets", "sync_stream"]


def iter_weight_buckets(
    weights: WeightsArg,
    bucket_bytes: int,
    dtype: torch.dtype,
    *,
    device: torch.device | str = "cpu",
    keep_dtype: Sequence[str] = (),
    counter: dict[str, float] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` converted to ``dtype`` on ``device``, at most one bucket ahead of the consumer.

    ``weights``: a state dict or a stream of pairs, consumed one pair at a time (never collected). Each
    tensor is converted as it arrives and added to the current bucket; when the next one would take the
    bucket past ``bucket_bytes`` (sum of converted bytes; a single larger tensor forms its own bucket),
    the bucket is handed on tensor by tensor, each dropped from the bucket as it is yielded. So this
    generator holds at most one bucket plus the tensor being converted, whatever the model size. A tensor
    already in ``dtype``, contiguous and on ``device`` is passed as is (no copy). Tensors named with a
    suffix in ``keep_dtype`` and float8 tensors keep their dtype (FP8 payload). ``counter["bytes"]``
    (if given) accumulates the converted bytes as they pass.
    """
    dev = torch.device(device)
    keep = tuple(keep_dtype)
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    bucket: deque[tuple[str, torch.Tensor]] = deque()
    size = 0
    for name, t in pairs:
        as_is = t.dtype == torch.float8_e4m3fn or (keep and name.endswith(keep))
        c = t.detach().to(device=dev, dtype=None if as_is else dtype).contiguous()
        del t
        n = c.numel() * c.element_size()
        if bucket and size + n > bucket_bytes:
            while bucket:
                yield bucket.popleft()
            size = 0
        bucket.append((name, c))
        del c
        size += n
        if counter is not None:
            counter["bytes"] = counter.get("bytes", 0.0) + n
    while bucket:
        yield bucket.popleft()


def _vocab_message(name: str, rows: int, vocab_size: int) -> str:
    return (f"weight sync: {name} has {rows} rows but the vllm engine was built for model.vocab_size="
            f"{vocab_size}; build the engine with the exported vocabulary size")


def sync_stream(
    shape: ModelShape,
    weights: WeightsArg,
    *,
    vocab_size: int,
    tied: bool,
    block_fp8: bool,
    device: torch.device,
    high_precision_layers: Sequence[int] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checked HF pairs of one sync, in the engine's format (FP8 payload when ``block_fp8``).

    ``weights``: a state dict (checked here, before the reload starts, so a bad dict leaves the engine
    untouched, then passed on as is) or a stream (each pair checked as the consumer pulls it, finiteness after the last pair).
    ``vocab_size``: the rows the engine was built with (the embedding and LM head must match).
    ``tied``: the model ties its LM head to the embedding (``lm_head.weight`` is not sent).
    ``block_fp8``: ``rollout.fp8.scheme=vllm_block``: linears as E4M3 + ``weight_scale_inv``, quantized on
    ``device``. ``high_precision_layers``: BF16 edge layers, whose linears stay high precision.
    """
    V = vocab_size
    if isinstance(weights, Mapping):
        # checked before the reload starts (a bad dict leaves the engine untouched), then passed on as is
        rows = check_hf_state_dict(shape, weights)
        if rows != V:
            raise ValueError(_vocab_message("model.embed_tokens.weight", rows, V))
        pairs: Iterable[tuple[str, torch.Tensor]] = weights.items()
    else:
        pairs = checked_weight_stream(shape, weights)

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in pairs:
            if name in ("model.embed_tokens.weight", "lm_head.weight") and int(t.shape[0]) != V:
                raise ValueError(_vocab_message(name, int(t.shape[0]), V))
            if tied and name == "lm_head.weight":
                continue  # tied: vLLM's LM head is the embedding
            yield name, t

    stream = gen()
    if block_fp8:
        from nemo_fp8rl.rollout.vllm_fp8 import vllm_block_fp8_stream

        stream = vllm_block_fp8_stream(stream, device=device, high_precision_layers=high_precision_layers)
    return stream
