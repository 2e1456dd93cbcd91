"""Math task from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object per line, math-verify reward.

Loading is strict by default: every malformed row raises an error that names ``file:line``, what is
wrong and how to fix it: bad JSON, a line that is not an object, a missing field, a field of the
wrong type (the prompt must be a string; the answer a string or a number), an empty prompt or answer,
a prompt longer than ``max_prompt_len`` tokens. With ``on_error="skip"`` such rows are skipped and
counted instead (``skipped_rows``, ``skipped_by_reason``, logged once). Blank lines are ignored.

Reward: Hugging Face ``math-verify`` parses the ground truth (wrapped in ``\\boxed{}`` unless it already
has ``$`` or ``\\boxed``) and the response into SymPy and compares them (so ``\\frac{1}{2}``, ``1/2`` and
``0.5`` agree). A response is well-formed when it holds a non-empty ``\\boxed{...}`` with balanced
braces.

Tokenizer: by default a character tokenizer over printable ASCII, newline, and every character of the
data; prompts are ``[BOS] + characters``. With ``tokenizer=<checkpoint directory>`` (or a tokenizer
object) the model's own Hugging Face tokenizer is used (:class:`~nemo_fp8rl.tasks.hf_tokenizer.HFTokenizer`)
and each prompt is built by its chat template (user turn + generation prompt) when it has one and
``chat_template`` is true, else as the text with the tokenizer's own special tokens.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nemo_fp8rl.tasks.base import CharTokenizer, Prompt, Task, pad_examples, register_task
from nemo_fp8rl.tasks.rewards import has_boxed_answer, math_verify_reward, prepare_math_verify

__all__ = ["JsonlDataError", "MathJsonlTask"]

log = logging.getLogger(__name__)

_BASE_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class JsonlDataError(ValueError):
    """A malformed row of a JSONL data file (the message starts with ``file:line``)."""


@register_task("math_jsonl")
class MathJsonlTask(Task):
    """Prompts and answers from a JSONL file, rewarded with math-verify (see the module docstring).

    Args:
        path: the JSONL file.
        prompt_key, answer_key: field names of the prompt and the ground-truth answer in each object.
        on_error: ``"raise"`` (stop at the first malformed row, naming file:line) or ``"skip"`` (skip and count).
        max_prompt_len: most prompt tokens (special tokens and chat template included, after
            ``prompt_template``); longer rows are malformed.
        prompt_template: Python format string with ``{prompt}``, applied to each prompt (before the chat template).
        format_reward: reward of a well-formed (boxed) wrong answer; 0 disables it.
        shuffle: reshuffle the rows each epoch (False = file order).
        seed: seed of the shuffling (and of the task's other draws).
        shard_rank, num_shards: this data-parallel rank's share of each epoch: every rank draws the same
            per-epoch permutation (from ``shuffle_seed``) and keeps the rows at positions
            ``shard_rank, shard_rank + num_shards, ...`` of its first ``num_shards * (N // num_shards)``
            entries, so the ranks see disjoint rows and equally long epochs (up to ``num_shards - 1``
            rows of an epoch, different ones each epoch, are left out). ``num_shards=1``: all rows.
        shuffle_seed: seed of the shared permutation (the same on every rank); None = ``seed``.
        reward_timeout_s: per-call reward timeout in seconds.
        tokenizer: None (character tokenizer), a Hugging Face checkpoint/tokenizer directory, or a
            tokenizer object with the ``Tokenizer`` interface.
        chat_template: with a Hugging Face tokenizer that has a chat template, wrap each prompt in it.
    """

    name = "math_jsonl"

    def __init__(
        self,
        path: str,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        on_error: str = "raise",
        max_prompt_len: int = 256,
        prompt_template: str = "{prompt}",
        format_reward: float = 0.0,
        shuffle: bool = True,
        seed: int = 0,
        reward_timeout_s: float = 5.0,
        tokenizer: Any = None,
        chat_template: bool = True,
        shard_rank: int = 0,
        num_shards: int = 1,
        shuffle_seed: int | None = None,
    ) -> None:
        super().__init__(seed=seed, reward_timeout_s=reward_timeout_s)
        if not (isinstance(num_shards, int) and num_shards >= 1 and isinstance(shard_rank, int)
                and 0 <= shard_rank < num_shards):
            raise ValueError(f"shard_rank={shard_rank!r} / num_shards={num_shards!r}: need 0 <= shard_rank < num_shards")
        self.shard_rank, self.num_shards = shard_rank, num_shards
        # one permutation per epoch, identical on every rank (its own generator, so the task's other
        # draws keep their per-rank seed); without sharding it is the task's generator, as before
        self.order_generator = (self.generator if shuffle_seed is None
                                else torch.Generator().manual_seed(int(shuffle_seed)))
        if on_error not in ("raise", "skip"):
            raise ValueError(f"task.on_error={on_error!r} is not valid; use 'raise' or 'skip'")
        if not (isinstance(max_prompt_len, int) and max_prompt_len >= 2):
            raise ValueError(f"task.max_prompt_len={max_prompt_len!r} must be an integer >= 2 (BOS + one token)")
        if "{prompt}" not in prompt_template:
            raise ValueError(f"task.prompt_template={prompt_template!r} must contain '{{prompt}}'")
        if not (0.0 <= float(format_reward) < 1.0):
            raise ValueError(f"task.format_reward={format_reward!r} must be in [0, 1)")
        if not path:
            raise ValueError("task.path is required: the JSONL file with one {prompt, answer} object per line")
        self.path = os.fspath(path)
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.on_error = on_error
        self.max_prompt_len = max_prompt_len
        self.prompt_template = prompt_template
        self.format_reward = float(format_reward)
        self.shuffle = bool(shuffle)
        self.chat_template = bool(chat_template)
        self.skipped_by_reason: Counter[str] = Counter()

        rows = self._read_rows()
        if tokenizer is None:
            chars = set(_BASE_CHARS)
            for _, text, answer in rows:
                chars.update(text)
                chars.update(answer)
            self.tokenizer = CharTokenizer(sorted(chars))
        else:
            from nemo_fp8rl.tasks.hf_tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer)
        self.rows: list[Prompt] = []
        included = "special tokens included" if hasattr(self.tokenizer, "encode_prompt") else "BOS included"
        for line, text, answer in rows:
            ids = self.prompt_ids(text)
            if len(ids) > max_prompt_len:
                self._bad(line, "too_long", f"prompt is {len(ids)} tokens ({included}) > task.max_prompt_len="
                          f"{max_prompt_len}; shorten it or raise task.max_prompt_len")
                continue
            self.rows.append(Prompt(ids=ids, text=text, answer=answer, meta={"source": f"{self.path}:{line}"}))
        if self.skipped_rows:
            log.warning("%s: skipped %d malformed rows (%s)", self.path, self.skipped_rows, dict(self.skipped_by_reason))
        if not self.rows:
            raise JsonlDataError(f"{self.path}: no usable rows (skipped {dict(self.skipped_by_reason)})")
        if len(self.rows) < num_shards:
            raise JsonlDataError(f"{self.path}: {len(self.rows)} usable rows cannot be shared by {num_shards} "
                                 "data-parallel ranks (each needs at least one); use a larger file or fewer ranks")
        self.epoch, self.cursor = 0, 0
        self.order = self._new_order()

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a (templated) prompt: the tokenizer's ``encode_prompt`` (chat template) when it has
        one, else ``[BOS] + encode(text)``."""
        encode_prompt = getattr(self.tokenizer, "encode_prompt", None)
        if encode_prompt is not None:
            return list(encode_prompt(text, chat_template=self.chat_template))
        return [self.tokenizer.bos_id] + self.tokenizer.encode(text)

    # ---------------------------------------------------------------- loading
    @property
    def skipped_rows(self) -> int:
        """Rows skipped as malformed (``on_error="skip"``)."""
        return sum(self.skipped_by_reason.values())

    def _bad(self, line: int, reason: str, msg: str) -> None:
        if self.on_error == "raise":
            raise JsonlDataError(f"{self.path}:{line}: {msg} (or set task.on_error=skip to skip such rows)")
        self.skipped_by_reason[reason] += 1

    def _read_rows(self) -> list[tuple[int, str, str]]:
        """Parse and check every line; return (line number, templated prompt, answer) of the good rows."""
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"task.path={self.path!r}: no such file")
        rows = []
        pk, ak = self.prompt_key, self.answer_key
        with open(self.path, encoding="utf-8") as f:
            for line, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as e:
                    self._bad(line, "bad_json", f"invalid JSON ({e.msg} at column {e.colno})")
                    continue
                if not isinstance(obj, dict):
                    self._bad(line, "not_object", f"expected a JSON object, got {type(obj).__name__}")
                    continue
                missing = [k for k in (pk, ak) if k not in obj]
                if missing:
                    self._bad(line, "missing_field", f"missing field(s) {missing} (task.prompt_key={pk!r}, "
                              f"task.answer_key={ak!r}); the object has keys {sorted(obj)[:10]}")
                    continue
                prompt, answer = obj[pk], obj[ak]
                if not isinstance(prompt, str):
                    self._bad(line, "wrong_type", f"field {pk!r} must be a string, got {type(prompt).__name__}")
                    continue
                if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                    self._bad(line, "wrong_type", f"field {ak!r} must be a string or a number, got {type(answer).__name__}")
                    continue
                answer = str(answer).strip()
                if not prompt.strip():
                    self._bad(line, "empty", f"field {pk!r} is empty")
                    continue
                if not answer:
                    self._bad(line, "empty", f"field {ak!r} is empty")
                    continue
                rows.append((line, self.prompt_template.format(prompt=prompt), answer))
        return rows

    # ---------------------------------------------------------------- data stream
    def _new_order(self) -> list[int]:
        """This rank's row indices for the next epoch (see ``shard_rank`` / ``num_shards``)."""
        n = len(self.rows)
        order = torch.randperm(n, generator=self.order_generator).tolist() if self.shuffle else list(range(n))
        if self.num_shards == 1:
            return order
        return order[: n - n % self.num_shards][self.shard_rank :: self.num_shards]

    def prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        """Next ``n`` rows of the (per-epoch shuffled) stream; with ``generator``: ``n`` rows drawn uniformly
        with replacement from it, leaving the stream untouched."""
        if generator is not None:
            idx = torch.randint(0, len(self.rows), (n,), generator=generator).tolist()
            return [self.rows[i] for i in idx]
        out = []
        for _ in range(n):
            if self.cursor == len(self.order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._new_order()
            out.append(self.rows[self.order[self.cursor]])
            self.cursor += 1
        self.prompts_served += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch, "cursor": self.cursor, "order": list(self.order),
                "num_rows": len(self.rows), "shard": [self.shard_rank, self.num_shards],
                "order_generator": self.order_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_rows") != len(self.rows):
            raise ValueError(
                f"task state was saved with {state.get('num_rows')} rows but {self.path} now has {len(self.rows)} "
                "usable rows; resume with the same data file"
            )
        shard = list(state.get("shard", [0, 1]))  # checkpoints from before sharding: one shard
        if shard != [self.shard_rank, self.num_shards]:
            raise ValueError(f"task state was saved by data-parallel rank {shard[0]} of {shard[1]}, this is rank "
                             f"{self.shard_rank} of {self.num_shards}; resume with the same layout")
        super().load_state_dict(state)
        self.epoch, self.cursor, self.order = int(state["epoch"]), int(state["cursor"]), list(state["order"])
        if "order_generator" in state and self.order_generator is not self.generator:
            self.order_generator.set_state(state["order_generator"])

    def reshard_state(self, saved_states: Sequence[dict[str, Any]], dp_rank: int, dp_size: int, step: int) -> str:
        """Continue the saved epoch as DP rank ``dp_rank`` of ``dp_size`` (a run saved by ``k_old =
        len(saved_states)`` DP ranks resumes with ``k_new = dp_size``).

        Every rank of a run draws the same per-epoch permutation ``perm`` and rank i serves
        ``perm[i::k_old]`` (the strided shards interleave), so when the saved ranks are all at
        ``(epoch, cursor)`` the rows served this epoch are exactly ``perm[:cursor * k_old]``. The
        permutation is rebuilt from the saved shards (``perm[j] = order[j % k_old][j // k_old]``; the
        ``N % k_old`` rows no old shard held go last, in row order); this rank takes its stride
        ``perm[dp_rank::k_new]`` (first ``k_new * (N // k_new)`` entries, as every epoch) and starts at
        cursor ``ceil(cursor * k_old / k_new)``. So no row is served twice in the epoch, and at most
        ``k_new - 1`` rows of it (positions ``cursor * k_old`` up to ``k_new * new_cursor``) are skipped.
        The permutation generator continues from the saved state, so the next epochs' permutations are
        the ones the uninterrupted run draws.

        With DAPO dynamic sampling the ranks draw unequal numbers of prompts and may stand at different
        cursors or epochs. Then the latest epoch E is continued (its permutation rebuilt by replaying
        the permutation generator of a rank that had not drawn it yet, checked against the ranks that
        had) from position ``k_old * max(cursor)``: rows of E that a slower rank had not reached, and
        rows of earlier epochs that ranks behind had not reached, are skipped (counted in the returned
        line), none is served twice. Inconsistent saved shards (another file, another layout than the
        list says, permutations that do not agree) are refused, naming the mismatch.

        The task's own generator is re-seeded as in :meth:`Task.reshard_state` (without sharding it is
        also the permutation generator, which continues instead).
        """
        k_old, k_new, n = len(saved_states), int(dp_size), len(self.rows)
        if (dp_rank, dp_size) != (self.shard_rank, self.num_shards):
            raise ValueError(f"reshard_state(dp_rank={dp_rank}, dp_size={dp_size}) on a task built as shard "
                             f"{self.shard_rank} of {self.num_shards}; build the task with shard_rank=dp_rank, "
                             "num_shards=dp_size")
        for i, st in enumerate(saved_states):
            if st.get("num_rows") != n:
                raise ValueError(f"task state of saved data-parallel rank {i} was saved with {st.get('num_rows')} "
                                 f"rows but {self.path} now has {n} usable rows; resume with the same data file")
            shard = list(st.get("shard", [0, 1]))  # checkpoints from before sharding: one shard
            if shard != [i, k_old]:
                raise ValueError(f"task state {i} of the {k_old} saved data-parallel ranks was saved by rank "
                                 f"{shard[0]} of {shard[1]}; pass one state per saved DP rank, in rank order")
            missing = {"epoch", "cursor", "order"} - set(st)
            if missing:
                raise KeyError(f"task state of saved data-parallel rank {i} is missing {sorted(missing)} "
                               "(checkpoint from another task?)")
        note = super().reshard_state(saved_states, dp_rank, dp_size, step)

        epochs = [int(st["epoch"]) for st in saved_states]
        E = max(epochs)
        used = [int(st["cursor"]) if e == E else 0 for st, e in zip(saved_states, epochs)]
        gen_states = [st.get("order_generator", st["rng_state"]) for st in saved_states]
        at_e = [i for i, e in enumerate(epochs) if e == E]
        if min(epochs) == E:
            orders = [list(st["order"]) for st in saved_states]
            if len({len(o) for o in orders}) != 1:
                raise ValueError(f"saved task shards have unequal epoch lengths {[len(o) for o in orders]}; "
                                 "they are not the shards of one run")
            perm = [orders[j % k_old][j // k_old] for j in range(k_old * len(orders[0]))]
            perm += sorted(set(range(n)) - set(perm))
        else:  # ranks behind: replay the permutation generator of the furthest-behind rank up to epoch E
            behind = epochs.index(min(epochs))
            g = torch.Generator()
            g.set_state(gen_states[behind])
            perm = list(range(n))
            for _ in range(E - epochs[behind]):
                perm = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
            gen_states = [g.get_state() if e < E else s for e, s in zip(epochs, gen_states)]
        if sorted(perm) != list(range(n)):
            raise ValueError("the saved task shards do not form one permutation of the rows; they are not the "
                             "shards of one run (resume with the saved data-parallel size)")
        kept = perm[: n - n % k_old]
        for i in at_e:
            if kept[i::k_old] != list(saved_states[i]["order"]):
                raise ValueError(f"saved data-parallel rank {i}'s epoch-{E} rows are not its stride of the run's "
                                 "permutation (another shuffle_seed or data file?); resume with the saved "
                                 "data-parallel size")
        if self.shuffle and any(not torch.equal(g_i, gen_states[0]) for g_i in gen_states):
            raise ValueError("the saved data-parallel ranks' permutation generators differ (another shuffle_seed?); "
                             "resume with the saved data-parallel size")

        start = k_old * max(used)  # every row served in epoch E lies before this position
        self.epoch = E
        self.order = perm[: n - n % k_new][dp_rank::k_new]
        self.cursor = min(math.ceil(start / k_new), len(self.order))
        self.order_generator.set_state(gen_states[at_e[0]])  # after the base re-seed: may be self.generator
        late = start - sum(used)  # rows of epoch E before `start` that a slower rank had not served
        earlier = sum(len(st["order"]) * (E - e) - int(st["cursor"])  # its epoch's rest + whole epochs between
                      for st, e in zip(saved_states, epochs) if e < E)
        # the seam: positions start .. k_new * cursor (none when the epoch's usual tail is all that is left)
        skipped = max(0, k_new * self.cursor - start) + late
        if self.order_generator is self.generator:  # no sharding: the generator draws only permutations
            note = f"task {self.name}: warm-up stream re-seeded from (seed {self.seed}, step {step})"
        msg = (f"{note}; math_jsonl epoch {E} continued from position {start} of its permutation "
               f"({sum(used)} rows served before the resume, {skipped} rows of the epoch skipped")
        if earlier:
            msg += f", {earlier} rows of earlier epochs left unserved by ranks that were behind"
        return msg + "), later epochs draw the saved run's permutations"

    # ---------------------------------------------------------------- rewards
    @property
    def reward_fn(self) -> Callable[[str, str], Any]:
        return functools.partial(math_verify_reward, format_reward=self.format_reward)

    @property
    def reward_prepare(self) -> Callable[[], Any]:
        return prepare_math_verify

    def is_valid(self, text: str) -> bool:
        """Well-formed = holds a non-empty ``\\boxed{...}`` and all braces are balanced."""
        return has_boxed_answer(text)

    def warmup_examples(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` rows (uniform, with replacement) as ``prompt -> \\boxed{answer} <eos>`` (teaches the format)."""
        g = self._gen(generator, warmup=True)
        idx = torch.randint(0, len(self.rows), (n,), generator=g).tolist()
        seqs, plens = [], []
        for i in idx:
            p = self.rows[i]
            seqs.append(p.ids + self.tokenizer.encode("\\boxed{" + p.answer + "}") + [self.tokenizer.eos_id])
            plens.append(len(p.ids))
        return pad_examples(seqs, plens, self.tokenizer.pad_id)
