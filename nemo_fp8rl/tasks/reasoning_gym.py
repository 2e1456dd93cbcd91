"""Verifiable tasks from the ``reasoning-gym`` package: seeded problem generators with their own checkers.

``task=reasoning_gym task.dataset=chain_sum +task.dataset_kwargs.max_terms=4`` trains on one of
reasoning-gym's procedural datasets (``chain_sum``, ``basic_arithmetic``, ``leg_counting``,
``countdown``, ``gsm_symbolic``, ...; ``reasoning_gym.factory.DATASETS`` lists them). The package is the
``real`` extra (``pip install 'nemo-fp8rl[real]'``).

Problem stream. A reasoning-gym dataset is indexed: ``create_dataset(name, seed=s, size=S)[i]`` is a
pure function of ``(config, s, i)``. The task strings fixed-size chunks of ``S`` problems (``S`` =
the dataset config's ``size``, 500 unless ``dataset_kwargs`` sets it) into an unbounded stream: global
problem ``g`` is item ``g mod S`` of chunk ``c = g // S``, whose seed is
``(stream_seed + c * S) mod 2**32``. For the many datasets that draw item i from ``Random(seed + i)``
this makes problem g come from ``Random(stream_seed + g)``: chunks never repeat one another (as
seeding chunk c with ``seed + c`` would). ``stream_seed`` is a 32-bit hash of (dataset, run seed), so
runs with other seeds get other problems.

Data parallelism. All ranks share the stream (``shuffle_seed``, which the trainer passes to every rank
alike); rank r of k serves ``g = start + r + k * position`` for its ``position = 0, 1, ...``, so ranks
never overlap. ``(start, position)`` is the task state: a resumed run continues with the next problem.
:meth:`ReasoningGymTask.reshard_state` continues a run saved with another DP size after every problem
any saved rank may have served.

Prompts. The question goes through ``prompt_template`` (``{prompt}``) and, with a Hugging Face
tokenizer (``tokenizer=<checkpoint dir>``; ``model.hf_path`` in the trainer), through the model's chat
template with ``system_prompt`` as the system turn (:meth:`HFTokenizer.encode_prompt`). Without one a
character tokenizer over printable ASCII and newline is used (``[BOS] + system_prompt + "\\n" +
prompt``); problems with other characters, and problems longer than ``max_prompt_len`` tokens, are
skipped and counted (``skipped_by_reason``).

Reward: reasoning-gym's ``score_answer`` on the content of the response's last ``<answer>...</answer>``
(:func:`~nemo_fp8rl.tasks.reasoning_gym_reward.reasoning_gym_reward`); a response without one is
invalid (``rollout/invalid_frac``, the stability monitor's garbled-output signal) and scores 0.
``task.partial_credit=false`` makes the reward binary (checkers such as chain_sum's give an answer that
merely contains the right number a partial score, which a policy can learn to exploit). A
response with non-whitespace text after its final answer's closing tag (it ran on past the answer) is
counted in ``reward/trailing_text`` and, with ``task.trailing_text_penalty`` p > 0, scores p less (a format
penalty; ``rollout.stop=['</answer>']`` ends responses at the tag instead). A final answer read from an
opening tag that is never closed (the lenient parse of
:func:`~nemo_fp8rl.tasks.reasoning_gym_reward.extract_answer`) is counted in ``reward/unclosed_answer``: its
reward stands (a rising share is a format drifting away from the tags), or, with
``task.unclosed_answer_penalty`` p > 0, scores p less.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nemo_fp8rl.config.schema import ConfigError
from nemo_fp8rl.tasks.base import CharTokenizer, Prompt, Scores, Task, pad_examples, register_task
from nemo_fp8rl.tasks.reasoning_gym_reward import (extract_answer, prepare_scorer, reasoning_gym_reward, trailing_text,
                                                    unclosed_answer)

__all__ = ["DEFAULT_SYSTEM_PROMPT", "ReasoningGymTask", "dataset_names"]

log = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = "Put only the final answer in <answer></answer> tags, e.g. <answer>42</answer>."
"""System turn of every prompt: asks for the final answer in the tags that the reward parses."""

_ASCII = "\n" + "".join(chr(c) for c in range(32, 127))
_MAX_SKIPS_IN_A_ROW = 200
_STATE_KEYS = ("dataset", "stream_seed", "chunk_size", "start", "position", "shard")


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("task=reasoning_gym needs the reasoning-gym package: pip install 'nemo-fp8rl[real]' "
                          "(or pip install reasoning-gym==0.1.25)") from e
    return reasoning_gym


def dataset_names() -> list[str]:
    """The reasoning-gym datasets ``task.dataset`` accepts."""
    _rg()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _seed32(*parts: object) -> int:
    """A 32-bit seed from ``parts`` (``random.Random`` seeds a string by its SHA-512: the same in every
    process and Python run, unlike ``hash``)."""
    return random.Random(":".join(str(p) for p in parts)).getrandbits(32)


@register_task("reasoning_gym")
class ReasoningGymTask(Task):
    """Problems of a reasoning-gym dataset, scored by its ``score_answer`` (see the module docstring).

    Args:
        dataset: reasoning-gym dataset name (``task.dataset``).
        dataset_kwargs: keyword arguments of the dataset's config dataclass (``task.dataset_kwargs``),
            e.g. ``{"min_terms": 2, "max_terms": 4}``; ``size`` sets the chunk size; ``seed`` is not
            allowed (the stream is seeded from the run seed).
        system_prompt: system turn of the chat template (plain text before the prompt without one).
        prompt_template: Python format string with ``{prompt}`` (the dataset's question).
        answer_tag: the tag whose last non-empty pair holds the final answer (``<answer>...</answer>``).
        response_prefix: text the assistant turn starts with, appended to every prompt (e.g.
            ``"<answer>"``: a small model then answers in the tag format); rewards and validity read
            ``response_prefix + response``.
        format_reward: reward of a parseable answer that scores lower (0 = the checker's score only).
        partial_credit: keep the checker's partial scores in (0, 1) (chain_sum scores an answer that merely
            contains the right number len(right answer) / len(answer)); false = a binary reward, 1 for a
            correct answer and 0 (or ``format_reward``) otherwise.
        trailing_text_penalty: subtracted from the reward of a response with non-whitespace text after the
            closing tag of its final answer (:func:`~nemo_fp8rl.tasks.reasoning_gym_reward.trailing_text`;
            0 = off). ``Scores.trailing`` (``reward/trailing_text``) flags such responses either way.
        unclosed_answer_penalty: subtracted from the reward of a response whose final answer was read from
            a tag never closed (:func:`~nemo_fp8rl.tasks.reasoning_gym_reward.unclosed_answer`; 0 = off, the
            lenient parse's reward stands). ``Scores.unclosed`` (``reward/unclosed_answer``) flags them either way.
        max_prompt_len: most prompt tokens (chat template and system prompt included); longer
            problems are skipped and counted.
        chat_template: with a Hugging Face tokenizer that has a chat template, wrap each prompt in it.
        tokenizer: None (character tokenizer), a Hugging Face checkpoint/tokenizer directory, or a
            ``Tokenizer`` object.
        seed: seed of the task's generators (per DP rank in the trainer); also the stream's seed when
            ``shuffle_seed`` is None.
        shard_rank, num_shards: this data-parallel rank and the DP size (see the module docstring).
        shuffle_seed: the stream's seed, the same on every rank (the trainer's ``cfg.seed * 1000 + 29``).
        reward_timeout_s: per-call reward timeout in seconds.
    """

    name = "reasoning_gym"

    def __init__(
        self,
        dataset: str = "chain_sum",
        dataset_kwargs: dict[str, Any] | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        prompt_template: str = "{prompt}",
        answer_tag: str = "answer",
        response_prefix: str = "",
        format_reward: float = 0.0,
        partial_credit: bool = True,
        trailing_text_penalty: float = 0.0,
        unclosed_answer_penalty: float = 0.0,
        max_prompt_len: int = 256,
        chat_template: bool = True,
        tokenizer: Any = None,
        seed: int = 0,
        shard_rank: int = 0,
        num_shards: int = 1,
        shuffle_seed: int | None = None,
        reward_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(seed=seed, reward_timeout_s=reward_timeout_s)
        if not (isinstance(num_shards, int) and num_shards >= 1 and isinstance(shard_rank, int)
                and 0 <= shard_rank < num_shards):
            raise ValueError(f"shard_rank={shard_rank!r} / num_shards={num_shards!r}: need 0 <= shard_rank < num_shards")
        if "{prompt}" not in prompt_template:
            raise ConfigError(f"task.prompt_template={prompt_template!r} must contain '{{prompt}}'")
        if not (0.0 <= float(format_reward) < 1.0):
            raise ConfigError(f"task.format_reward={format_reward!r} must be in [0, 1)")
        if not isinstance(partial_credit, bool):
            raise ConfigError(f"task.partial_credit={partial_credit!r} must be true (keep the checker's partial scores) "
                              "or false (exact answers only: reward 1 or 0)")
        p = unclosed_answer_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and p >= 0):
            raise ConfigError(f"task.unclosed_answer_penalty={p!r} must be a number >= 0 (subtracted from the reward "
                              "of a response whose final answer sits in a tag never closed; 0 = off)")
        p = trailing_text_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (math.isfinite(p) and p >= 0):
            raise ConfigError(f"task.trailing_text_penalty={p!r} must be a number >= 0 (subtracted from the reward of "
                              "a response with text after its final answer's closing tag; 0 = off)")
        if not (isinstance(max_prompt_len, int) and max_prompt_len >= 2):
            raise ConfigError(f"task.max_prompt_len={max_prompt_len!r} must be an integer >= 2")
        if not (isinstance(answer_tag, str) and answer_tag and answer_tag.isidentifier()):
            raise ConfigError(f"task.answer_tag={answer_tag!r} must be a tag name such as 'answer'")
        self.dataset = dataset
        self.dataset_kwargs = self._check_dataset(dataset, dataset_kwargs)
        self.chunk_size = int(self.dataset_kwargs.get("size", getattr(self._config_cls()(), "size", 500)))
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.answer_tag = answer_tag
        if not isinstance(response_prefix, str):
            raise ConfigError(f"task.response_prefix={response_prefix!r} must be a string ('' = none)")
        self.response_prefix = response_prefix
        self.format_reward = float(format_reward)
        self.partial_credit = partial_credit
        self.trailing_text_penalty = float(trailing_text_penalty)
        self.unclosed_answer_penalty = float(unclosed_answer_penalty)
        self.max_prompt_len = max_prompt_len
        self.chat_template = bool(chat_template)
        self.shard_rank, self.num_shards = shard_rank, num_shards
        base = self.seed if shuffle_seed is None else int(shuffle_seed)
        self.stream_seed = _seed32("reasoning_gym", dataset, base)
        self.heldout_seed = _seed32("reasoning_gym", dataset, base, "held-out")
        """Seed of the one chunk that warm-up examples and ``prompts(n, generator)`` draw from."""
        self.start, self.position = 0, 0
        self.skipped_by_reason: Counter[str] = Counter()
        self._chunks: OrderedDict[int, Any] = OrderedDict()
        if tokenizer is None:
            self.tokenizer = CharTokenizer(_ASCII)
        else:
            from nemo_fp8rl.tasks.hf_tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer)

    # ---------------------------------------------------------------- dataset
    def _config_cls(self) -> type:
        from reasoning_gym.factory import DATASETS

        return DATASETS[self.dataset][1]

    @staticmethod
    def _check_dataset(dataset: str, kwargs: Any) -> dict[str, Any]:
        """Check ``task.dataset`` / ``task.dataset_kwargs`` by building the dataset once; plain-dict kwargs."""
        rg = _rg()
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ConfigError(f"task.dataset={dataset!r} is not a reasoning-gym dataset; valid names: {sorted(DATASETS)}")
        if kwargs is None:
            kwargs = {}
        if type(kwargs).__module__.startswith("omegaconf"):  # a DictConfig built in Python (the CLI passes dicts)
            from omegaconf import OmegaConf

            kwargs = OmegaConf.to_container(kwargs, resolve=True)
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ConfigError(f"task.dataset_kwargs={kwargs!r} must be a mapping of config field names to values")
        try:  # plain JSON values: the reward worker rebuilds the scorer from them
            kwargs = json.loads(json.dumps(kwargs))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"task.dataset_kwargs={kwargs!r} must hold plain values (numbers, strings, lists): {e}") from None
        fields = [f.name for f in dataclasses.fields(DATASETS[dataset][1])]
        if "seed" in kwargs:
            raise ConfigError("task.dataset_kwargs.seed is not allowed: the problem stream is seeded from the run "
                              "seed (set seed=...)")
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise ConfigError(f"task.dataset_kwargs has {unknown}, which reasoning-gym's {dataset!r} config does not "
                              f"take; valid keys: {sorted(f for f in fields if f != 'seed')}")
        try:
            rg.create_dataset(dataset, seed=0, **kwargs)
        except (AssertionError, TypeError, ValueError) as e:
            raise ConfigError(f"task.dataset_kwargs={kwargs} is not valid for reasoning-gym's {dataset!r}: "
                              f"{e or type(e).__name__}") from None
        return kwargs

    def _chunk(self, seed: int) -> Any:
        """The dataset of ``chunk_size`` problems with ``seed`` (the last few are kept: building one may
        be costly for datasets that precompute)."""
        ds = self._chunks.get(seed)
        if ds is None:
            ds = _rg().create_dataset(self.dataset, **{**self.dataset_kwargs, "seed": seed, "size": self.chunk_size})
            self._chunks[seed] = ds
            while len(self._chunks) > 4:
                self._chunks.popitem(last=False)
        return ds

    def entry(self, g: int) -> dict[str, Any]:
        """Problem ``g`` of the stream: item ``g mod S`` of the chunk seeded ``(stream_seed + (g // S) * S)
        mod 2**32`` (``S`` = ``chunk_size``)."""
        c, i = divmod(int(g), self.chunk_size)
        return self._chunk((self.stream_seed + c * self.chunk_size) % 2**32)[i]

    def heldout_entry(self, i: int) -> dict[str, Any]:
        """Item ``i`` (< ``chunk_size``) of the held-out chunk (seed ``heldout_seed``)."""
        return self._chunk(self.heldout_seed)[int(i)]

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a templated prompt: the HF tokenizer's ``encode_prompt`` (chat template, system
        turn), else ``[BOS] + encode(system_prompt + "\\n" + text)``."""
        encode_prompt = getattr(self.tokenizer, "encode_prompt", None)
        if encode_prompt is not None:
            ids = list(encode_prompt(text, chat_template=self.chat_template, system_prompt=self.system_prompt or None))
        else:
            ids = [self.tokenizer.bos_id] + self.tokenizer.encode((self.system_prompt + "\n" if self.system_prompt
                                                                   else "") + text)
        return ids + (list(self.tokenizer.encode(self.response_prefix)) if self.response_prefix else [])

    def _heldout_prompt(self, generator: torch.Generator) -> Prompt | None:
        """The prompt of a random item of the held-out chunk (one draw of ``generator``); None as :meth:`_prompt`."""
        i = int(torch.randint(0, self.chunk_size, (1,), generator=generator))
        return self._prompt(self.heldout_entry(i), f"reasoning_gym/{self.dataset}:held-out:{i}")

    def _prompt(self, entry: dict[str, Any], source: str) -> Prompt | None:
        """The prompt of ``entry``; None (counted in ``skipped_by_reason``) when it cannot be encoded or is
        longer than ``max_prompt_len``."""
        text = self.prompt_template.format(prompt=entry["question"])
        try:
            ids = self.prompt_ids(text)
        except ValueError:  # characters outside the character tokenizer's vocabulary
            self._skip("unencodable", f"{source} has characters outside the character tokenizer's printable ASCII")
            return None
        if len(ids) > self.max_prompt_len:
            self._skip("too_long", f"{source} is {len(ids)} tokens > task.max_prompt_len={self.max_prompt_len}")
            return None
        return Prompt(ids=ids, text=text, answer=str(entry["answer"]), meta={"source": source, "entry": entry})

    @property
    def skipped_rows(self) -> int:
        """Problems skipped so far (too long, or not encodable); the trainer logs it as ``data/skipped_rows``."""
        return sum(self.skipped_by_reason.values())

    def _skip(self, reason: str, msg: str) -> None:
        if not self.skipped_by_reason[reason]:
            log.warning("skipping reasoning-gym problems: %s (further skips are counted in data/skipped_rows)", msg)
        self.skipped_by_reason[reason] += 1

    def _skip_guard(self, skips: int) -> None:
        if skips >= _MAX_SKIPS_IN_A_ROW:
            raise ConfigError(
                f"task.dataset={self.dataset!r}: {skips} problems in a row were skipped ({dict(self.skipped_by_reason)}): "
                "raise task.max_prompt_len, shorten task.system_prompt, or use a Hugging Face tokenizer "
                "(model.hf_path) for problems outside printable ASCII")

    # ---------------------------------------------------------------- data stream
    def prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        """The next ``n`` problems of this rank's share of the stream (``g = start + shard_rank +
        num_shards * position``); with ``generator``: ``n`` problems drawn uniformly with replacement
        from the held-out chunk, leaving the stream untouched."""
        out: list[Prompt] = []
        skips = 0
        while len(out) < n:
            if generator is not None:
                p = self._heldout_prompt(generator)
            else:
                g = self.start + self.shard_rank + self.num_shards * self.position
                self.position += 1
                p = self._prompt(self.entry(g), f"reasoning_gym/{self.dataset}:{g}")
            if p is None:
                skips += 1
                self._skip_guard(skips)
                continue
            skips = 0
            out.append(p)
        if generator is None:
            self.prompts_served += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dataset": self.dataset, "stream_seed": self.stream_seed,
                "chunk_size": self.chunk_size, "start": self.start, "position": self.position,
                "shard": [self.shard_rank, self.num_shards], "skipped_by_reason": dict(self.skipped_by_reason)}

    def _check_stream(self, st: dict[str, Any], who: str) -> None:
        missing = sorted(set(_STATE_KEYS) - set(st))
        if missing:
            raise KeyError(f"{who} is missing {missing} (checkpoint from another task?)")
        mine = (self.dataset, self.stream_seed, self.chunk_size)
        saved = (st["dataset"], st["stream_seed"], st["chunk_size"])
        if saved != mine:
            raise ValueError(f"{who} was saved for (dataset, stream seed, chunk size) {saved}, this task is {mine}; "
                             "resume with the same task.dataset, task.dataset_kwargs.size and seed")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_stream(state, "task state")
        if list(state["shard"]) != [self.shard_rank, self.num_shards]:
            raise ValueError(f"task state was saved by data-parallel rank {state['shard'][0]} of {state['shard'][1]}, "
                             f"this is rank {self.shard_rank} of {self.num_shards}; resume with the same layout")
        super().load_state_dict(state)
        self.start, self.position = int(state["start"]), int(state["position"])
        self.skipped_by_reason = Counter(state.get("skipped_by_reason", {}))

    def reshard_state(self, saved_states: Sequence[dict[str, Any]], dp_rank: int, dp_size: int, step: int) -> str:
        """Continue a run saved by ``k_old = len(saved_states)`` DP ranks as rank ``dp_rank`` of ``dp_size``.

        Saved rank i served ``g = start + i + k_old * t`` for ``t < position_i``, all below
        ``start' = start + k_old * max_i(position_i)``; the new ranks continue from ``start'`` with
        stride ``dp_size`` and position 0. No problem is served twice; the ``sum_i (max position -
        position_i)`` problems below ``start'`` that slower ranks (DAPO dynamic sampling draws unequal
        numbers) had not reached are skipped and counted in the returned line. The task's generators
        are re-seeded as in :meth:`Task.reshard_state`.
        """
        if (dp_rank, dp_size) != (self.shard_rank, self.num_shards):
            raise ValueError(f"reshard_state(dp_rank={dp_rank}, dp_size={dp_size}) on a task built as shard "
                             f"{self.shard_rank} of {self.num_shards}; build the task with shard_rank=dp_rank, "
                             "num_shards=dp_size")
        k_old = len(saved_states)
        for i, st in enumerate(saved_states):
            self._check_stream(st, f"task state of saved data-parallel rank {i}")
            if list(st["shard"]) != [i, k_old]:
                raise ValueError(f"task state {i} of the {k_old} saved data-parallel ranks was saved by rank "
                                 f"{st['shard'][0]} of {st['shard'][1]}; pass one state per saved DP rank, in rank order")
        starts = {int(st["start"]) for st in saved_states}
        if len(starts) != 1:
            raise ValueError(f"the saved data-parallel ranks started at different stream positions {sorted(starts)}; "
                             "they are not the shards of one run")
        note = super().reshard_state(saved_states, dp_rank, dp_size, step)
        pos = [int(st["position"]) for st in saved_states]
        self.start, self.position = starts.pop() + k_old * max(pos), 0
        self.skipped_by_reason = Counter(saved_states[dp_rank if dp_rank < k_old else 0].get("skipped_by_reason", {}))
        return (f"{note}; reasoning_gym {self.dataset} stream continued at problem {self.start} "
                f"({sum(pos)} served before the resume, {k_old * max(pos) - sum(pos)} skipped)")

    # ---------------------------------------------------------------- rewards
    @property
    def reward_fn(self) -> Callable[..., Any]:
        """``reasoning_gym_reward(response, entry)`` with this task's dataset, tag and format reward bound."""
        return functools.partial(reasoning_gym_reward, dataset=self.dataset,
                                 dataset_kwargs_json=self._dataset_kwargs_json,
                                 answer_tag=self.answer_tag, format_reward=self.format_reward,
                                 response_prefix=self.response_prefix, partial_credit=self.partial_credit)

    @property
    def reward_prepare(self) -> Callable[[], Any]:
        """Builds the dataset's scorer once per reward worker, before its first call (the import is slow)."""
        return functools.partial(prepare_scorer, self.dataset, self._dataset_kwargs_json)

    @property
    def _dataset_kwargs_json(self) -> str:
        """``dataset_kwargs`` as the reward worker's scorer cache keys it (JSON, sorted keys)."""
        return json.dumps(self.dataset_kwargs, sort_keys=True)

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> Scores:
        """As :meth:`Task.score`, but the reward worker gets each prompt's whole reasoning-gym entry
        (``score_answer`` reads its metadata, not only the answer string). ``Scores.trailing`` flags the
        responses with text after their final answer's closing tag (``response_prefix + response``); with
        ``trailing_text_penalty`` p their reward is lowered by p. ``Scores.unclosed`` flags those whose final
        answer was read from a tag never closed; with ``unclosed_answer_penalty`` p, theirs is lowered by p."""
        scores = super().score([dataclasses.replace(p, answer=p.meta["entry"]) for p in prompts], responses)
        texts = [self.response_prefix + r for r in responses]
        scores.trailing = torch.tensor([trailing_text(t, self.answer_tag) for t in texts], dtype=torch.bool)
        scores.unclosed = torch.tensor([unclosed_answer(t, self.answer_tag) for t in texts], dtype=torch.bool)
        if self.trailing_text_penalty:
            scores.rewards = scores.rewards - self.trailing_text_penalty * scores.trailing.float()
        if self.unclosed_answer_penalty:
            scores.rewards = scores.rewards - self.unclosed_answer_penalty * scores.unclosed.float()
        return scores

    def is_valid(self, text: str) -> bool:
        """Well-formed = ``response_prefix + text`` holds an answer (:func:`extract_answer`)."""
        return extract_answer(self.response_prefix + text, self.answer_tag) is not None

    def warmup_examples(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` held-out problems as ``prompt -> <answer>{answer}</answer> <eos>`` (teaches the format)."""
        g = self._gen(generator, warmup=True)
        seqs, plens = [], []
        skips = 0
        while len(seqs) < n:
            p = self._heldout_prompt(g)
            if p is None:
                skips += 1
                self._skip_guard(skips)
                continue
            skips = 0
            t = self.answer_tag
            target = f"<{t}>{p.answer}</{t}>"
            if self.response_prefix and target.startswith(self.response_prefix):
                target = target[len(self.response_prefix):]  # the prompt already ends with the prefix
            try:
                answer = self.tokenizer.encode(target)
            except ValueError:  # characters outside the character tokenizer's vocabulary
                self._skip("unencodable", f"the answer of {p.meta['source']} has characters outside printable ASCII")
                skips += 1
                self._skip_guard(skips)
                continue
            seqs.append(p.ids + answer + [self.tokenizer.eos_id])
            plens.append(len(p.ids))
        return pad_examples(seqs, plens, self.tokenizer.pad_id)
