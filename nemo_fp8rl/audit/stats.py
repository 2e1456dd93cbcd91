"""The audit's statistics: what FP8 rounding alone does to the log-probs and importance ratios of tokens.

Inputs are teacher-forced log-probs of the same sampled tokens, [B, T], with the response mask m [B, T]:
``logp_ref`` (high precision: the tokens were sampled from it) and ``logp`` (one FP8 configuration). With
d_t = logp_t - logp_ref_t over response tokens (m_t = 1):

- ``mean_abs_dlogp`` = mean |d_t|; ``max_abs_dlogp`` = max |d_t|.
- ``kl`` = mean (exp(d_t) - 1 - d_t): Schulman's k3 estimator of KL(pi_ref || pi) from tokens sampled by
  pi_ref, i.e. NeMo RL's ``gen_kl_error`` (its default k3) with the high-precision model as the generator.
- ``token_mult_prob_error``: NeMo RL's metric, ported rule for rule from its ``ClippedPGLossFn``:
  ``masked_mean(exp(|gen - prev| * mask), mask) = sum(exp(|d| m) m) / (sum(m) + 1e-8)`` (1 = no mismatch;
  NeMo RL's recipe tests expect its median below 1.1).

Pure-noise clips. With no policy change at all (the same weights on both sides) the importance ratio PPO
clips is r_t = exp(logp_trainer_t - logp_rollout_t) (``algorithm.old_logprobs=rollout``); a BF16 run has
r = 1. An FP8 rollout configuration gives r_t = exp(logp_ref_t - logp_t) (trainer in high precision), an
FP8 training recipe r_t = exp(logp_t - logp_ref_t) (rollout in high precision): ``log_ratio`` is -d or d.
``noise_clip`` = share of response tokens with r_t outside [1 - eps_low, 1 + eps_high]; ``noise_clip_low``
(r < 1 - eps_low: a negative-advantage token there gets no gradient) and ``noise_clip_high``
(r > 1 + eps_high: the same for positive advantages). Split by the high-precision probability of the token,
p_t = exp(logp_ref_t), in ten bins [k/10, (k+1)/10) (``by_prob_decile``), and by response position
(``by_position``: buckets of the token's index in its response).

The lower bound Calibrated Clipping would pick (:func:`calibration_bounds`), with
:func:`nemo_fp8rl.algorithms.calibration.calibrate_bounds` on these ratios and advantages A = -1 (every
token a negative-advantage token: only the lower bound is asked):

- ``lower_onpolicy``: high-precision ratios rho = 1 (no policy change: the first minibatch of a step, where
  the trainer's shadow ratio is exactly 1). BF16 clips nothing (alpha = 0), so L* = min r and the bound is
  clamp(min r, calibration.lower_min, 1 - eps_low): calibration stops clipping pure noise.
- ``lower_at_alpha[a]``: the bound for a step where BF16 clips a share a of the negative-advantage tokens
  (rho < 1 - eps_low on floor(a |N|) tokens): L* = the a-quantile of r ("lower" interpolation: exactly
  floor(a |N|) tokens strictly below), clamped. It assumes the FP8 ratios of that step are these noise
  ratios, i.e. a policy change small against the FP8 noise, the regime where fixed clipping fails; with a
  larger change the ratios spread more and the bound lands lower.

Every function takes [B, T] tensors and returns Python floats and dicts (computed once, on the host).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "calibration_bounds",
    "config_stats",
    "kl_k3",
    "layer_ranking",
    "noise_clip_shares",
    "position_bucket_labels",
    "token_mult_prob_error",
]

_NEMO_RL_EPS = 1e-8  # NeMo RL's masked_mean: sum(values * mask) / (normalization_factor + 1e-8)


def _check(mask: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
    for x in xs:
        if x.shape != mask.shape:
            raise ValueError(f"log-probs {tuple(x.shape)} and mask {tuple(mask.shape)} must have the same shape [B, T]")
    return mask.bool()


def token_mult_prob_error(gen_logp: torch.Tensor, prev_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """NeMo RL's ``token_mult_prob_error`` (``ClippedPGLossFn``, with one global normalisation):
    ``lp_error = |gen - prev|``; ``sum(exp(lp_error * mask) * mask) / (sum(mask) + 1e-8)``."""
    _check(mask, gen_logp, prev_logp)
    m = mask.double()
    lp_error = (gen_logp.double() - prev_logp.double()).abs()
    return float((torch.exp(lp_error * m) * m).sum() / (m.sum() + _NEMO_RL_EPS))


def kl_k3(sampler_logp: torch.Tensor, other_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """mean over mask of exp(lr) - 1 - lr, lr = other - sampler: k3 estimate of KL(sampler || other) from
    tokens drawn by the sampler (NeMo RL's ``gen_kl_error`` with kl_type k3). NaN without tokens."""
    m = _check(mask, sampler_logp, other_logp)
    lr = (other_logp.double() - sampler_logp.double())[m]
    return float((torch.expm1(lr) - lr).mean()) if lr.numel() else math.nan


def noise_clip_shares(log_ratio: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """Shares of masked tokens with r = exp(log_ratio) below 1 - eps_low, above 1 + eps_high, and either."""
    m = _check(mask, log_ratio)
    r = torch.exp(log_ratio.double()[m])
    n = r.numel()
    if n == 0:
        return {"noise_clip": math.nan, "noise_clip_low": math.nan, "noise_clip_high": math.nan}
    low = int((r < 1.0 - eps_low).sum())
    high = int((r > 1.0 + eps_high).sum())
    return {"noise_clip": (low + high) / n, "noise_clip_low": low / n, "noise_clip_high": high / n}


def position_bucket_labels(starts: Sequence[int]) -> list[str]:
    """``[0, 32, 64]`` -> ``["0-31", "32-63", "64+"]``."""
    s = list(starts)
    return [f"{a}-{b - 1}" for a, b in zip(s[:-1], s[1:])] + [f"{s[-1]}+"]


def _group(name_of: torch.Tensor, n_groups: int, d: torch.Tensor, lr: torch.Tensor, m: torch.Tensor,
           eps_low: float, eps_high: float, labels: list[str], key: str) -> list[dict]:
    out = []
    for g in range(n_groups):
        sel = m & (name_of == g)
        n = int(sel.sum())
        row = {key: labels[g], "tokens": n}
        if n:
            row["mean_abs_dlogp"] = float(d.double()[sel].abs().mean())
            row.update(noise_clip_shares(lr, sel, eps_low, eps_high))
        out.append(row)
    return out


def config_stats(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, *, side: str, eps_low: float,
                 eps_high: float, response_pos: torch.Tensor, position_buckets: Sequence[int]) -> dict:
    """Every per-configuration statistic of the module docstring except the calibration bounds.

    Args:
        logp, logp_ref: [B, T] log-probs of the same tokens (configuration, high precision).
        mask: [B, T] response tokens.
        side: ``rollout`` (r = exp(logp_ref - logp)) or ``train`` (r = exp(logp - logp_ref)).
        response_pos: [B, T] long, index of each token in its response (0 = first response token).
        position_buckets: bucket starts, increasing from 0 (the last one open-ended).
    """
    if side not in ("rollout", "train"):
        raise ValueError(f"side={side!r}; rollout or train")
    m = _check(mask, logp, logp_ref, response_pos)
    d = logp.double() - logp_ref.double()
    lr = -d if side == "rollout" else d
    ad = d[m].abs()
    out = {
        "tokens": int(m.sum()),
        "mean_abs_dlogp": float(ad.mean()) if ad.numel() else math.nan,
        "max_abs_dlogp": float(ad.max()) if ad.numel() else math.nan,
        "kl": kl_k3(logp_ref, logp, mask),
        "token_mult_prob_error": token_mult_prob_error(logp_ref, logp, mask),
    }
    out.update(noise_clip_shares(lr, mask, eps_low, eps_high))
    p = torch.exp(logp_ref.double())
    decile = torch.clamp((p * 10).floor().long(), 0, 9)
    out["by_prob_decile"] = _group(decile, 10, d, lr, m, eps_low, eps_high,
                                   [f"{k / 10:.1f}-{(k + 1) / 10:.1f}" for k in range(10)], "p_ref")
    edges = torch.tensor(list(position_buckets), dtype=torch.long)
    bucket = torch.bucketize(response_pos.long(), edges, right=True) - 1
    out["by_position"] = _group(bucket, len(edges), d, lr, m, eps_low, eps_high,
                                position_bucket_labels(position_buckets), "positions")
    return out


def calibration_bounds(log_ratio: torch.Tensor, mask: torch.Tensor, *, eps_low: float, eps_high: float,
                       alphas: Sequence[float], lower_min: float, upper_max: float) -> dict:
    """The lower bounds Calibrated Clipping picks for these pure-noise ratios (module docstring):
    ``lower_onpolicy`` / ``lower_onpolicy_raw`` (rho = 1) and ``lower_at_alpha`` {alpha: {lower, lower_raw,
    alpha_bf16}} from :func:`~nemo_fp8rl.algorithms.calibration.calibrate_bounds` (A = -1 on every token,
    ``upper_mode=fixed``, ``min_tokens=1``)."""
    from nemo_fp8rl.algorithms.calibration import calibrate_bounds

    m = _check(mask, log_ratio)
    r = torch.exp(log_ratio.double()[m]).float()
    n = r.numel()
    if n == 0:
        return {"lower_onpolicy": math.nan, "lower_onpolicy_raw": math.nan, "lower_at_alpha": {}}
    adv = -torch.ones_like(r)
    kw = dict(eps_low=eps_low, eps_high=eps_high, upper_mode="fixed", lower_min=lower_min, upper_max=upper_max,
              min_tokens=1)
    on = calibrate_bounds(r, torch.ones_like(r), adv, **kw)
    out = {"lower_onpolicy": on.lower, "lower_onpolicy_raw": on.lower_raw, "lower_at_alpha": {}}
    for a in alphas:
        k = int(math.floor(float(a) * n))
        rho = torch.ones_like(r)
        rho[:k] = 0.5 * (1.0 - eps_low)  # k tokens that BF16 clips; which ones does not move L* (a count)
        res = calibrate_bounds(r, rho, adv, **kw)
        out["lower_at_alpha"][f"{float(a):g}"] = {"lower": res.lower, "lower_raw": res.lower_raw,
                                                  "alpha_bf16": res.alpha_bf16}
    return out


def layer_ranking(base: float, with_layer_hp: dict[int, float]) -> list[dict]:
    """Layers sorted by the mismatch drop when that layer alone runs in high precision.

    ``base``: mean |dlogp| of the ranked configuration; ``with_layer_hp[i]``: the same with layer i in high
    precision. Each row: ``layer``, ``mean_abs_dlogp`` (with it in high precision), ``drop`` = base - that,
    ``drop_share`` = drop / base. Largest drop first (ties: lower layer first).
    """
    rows = [{"layer": int(i), "mean_abs_dlogp": float(v), "drop": float(base - v),
             "drop_share": float((base - v) / base) if base > 0 else math.nan} for i, v in with_layer_hp.items()]
    return sorted(rows, key=lambda r: (-r["drop"], r["layer"]))
