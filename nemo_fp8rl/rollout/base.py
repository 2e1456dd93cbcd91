"""The rollout-engine interface: what the trainer needs from anything that generates responses.

A rollout engine is a separate model implementation, the way vLLM is in real RL stacks (verl, NeMo RL,
OpenRLHF): the trainer owns the weights, and after every optimizer step it pushes them to the engine
("weight sync") in Hugging Face Llama/Qwen naming. The engine keeps its own copy, possibly quantized
with its own FP8 scheme, and samples responses with it. Because the two implementations (and their FP8
schemes) differ, the engine reports the log-probability of every token it sampled (``rollout_logp``),
which the trainer compares with its own (``old_logp``) for rollout correction (TIS / IcePop).

Three small pieces keep engines interchangeable:

- :class:`SamplingParams`: temperature, top-p, maximum new tokens, stop on EOS, stop strings.
- :class:`RolloutBatch`: the result, in one layout every engine must produce (below).
- :class:`RolloutEngine` (a Protocol) and the registry :func:`get_rollout_engine` /
  :func:`register_rollout_engine`. ``"torch"`` is the in-process engine of
  :mod:`nemo_fp8rl.rollout.torch_engine`; ``"vllm"`` is vLLM's offline engine
  (:mod:`nemo_fp8rl.rollout.vllm_engine`, optional dependency ``nemo-fp8rl[vllm]``).

Layout of :class:`RolloutBatch` (B sequences, T positions)::

    tokens[b]       = p_0 .. p_{P_b - 1}  r_0 .. r_{R_b - 1}  pad ... pad
    mask[b, t]      = 1 for P_b <= t < P_b + R_b (response tokens, EOS included when sampled), else 0
    rollout_logp[b, t] = log p_rollout(tokens[b, t] | tokens[b, :t]) where mask is 1, else 0

so ``rollout_logp`` lines up with the trainer's teacher-forced log-probs of the same ``tokens``
(log-prob of token t from the logits at position t - 1).

How a response ends (``finished``): on an EOS id (with ``stop_on_eos``; the EOS is its last token), on a
stop string (``SamplingParams.stop``: its last token is the one that completed the string; text past the
string inside that token stays, as in vLLM's ``token_ids`` with ``include_stop_str_in_output=True``), or at
``max_new_tokens`` without either (``finished`` False).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_fp8rl.registry import Registry

__all__ = [
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "check_generate_inputs",
    "get_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_names",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of responses.

    ``rollout_logp`` convention ("sampling distribution", every engine): the log-probability of the
    sampled token under the distribution it was drawn from, i.e. after temperature and the top-p cut,
    renormalised over the nucleus K (the behaviour policy that TIS / IcePop correct for)::

        q = softmax(logits / temperature);  rollout_logp = log q_tok - log sum_{j in K} q_j

    This is vLLM's ``logprobs_mode="processed_logprobs"``. With ``top_p=1`` (K = the vocabulary) it is
    ``log_softmax(logits / temperature)``, at ``temperature=1`` the policy's own log-probability; with
    ``top_p < 1`` it exceeds that by ``-log sum_{j in K} q_j`` (vLLM's default ``raw_logprobs`` would
    instead ignore the temperature). ``temperature=0`` means greedy decoding; its ``rollout_logp`` is
    ``log_softmax(logits)`` (top-p does not apply).
    """

    temperature: float = 1.0
    """Softmax temperature (> 0), or 0 for greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p (0 < top_p <= 1)."""
    max_new_tokens: int = 16
    """Most tokens generated per prompt (EOS included)."""
    stop_on_eos: bool = True
    """Stop a sequence when it samples the EOS token (the EOS is kept as the last response token)."""
    min_tokens: int = 0
    """vLLM's ``min_tokens``: the EOS ids get probability 0 until a response has this many tokens (the
    tokens are then drawn from the distribution conditioned on "not yet the end"; their ``rollout_logp``
    is of that distribution). A stop string counts only where it ends after the text of these tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings (vLLM's ``stop`` with ``include_stop_str_in_output=True``): a response ends at the
    first token after which its decoded text holds one of them; that token is its last (the string is
    kept: a reward parser needs the closing ``</answer>``). Empty = off. Engines need the task's
    tokenizer to decode (``tokenizer=`` at build)."""

    def __post_init__(self) -> None:
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(
                f"SamplingParams.temperature={t!r} is not valid; use a finite number > 0, or 0 for greedy "
                "decoding (config key rollout.temperature)"
            )
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"SamplingParams.top_p={self.top_p!r} is not valid; use 0 < top_p <= 1 "
                "(config key rollout.top_p; 1.0 disables nucleus sampling)"
            )
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r} is not valid; use an integer >= 1 "
                "(config key rollout.max_new_tokens)"
            )
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens):
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens!r} is not valid; use an integer >= 0")
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, (tuple, list)) or not all(
                isinstance(s, str) and s for s in stop):
            raise ValueError(
                f"SamplingParams.stop={stop!r} is not valid; give a list of non-empty strings, e.g. "
                "rollout.stop=['</answer>'] (config key rollout.stop; [] = no stop strings)"
            )
        object.__setattr__(self, "stop", tuple(stop))  # a list (from the config) becomes the field's tuple

    @classmethod
    def from_config(cls, rollout: Any) -> "SamplingParams":
        """The sampling parameters of a ``rollout`` config section (:class:`~nemo_fp8rl.config.schema.RolloutConfig`):
        temperature, top-p, max_new_tokens, stop_on_eos and stop. The one place a config becomes
        sampling parameters (the trainer and config validation use it)."""
        stop = rollout.stop
        return cls(temperature=rollout.temperature, top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens,
                   stop_on_eos=rollout.stop_on_eos, stop=stop if stop is None or isinstance(stop, str) else tuple(stop))


