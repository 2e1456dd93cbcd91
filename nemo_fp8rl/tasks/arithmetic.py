"""Built-in verifiable task: multi-digit addition with a character tokenizer.

Sequence (digits = 3)::

    <bos> 1 2 3 + 4 5 6 =  0 5 7 9 <eos>
    '---- prompt ------'  '- response -'

Operands a, b are uniform in [0, 10^digits) and written zero-padded to ``digits`` characters; the answer
is a + b zero-padded to ``digits + 1`` characters, then EOS. The vocabulary is ``<pad> <bos> <eos>
0-9 + = space`` = 16 tokens (space is never used: emitting it is a format error; it makes the vocabulary
a multiple of 16, so Megatron pads no rows). Prompts all have 2 * digits + 3 tokens, responses
digits + 2, so rollout needs ``max_new_tokens >= digits + 2``.

Reward: 1 for the exact answer; ``format_reward`` for a well-formed wrong answer (exactly digits + 1
digits); else 0. A tiny model (d = 128, 3 layers) learns 3-digit addition on 2 CPU cores in minutes:
a supervised warm-up of ~900 steps gives ~50% sampled accuracy, then RL improves it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch

from nemo_fp8rl.tasks.base import CharTokenizer, Prompt, Task, pad_examples, register_task
from nemo_fp8rl.tasks.rewards import exact_match_reward

__all__ = ["ArithmeticTask"]

_EVAL_SEED_OFFSET = 1_000_003


@register_task("arithmetic")
class ArithmeticTask(Task):
    """Addition of two ``digits``-digit numbers (see the module docstring).

    Args:
        digits: digits per operand (1..9).
        format_reward: reward of a well-formed but wrong answer (0 disables the format reward).
        seed: seed of the prompt stream.
        reward_timeout_s: per-call reward timeout in seconds.
    """

    name = "arithmetic"

    def __init__(self, digits: int = 3, format_reward: float = 0.0, seed: int = 0, reward_timeout_s: float = 5.0) -> None:
        if not (isinstance(digits, int) and 1 <= digits <= 9):
            raise ValueError(f"task.digits={digits!r} must be an integer in [1, 9]")
        if not (0.0 <= float(format_reward) < 1.0):
            raise ValueError(f"task.format_reward={format_reward!r} must be in [0, 1) (below the reward of a correct answer)")
        super().__init__(seed=seed, reward_timeout_s=reward_timeout_s)
        self.digits = digits
        self.format_reward = float(format_reward)
        self.tokenizer = CharTokenizer("0123456789+= ")
        self._answer_re = re.compile(rf"\d{{{digits + 1}}}")

    @property
    def response_len(self) -> int:
        """Tokens of a correct response: digits + 1 answer digits and EOS."""
        return self.digits + 2

    @property
    def reward_fn(self) -> Callable[[str, str], Any]:
        return functools.partial(exact_match_reward, format_pattern=self._answer_re.pattern, format_reward=self.format_reward)

    def _operands(self, n: int, generator: torch.Generator) -> list[tuple[int, int]]:
        ab = torch.randint(0, 10**self.digits, (n, 2), generator=generator)
        return [(int(a), int(b)) for a, b in ab.tolist()]

    def _prompt(self, a: int, b: int) -> Prompt:
        d = self.digits
        text = f"{a:0{d}d}+{b:0{d}d}="
        return Prompt(
            ids=[self.tokenizer.bos_id] + self.tokenizer.encode(text),
            text=text,
            answer=f"{a + b:0{d + 1}d}",
            meta={"a": a, "b": b},
        )

    def prompts(self, n: int, generator: torch.Generator | None = None) -> list[Prompt]:
        out = [self._prompt(a, b) for a, b in self._operands(n, self._gen(generator))]
        if generator is None:
            self.prompts_served += n
        return out

    def eval_prompts(self, n: int) -> list[Prompt]:
        """A fixed held-out set (same ``n`` prompts on every call; independent of the training stream)."""
        g = torch.Generator().manual_seed(self.seed + _EVAL_SEED_OFFSET)
        return [self._prompt(a, b) for a, b in self._operands(n, g)]

    def is_valid(self, text: str) -> bool:
        """Well-formed = exactly ``digits + 1`` decimal digits (the response up to EOS)."""
        return self._answer_re.fullmatch(text) is not None

    def warmup_examples(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` solved problems: tokens [n, 3 * digits + 5], loss_mask 1 on the answer digits and EOS."""
        g = self._gen(generator, warmup=True)
        seqs, plens = [], []
        for a, b in self._operands(n, g):
            p = self._prompt(a, b)
            seqs.append(p.ids + self.tokenizer.encode(p.answer) + [self.tokenizer.eos_id])
            plens.append(len(p.ids))
        return pad_examples(seqs, plens, self.tokenizer.pad_id)
