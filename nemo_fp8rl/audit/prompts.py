"""The audit's prompts: the task's (``task=...``, as the trainer draws them) or a JSONL file (``audit.prompts_file``).

A prompts file holds one JSON object per line with the prompt text under ``audit.prompt_key`` (default
``prompt``; other fields, e.g. ``answer``, are ignored); blank lines are skipped. Each prompt is tokenized
with the model's tokenizer through its chat template (``audit.chat_template``), as the ``math_jsonl`` task
does. Every malformed line stops the audit with ``file:line``, what is wrong and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nemo_fp8rl.config.schema import ConfigError

__all__ = ["PromptsFileError", "load_task", "prompts_from_file", "prompts_from_task"]


class PromptsFileError(ConfigError):
    """A missing or malformed ``audit.prompts_file`` (the message names the file, and the line)."""


def load_task(cfg: Any) -> Any:
    """The run's task, built as the trainer builds it (its tokenizer is the model's with ``model.hf_path``)."""
    from nemo_fp8rl.tasks import get_task, task_class, task_kwargs

    kw = task_kwargs(cfg, task_class(cfg.task.name), seed=cfg.seed * 1000 + 29)
    if cfg.model.hf_path:
        import inspect

        if "tokenizer" not in inspect.signature(task_class(cfg.task.name)).parameters:
            raise ConfigError(f"task={cfg.task.name} has a built-in tokenizer and cannot use model.hf_path's; use "
                              "task=reasoning_gym or task=math_jsonl, or audit.prompts_file=PROMPTS.jsonl")
        kw["tokenizer"] = cfg.model.hf_path
    return get_task(cfg.task.name, **kw)


def prompts_from_task(task: Any, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts drawn from the task with a generator seeded by ``seed`` (token ids)."""
    g = torch.Generator().manual_seed(int(seed))
    return [list(p.ids) for p in task.prompts(n, generator=g)]


def prompts_from_file(path: str, tokenizer: Any, n: int, *, key: str = "prompt", chat_template: bool = True) -> list[list[int]]:
    """The first ``n`` prompts of a JSONL file (module docstring), as token ids."""
    p = Path(path)
    if not p.is_file():
        raise PromptsFileError(f"audit.prompts_file={path!r}: no such file; give a JSONL file with one "
                               f'{{"{key}": "..."}} object per line')
    texts: list[str] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptsFileError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be "
                                       f'one JSON object such as {{"{key}": "What is 2 + 3?"}}') from None
            if not isinstance(row, dict):
                raise PromptsFileError(f"{where}: a JSON {type(row).__name__}, not an object; write "
                                       f'{{"{key}": "..."}}')
            if key not in row:
                raise PromptsFileError(f"{where}: no {key!r} field (fields: {sorted(row)}); add it or set "
                                       "audit.prompt_key to the field that holds the prompt")
            text = row[key]
            if not isinstance(text, str) or not text.strip():
                raise PromptsFileError(f"{where}: {key!r} must be a non-empty string, got {text!r}")
            texts.append(text)
            if len(texts) == n:
                break
    if not texts:
        raise PromptsFileError(f"audit.prompts_file={path!r} holds no prompts; write one JSON object per line")
    if hasattr(tokenizer, "encode_prompt"):
        return [tokenizer.encode_prompt(t, chat_template=chat_template) for t in texts]
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    return [bos + list(tokenizer.encode(t)) for t in texts]