@dataclass
class RolloutBatch:
    """Sampled sequences, prompt first, right-padded (see the module docstring for the layout).

    Shapes: ``tokens`` LongTensor [B, T]; ``prompt_lens``, ``response_lens`` LongTensor [B];
    ``mask`` FloatTensor [B, T]; ``rollout_logp`` FloatTensor [B, T] (float32); ``finished``
    BoolTensor [B]. All on CPU.

    ``finished[b]`` is True when the response ended before ``max_new_tokens`` could cut it: on an EOS id
    (``stop_on_eos``; the EOS is its last token) or on a stop string (``SamplingParams.stop``; its last
    token is the one whose decoding completed the string, any text past the string inside that token
    included). One that ends so on its ``max_new_tokens``-th token is finished too (vLLM reports
    ``finish_reason="stop"`` there). False: cut at ``max_new_tokens`` (the trainer's ``rollout/eos_frac``
    is the share of finished responses, stop strings included).
    """

    tokens: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    finished: torch.Tensor

    @classmethod
    def from_padded(
        cls, tokens: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor, logp: torch.Tensor,
        finished: torch.Tensor,
    ) -> "RolloutBatch":
        """A batch from an engine's right-padded buffers, cut to T = max(prompt_len + response_len).

        ``tokens``, ``logp``: [B, >= T] (prompt then response per row, pad after); ``prompt_lens``,
        ``response_lens``: [B] long; ``finished``: [B] bool. mask[b, t] = 1 for P_b <= t < P_b + R_b;
        ``rollout_logp`` = logp * mask.
        """
        T = int((prompt_lens + response_lens).max())
        pos = torch.arange(T).unsqueeze(0)
        mask = ((pos >= prompt_lens.unsqueeze(1)) & (pos < (prompt_lens + response_lens).unsqueeze(1))).float()
        return cls(tokens=tokens[:, :T].contiguous(), prompt_lens=prompt_lens, response_lens=response_lens,
                   mask=mask, rollout_logp=logp[:, :T] * mask, finished=finished)

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
        """Rows of ``batches`` in order, re-padded to the widest: [sum B_i, max T_i] (tokens padded with
        ``pad_id``, mask and ``rollout_logp`` with 0)."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        width = max(b.tokens.shape[1] for b in batches)

        def cat(name: str, value: float) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(getattr(b, name), (0, width - b.tokens.shape[1]), value=value)
                              for b in batches])

        return cls(tokens=cat("tokens", pad_id), mask=cat("mask", 0.0), rollout_logp=cat("rollout_logp", 0.0),
                   prompt_lens=torch.cat([b.prompt_lens for b in batches]),
                   response_lens=torch.cat([b.response_lens for b in batches]),
                   finished=torch.cat([b.finished for b in batches]))

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    def responses(self) -> list[list[int]]:
        """Response token ids of each sequence (EOS included when it was sampled)."""
        out = []
        for b in range(self.batch_size):
            p, r = int(self.prompt_lens[b]), int(self.response_lens[b])
            out.append(self.tokens[b, p : p + r].tolist())
        return out

    def validate(self) -> None:
        """Check the layout invariants; raise ``ValueError`` naming the first one broken.

        Engines call this in tests; it is cheap enough to call on every batch while debugging.
        """
        B, T = self.tokens.shape
        for name in ("prompt_lens", "response_lens", "finished"):
            if tuple(getattr(self, name).shape) != (B,):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected ({B},)")
        for name in ("mask", "rollout_logp"):
            if tuple(getattr(self, name).shape) != (B, T):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected ({B}, {T})")
        pos = torch.arange(T).unsqueeze(0)
        start, end = self.prompt_lens.unsqueeze(1), (self.prompt_lens + self.response_lens).unsqueeze(1)
        expected = ((pos >= start) & (pos < end)).to(self.mask.dtype)
        if not torch.equal(self.mask, expected):
            raise ValueError("RolloutBatch.mask is not 1 exactly on positions prompt_len <= t < prompt_len + response_len")
        if bool(((self.rollout_logp != 0) & (self.mask == 0)).any()):
            raise ValueError("RolloutBatch.rollout_logp is nonzero outside the response mask")
        if B and int(end.max()) > T:
            raise ValueError("RolloutBatch: prompt_len + response_len exceeds the token width T")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer calls on a rollout engine.

    - ``update_weights(weights)``: replace the engine's weights (Hugging Face Llama/Qwen names, float
      tensors, any order), given as a full state dict or as a stream of ``(name, tensor)`` pairs (the
      trainer passes ``actor.iter_weights()``, which holds one tensor at a time: an engine must not
      collect the stream into a second full copy); the engine re-quantizes them for its FP8 scheme. Returns nothing the
      trainer must use (engines may return a summary of the sync).
    - ``generate(prompts, params, generator)``: sample one response per prompt (prompt = list of token
      ids, lengths may differ) and return a :class:`RolloutBatch`. Same weights, prompts, params and
      generator state -> same result.

    Colocation with training (the engine and the trainer share an accelerator), one step::

        update_weights -> generate -> sleep -> (trainer: logprobs, updates) -> [wake_up] -> update_weights ...

    - ``sleep()``: free or offload the engine's accelerator memory (weights, KV cache) so training can use
      it. Idempotent (a second call does nothing). An engine may discard its weights (vLLM sleep level 2):
      after a sleep, a weight sync must come before the next ``generate``. Returns True when memory was
      freed, False when there was nothing to do (already asleep, no accelerator memory, closed).
    - ``wake_up()``: restore what ``sleep`` freed, before the next ``generate`` / ``update_weights``
      (``update_weights`` on a sleeping engine wakes it too). Idempotent; True when it woke.
      With the weights kept across the sleep, ``generate`` after ``sleep(); wake_up()`` returns what it
      would have returned without.
    - ``close()``: release everything the engine holds (weights, caches, worker processes, temporary
      files). Idempotent, and safe on an engine whose build failed midway; afterwards ``generate`` and
      ``update_weights`` raise ``RuntimeError``, ``sleep`` / ``wake_up`` return False.

    FP8 KV cache (``rollout.fp8.kv_cache``; both built-in engines): ``set_kv_scales(scales)`` takes the
    per-layer :class:`~nemo_fp8rl.fp8.kv_cache.KvScales` the trainer calibrates (``rollout.fp8.kv_scales=
    calibrated``) and keeps them across syncs, sleep and wake-up; ``update_weights(weights, kv_scales=...)``
    ships them with a sync. Not part of this protocol: engines without an FP8 cache need neither.
    """

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> Any: ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> RolloutBatch: ...

    def sleep(self) -> bool: ...

    def wake_up(self) -> bool: ...

    def close(self) -> None: ...


