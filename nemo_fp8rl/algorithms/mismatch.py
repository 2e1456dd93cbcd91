"""Mismatch metrics (rollout vs trainer, FP8 vs BF16 shadow) and the entropy-surge stability monitor."""

from __future__ import annotations

import math
from collections import deque

import torch

from nemo_fp8rl.algorithms._common import (
    as_bool_mask,
    check_2d,
    check_number,
    check_same_shape,
    masked_max,
    masked_mean,
    upcast,
)
from nemo_fp8rl.algorithms.metrics import Metric, make_metric


def mismatch_metrics(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    hp_old_logp: torch.Tensor | None = None,
) -> dict[str, Metric]:
    """Per-step diagnostics of how far the trainer's log-probs are from the rollout engine's.

    With d_t = old_logp_t - rollout_logp_t over valid tokens (tokens were sampled by pi_rollout):

    - ``mismatch/logp_abs_diff_mean`` = mean |d_t|, ``mismatch/logp_abs_diff_max`` = max |d_t|
    - ``mismatch/k3_kl`` = mean (exp(d_t) - 1 - d_t): Schulman's k3 estimate of KL(pi_rollout || pi_old)
      (http://joschu.net/blog/kl-approx.html)
    - ``mismatch/token_mult_prob_error`` = mean exp(|d_t|), NeMo RL's definition (a value of 1 means no
      mismatch; NeMo RL's recipe tests expect its median below 1.1)
    - with ``hp_old_logp`` (BF16 shadow forward of the same weights, a calibration step):
      ``mismatch/fp8_bf16_logp_abs_diff_mean`` = mean |old_logp_t - hp_old_logp_t|

    Shapes: all ``[batch, seq]``. Returns ``dict[str, Metric]`` (0-dim tensors, no host sync).
    """
    check_2d("old_logp", old_logp)
    check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp, hp_old_logp=hp_old_logp)
    m = as_bool_mask(mask, old_logp)
    with torch.no_grad():
        d = torch.where(m, upcast(old_logp.detach()) - upcast(rollout_logp.detach()), torch.zeros(()))
        ad = d.abs()
        out: dict[str, Metric] = {
            "mismatch/logp_abs_diff_mean": (masked_mean(ad, m), "mean"),
            "mismatch/logp_abs_diff_max": (masked_max(ad, m, empty=0.0), "max"),
            "mismatch/k3_kl": (masked_mean(torch.expm1(d) - d, m), "mean"),
            "mismatch/token_mult_prob_error": (masked_mean(torch.exp(ad), m), "mean"),
        }
        if hp_old_logp is not None:
            hd = (upcast(old_logp.detach()) - upcast(hp_old_logp.detach())).abs()
            out["mismatch/fp8_bf16_logp_abs_diff_mean"] = (masked_mean(hd, m), "mean")
    return out


class EntropySurgeMonitor:
    """Flags an entropy surge against a lagged baseline that does not follow the surge (docs/design.md, "One training step").

    With h_t the mean token entropy of step t (t = 0, 1, ...) and w = ``window``, the baseline is the
    median of the steps that end ``w`` steps before t::

        B_t = median{h_s : max(0, t - 2w) <= s < max(1, t - w)}        (lower median for even counts)
        stability/entropy_ratio = h_t / B_t
        stability/entropy_surge = 1 if (h_t > factor * B_t and h_t - B_t > min_rise) else 0

    From t = 2w on this is the median of steps [t - 2w, t - w), as docs/design.md writes it. For a younger run
    the design says "the first window"; taken literally ([0, min(t, w)) while t < 2w) that baseline holds
    the steps just before t and follows a surge that starts early - the study's lr 1e-3 collapse jumped
    at step 1 and would never be flagged. Here the same lag applies from the start, clipped at step 0:
    while t <= w the baseline is step 0 alone, then it grows over the first steps to w values at t = 2w.
    Consequences (tests/algorithms/test_mismatch.py): a jump that stays up is flagged on every step until
    the lagged window's median reaches the new level, at least w steps and about 1.5 w; a single-step
    spike is flagged on that step only (it is one value of w once it enters a baseline); a slow decline
    is never flagged (ratio < 1). ``min_rise`` (nats) keeps small absolute changes at low entropy from
    counting as a surge. Step 0 has no baseline: ratio 1, no surge.

    Runs on the host once per step, after the metrics were synced. The state is the last 2w values and
    the surge count; ``state_dict``/``load_state_dict`` resume exactly.

    Args:
        window: baseline window and lag w in steps (>= 1).
        factor: surge threshold multiplier (> 1).
        min_rise: minimum absolute rise over the baseline, in nats (>= 0).
    """

    def __init__(self, window: int = 20, factor: float = 1.5, min_rise: float = 0.05) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.window = window
        self.factor = check_number("factor", factor, low=1.0, low_open=True, hint="e.g. factor=1.5")
        self.min_rise = check_number("min_rise", min_rise, low=0.0, hint="e.g. min_rise=0.05")
        self._history: deque[float] = deque(maxlen=2 * window)  # steps [max(0, t - 2w), t)
        self.surges = 0

    @property
    def baseline(self) -> float:
        """B_t for the next step t (see the class docstring); NaN before the first step."""
        if not self._history:
            return math.nan
        s = sorted(list(self._history)[: max(1, len(self._history) - self.window)])
        return s[(len(s) - 1) // 2]

    def update(self, entropy: float | torch.Tensor) -> dict[str, Metric]:
        """Feed step t's mean token entropy h_t; returns ``stability/entropy_{surge,ratio}`` (0-dim metrics)."""
        h = float(entropy)
        if not math.isfinite(h):
            raise ValueError(f"entropy must be finite, got {h}; check the loss for NaN before the monitor")
        b = self.baseline
        if math.isnan(b):
            ratio, surge = 1.0, False
        else:
            ratio = h / b if b > 0 else (1.0 if h == 0 else math.inf)
            surge = h > self.factor * b and h - b > self.min_rise
        self.surges += int(surge)
        self._history.append(h)
        return {
            "stability/entropy_surge": make_metric(float(surge), "max"),
            "stability/entropy_ratio": make_metric(ratio, "mean"),
        }

    def state_dict(self) -> dict:
        return {"history": list(self._history), "surges": self.surges, "window": self.window}

    def load_state_dict(self, state: dict) -> None:
        """Restore; a checkpoint written with another ``window`` (or by the running-median monitor, which
        kept only w values) keeps the values it has, so the baselines of the next steps are computed from
        fewer steps than an uninterrupted run would use."""
        self._history = deque((float(x) for x in state["history"]), maxlen=2 * self.window)
        self.surges = int(state["surges"])
