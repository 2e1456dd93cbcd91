"""The RL loop, its checkpoints, metrics logging and supervised warm-up.

The names are loaded lazily (PEP 562): ``nemo_fp8rl.report`` reads ``metrics.jsonl`` through
``nemo_fp8rl.trainer.logger`` and must not import the trainer, Megatron and the engines to do so.
"""

from __future__ import annotations

from nemo_fp8rl._lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
