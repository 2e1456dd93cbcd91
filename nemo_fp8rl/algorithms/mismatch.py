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
    """Flags an entropy surge: entropy above ``factor`` x its running median (DESIGN.md section 7).

    At each step, with h the step's mean token entropy and med the median of the previous ``window``
    values (the current one excluded)::

        stability/entropy_ratio = h / med
        stability/entropy_surge = 1 if (history >= min_history and h > factor * med) else 0

    and h is then appended to the history (surging values included, so a lasting new level stops
    counting as a surge after about window/2 steps). Runs on the host once per step, after the metrics
    were synced; ``state_dict``/``load_state_dict`` keep the history for exact resume.

    Args:
        window: number of past values in the running median (>= 1).
        factor: surge threshold multiplier (> 1).
        min_history: values needed before a surge can be flagged (1 <= min_history <= window).
    """

    def __init__(self, window: int = 20, factor: float = 2.0, min_history: int = 5) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if (
            isinstance(min_history, bool)
            or not isinstance(min_history, int)
            or not 1 <= min_history <= window
        ):
            raise ValueError(f"min_history must be an int in [1, window={window}], got {min_history!r}")
        self.window = window
        self.factor = check_number("factor", factor, low=1.0, low_open=True, hint="e.g. factor=2.0")
        self.min_history = min_history
        self._history: deque[float] = deque(maxlen=window)
        self.surges = 0

    @property
    def median(self) -> float:
        """Median of the history (lower median for even length); NaN when empty."""
        if not self._history:
            return math.nan
        s = sorted(self._history)
        return s[(len(s) - 1) // 2]

    def update(self, entropy: float | torch.Tensor) -> dict[str, Metric]:
        """Feed one step's mean entropy; returns ``stability/entropy_{surge,ratio}`` metrics."""
        h = float(entropy)
        if not math.isfinite(h):
            raise ValueError(f"entropy must be finite, got {h}; check the loss for NaN before the monitor")
        med = self.median
        ratio = h / med if med > 0 else (1.0 if math.isnan(med) or h == 0 else math.inf)
        surge = len(self._history) >= self.min_history and h > self.factor * med
        self.surges += int(surge)
        self._history.append(h)
        return {
            "stability/entropy_surge": make_metric(float(surge), "max"),
            "stability/entropy_ratio": make_metric(ratio, "mean"),
        }

    def state_dict(self) -> dict:
        return {"history": list(self._history), "surges": self.surges}

    def load_state_dict(self, state: dict) -> None:
        self._history = deque((float(x) for x in state["history"]), maxlen=self.window)
        self.surges = int(state["surges"])
