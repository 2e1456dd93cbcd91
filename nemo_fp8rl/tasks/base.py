"""Task interface: prompts with ground truth, a tokenizer, rewards run safely, a well-formedness check.

A task is what an RL run optimises: it hands out prompts (token ids + text + ground-truth answer),
scores the sampled responses (``score``), says whether a response is well-formed (``is_valid``, the
garbled-output metric ``rollout/invalid_frac``), and provides supervised warm-up examples so RL starts
from a policy that is right part of the time (``warmup_examples``). Its position in the data stream is
part of the checkpoint (``state_dict`` / ``load_state_dict``) so a resumed run sees the same prompts.
A run resumed at another data-parallel size hands the new rank every saved rank's state
(``reshard_state``): the stream goes on from the saved position, re-seeded or resharded, never from
its opening.

Reward functions run in a separate worker process with a per-call timeout
(:mod:`nemo_fp8rl.tasks.reward_runner`): a reward that raises, hangs or crashes scores 0 and is counted
in ``reward/errors``; training goes on.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from nemo_fp8rl.algorithms.metrics import Metric, make_metric
from nemo_fp8rl.registry import Registry
from nemo_fp8rl.tasks.reward_runner import RewardRunner

if TYPE_CHECKING:
    from nemo_fp8rl.config.schema import TrainConfig

__all__ = [
    "CharTokenizer",
    "Prompt",
    "Scores",
    "Task",
    "Tokenizer",
    "get_task",
    "pad_examples",
    "register_task",
    "reshard_seed",
    "task_class",
    "task_names",
]


RESHARD_SEED_STRIDE = 1_000_000_007
"""Prime step of :func:`reshard_seed` (not the arithmetic task's eval offset 1_000_003)."""


def reshard_seed(seed: int, step: int) -> int:
    """The seed a random stream gets when a run resumes at step ``step`` with another data-parallel size.

    ``seed`` is the stream's seed as built (for the trainer's streams and the task it already holds the
    DP rank: ``cfg.seed * 1000 + offset + dp_rank``); adding ``RESHARD_SEED_STRIDE * step`` gives a
    stream that is neither the run's opening (step 0) nor another rank's, and the same on every
    resume from the same checkpoint (a resumed run stays reproducible).
    """
    return int(seed) + RESHARD_SEED_STRIDE * int(step)


@runtime_checkable
class Tokenizer(Protocol):
    """The small tokenizer interface tasks, trainer and rollout rely on (a HF tokenizer adapter fits it)."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class CharTokenizer:
    """One token per character, after three special tokens: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

    ``encode`` adds no special tokens and rejects characters outside the vocabulary (naming them and
    their position). ``decode`` renders special ids as ``<pad>``/``<bos>``/``<eos>`` and ids outside the
    vocabulary as ``<unk:ID>``, so a response that contains them is visibly ill-formed.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, chars: Iterable[str]) -> None:
        chars = list(chars)
        if any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer needs single characters")
        if len(set(chars)) != len(chars):
            dup = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"CharTokenizer got duplicate characters {dup!r}")
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
        self.vocab_size = len(self.SPECIALS) + len(chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError:
            bad = sorted({c for c in text if c not in self._ids})
            pos = next(i for i, c in enumerate(text) if c not in self._ids)
            raise ValueError(
                f"characters {bad!r} are not in the tokenizer's vocabulary (first at position {pos} of {text[:60]!r})"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        n = len(self.SPECIALS)
        out = []
        for i in ids:
            i = int(i)
            if 0 <= i < n:
                out.append(self.SPECIALS[i])
            elif n <= i < self.vocab_size:
                out.append(self.chars[i - n])
            else:
                out.append(f"<unk:{i}>")
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


@dataclass
class Prompt:
    """One prompt: ``ids`` (token ids, BOS first), its ``text`` (without BOS) and the ground-truth ``answer``."""

    ids: list[int]
    text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    """Where it came from (e.g. ``{"source": "data.jsonl:17"}``) and other task-specific facts."""


@dataclass
class Scores:
    """Rewards of a batch of responses. Shapes: ``rewards`` float32 [n], ``correct`` and ``invalid`` bool [n].

    ``errors`` counts reward calls that raised, timed out, crashed or returned a non-number (they score
    0); ``error_messages`` keeps the first few for the log. ``trailing`` (bool [n], or None for a task
    without a closing answer tag): the response has non-whitespace text after its final answer's closing
    tag (a sample that ran on past its answer; ``task.trailing_text_penalty``). ``unclosed`` (bool [n], or
    None likewise): its final answer was read from an opening tag that is never closed (the lenient parse).
    """

    rewards: torch.Tensor
    correct: torch.Tensor
    invalid: torch.Tensor
    errors: int
    error_messages: list[str] = field(default_factory=list)
    trailing: torch.Tensor | None = None
    unclosed: torch.Tensor | None = None

    def metrics(self) -> dict[str, Metric]:
        """``reward/mean``, ``reward/accuracy``, ``rollout/invalid_frac`` (means) and ``reward/errors`` (sum);
        ``reward/trailing_text`` and ``reward/unclosed_answer`` (the shares of ``trailing`` and ``unclosed``,
        means) for tasks that have the notion."""
        n = max(int(self.rewards.numel()), 1)
        out = {
            "reward/mean": make_metric(self.rewards.float().sum() / n, "mean"),
            "reward/accuracy": make_metric(self.correct.float().sum() / n, "mean"),
            "reward/errors": make_metric(float(self.errors), "sum"),
            "rollout/invalid_frac": make_metric(self.invalid.float().sum() / n, "mean"),
        }
        if self.trailing is not None:
            out["reward/trailing_text"] = make_metric(self.trailing.float().sum() / n, "mean")
        if self.unclosed is not None:
            out["reward/unclosed_answer"] = make_metric(self.unclosed.float().sum() / n, "mean")
        return out


def pad_examples(seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad full sequences into ``tokens`` LongTensor [n, T] and ``loss_mask`` FloatTensor [n, T].

    loss_mask[b, t] = 1 for prompt_lens[b] <= t < len(seqs[b]) (the response tokens, EOS included), the
    same convention as ``RolloutBatch.mask``: the loss at t is -log p(tokens[t] | tokens[:t]).
    """
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.float32)
    for b, (s, p) in enumerate(zip(seqs, prompt_lens)):
        tokens[b, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, p : len(s)] = 1.0
    return tokens, mask


class Task(ABC):
    """Base of all tasks. Subclasses set ``name``, ``tokenizer``, ``reward_fn`` and implement the abstract
    methods; :meth:`score` is shared (runs ``reward_fn(response, answer)`` in the reward worker).

    Args:
        seed: seed of the task's own prompt stream (used when ``prompts`` gets no generator).
        reward_timeout_s: seconds one reward call may take before it scores 0 and counts as an error.
    """

    name: str = "task"
    tokenizer: Tokenizer

    def __init__(self, *, seed: int = 0, reward_timeout_s: float = 5.0) -> None:
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        """The task's own prompt-stream RNG (saved in ``state_dict``)."""
        self.warmup_generator = torch.Generator().manual_seed(self.seed + 1)
        """RNG of ``warmup_examples`` when it gets no generator (separate, so warm-up leaves the prompt
        stream untouched; saved in ``state_dict``)."""
        self.reward_timeout_s = float(reward_timeout_s)
        self._runner: RewardRunner | None = None
        self.prompts_served = 0

    # ---------------------------------------------------------------- to implement
    @property
    @abstractmethod
    def reward_fn(self) -> Callable[[str, str], Any]:
        """Picklable ``f(response_text, answer) -> reward | (reward, correct)`` run in the reward worker."""

    @property
    def reward_prepare(self) -> Callable[[], Any] | None:
        """Picklable ``f()`` each reward worker runs once before its first ``reward_fn`` call, outside the
        per-call ``reward_timeout_s`` (importing the checker; :mod:`~nemo_fp8rl.tasks.reward_runner`). None:
        nothing to prepare."""
        return None

    @abstractmethod
    def prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        """The next ``n`` prompts (from ``generator``, else from the task's own stream, which advances)."""

    @abstractmethod
    def is_valid(self, text: str) -> bool:
        """Whether a response (decoded, up to its EOS) is well-formed; feeds ``rollout/invalid_frac``."""

    @abstractmethod
    def warmup_examples(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` supervised examples: ``(tokens [n, T] long, loss_mask [n, T] float)`` (see :func:`pad_examples`)."""

    # ---------------------------------------------------------------- shared
    def _gen(self, generator: torch.Generator | None, warmup: bool = False) -> torch.Generator:
        if generator is not None:
            return generator
        return self.warmup_generator if warmup else self.generator

    def response_text(self, ids: Sequence[int]) -> str:
        """Decode a response: the tokens before its first EOS (any of the tokenizer's ``eos_ids``; the EOS
        itself and anything after dropped)."""
        ids = [int(i) for i in ids]
        stops = set(getattr(self.tokenizer, "eos_ids", ())) | {self.tokenizer.eos_id}
        end = next((k for k, i in enumerate(ids) if i in stops), len(ids))
        return self.tokenizer.decode(ids[:end])

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> Scores:
        """Score ``responses[i]`` against ``prompts[i].answer``; see :class:`Scores`.

        The reward function runs in the reward worker with a ``reward_timeout_s`` deadline per call, after
        :attr:`reward_prepare` (once per worker, under the worker's start-up deadline).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"score() got {len(prompts)} prompts but {len(responses)} responses")
        if self._runner is None:
            self._runner = RewardRunner(self.reward_timeout_s)
        results = self._runner.run(self.reward_fn, [(r, p.answer) for p, r in zip(prompts, responses)],
                                   prepare=self.reward_prepare)
        msgs = [f"response {i}: {res.error}" for i, res in enumerate(results) if res.error is not None]
        return Scores(
            rewards=torch.tensor([res.reward for res in results], dtype=torch.float32),
            correct=torch.tensor([res.correct for res in results], dtype=torch.bool),
            invalid=torch.tensor([not self.is_valid(r) for r in responses], dtype=torch.bool),
            errors=len(msgs),
            error_messages=msgs[:8],
        )

    def close(self) -> None:
        """Stop the reward worker (a later ``score`` starts a new one)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def state_dict(self) -> dict[str, Any]:
        """Position in the prompt stream, for exact resume."""
        return {
            "rng_state": self.generator.get_state(),
            "warmup_rng_state": self.warmup_generator.get_state(),
            "prompts_served": self.prompts_served,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the stream continues exactly where it was saved)."""
        missing = {"rng_state", "warmup_rng_state", "prompts_served"} - set(state)
        if missing:
            raise KeyError(f"task state is missing {sorted(missing)} (checkpoint from another task?)")
        self.generator.set_state(state["rng_state"])
        self.warmup_generator.set_state(state["warmup_rng_state"])
        self.prompts_served = int(state["prompts_served"])

    def reshard_state(self, saved_states: Sequence[dict[str, Any]], dp_rank: int, dp_size: int, step: int) -> str:
        """Continue a run saved at another data-parallel size: this task becomes DP rank ``dp_rank`` of
        ``dp_size`` at step ``step``.

        ``saved_states[i]`` is the :meth:`state_dict` of saved DP rank i (one per saved DP rank, in rank
        order). No saved rank owns this rank's stream, and building it afresh (seeded by the DP rank)
        would replay the run's opening prompts on rank 0; so the task's generators are re-seeded from
        their seed as built and the resumed step (:func:`reshard_seed`): new prompts, never the
        opening ones. ``prompts_served`` continues from the saved rank of this DP rank (saved rank 0
        when there is none). A task that reads a dataset overrides this to continue the saved epoch.

        Returns:
            One line for the resume warning: what was re-seeded or continued.
        """
        if not saved_states:
            raise ValueError("reshard_state() needs the task state of every saved data-parallel rank, got none")
        if not (0 <= dp_rank < dp_size):
            raise ValueError(f"reshard_state(): dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        for i, st in enumerate(saved_states):
            missing = {"rng_state", "warmup_rng_state", "prompts_served"} - set(st)
            if missing:
                raise KeyError(f"task state of saved data-parallel rank {i} is missing {sorted(missing)} "
                               "(checkpoint from another task?)")
        self.generator.manual_seed(reshard_seed(self.seed, step))
        self.warmup_generator.manual_seed(reshard_seed(self.seed + 1, step))
        own = saved_states[dp_rank] if dp_rank < len(saved_states) else saved_states[0]
        self.prompts_served = int(own["prompts_served"])
        return (f"task {self.name}: prompt stream re-seeded from (seed {self.seed}, step {step}) "
                f"(reshard_seed)")


TASKS: Registry[Callable[..., Task]] = Registry("task", "task.name")


def register_task(name: str) -> Callable[[type], type]:
    """Class decorator: register a task under ``name`` (re-registering a name raises)."""
    return TASKS.register(name)


def _load_builtin_tasks() -> None:
    import nemo_fp8rl.tasks.arithmetic
    import nemo_fp8rl.tasks.math_jsonl
    import nemo_fp8rl.tasks.reasoning_gym  # noqa: F401


def task_names() -> list[str]:
    """Names accepted by :func:`get_task`."""
    _load_builtin_tasks()
    return TASKS.names()


def task_class(name: str) -> type:
    """The class registered as ``name`` (for inspecting its constructor's keys); unknown names raise."""
    _load_builtin_tasks()
    return TASKS.get(name)  # type: ignore[return-value]


_FORMAT_PENALTIES = {
    "trailing_text_penalty": "penalises text after the closing tag of a response's final answer",
    "unclosed_answer_penalty": "penalises a final answer in a tag that is never closed",
}
"""The format-penalty keys of TaskConfig that need a task with answer tags, and what each does."""


def _check_format_penalties(cfg: "TrainConfig", params) -> None:
    """A format penalty other than 0 for a task without answer tags raises instead of being dropped."""
    for key, what in _FORMAT_PENALTIES.items():
        value = getattr(cfg.task, key)
        if value and key not in params:
            from nemo_fp8rl.config.schema import ConfigError

            takers = [n for n in task_names() if key in inspect.signature(task_class(n)).parameters]
            raise ConfigError(
                f"task.{key}={value} {what}, but task {cfg.task.name!r} has no closing answer tag (arithmetic: the "
                "response is the answer; math_jsonl: math-verify reads the answer anywhere in the text); set "
                f"task.{key}=0, or use a task with answer tags: {takers}")


def check_task_config(cfg: "TrainConfig") -> None:
    """``validate()``'s task check: ``task.trailing_text_penalty`` and ``task.unclosed_answer_penalty`` only
    for a task that takes them (raises
    :class:`~nemo_fp8rl.config.schema.ConfigError`), so the launcher refuses it before a job is queued. A
    task name not registered here (a user's task, registered by their code before the trainer starts) is
    checked when the trainer builds it (:func:`task_kwargs`)."""
    _load_builtin_tasks()
    if cfg.task.name not in TASKS.names(include_aliases=True):
        return
    _check_format_penalties(cfg, inspect.signature(task_class(cfg.task.name)).parameters)


def task_kwargs(cfg: "TrainConfig", factory, seed: int, dp_rank: int = 0, dp_size: int = 1) -> dict:
    """The TaskConfig fields the task's constructor accepts, plus its prompt-stream seed and, for a task
    that reads a dataset (``num_shards`` in its signature) under data parallelism, this rank's shard of
    each epoch with a permutation seed shared by all ranks (``cfg.seed * 1000 + 29``).

    A ``task.trailing_text_penalty`` or ``task.unclosed_answer_penalty`` other than 0 for a task that does
    not take it (no answer tags) raises :class:`~nemo_fp8rl.config.schema.ConfigError` instead of being
    dropped silently."""
    params = inspect.signature(factory).parameters
    _check_format_penalties(cfg, params)
    kw = {k: v for k, v in dataclasses.asdict(cfg.task).items() if k != "name" and k in params}
    if "seed" in params:
        kw["seed"] = seed
    if dp_size > 1 and "num_shards" in params:
        kw.update(shard_rank=dp_rank, num_shards=dp_size, shuffle_seed=cfg.seed * 1000 + 29)
    return kw


def get_task(name: str, **cfg: Any) -> Task:
    """Build the task registered as ``name`` with keyword config ``cfg`` (config group ``task``).

    Unknown names and unknown keys raise ``ValueError`` listing the valid ones.
    """
    cls = task_class(name)

    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        valid = sorted(k for k in params if k != "self")
        unknown = sorted(set(cfg) - set(valid))
        if unknown:
            raise ValueError(f"task {name!r} does not take {unknown} (config keys task.*); valid keys: {valid}")
    return cls(**cfg)
