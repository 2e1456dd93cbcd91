"""The in-process rollout engine ("torch"): batched incremental decoding with a KV cache and its own FP8.

How a step goes (the way vLLM serves a batch, without its paging and continuous batching):

1. ``update_weights(weights)``: validate names and shapes, fuse q/k/v and gate/up, quantize every
   linear weight once with the rollout FP8 scheme (the per-weight scales are recomputed from the new
   weights on every sync, as an inference engine does when the trainer pushes BF16 weights).
2. ``generate``: prompts of different lengths are right-padded and prefilled in one causal forward that
   fills a preallocated KV cache [B, G, P + N, hd] per layer. Then one token per step: each row writes its
   new key/value at its own position (prompt length + step) and attends to its own prefix, so ragged
   prompts need no left padding and the positions seen by RoPE are the trainer's (0-based from the
   prompt's first token). Rows that sample EOS leave the batch (their cache rows are dropped) at the next
   stop check, every ``stop_check_interval`` steps (``rollout.stop_check_interval``; until then an ended row
   decodes on and records nothing); the loop stops when no row is left. Stop strings (``SamplingParams.stop``)
   are found at the same checks (:mod:`~nemo_fp8rl.rollout.stop_strings`: the live rows' new tokens come to
   the host in the check's one transfer and are decoded with the task's tokenizer); a row that completed
   one leaves there, and the tokens it wrote after the completing token are dropped at the end, so it too
   records nothing after its ending token. Without stop strings nothing of this runs (same batch, same syncs).

   Host syncs: the sampled tokens, log-probs and lengths stay on the engine's device until the batch is
   done, the attended length is known on the host, and the stop check is the only sync, once every
   ``stop_check_interval`` steps (1 on CPU, where a sync costs nothing and rows leave as early as possible;
   8 on CUDA, :data:`GPU_STOP_CHECK_INTERVAL`). The batch is a function of the seed *and* the interval (an
   ended row draws sampling noise until its check). On CUDA the sampler draws its noise on the GPU from a
   generator seeded by one draw of the caller's CPU generator (:func:`sampling_generator`), not [B, V]
   numbers per step on the host.
3. The result is a :class:`~nemo_fp8rl.rollout.base.RolloutBatch` in the trainer's layout.

FP8 KV cache (``kv_cache="e4m3"`` or ``"e5m2"``, ``rollout.fp8.kv_cache``): keys (after RoPE) and values are
stored as FP8 codes with one float32 scale per layer and tensor and attended to as read back, exactly as
vLLM stores them (:mod:`nemo_fp8rl.fp8.kv_cache`; ``kv_kernel`` picks vLLM's CUDA writer, the default, or
vLLM-CPU's). The scales are vLLM's default (1.0) until :meth:`TorchRolloutEngine.set_kv_scales` (or
``update_weights(..., kv_scales=...)``) gives calibrated ones; they persist across syncs, sleep and wake-up.
``high_precision_layers`` keep those layers' linears and KV cache out of FP8 (BF16 edge layers).

Memory: the KV cache lives for one ``generate`` call, so between rollouts the engine holds only its
weights (the quantized copy of the actor's). :meth:`~TorchRolloutEngine.sleep` and
:meth:`~TorchRolloutEngine.wake_up` therefore have nothing to free or restore (the weights stay, so the
next ``generate`` needs no sync); :meth:`~TorchRolloutEngine.close` drops the weights.

Cost: prefill O(B P^2) attention + O(B P) linears; each decode step O(B S) attention + O(B) linears,
instead of O(B S^2) + O(B S) without a cache (S = current length). :meth:`forward` is the no-cache path
(used by tests to check the cache path).
"""

from __future__ import annotations

from collections.abc import Sequence
import logging
from typing import Any

import torch

