"""Verifiable tasks: prompts with ground truth, tokenizers, reward functions run safely.

``get_task("arithmetic", digits=3)`` or ``get_task("math_jsonl", path="data.jsonl")`` builds a
:class:`Task`; see :mod:`nemo_fp8rl.tasks.base` for the interface. ``get_task("math_jsonl", path=...,
tokenizer="/ckpt/Qwen3-8B")`` uses the checkpoint's Hugging Face tokenizer and chat template
(:class:`HFTokenizer`).

The names below are loaded lazily (PEP 562): the reward worker process imports
``nemo_fp8rl.tasks.reward_runner`` and ``nemo_fp8rl.tasks.rewards``, which need only the standard
library, and must not pay for importing torch through this package's ``__init__``.
"""

from __future__ import annotations

from nemo_fp8rl._lazy import lazy_exports

_EXPORTS = {
    "Task": "base",
    "Tokenizer": "base",
    "CharTokenizer": "base",
    "Prompt": "base",
    "Scores": "base",
    "get_task": "base",
    "register_task": "base",
    "task_names": "base",
    "task_class": "base",
    "task_kwargs": "base",
    "pad_examples": "base",
    "reshard_seed": "base",
    "ArithmeticTask": "arithmetic",
    "MathJsonlTask": "math_jsonl",
    "JsonlDataError": "math_jsonl",
    "ReasoningGymTask": "reasoning_gym",
    "HFTokenizer": "hf_tokenizer",
    "load_tokenizer": "hf_tokenizer",
    "RewardRunner": "reward_runner",
    "RewardResult": "reward_runner",
}

__all__ = [  # noqa: RUF022 - same order as _EXPORTS
    "Task", "Tokenizer", "CharTokenizer", "Prompt", "Scores", "get_task", "register_task", "task_names",
    "task_class", "task_kwargs", "pad_examples", "reshard_seed", "ArithmeticTask", "MathJsonlTask", "JsonlDataError",
    "ReasoningGymTask", "HFTokenizer", "load_tokenizer", "RewardRunner", "RewardResult",
]
assert sorted(__all__) == sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
