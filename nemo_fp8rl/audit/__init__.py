"""``nemo-fp8rl-audit``: what FP8 does to a model's importance ratios, measured before any training.

Responses are sampled from the model in high precision; every FP8 configuration (training recipes through
the trainer's model, rollout schemes, the FP8 KV cache with static or calibrated scales, high-precision edge
layers) scores the same tokens. Per configuration the report gives the log-prob mismatch against high
precision (mean |dlogp|, KL, NeMo RL's ``token_mult_prob_error``), the share of tokens whose importance
ratio leaves the clip range from rounding alone (pure-noise clips) by token probability and response
position, the lower bound Calibrated Clipping would pick, which layers contribute most, and a one-line
recommendation of trainer overrides. docs/audit.md has every definition.

One job per file: ``settings`` (the ``audit.*`` keys), ``configs`` (configuration names), ``prompts``,
``sampling`` (high-precision responses), ``scoring`` (log-probs per configuration, layer swap), ``stats``
(the statistics, pure torch), ``recommend``, ``report`` (md, png, json), ``run`` (the pipeline), ``cli``.
"""

from nemo_fp8rl.audit.settings import AuditConfig, AuditRunConfig

__all__ = ["AuditConfig", "AuditRunConfig", "run_audit"]


def run_audit(cfg, command: str = "") -> dict:
    """:func:`nemo_fp8rl.audit.run.run_audit` (imported on use: the statistics need no model code)."""
    from nemo_fp8rl.audit.run import run_audit as _run

    return _run(cfg, command=command)