from nemo_fp8rl.rollout.base import (
    RolloutBatch,
    SamplingParams,
    check_generate_inputs,
    register_rollout_engine,
)
from nemo_fp8rl.fp8.kv_cache import KV_CACHE_FORMATS, KV_KERNELS, KvScales
from nemo_fp8rl.rollout.decode_graphs import StaticDecode
from nemo_fp8rl.rollout.model import (
    KVCache,
    KvQuant,
    ModelShape,
    RolloutWeights,
    WeightsArg,
    build_weights,
    forward_decode,
    forward_full,
    forward_prefill,
)
from nemo_fp8rl.rollout.sampling import sample_next
from nemo_fp8rl.rollout.stop_strings import StopStrings

__all__ = ["GPU_STOP_CHECK_INTERVAL", "TorchRolloutEngine", "engine_dtype", "resolve_rollout_scheme", "sampling_generator"]

log = logging.getLogger(__name__)


GPU_STOP_CHECK_INTERVAL = 8
"""Decode steps between stop checks on CUDA. Each check is a host sync that drains the GPU's queue of
launches; every 8 steps keeps the host up to 8 steps ahead, while a row that ended just after a check decodes
at most 7 tokens that are thrown away (responses are tens to thousands of tokens)."""


def sampling_generator(generator: torch.Generator, device: str | torch.device) -> torch.Generator:
    """The generator the sampler draws from on ``device``: ``generator`` itself when it lives there (CPU:
    unchanged results), else a new one on ``device`` seeded by one draw of ``generator`` (deterministic in
    its state; the noise is then drawn where the logits are, with no host work per token)."""
    a, b = torch.device(generator.device), torch.device(device)
    if a.type == b.type and (a.index is None or b.index is None or a.index == b.index):
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=b).manual_seed(seed)


