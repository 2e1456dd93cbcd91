"""Reward of the ``reasoning_gym`` task: extract the tagged answer, score it with the dataset's own checker.

Runs inside the reward worker (:mod:`nemo_fp8rl.tasks.reward_runner`), so this module imports only the
standard library at module level; ``reasoning_gym`` is imported on the first call, and each dataset's
scorer is built once per worker (``functools.lru_cache``).
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

__all__ = ["extract_answer", "prepare_scorer", "reasoning_gym_reward", "trailing_text", "unclosed_answer"]


@functools.lru_cache(maxsize=64)
def _tag_pattern(tag: str) -> re.Pattern[str]:
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)


def _final_answer(text: str, tag: str) -> tuple[str, int | None] | None:
    """The final answer of :func:`extract_answer` and where its closing ``</tag>`` ends (None for an
    unclosed last tag); None when there is no answer."""
    closed = [(m.group(1).strip(), m.end()) for m in _tag_pattern(tag).finditer(text)]
    found: list[tuple[str, int | None]] = [(a, end) for a, end in closed if a]
    last_open = text.rfind(f"<{tag}>")
    if last_open >= 0 and text.find(f"</{tag}>", last_open) < 0:  # unclosed last tag
        rest = re.split(r"[<\n]", text[last_open + len(tag) + 2:], maxsplit=1)[0].strip()
        if rest:
            found.append((rest, None))
    return found[-1] if found else None


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """The final answer of a response: the stripped content of its last ``<tag>...</tag>`` pair.

    A last opening ``<tag>`` that is never closed (a small model that stops, or writes ``</tag`` or
    ``</tag}``) counts up to the first ``<`` or line break after it. None when neither gives a
    non-empty answer (an unparseable response).
    """
    final = _final_answer(text, tag)
    return None if final is None else final[0]


def trailing_text(text: str, tag: str = "answer") -> bool:
    """Whether non-whitespace text follows the closing ``</tag>`` of the response's final answer (the pair
    :func:`extract_answer` reads): a sample that ran on past its answer. False without an answer, and for
    a final answer in an unclosed tag (it has no closing tag)."""
    final = _final_answer(text, tag)
    return final is not None and final[1] is not None and bool(text[final[1]:].strip())


def unclosed_answer(text: str, tag: str = "answer") -> bool:
    """Whether the response's final answer (the one :func:`extract_answer` reads) comes from an opening
    ``<tag>`` that is never closed: scored only because the parse is lenient. A policy whose answers drift
    into this form (``<answer>3</reference tags, e.g. ...``, seen in issue 41's exploration) keeps its
    reward while its format degrades; ``reward/unclosed_answer`` logs the share. False without an answer."""
    final = _final_answer(text, tag)
    return final is not None and final[1] is None


@functools.lru_cache(maxsize=8)
def _scorer(dataset: str, dataset_kwargs_json: str) -> Any:
    """The configured reasoning-gym dataset whose ``score_answer`` checks answers (one per worker)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(dataset, **json.loads(dataset_kwargs_json))


def prepare_scorer(dataset: str, dataset_kwargs_json: str) -> None:
    """Build the dataset's scorer in the reward worker (``import reasoning_gym`` pulls in matplotlib: 1-19 s
    measured on the 2-core CI machine under load), so that the first reward call finds it cached and is not
    charged for it (the task's ``reward_prepare``)."""
    _scorer(dataset, dataset_kwargs_json)


def reasoning_gym_reward(response: str, entry: dict[str, Any], *, dataset: str, dataset_kwargs_json: str,
                         answer_tag: str = "answer", format_reward: float = 0.0,
                         response_prefix: str = "", partial_credit: bool = True) -> tuple[float, bool]:
    """Reward of one response to a reasoning-gym problem.

    s = ``dataset.score_answer(extract_answer(response), entry)`` in [0, 1] (reasoning-gym's checker;
    some datasets give partial credit, e.g. chain_sum scores an answer that contains the right number
    len(right answer) / len(answer)). With ``partial_credit`` false, s = 1 if s >= 1 else 0 (a binary
    reward). reward = 0 for an unparseable response (no non-empty ``<answer_tag>`` pair; the scorer is
    not called), else ``max(s, format_reward)``; correct = (s >= 1). A score outside [0, 1] (or not a number) raises, so the runner counts it in
    ``reward/errors``: the checker, not the policy, is at fault.

    Args:
        response: the decoded response text (up to its EOS).
        entry: the reasoning-gym entry (``{"question", "answer", "metadata"}``) the prompt came from.
        dataset, dataset_kwargs_json: the dataset name and its config keyword arguments as JSON
            (the scorer is built from them once per worker).
        response_prefix: the text the prompt ended with inside the assistant turn (task.response_prefix);
            the answer is extracted from ``response_prefix + response``.
        partial_credit: keep the checker's scores below 1 (task.partial_credit); false = exact answers
            only.
    """
    answer = extract_answer(response_prefix + response, answer_tag)
    if answer is None:
        return 0.0, False
    s = _scorer(dataset, dataset_kwargs_json).score_answer(answer, entry)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0.0 <= s <= 1.0:
        raise ValueError(f"reasoning-gym {dataset!r} score_answer returned {s!r}; a score must be in [0, 1]")
    correct = s >= 1.0
    s = float(s) if partial_credit else float(correct)
    return max(s, float(format_reward)), correct
