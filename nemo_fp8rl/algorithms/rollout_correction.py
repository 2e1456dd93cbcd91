"""Rollout correction: importance weights for the rollout-engine / trainer mismatch.

The rollout engine (FP8 scheme of its own, other kernels) and the trainer disagree on log-probs even at
identical weights, so the tokens are sampled from pi_rollout while the loss assumes pi_old. The
per-token importance ratio is rho_is_t = exp(old_logp_t - rollout_logp_t) = pi_old / pi_rollout.
Modes (applied as a detached per-token weight on the policy loss, docs/design.md, "RL math"):

- ``tis``: truncated importance sampling, w_t = min(rho_is_t, C), C = ``cap`` = 2 by default
  (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", FlashRL, 2025).
- ``icepop``: w_t = rho_is_t if lo <= rho_is_t <= hi else 0 (masks tokens of large mismatch in both
  directions; Ling team, "Every Step Evolves", arXiv 2510.18855; lo, hi = 0.5, 5 by default;
  NeMo RL's ``truncated_importance_sampling_type="icepop"`` behaves the same way).
- ``is``: plain (untruncated) importance sampling, w_t = rho_is_t (NeMo RL's
  ``use_importance_sampling_correction`` without truncation; high variance, prefer ``tis``).
- ``none``: w_t = 1.

Padding positions get weight 0.
"""

from __future__ import annotations

import torch

from nemo_fp8rl.algorithms._common import (
    as_bool_mask,
    check_2d,
    check_number,
    check_same_shape,
    masked_max,
    masked_mean,
    masked_min,
    upcast,
)
from nemo_fp8rl.algorithms.losses import LOG_RATIO_CLAMP
from nemo_fp8rl.algorithms.metrics import Metric
from nemo_fp8rl.registry import choices

ROLLOUT_CORRECTION_MODES = choices("rollout-correction mode", "algorithm.rollout_correction", ("tis", "icepop", "is", "none"))
"""The modes of :func:`rollout_correction` (``algorithm.rollout_correction``)."""


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor | None,
    mode: str = "tis",
    *,
    cap: float = 2.0,
    lo: float = 0.5,
    hi: float = 5.0,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token importance weights correcting for rollout/trainer mismatch.

    rho_is_t = exp(clamp(old_logp_t - rollout_logp_t, -20, 20));
    ``tis``: w_t = min(rho_is_t, cap); ``icepop``: w_t = rho_is_t * 1[lo <= rho_is_t <= hi];
    ``is``: w_t = rho_is_t; ``none``: w_t = 1; w_t = 0 on padding. References: module docstring.

    Args:
        old_logp: ``[batch, seq]`` trainer log-probs at the start of the step (pi_old).
        rollout_logp: ``[batch, seq]`` log-probs reported by the rollout engine (pi_rollout).
        mask: ``[batch, seq]`` bool or 0/1, or None.
        mode: ``"tis"``, ``"icepop"``, ``"is"`` or ``"none"``.
        cap: C of ``tis`` (> 0).
        lo, hi: band of ``icepop`` (0 <= lo < hi).

    Returns:
        ``(weights [batch, seq] float32 detached, metrics)`` with ``mismatch/is_ratio_{mean,min,max}``
        (of rho_is over valid tokens) and ``mismatch/masked_frac`` (fraction of valid tokens given weight
        0 by ``icepop``; 0 for the other modes).
    """
    check_2d("old_logp", old_logp)
    check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp)
    m = as_bool_mask(mask, old_logp)
    ROLLOUT_CORRECTION_MODES.check(mode)
    with torch.no_grad():
        diff = torch.where(m, upcast(old_logp.detach()) - upcast(rollout_logp.detach()), torch.zeros(()))
        is_ratio = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        masked_frac = torch.zeros((), device=is_ratio.device)
        if mode == "tis":
            c = check_number("cap", cap, low=0.0, low_open=True, hint="the TIS cap C is usually 2")
            weights = is_ratio.clamp(max=c)
        elif mode == "icepop":
            lo_v = check_number("lo", lo, low=0.0)
            hi_v = check_number(
                "hi", hi, low=lo_v, low_open=True, hint="icepop needs lo < hi, e.g. lo=0.5, hi=5"
            )
            inside = (is_ratio >= lo_v) & (is_ratio <= hi_v)
            weights = torch.where(inside, is_ratio, torch.zeros(()))
            masked_frac = (m & ~inside).sum() / m.sum().clamp(min=1)
        elif mode == "is":
            weights = is_ratio
        else:
            weights = torch.ones_like(is_ratio)
        weights = torch.where(m, weights, torch.zeros(()))
        metrics: dict[str, Metric] = {
            "mismatch/is_ratio_mean": (masked_mean(is_ratio, m), "mean"),
            "mismatch/is_ratio_min": (masked_min(is_ratio, m, empty=1.0), "min"),
            "mismatch/is_ratio_max": (masked_max(is_ratio, m, empty=1.0), "max"),
            "mismatch/masked_frac": (upcast(masked_frac), "mean"),
        }
    return weights, metrics
