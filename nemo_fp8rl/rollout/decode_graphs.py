"""Static-shape decode steps of the torch engine, captured as CUDA graphs (``rollout.cuda_graphs``).

Why: one decode step of :func:`~nemo_fp8rl.rollout.model.forward_decode` launches some 40-50 kernels per
decoder layer (norms, the FP8 activation quantizers and GEMMs, RoPE, the cache writes, attention). At a
decode batch of a few hundred rows each kernel runs for microseconds, so on a GPU the step waits for the
host that issues them (issue 39). A CUDA graph records the launches of one step once and replays them with
one call, the way vLLM serves decode batches.

A graph replays fixed kernels on fixed addresses, so the step runs on static shapes:

- the KV cache of the ``generate`` call (B rows, P + N positions) is the one every graph reads and writes;
- the step's tokens and positions are copied into buffers ``tok`` / ``pos`` [B] before each replay;
- a graph covers the first ``Bc`` rows (:func:`batch_bucket`: a power of two >= the live rows, at least
  :data:`MIN_BATCH_BUCKET`, at most B) and attends to the first ``Sc`` positions (:func:`length_bucket`: a
  power of two >= the longest live row, at least :data:`MIN_LENGTH_BUCKET`, at most P + N).

Rows live in slots. Rows that end leave the list of live slots at a stop check; their slots decode on
(writing only their own cache rows) and are never read. The live rows move to the first slots only when
they fit a smaller batch bucket (one gather of the cache per layer), so a call captures at most one graph
per batch bucket and length bucket it passes through. The sampler sees exactly the eager path's batch (the
live rows' logits, in the same order), so the sampled tokens follow the same random draws; the logits agree
with the eager ones to float rounding (the GEMMs see ``Bc`` rows instead of the live count, and the masked
attention ``Sc`` positions instead of the longest row's).

Capture: the first time a (``Bc``, ``Sc``) is needed, the step runs once eagerly on a side stream (it writes
the same keys and values the replay writes, and fixes the Triton kernels' launch configurations, which are
timed on first use) and is then recorded; graphs live as long as the ``generate`` call (the weights are
rebuilt at every sync, so a graph could not outlive it). A capture that fails is logged once with its
reason and the call goes on with the same static steps run eagerly. Without CUDA there is nothing to
capture: the static steps run eagerly, which is how the CPU tests check this module against the eager path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from nemo_fp8rl.rollout.model import KVCache, ModelShape, RolloutWeights, forward_decode

__all__ = ["MIN_BATCH_BUCKET", "MIN_LENGTH_BUCKET", "StaticDecode", "batch_bucket", "length_bucket"]

log = logging.getLogger(__name__)

MIN_BATCH_BUCKET = 8
"""Smallest batch bucket: below it a step is launch-bound at any row count, and fewer buckets mean fewer
captures."""
MIN_LENGTH_BUCKET = 256
"""Smallest length bucket: attention over 256 masked positions costs a decode step little next to its GEMMs,
and responses of up to 256 tokens then need a single graph per batch bucket."""


def _bucket(n: int, floor: int, cap: int) -> int:
    if n < 1 or cap < 1:
        raise ValueError(f"bucket of {n} with cap {cap}: both must be >= 1")
    return min(cap, max(floor, 1 << (n - 1).bit_length()))


def batch_bucket(rows: int, cap: int) -> int:
    """Rows a decode graph covers for ``rows`` live rows: ``min(cap, max(MIN_BATCH_BUCKET, 2^ceil(log2 rows)))``."""
    return _bucket(rows, MIN_BATCH_BUCKET, cap)


def length_bucket(length: int, cap: int) -> int:
    """Cache positions a decode graph attends to when the longest live row needs ``length``:
    ``min(cap, max(MIN_LENGTH_BUCKET, 2^ceil(log2 length)))``."""
    return _bucket(length, MIN_LENGTH_BUCKET, cap)


class StaticDecode:
    """The decode steps of one ``generate`` call on static shapes (module docstring).

    Args:
        shape, weights, scheme: what :func:`~nemo_fp8rl.rollout.model.forward_decode` takes.
        cache: the call's KV cache, [B, G, P + N, hd] per layer, already prefilled.
        capture: record CUDA graphs (True on CUDA); False runs the same static steps eagerly.

    Use: :meth:`step` per decode step with the live rows' tokens and positions (in the eager path's row
    order), :meth:`keep` when rows leave at a stop check.
    """

    def __init__(self, shape: ModelShape, weights: RolloutWeights, scheme: Any, cache: KVCache, *,
                 capture: bool) -> None:
        self.shape, self.weights, self.scheme, self.cache = shape, weights, scheme, cache
        B, _, S, _ = cache.k[0].shape
        self.batch, self.max_len = int(B), int(S)
        dev = cache.k[0].device
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)
        """Token of each slot for the next step (a dead slot keeps its last one)."""
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)
        """Position of each slot's token (a dead slot keeps its last one: within the cache)."""
        self.slots = torch.arange(B, device=dev)
        """Slot of each live row, in the eager path's row order (all < :attr:`rows`)."""
        self.live = int(B)
        self.rows = batch_bucket(self.live, self.batch)
        """Rows the graphs cover now (:func:`batch_bucket` of the live rows, never grows)."""
        self.capture = bool(capture)
        self.fallback: str | None = None
        """Why this call stopped capturing (the first failed capture), or None."""
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        """(rows, length) -> (CUDA graph, its output logits [rows, V])."""
        self._pool: Any = None
        """The memory pool all graphs of this call share (a later graph reuses an earlier one's freed
        temporaries; safe here: graphs never run concurrently, and each output is copied out right after its
        replay, before another graph runs), so a call holds one step's temporaries, not one per bucket."""
        self._stream: Any = None
        """The side stream of every warm-up and capture of this call."""

    def _view(self, rows: int) -> KVCache:
        c = self.cache
        return KVCache(k=[k[:rows] for k in c.k], v=[v[:rows] for v in c.v], kv=c.kv)

    def _fn(self, rows: int, length: int) -> Callable[[], torch.Tensor]:
        view, tok, pos = self._view(rows), self.tok[:rows], self.pos[:rows]
        return lambda: forward_decode(self.shape, self.weights, self.scheme, tok, pos, view, length=length)

    def _graph(self, rows: int, length: int) -> tuple[Any, torch.Tensor] | None:
        key = (rows, length)
        if key in self.graphs:
            return self.graphs[key]
        fn = self._fn(rows, length)
        try:
            if self._stream is None:
                self._stream, self._pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
            side = self._stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm-up: the same keys and values the replay writes; kernels' launch configs timed
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                out = fn()
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say why once
            self.fallback = f"{type(e).__name__}: {e}"
            log.warning("rollout.cuda_graphs: capturing the decode step (%d rows, %d positions) failed (%s); "
                        "this generate call decodes without CUDA graphs", rows, length, self.fallback)
            return None
        self.graphs[key] = (graph, out)
        return graph, out

    def step(self, tok: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """One decode step of the live rows: tok, pos [n] (n live rows, eager row order) -> logits [n, V] fp32.

        ``length``: the positions the eager path would attend to (``longest prompt + step + 1``); the step
        attends to :func:`length_bucket` of it, masked per row to its own ``pos``.
        """
        if tok.shape[0] != self.live:
            raise ValueError(f"step got {tok.shape[0]} rows, {self.live} are live")
        self.tok.index_copy_(0, self.slots, tok)
        self.pos.index_copy_(0, self.slots, pos)
        rows, S = self.rows, length_bucket(int(length), self.max_len)
        got = self._graph(rows, S) if self.capture and self.fallback is None else None
        if got is None:
            out = self._fn(rows, S)()
        else:
            graph, out = got
            graph.replay()
        return out.index_select(0, self.slots)

    def keep(self, keep: torch.Tensor) -> None:
        """Only the live rows ``keep`` (LongTensor [n'], indices into the live rows, ascending) decode on; they
        move to the first n' slots when n' fits a smaller batch bucket."""
        self.slots = self.slots.index_select(0, keep)
        self.live = int(keep.numel())
        rows = batch_bucket(max(self.live, 1), self.batch)
        if rows < self.rows:
            n = self.live
            for t in (*self.cache.k, *self.cache.v):
                t[:n] = t.index_select(0, self.slots)
            self.tok[:n] = self.tok.index_select(0, self.slots)
            self.pos[:n] = self.pos.index_select(0, self.slots)
            self.slots = torch.arange(n, device=self.slots.device)
            self.rows = rows
