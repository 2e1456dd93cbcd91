"""NeMo RL's loss-interface enums: its own classes when NeMo RL is installed, same names and values if not.

NeMo RL's workers dispatch with ``==`` (``loss_fn.input_type == LossInputType.LOGPROB``), so inside NeMo RL
these must be the very classes of ``nemo_rl.algorithms.loss.interfaces``; outside it (CPU tests, our own
trainer) stand-ins with NeMo RL's member names and values take their place.
"""

from __future__ import annotations

import enum

try:
    from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType, MetricNormalizer
except ImportError:  # NeMo RL not installed: same names and values

    LossType = enum.Enum("LossType", {"TOKEN_LEVEL": "token_level", "SEQUENCE_LEVEL": "sequence_level"})
    LossInputType = enum.Enum("LossInputType", {
        "LOGIT": "logit", "LOGPROB": "logprob", "DISTILLATION": "distillation",
        "DISTILLATION_CROSS_TOKENIZER": "distillation_cross_tokenizer", "DRAFT": "draft"})
    MetricNormalizer = enum.Enum("MetricNormalizer", {"TOKENS": "tokens", "SEQUENCES": "sequences", "NONE": "none"})


__all__ = ["LossInputType", "LossType", "MetricNormalizer"]
