"""``validate(cfg)``: every check of a :class:`~nemo_fp8rl.config.schema.TrainConfig`, in one call.

``nemo_fp8rl.config`` is a leaf (it imports nothing else of ours): it holds the dataclasses and the
checks of its own values (:func:`~nemo_fp8rl.config.schema.check_values`). A check that needs a
component's knowledge lives next to that component and is composed here:

* the rollout-correction and calibration upper modes: the registries of ``nemo_fp8rl.algorithms``;
* ``fp8.recipe`` and its overrides: :func:`nemo_fp8rl.fp8.recipes.check_fp8_config`;
* ``rollout.fp8.scheme``: :data:`nemo_fp8rl.fp8.ROLLOUT_SCHEMES`;
* ``rollout.engine`` and what vLLM can run: :func:`nemo_fp8rl.rollout.vllm_support.check_rollout_config`.

The train CLI, the launcher, the memory planner and the trainer all call :func:`validate`.
"""

from __future__ import annotations

from nemo_fp8rl.config.schema import ConfigError, TrainConfig, check_choice, check_values


def validate(cfg: TrainConfig) -> TrainConfig:
    """Reject values and combinations that cannot work, naming the key and the fix. Returns ``cfg``
    (with the deprecated ``fp8.use_te`` folded into ``fp8.backend``).

    Raises :class:`~nemo_fp8rl.config.schema.ConfigError`.
    """
    from nemo_fp8rl.algorithms import ROLLOUT_CORRECTION_MODES, UPPER_MODES
    from nemo_fp8rl.fp8 import ROLLOUT_SCHEMES
    from nemo_fp8rl.fp8.recipes import check_fp8_config
    from nemo_fp8rl.rollout.vllm_support import check_rollout_config
    from nemo_fp8rl.tasks.base import check_task_config

    check_values(cfg)
    check_choice("algorithm.rollout_correction", cfg.algorithm.rollout_correction, ROLLOUT_CORRECTION_MODES)
    check_choice("calibration.upper_mode", cfg.calibration.upper_mode, UPPER_MODES)
    check_fp8_config(cfg)
    check_choice("rollout.fp8.scheme", cfg.rollout.fp8.scheme, ROLLOUT_SCHEMES)
    check_rollout_config(cfg)
    check_task_config(cfg)
    return cfg


__all__ = ["ConfigError", "validate"]
