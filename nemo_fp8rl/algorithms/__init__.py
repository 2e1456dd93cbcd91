"""Pure-torch RL math for nemo_fp8rl: policy losses, advantages, rollout correction, Calibrated Clipping.

Imports only torch and the standard library, so any framework can use it and it runs on CPU.
Modules: ``metrics`` (the ``(tensor, reduction)`` metric convention), ``losses`` (policy-loss registry,
aggregation, KL, entropy), ``advantages`` (GRPO/RLOO registry, DAPO dynamic sampling and overlong
shaping), ``rollout_correction`` (TIS / IcePop), ``calibration`` (Calibrated Clipping, arXiv 2609.22870),
``mismatch`` (rollout/trainer and FP8/BF16 mismatch metrics, entropy-surge monitor).
NeMo RL's ``ClippedPGLossFn`` with Calibrated Clipping is :mod:`nemo_fp8rl.integrations.nemo_rl`.
"""

from nemo_fp8rl.algorithms.advantages import (
    AdvantageEstimator,
    dynamic_sampling_filter,
    get_advantage_estimator,
    grpo_advantages,
    list_advantage_estimators,
    overlong_reward_shaping,
    register_advantage_estimator,
    rloo_advantages,
)
from nemo_fp8rl.algorithms.calibration import (
    UPPER_MODES,
    CalibratedClipping,
    CalibrationResult,
    balance_upper,
    calibrate_bounds,
)
from nemo_fp8rl.algorithms.losses import (
    AGG_MODES,
    KL_KINDS,
    PolicyLossFn,
    agg_loss,
    clipped_surrogate,
    entropy_from_logits,
    get_policy_loss,
    gspo_loss,
    kl_penalty,
    list_policy_losses,
    ppo_clip_loss,
    register_policy_loss,
    reinforce_loss,
)
from nemo_fp8rl.algorithms.metrics import REDUCTIONS, Metric, make_metric, metrics_to_floats, reduce_metrics
from nemo_fp8rl.algorithms.mismatch import EntropySurgeMonitor, mismatch_metrics
from nemo_fp8rl.algorithms.rollout_correction import ROLLOUT_CORRECTION_MODES, rollout_correction

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "REDUCTIONS",
    "ROLLOUT_CORRECTION_MODES",
    "UPPER_MODES",
    "AdvantageEstimator",
    "CalibratedClipping",
    "CalibrationResult",
    "EntropySurgeMonitor",
    "Metric",
    "PolicyLossFn",
    "agg_loss",
    "balance_upper",
    "calibrate_bounds",
    "clipped_surrogate",
    "dynamic_sampling_filter",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "list_advantage_estimators",
    "list_policy_losses",
    "make_metric",
    "metrics_to_floats",
    "mismatch_metrics",
    "overlong_reward_shaping",
    "ppo_clip_loss",
    "reduce_metrics",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_loss",
    "rloo_advantages",
    "rollout_correction",
]
