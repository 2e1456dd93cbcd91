"""Reward functions of the built-in tasks (run inside the reward worker, see ``reward_runner``).

Each takes ``(response_text, answer_text, **options)`` and returns ``(reward, correct)``. They import
only the standard library at module level (``math_verify`` on first use), so the worker starts fast.
"""

from __future__ import annotations

import re

__all__ = ["balanced_braces", "exact_match_reward", "gold_for_math_verify", "has_boxed_answer", "math_verify_reward"]


def exact_match_reward(response: str, answer: str, *, format_pattern: str, format_reward: float = 0.0) -> tuple[float, bool]:
    """Exact-match reward with an optional format bonus.

    reward = 1 if response == answer; else ``format_reward`` if ``re.fullmatch(format_pattern, response)``;
    else 0. correct = (response == answer).
    """
    if response == answer:
        return 1.0, True
    if format_reward and re.fullmatch(format_pattern, response):
        return float(format_reward), False
    return 0.0, False


def balanced_braces(text: str) -> bool:
    """True when every ``{`` in ``text`` is closed by a later ``}`` and no ``}`` is unmatched."""
    depth = 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def has_boxed_answer(text: str) -> bool:
    """True when ``text`` has balanced braces and contains a non-empty ``\\boxed{...}``."""
    if not balanced_braces(text):
        return False
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0 and text[m.end() : j - 1].strip():
            return True
    return False


def gold_for_math_verify(answer: str) -> str:
    """The ground-truth string as math-verify should parse it: as given when it already holds ``$`` or
    ``\\boxed``, else wrapped in ``\\boxed{...}`` (so LaTeX like ``\\sqrt{2}`` or ``x^2+1`` is recognised)."""
    if "$" in answer or "\\boxed" in answer:
        return answer
    return "\\boxed{" + answer + "}"


def prepare_math_verify() -> None:
    """Import ``math_verify`` (SymPy and its LaTeX grammar; 1-23 s measured on the 2-core CI machine under
    load) and check one answer, so that the reward worker's first :func:`math_verify_reward` call is not
    charged for it (the math_jsonl task's ``reward_prepare``)."""
    from math_verify import parse, verify

    verify(parse("\\boxed{1}"), parse("\\boxed{1}"))


def math_verify_reward(response: str, answer: str, *, format_reward: float = 0.0) -> tuple[float, bool]:
    """Math reward with Hugging Face's ``math-verify``: parse both sides to SymPy and compare.

    reward = 1 if ``verify(parse(gold), parse(response))``; else ``format_reward`` if the response holds
    a ``\\boxed{}`` answer; else 0. An answer that cannot be parsed is an error (raised, so the runner
    counts it in ``reward/errors``): the data, not the policy, is at fault.
    """
    from math_verify import parse, verify

    gold = parse(gold_for_math_verify(answer))
    if not gold:
        raise ValueError(f"math-verify could not parse the ground-truth answer {answer!r}")
    pred = parse(response)
    if pred and verify(gold, pred):
        return 1.0, True
    if format_reward and has_boxed_answer(response):
        return float(format_reward), False
    return 0.0, False