def engine_dtype(device: str | torch.device) -> torch.dtype:
    """The torch engine's default compute dtype on ``device``: bfloat16 on CUDA (the dtype vLLM serves a
    BF16 checkpoint in; float32 there doubles the weights' bytes and the decode's memory traffic), float32
    elsewhere (the CPU engine is the float32 reference the tests pin)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_rollout_scheme(fp8_scheme: Any, train_recipe: Any = None) -> Any:
    """Turn ``rollout.fp8.scheme`` into a scheme object with ``quantize_weight`` / ``quantize_activation``.

    A string is looked up with :func:`nemo_fp8rl.fp8.get_rollout_scheme`; an object that already has
    both methods is used as is (custom schemes, tests).
    """
    if callable(getattr(fp8_scheme, "quantize_weight", None)) and callable(getattr(fp8_scheme, "quantize_activation", None)):
        return fp8_scheme
    if not isinstance(fp8_scheme, str):
        raise TypeError(
            f"rollout.fp8.scheme must be a scheme name (str) or an object with quantize_weight and "
            f"quantize_activation; got {type(fp8_scheme).__name__}"
        )
    from nemo_fp8rl.fp8 import get_rollout_scheme

    return get_rollout_scheme(fp8_scheme, train_recipe=train_recipe)


class TorchRolloutEngine:
    """In-process sampler over the actor's weights with its own FP8 scheme (see the module docstring).

    Args:
        model_cfg: :class:`nemo_fp8rl.config.model.ModelConfig` of the policy.
        fp8_scheme: rollout FP8 scheme name or object (:func:`resolve_rollout_scheme`).
        train_recipe: training FP8 recipe (only for ``"same_as_train"``).
        eos_id, pad_id: end-of-sequence and padding token ids.
        eos_ids: every id that ends a response (e.g. Qwen3's ``<|im_end|>`` and ``<|endoftext|>``, from
            ``generation_config.json``); None = ``(eos_id,)``. ``eos_id`` is added if missing.
        device: where the weights, cache and forward live (outputs are returned on CPU).
        dtype: compute dtype of activations and stored weights; None (default) = :func:`engine_dtype`
            (bfloat16 on CUDA, as vLLM serves a BF16 checkpoint; float32 elsewhere, so CPU results keep
            the float32 reference).
        fp8_gemm: ``emulate`` | ``torch`` (FP8 linears on torch's scaled GEMM where it runs the scheme).
        kv_cache: ``off`` | ``e4m3`` | ``e5m2``: the FP8 KV cache (``rollout.fp8.kv_cache``).
        kv_kernel: ``cuda`` (vLLM on GPU: divide by the scale, round to nearest even, the query quantized
            too with E4M3) | ``cpu`` (vLLM-CPU 0.32: multiply by the reciprocal, round toward zero).
        high_precision_layers: decoder layers whose linears and KV cache stay in ``dtype`` (BF16 edge
            layers, :func:`~nemo_fp8rl.rollout.model.edge_layers`).
        stop_check_interval: decode steps between the checks for ended rows (``rollout.stop_check_interval``;
            a host sync each); None = 1 on CPU, :data:`GPU_STOP_CHECK_INTERVAL` elsewhere.
        tokenizer: the task's tokenizer (anything with ``decode(ids) -> str``): decodes the responses for
            stop strings (``SamplingParams.stop``, :mod:`~nemo_fp8rl.rollout.stop_strings`); None refuses them.
        cuda_graphs: decode on static shapes, each step replayed as a CUDA graph on CUDA
            (``rollout.cuda_graphs``, :mod:`~nemo_fp8rl.rollout.decode_graphs`); without CUDA the same static
            steps run eagerly.
    """

    name = "torch"

    def __init__(
        self,
        model_cfg: Any,
        *,
        fp8_scheme: Any,
        train_recipe: Any = None,
        eos_id: int,
        pad_id: int,
        eos_ids: Sequence[int] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        fp8_gemm: str = "emulate",
        kv_cache: str = "off",
        kv_kernel: str = "cuda",
        high_precision_layers: Sequence[int] = (),
        stop_check_interval: int | None = None,
        tokenizer: Any = None,
        cuda_graphs: bool = False,
    ) -> None:
        if fp8_gemm not in ("emulate", "torch"):
            raise ValueError(f"torch rollout engine: fp8_gemm={fp8_gemm!r}; use 'emulate' or 'torch'")
        if kv_cache != "off" and kv_cache not in KV_CACHE_FORMATS:
            raise ValueError(f"rollout.fp8.kv_cache={kv_cache!r}; choose off or one of {list(KV_CACHE_FORMATS)}")
        if kv_kernel not in KV_KERNELS:
            raise ValueError(f"torch rollout engine: kv_kernel={kv_kernel!r}; choose one of {list(KV_KERNELS)}")
        self.fp8_gemm = fp8_gemm
        self.shape = ModelShape.from_config(model_cfg)
        bad = [i for i in high_precision_layers if not 0 <= int(i) < self.shape.num_layers]
        if bad:
            raise ValueError(f"high_precision_layers {bad} outside the model's {self.shape.num_layers} layers")
        self.high_precision_layers: tuple[int, ...] = tuple(sorted({int(i) for i in high_precision_layers}))
        """Decoder layers kept out of FP8 (linears and KV cache)."""
        self.kv: KvQuant | None = None if kv_cache == "off" else KvQuant(
            kv_cache, kv_kernel, KvScales.static(self.shape.num_layers), frozenset(self.high_precision_layers))
        """The FP8 KV cache (format, kernel, the scales in force, high-precision layers), or None."""
        self.scheme = resolve_rollout_scheme(fp8_scheme, train_recipe)
        self.scheme_name = fp8_scheme if isinstance(fp8_scheme, str) else type(fp8_scheme).__name__
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in (eos_ids or ()))]))
        self._eos = torch.tensor(self.eos_ids, dtype=torch.long)
        self.device = torch.device(device)
        self.dtype = engine_dtype(self.device) if dtype is None else dtype
        if stop_check_interval is None:
            stop_check_interval = 1 if self.device.type == "cpu" else GPU_STOP_CHECK_INTERVAL
        if isinstance(stop_check_interval, bool) or not isinstance(stop_check_interval, int) or stop_check_interval < 1:
            raise ValueError(f"rollout.stop_check_interval={stop_check_interval!r} must be an integer >= 1 (or null)")
        self.stop_check_interval = int(stop_check_interval)
        """Decode steps between the checks for ended rows (one host sync each)."""
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"torch rollout engine: tokenizer={tokenizer!r} has no decode(ids) -> str")
        self.tokenizer = tokenizer
        """Decodes responses for stop strings (None: ``SamplingParams.stop`` is refused)."""
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"rollout.cuda_graphs={cuda_graphs!r} must be true or false")
        self.cuda_graphs = cuda_graphs
        """Decode on static shapes (:class:`~nemo_fp8rl.rollout.decode_graphs.StaticDecode`), captured as
        CUDA graphs on CUDA."""
        if cuda_graphs and self.device.type != "cuda":
            log.info("rollout.cuda_graphs: no CUDA device (%s), so the static decode steps run without capture",
                     self.device)
        self.weights: RolloutWeights | None = None
        self.weights_version = 0
        """Number of weight syncs received so far."""
        self._closed = False

    # ---------------------------------------------------------------- weights
    @property
    def sync_target(self) -> tuple[torch.device, torch.dtype]:
        """``(device, dtype)`` a colocated trainer should send the weights in: the engine's own, so a sync
        is a device-to-device copy in the engine dtype (no host round trip, no float32 copy;
        :func:`nemo_fp8rl.models.hf_weights.iter_stage_hf`). Weights sent otherwise are converted."""
        return self.device, self.dtype

    def update_weights(self, weights: WeightsArg, kv_scales: KvScales | None = None) -> dict[str, dict[str, float]]:
        """Replace the weights (HF Llama/Qwen names, any order) and re-quantize them for the FP8 scheme.

        ``weights``: a full state dict or a stream of ``(name, tensor)`` pairs (``actor.iter_weights()``);
        a stream is consumed layer by layer (:func:`~nemo_fp8rl.rollout.model.build_weights`). The new
        weights replace the old ones only after the whole sync succeeded. ``kv_scales``: new FP8 KV-cache
        scales shipped with this sync (:meth:`set_kv_scales`); None keeps the current ones.

        Returns the per-linear record of this sync (``amax``, relative quantization error ``rel_err``,
        and the ``scale`` when the scheme reports it), also kept as :attr:`last_sync`.
        """
        self._check_open()
        self.weights = build_weights(self.shape, weights, self.scheme, self.device, self.dtype, gemm=self.fp8_gemm,
                                     high_precision_layers=self.high_precision_layers)
        if kv_scales is not None:
            self.set_kv_scales(kv_scales)
        self.weights_version += 1
        if self.weights_version == 1:
            stats = self.weights.linear_stats
            gemm = "emulated GEMMs" if self.scheme.enabled else "unquantized GEMMs"
            if self.fp8_gemm == "torch" and self.scheme.enabled:
                real = sum(1 for r in stats.values() if r.get("gemm") == "torch")
                why = sorted({r["fallback"] for r in stats.values() if "fallback" in r})
                gemm = f"{real} on torch FP8 GEMMs, {len(stats) - real} emulated" + (f" ({'; '.join(why)})" if why else "")
            hp = self.high_precision_layers
            # a warning only when FP8 linears that could run on torch's FP8 GEMMs fell back (scheme off has none)
            fell_back = self.fp8_gemm == "torch" and self.scheme.enabled and any("fallback" in r for r in stats.values())
            n_fp8 = len(stats) - 4 * len(hp) if self.scheme.enabled else len(stats)
            (log.warning if fell_back else log.info)(
                "rollout engine 'torch': FP8 scheme %s %s (fused qkv and "
                "gate_up per layer; %s); embeddings, norms and the LM head stay %s%s; KV cache %s",
                self.scheme_name,
                f"quantizes {n_fp8} linear weights per sync" if self.scheme.enabled else
                f"(no FP8): {n_fp8} linear weights synced in {self.dtype}", gemm, self.dtype,
                f", and layers {list(hp)} (high-precision edge layers)" if hp else "",
                "in " + str(self.dtype) if self.kv is None else
                f"FP8 {self.kv.fmt.upper()} (vLLM's {self.kv.kernel} rules, query quantized: "
                f"{'yes' if self.kv.quantize_query else 'no'})",
            )
        return self.weights.linear_stats

    def set_kv_scales(self, scales: KvScales) -> None:
        """Use these per-layer FP8 KV-cache scales from the next ``generate`` on (kept across syncs).

        ``scales``: :class:`~nemo_fp8rl.fp8.kv_cache.KvScales` with one q/k/v scale per decoder layer
        (the high-precision layers' entries are ignored). A no-op without an FP8 KV cache.
        """
        if self.kv is None:
            return
        if scales.num_layers != self.shape.num_layers:
            raise ValueError(f"KV scales for {scales.num_layers} layers, the model has {self.shape.num_layers}")
        self.kv.scales = scales

    @property
    def kv_scales(self) -> KvScales | None:
        """The FP8 KV-cache scales in force (None without an FP8 KV cache)."""
        return None if self.kv is None else self.kv.scales

    @property
    def last_sync(self) -> dict[str, dict[str, float]]:
        """Per fused linear, what the last weight sync's quantization did (empty before the first sync)."""
        return {} if self.weights is None else self.weights.linear_stats

    @property
    def vocab_rows(self) -> int:
        return int(self._w().embed.shape[0])

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the rollout engine was closed")

    def _w(self) -> RolloutWeights:
        self._check_open()
        if self.weights is None:
            raise RuntimeError("the rollout engine has no weights yet: call update_weights(actor.export_weights()) first")
        return self.weights

    # ---------------------------------------------------------------- colocation
    def sleep(self) -> bool:
        """No-op (returns False): between rollouts the engine holds only its weights, which the next
        ``generate`` needs; the KV cache is freed at the end of every ``generate``."""
        return False

    def wake_up(self) -> bool:
        """No-op (returns False): :meth:`sleep` freed nothing."""
        return False

    def close(self) -> None:
        """Drop the weights; afterwards ``generate`` and ``update_weights`` raise. Idempotent."""
        self.weights = None
        self._closed = True

    # ---------------------------------------------------------------- reference path
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """No-cache full-sequence forward: tokens LongTensor [B, T] -> logits float32 [B, T, V] (on CPU)."""
        self._check_ids(tokens, "tokens")
        return forward_full(self.shape, self._w(), self.scheme, tokens.to(self.device), kv=self.kv).cpu()

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Teacher-forced log-probs of ``tokens`` [B, T] under this engine -> float32 [B, T].

        out[b, t] = log_softmax(logits[b, t - 1] / temperature)[tokens[b, t]] for t >= 1; out[b, 0] = 0.
        (Same alignment as ``RolloutBatch.rollout_logp``; mask it with the response mask.)
        """
        logits = self.forward(tokens)
        lp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)

    def _check_ids(self, tokens: torch.Tensor, what: str) -> None:
        V = self.vocab_rows
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{what} must be an integer tensor, got {tokens.dtype}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
            raise ValueError(f"{what} has ids outside [0, {V}) (min {int(tokens.min())}, max {int(tokens.max())})")

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator
    ) -> RolloutBatch:
        """Sample one response per prompt with the KV cache; see :class:`~nemo_fp8rl.rollout.base.RolloutBatch`.

        ``prompts``: B lists of token ids (each non-empty, lengths may differ). ``generator`` drives all
        randomness (same weights, prompts, params and generator state -> identical batch).
        """
        w = self._w()
        B, P, N, lens_list = check_generate_inputs(prompts, params, generator, self.shape.seq_length)
        lens = torch.tensor(lens_list, dtype=torch.long)
        tokens = torch.full((B, P + N), self.pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self._check_ids(tokens[:, :P], "prompts")
        # Everything the loop writes lives on the engine's device: no host copy per token (module docstring).
        dev = self.device
        tokens, lens_dev = tokens.to(dev), lens.to(dev)
        logp = torch.zeros((B, P + N), dtype=torch.float32, device=dev)
        resp = torch.zeros(B, dtype=torch.long, device=dev)
        eos = self._eos.to(dev)
        gen = sampling_generator(generator, dev)
        k = self.stop_check_interval

        stops = None
        if params.stop:
            if self.tokenizer is None:
                raise ValueError(
                    "rollout.stop needs the task's tokenizer to decode responses: build the torch engine with "
                    "tokenizer=task.tokenizer (the trainer does when rollout.stop is set)")
            stops = StopStrings(params.stop, self.tokenizer.decode, params.min_tokens, B)
        checks = params.stop_on_eos or stops is not None  # anything to check for ended rows

        cache = KVCache.empty(self.shape, B, P + N, dev, self.dtype, kv=self.kv)
        logits = forward_prefill(self.shape, w, self.scheme, tokens[:, :P], lens_dev, cache)
        static = StaticDecode(self.shape, w, self.scheme, cache, capture=dev.type == "cuda") if self.cuda_graphs else None
        rows = torch.arange(B, device=dev)  # original batch index of each live cache row
        alive = torch.ones(B, dtype=torch.bool, device=dev)  # live rows that have not sampled EOS yet
        longest = int(lens.max())  # longest prompt among the live rows (host-side: no sync)
        for step in range(N):
            if step < params.min_tokens:  # vLLM's min_tokens: no EOS yet
                logits = logits.float().index_fill(-1, eos, float("-inf"))
            tok, lp = sample_next(logits, params.temperature, params.top_p, gen)
            pos = lens_dev[rows] + step
            if params.stop_on_eos and k > 1:  # rows that ended since the last check record nothing
                tokens[rows, pos] = torch.where(alive, tok, self.pad_id)
                logp[rows, pos] = torch.where(alive, lp.float(), 0.0)
                resp[rows] += alive.long()
            else:
                tokens[rows, pos] = tok
                logp[rows, pos] = lp.float()
                resp[rows] += 1
            if step == N - 1:
                break
            if params.stop_on_eos:
                alive &= ~torch.isin(tok, eos)
            if checks and (step + 1) % k == 0:  # the check: one host sync every k steps
                if stops is None:
                    ended = not bool(alive.all())
                    keep = alive.nonzero().squeeze(1) if ended else None
                else:  # EOS and stop strings in one transfer; stop-string rows are cut after the loop
                    live = stops.check(rows, alive, tokens, lens_dev, resp, step + 1)
                    ended = not all(live)
                    keep = torch.tensor([j for j, go in enumerate(live) if go], dtype=torch.long,
                                        device=dev) if ended else None
                if ended:
                    if keep.numel() == 0:
                        break
                    rows, pos, tok, alive = rows[keep], pos[keep], tok[keep], alive[keep]
                    if static is None:
                        cache.select_rows(keep)
                    else:
                        static.keep(keep)
                    longest = int(lens_dev[rows].max())
            if static is None:
                logits = forward_decode(self.shape, w, self.scheme, tok, pos, cache, length=longest + step + 1)
            else:
                logits = static.step(tok, pos, longest + step + 1)
        if stops is not None and stops.seen < step + 1:  # the steps after the last check
            stops.check(rows, alive, tokens, lens_dev, resp, step + 1)
        tokens, lens, resp, logp = tokens.cpu(), lens, resp.cpu(), logp.cpu()
        finished = torch.zeros(B, dtype=torch.bool)
        if params.stop_on_eos:
            # A row stopped on EOS iff its last response token is one (with stop_on_eos, nothing follows one).
            finished = torch.isin(tokens[torch.arange(B), lens + resp - 1], self._eos)
        if stops is not None:
            # A row that completed a stop string ends at that token (an EOS after it is dropped): finished.
            stops.cut(tokens, logp, lens, resp, self.pad_id)
            finished[list(stops.ends)] = True

        return RolloutBatch.from_padded(tokens, lens, resp, logp, finished)


@register_rollout_engine("torch", options=("stop_check_interval", "cuda_graphs"))
def _make_torch_engine(model_cfg: Any, **kw: Any) -> TorchRolloutEngine:
    return TorchRolloutEngine(model_cfg, **kw)
