"""The RL loop, its checkpoints, metrics logging and supervised warm-up.

The names are loaded lazily (PEP 562): ``nemo_fp8rl.report`` reads ``metrics.jsonl`` through
``nemo_fp8rl.trainer.logger`` and must not import the trainer, Megatron and the engines to do so.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "checkpoint",
    "CheckpointManager": "checkpoint",
    "MetricsLogger": "logger",
    "read_metrics": "logger",
    "RLTrainer": "rl_trainer",
    "StopTraining": "rl_trainer",
    "model_fingerprint": "rl_trainer",
    "run_warmup": "warmup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"nemo_fp8rl.trainer.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'nemo_fp8rl.trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
