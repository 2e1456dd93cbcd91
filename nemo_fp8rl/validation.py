"""``validate(cfg)``: every check of a :class:`~nemo_fp8rl.config.schema.TrainConfig`, in one call.

``nemo_fp8rl.config`` is a leaf (it imports nothing else of ours): it holds the dataclasses and the
checks of single values. A check that needs a component's knowledge (the registered losses, FP8
recipes, rollout engines, what vLLM can run) lives next to that component and is composed here. The
train CLI, the launcher, the memory planner and the trainer all call this one function.
"""

from __future__ import annotations

from nemo_fp8rl.config.schema import ConfigError, TrainConfig
from nemo_fp8rl.config.schema import validate as _check_values


def validate(cfg: TrainConfig) -> TrainConfig:
    """Reject values and combinations that cannot work, naming the key and the fix. Returns ``cfg``.

    Raises :class:`~nemo_fp8rl.config.schema.ConfigError`.
    """
    return _check_values(cfg)


__all__ = ["ConfigError", "validate"]
