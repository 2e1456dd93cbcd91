"""Calibrated FP8 KV-cache scales: a high-precision forward of the weights being synced over calibration
sequences, taken layer by layer as the weights stream past.

The rule (NeMo RL's, ``rollout.fp8.kv_scales=calibrated``): run the rollout model in high precision (FP8
off, float32) over B calibration sequences; per decoder layer i and per sequence b record the amax over
the sequence's tokens of |q|, |k| and |v| as the attention receives them (after the QK-norm and RoPE;
values as projected)::

    amax[i, t, b] = max over valid tokens of |x_t|        t in (q, k, v), x_t: [heads, T, head_dim]
    pamax[i, t]   = percentile_p over b of amax[i, t, b]  (nearest rank, p = kv_calib_percentile)
    scale[i, t]   = pamax[i, t] * margin / M              (M = 448 for E4M3, 57344 for E5M2)

(NeMo RL records one amax per forward micro-batch; one per sequence is the same statistic at a finer
grain.) Data-parallel ranks calibrate on their own batches and keep the largest ``pamax`` of all ranks
(the trainer's :mod:`nemo_fp8rl.trainer.kv_scales`), so every engine gets the same scales.

:class:`KvAmaxCollector` sees the weights as a stream: :meth:`~KvAmaxCollector.tee` passes every
``(name, tensor)`` pair on unchanged (to a rollout engine's weight sync) and runs each layer as soon as it
and the layers before it have arrived (the actor streams the embedding first, then the layers in order),
so calibration costs one layer of extra weights and no second export of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from nemo_fp8rl.fp8.kv_cache import KvScales, percentile_nearest_rank, scale_from_amax
from nemo_fp8rl.rollout.model import (
    ModelShape,
    WeightsArg,
    _attend,
    _build_layer,
    _mlp_and_residual,
    _qkv,
    expected_hf_shapes,
    rope_cos_sin,
    rope_inv_freq,
)

__all__ = ["KvAmaxCollector", "calibrate_kv_scales", "kv_scales_from_amax"]

_OFF = None  # filled lazily: the high-precision scheme (nemo_fp8rl.fp8.rollout.RolloutScheme)


def _off_scheme() -> Any:
    global _OFF
    if _OFF is None:
        from nemo_fp8rl.fp8.rollout import RolloutScheme

        _OFF = RolloutScheme()
    return _OFF


class KvAmaxCollector:
    """Per-layer, per-sequence amax of |q|, |k|, |v| from a float32 forward, fed by a weight stream.

    Args:
        shape: the rollout model's :class:`~nemo_fp8rl.rollout.model.ModelShape`.
        tokens: LongTensor [B, T], right-padded calibration sequences.
        lengths: LongTensor [B]: valid tokens of each row (positions >= length are ignored).
        device: where the forward runs (the actor's device).
        chunk_tokens: padded tokens per forward chunk (whole sequences, at least one): bounds the attention's
            memory, which a CPU's SDPA spends as chunk x heads x T x T scores.
    """

    def __init__(self, shape: ModelShape, tokens: torch.Tensor, lengths: torch.Tensor,
                 device: str | torch.device = "cpu", chunk_tokens: int = 16384) -> None:
        if tokens.dim() != 2 or lengths.shape != tokens.shape[:1]:
            raise ValueError(f"calibration tokens [B, T] and lengths [B] expected, got {tuple(tokens.shape)} and "
                             f"{tuple(lengths.shape)}")
        if tokens.shape[0] == 0 or int(lengths.min()) < 1 or int(lengths.max()) > tokens.shape[1]:
            raise ValueError("calibration needs at least one sequence, each with 1..T valid tokens")
        self.shape = shape
        self.device = torch.device(device)
        self.tokens = tokens.to(self.device)
        B, T = tokens.shape
        self.mask = (torch.arange(T, device=self.device).unsqueeze(0) < lengths.to(self.device).unsqueeze(1))
        self.chunk = max(1, int(chunk_tokens) // T)
        self.amax = torch.zeros(shape.num_layers, 3, B)
        """[L, 3 (q, k, v), B] float32: filled as the layers pass."""
        self._h: torch.Tensor | None = None
        self._next = 0
        self._per_layer = {i: 0 for i in range(shape.num_layers)}
        for k in expected_hf_shapes(shape, 1):
            if k.startswith("model.layers."):
                self._per_layer[int(k.split(".")[2])] += 1
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._ready: dict[int, dict[str, torch.Tensor]] = {}
        pos = torch.arange(T, device=self.device).expand(B, T)
        self._cos, self._sin = rope_cos_sin(pos, rope_inv_freq(shape).to(self.device))

    @property
    def done(self) -> bool:
        """Whether every layer has run."""
        return self._next == self.shape.num_layers

    def tee(self, weights: WeightsArg) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the pairs of ``weights`` on unchanged, running the forward as the layers complete.

        A pair is taken after the consumer asked for the next one, i.e. after the consumer's own checks of
        it (an engine's sync rejects a bad tensor before the forward sees it).
        """
        pairs: Iterable[tuple[str, torch.Tensor]] = weights.items() if isinstance(weights, Mapping) else weights
        for name, t in pairs:
            yield name, t
            self.take(name, t)

    def take(self, name: str, t: torch.Tensor) -> None:
        """Record one HF-named tensor (others than the embedding and the layers' are ignored)."""
        if name == "model.embed_tokens.weight":
            emb = t.detach().to(device=self.device, dtype=torch.float32)
            self._h = emb[self.tokens]
        elif name.startswith("model.layers."):
            i = int(name.split(".")[2])
            got = self._pending.setdefault(i, {})
            got[name] = t.detach()
            if len(got) == self._per_layer[i]:
                self._ready[i] = self._pending.pop(i)
        else:
            return
        self._advance()

    def _advance(self) -> None:
        off = _off_scheme()
        while self._h is not None and self._next in self._ready:
            i = self._next
            lw = _build_layer(self.shape, i, self._ready.pop(i), off, self.device, torch.float32, {})
            last = i == self.shape.num_layers - 1
            outs = []
            for lo in range(0, self._h.shape[0], self.chunk):
                sl = slice(lo, lo + self.chunk)
                h, m = self._h[sl], self.mask[sl]
                q, k, v = _qkv(self.shape, lw, off, h, self._cos[sl], self._sin[sl])  # [b, heads, T, hd]
                for j, x in enumerate((q, k, v)):
                    per_tok = x.abs().amax(dim=(1, 3)) * m  # [b, T]; |x| >= 0, padding counts as 0
                    self.amax[i, j, sl] = per_tok.amax(dim=1).float().cpu()
                if not last:
                    outs.append(_mlp_and_residual(self.shape, lw, off, h, _attend(self.shape, q, k, v, None)))
            self._h = torch.cat(outs) if not last else None
            self._next += 1

    def percentile_amax(self, percentile: float) -> torch.Tensor:
        """[L, 3] float32: the ``percentile``-th percentile over sequences of ``amax`` (raises unless :attr:`done`)."""
        if not self.done:
            raise RuntimeError(f"KV calibration saw {self._next} of {self.shape.num_layers} layers: the weight stream "
                               "ended early or never sent model.embed_tokens.weight")
        return percentile_nearest_rank(self.amax, percentile)


def kv_scales_from_amax(pamax: torch.Tensor, fmt: str, margin: float) -> KvScales:
    """Per-layer scales from ``pamax`` [L, 3 (q, k, v)]: ``pamax * margin / M`` (an amax of 0 gives 1.0)."""
    s = scale_from_amax(pamax, fmt, margin)
    return KvScales(s[:, 0], s[:, 1], s[:, 2])


def calibrate_kv_scales(shape: ModelShape, weights: WeightsArg, tokens: torch.Tensor, lengths: torch.Tensor, *,
                        fmt: str = "e4m3", percentile: float = 99.9, margin: float = 1.05,
                        device: str | torch.device = "cpu") -> KvScales:
    """Calibrated scales of ``weights`` (HF names, a dict or a stream in layer order) on ``tokens`` [B, T]
    (``lengths`` [B] valid tokens each): one process, no reduction over ranks."""
    c = KvAmaxCollector(shape, tokens, lengths, device)
    for _ in c.tee(weights):
        pass
    return kv_scales_from_amax(c.percentile_amax(percentile), fmt, margin)
