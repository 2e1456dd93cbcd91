"""Rollout engines: generate responses from the actor's weights with the rollout's own FP8 scheme.

``get_rollout_engine("torch", model_cfg, fp8_scheme="vllm_w8a8", eos_id=..., pad_id=...)`` builds the
in-process engine; ``engine.update_weights(actor.export_weights())`` syncs weights;
``engine.generate(prompts, SamplingParams(...), generator)`` returns a :class:`RolloutBatch`.
"""

from nemo_fp8rl.rollout.base import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    get_rollout_engine,
    register_rollout_engine,
    rollout_engine_names,
)

__all__ = [
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "get_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_names",
]
