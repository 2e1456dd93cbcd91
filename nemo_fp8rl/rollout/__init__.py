"""Rollout engines: generate responses from the actor's weights with the rollout's own FP8 scheme.

``get_rollout_engine("torch", model_cfg, fp8_scheme="vllm_w8a8", eos_id=..., pad_id=...)`` builds the
in-process engine; ``engine.update_weights(actor.export_weights())`` syncs weights;
``engine.generate(prompts, SamplingParams(...), generator)`` returns a :class:`RolloutBatch`;
``engine.sleep()`` / ``engine.wake_up()`` / ``engine.close()`` manage its memory (:class:`RolloutEngine`).

The names are loaded lazily (PEP 562): config validation imports
:mod:`nemo_fp8rl.rollout.vllm_support`, which must not pull torch in through this package.
"""

from __future__ import annotations

from nemo_fp8rl._lazy import lazy_exports

_EXPORTS = {
    "RolloutBatch": "base",
    "RolloutEngine": "base",
    "SamplingParams": "base",
    "get_rollout_engine": "base",
    "register_rollout_engine": "base",
    "rollout_engine_names": "base",
}

__all__ = [
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "get_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_names",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