_ENGINES: Registry[Callable[..., RolloutEngine]] = Registry("rollout engine", "rollout.engine")
"""Rollout-engine factories by name (``rollout.engine``)."""

_OPTIONS: dict[str, tuple[str, ...]] = {}
"""Per engine name, the ``rollout.*`` keys its factory takes (:func:`register_rollout_engine`)."""


def check_generate_inputs(
    prompts: Sequence[Sequence[int]], params: SamplingParams, generator: object, seq_length: int
) -> tuple[int, int, int, list[int]]:
    """The checks every engine's ``generate`` runs before sampling; returns (B, P, N, prompt lengths).

    B prompts (each non-empty), P = the longest prompt, N = ``params.max_new_tokens``; P + N must fit in
    ``seq_length`` (``model.seq_length``), and ``generator`` must be a ``torch.Generator``.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generate() needs a torch.Generator for reproducible sampling, got {type(generator).__name__}")
    if len(prompts) == 0:
        raise ValueError("generate() got no prompts")
    lens_list = [len(p) for p in prompts]
    if min(lens_list) == 0:
        raise ValueError(f"prompt {lens_list.index(0)} is empty; every prompt needs at least one token (BOS)")
    B, P, N = len(prompts), max(lens_list), params.max_new_tokens
    if P + N > seq_length:
        raise ValueError(
            f"longest prompt ({P} tokens) + rollout.max_new_tokens ({N}) = {P + N} exceeds model.seq_length "
            f"= {seq_length}; lower rollout.max_new_tokens or the task's max_prompt_len, or raise "
            "model.seq_length"
        )
    return B, P, N, lens_list


def register_rollout_engine(
    name: str, options: tuple[str, ...] = ()
) -> Callable[[Callable[..., RolloutEngine]], Callable[..., RolloutEngine]]:
    """Decorator: register a rollout-engine factory under ``name`` (re-registering a name raises).

    The factory is called as ``factory(model_cfg, fp8_scheme=..., train_recipe=..., eos_id=..., pad_id=...,
    **kw)``. ``options``: names of ``rollout.*`` config keys the factory takes as keyword arguments
    (:func:`get_rollout_engine` passes them from its ``options`` object).
    """

    def deco(factory: Callable[..., RolloutEngine]) -> Callable[..., RolloutEngine]:
        _ENGINES.register(name, factory)
        _OPTIONS[name] = tuple(options)
        return factory

    return deco


def _load_builtin_engines() -> None:
    # Imported here, not at module top, so `base` stays importable by engines without a cycle.
    import nemo_fp8rl.rollout.torch_engine  # noqa: F401  (registers "torch")
    import nemo_fp8rl.rollout.vllm_engine  # noqa: F401  (registers "vllm"; imports vllm only when built)


def rollout_engine_names() -> list[str]:
    """Names accepted by :func:`get_rollout_engine`."""
    _load_builtin_engines()
    return _ENGINES.names()


def get_rollout_engine(
    name: str,
    model_cfg: Any,
    *,
    fp8_scheme: Any,
    train_recipe: Any = None,
    eos_id: int,
    pad_id: int,
    options: Any = None,
    **kw: Any,
) -> RolloutEngine:
    """Build the rollout engine registered as ``name``.

    Args:
        name: engine name (``"torch"``: the in-process engine).
        model_cfg: :class:`nemo_fp8rl.config.model.ModelConfig` of the policy (shapes of the weights that
            ``update_weights`` will receive).
        fp8_scheme: rollout FP8 scheme name (config key ``rollout.fp8.scheme``: ``"vllm_w8a8"``,
            ``"vllm_block"``, ``"same_as_train"``, ``"off"``), or a scheme object with
            ``quantize_weight`` and ``quantize_activation``.
        train_recipe: the training FP8 recipe, needed by ``"same_as_train"``.
        eos_id, pad_id: token ids of end-of-sequence and padding.
        options: the ``rollout`` config section (or None): the keys the engine registered as options
            (vllm: ``sync_bucket_mb``, ``tensor_parallel_size``, ``gpu_memory_utilization``) are passed on.
        **kw: engine-specific options (torch engine: ``device``, ``dtype``; vllm: ``dtype``, ``max_num_seqs``).
    """
    _load_builtin_engines()
    factory = _ENGINES.get(name)  # an unknown name raises, listing the registered engines
    if options is not None:
        kw = {**{k: getattr(options, k) for k in _OPTIONS[name]}, **kw}
    return factory(model_cfg, fp8_scheme=fp8_scheme, train_recipe=train_recipe, eos_id=eos_id, pad_id=pad_id, **kw)
