"""The "negative push": how far one RL step moved the high-precision log-probs of its tokens (pure torch).

The mechanism Calibrated Clipping (arXiv 2609.22870; docs/design.md, "Calibrated Clipping") is meant to
repair: under FP8 the ratios r_t of negative-advantage tokens are noisy, more of them fall below the lower
bound and get no gradient, so the step pushes the probability of those bad tokens down *less* than a BF16
step would. This module measures that push directly, in high precision, on the tokens of one step.

Per valid response token t of a step (log-probs at the sampling temperature, as everywhere in the trainer):

- ``hp_old_logp_t``: the BF16 shadow forward (FP8 off) of the weights *before* the step's updates (the
  calibration pass's old-log-prob shadow);
- ``hp_logp_after_t``: the same forward of the weights *after* the step's last minibatch update;
- ``A_t``: the token's advantage; N = {t : A_t < 0}, P = {t : A_t > 0} (A_t = 0 is in neither).

With the push d_t = hp_logp_after_t - hp_old_logp_t (nats):

    calib/neg_push           = (1 / |N|) sum_{t in N} d_t
    calib/pos_push           = (1 / |P|) sum_{t in P} d_t
    calib/neg_alt_mass       = (1 / |N|) sum_{t in N} (1 - exp(hp_logp_after_t))
    calib/neg_alt_mass_gain  = (1 / |N|) sum_{t in N} (exp(hp_old_logp_t) - exp(hp_logp_after_t))
    calib/neg_push_tokens    = |N|

``neg_push`` < 0: the step lowered the bad tokens' probability (what a policy-gradient step on A < 0 is
for); ``pos_push`` is its counterpart on the good tokens, for contrast. ``neg_alt_mass`` is the tail: the
probability that the policy after the step, at this position, samples anything *but* the negative token
(the mass of the sampled token's alternatives, 1 - p(y_t)); ``neg_alt_mass_gain`` is how much of that mass
the step moved onto the alternatives (= neg_alt_mass after minus before). If the paper's mechanism holds,
fixed-clip FP8 has a smaller |neg_push| and neg_alt_mass_gain than BF16 on the same regime, and
calibration restores them. A mean over an empty set is NaN (no negative token: nothing to measure).

Across data-parallel ranks the means must be taken over the union of the ranks' tokens, so the work is in
two halves: :func:`push_stats` returns the sums and counts of one rank as one vector (all-reduce it with
SUM), :func:`push_metrics` turns the summed vector into the metrics.
"""

from __future__ import annotations

import math

import torch

from nemo_fp8rl.algorithms._common import as_bool_mask, check_2d, check_same_shape, masked_sum, upcast
from nemo_fp8rl.algorithms.metrics import Metric, make_metric

PUSH_STATS = ("neg_push_sum", "neg_tokens", "pos_push_sum", "pos_tokens", "neg_alt_mass_sum",
              "neg_alt_mass_gain_sum")
"""The entries of :func:`push_stats`' vector, in order."""


def push_stats(
    hp_logp_after: torch.Tensor,
    hp_old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Sums and counts of one rank's tokens for :func:`push_metrics` (float32 vector of :data:`PUSH_STATS`).

    Args:
        hp_logp_after: high-precision log-probs of the sampled tokens after the step's updates, ``[batch, seq]``.
        hp_old_logp: the same before the updates, ``[batch, seq]``.
        advantages: token advantages, ``[batch, seq]`` (per-sequence advantages broadcast over the tokens).
        mask: valid (response) tokens, ``[batch, seq]``, bool or 0/1; None = all valid.

    Returns:
        ``[S_N, |N|, S_P, |P|, sum_N (1 - p_after), sum_N (p_old - p_after)]`` with S_X = sum over X of
        d_t = hp_logp_after_t - hp_old_logp_t; shape ``[6]``, no host sync. Summable over ranks.
    """
    check_2d("hp_logp_after", hp_logp_after)
    check_same_shape("hp_logp_after", hp_logp_after, hp_old_logp=hp_old_logp, advantages=advantages)
    m = as_bool_mask(mask, hp_logp_after)
    with torch.no_grad():
        after, before, adv = upcast(hp_logp_after.detach()), upcast(hp_old_logp.detach()), upcast(advantages.detach())
        neg, pos = m & (adv < 0), m & (adv > 0)
        d = after - before
        p_after, p_old = torch.exp(after), torch.exp(before)
        return torch.stack([
            masked_sum(d, neg), neg.sum().to(d.dtype),
            masked_sum(d, pos), pos.sum().to(d.dtype),
            masked_sum(1.0 - p_after, neg),
            masked_sum(p_old - p_after, neg),
        ]).float()


def push_metrics(stats: torch.Tensor) -> dict[str, Metric]:
    """``calib/neg_push``, ``calib/pos_push``, ``calib/neg_alt_mass``, ``calib/neg_alt_mass_gain`` and
    ``calib/neg_push_tokens`` (module docstring) from a :func:`push_stats` vector ``[6]``, summed over the
    data-parallel ranks. Means over an empty token set are NaN. Reduction "mean": the values are already
    global, identical on every rank."""
    if stats.shape != (len(PUSH_STATS),):
        raise ValueError(f"stats must have shape ({len(PUSH_STATS)},) (push_stats' vector), got {tuple(stats.shape)}")
    s_neg, n_neg, s_pos, n_pos, alt, gain = stats.float().unbind()
    nan = torch.full((), math.nan)

    def mean(total: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return torch.where(n > 0, total / n.clamp(min=1), nan.to(total.device))

    return {
        "calib/neg_push": make_metric(mean(s_neg, n_neg), "mean"),
        "calib/pos_push": make_metric(mean(s_pos, n_pos), "mean"),
        "calib/neg_alt_mass": make_metric(mean(alt, n_neg), "mean"),
        "calib/neg_alt_mass_gain": make_metric(mean(gain, n_neg), "mean"),
        "calib/neg_push_tokens": make_metric(n_neg, "mean"),
    }


__all__ = ["PUSH_STATS", "push_metrics", "push_stats"]
