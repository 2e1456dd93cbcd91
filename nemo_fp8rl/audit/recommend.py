"""The audit's one-line recommendation: the trainer overrides to run, from the measured pure-noise clips.

Rule (every threshold an ``audit.*`` key):

1. Rollout: among the audited rollout configurations, those whose pure-noise clip share ``noise_clip`` is
   at most ``audit.max_extra_clip`` above the lowest one audited; of these the one with the most in FP8
   (FP8 KV cache first, then FP8 linears, then fewer high-precision edge layers: the fastest rollout),
   ties broken by the lower ``noise_clip``.
2. Training: the audited training recipe with the lowest ``noise_clip`` (none audited: the ``fp8=`` given,
   else ``fp8=auto``: a run with training FP8 off keeps its rollout in high precision too).
3. Calibrated Clipping: ``calibration=paper`` when the share of tokens below 1 - eps_low from rounding
   alone (the false clips calibration removes) exceeds ``audit.calibrate_above``, else ``calibration=off``.
   That share is the chosen pair's (``pair``: the trainer's ratio with ``algorithm.old_logprobs=rollout``,
   both sides' noise at once) when a training recipe was audited, else the chosen rollout's
   ``noise_clip_low`` (a BF16 trainer against the FP8 rollout).

Each side is chosen on its own noise against high precision; ``pair`` then measures the two together.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["recommend"]


def recommend(results: list[dict], configs: list[Any], *, max_extra_clip: float, calibrate_above: float,
              fp8_recipe: Optional[str], pair: Optional[Callable[[str, str], dict]] = None) -> dict:
    """``results[i]``: :func:`~nemo_fp8rl.audit.stats.config_stats` of ``configs[i]``
    (:class:`~nemo_fp8rl.audit.configs.AuditConfiguration`); ``pair(train_name, rollout_name)``: the statistics
    of the trainer's ratio for that pair (rule 3). Returns ``{"overrides": [...], "line": str, "rollout": name |
    None, "train": name | None, "pair": stats | None, "why": str}``."""
    roll = [(c, r) for c, r in zip(configs, results) if c.side == "rollout" and r["tokens"]]
    train = [(c, r) for c, r in zip(configs, results) if c.side == "train" and r["tokens"]]
    overrides: list[str] = []
    why = []
    chosen_roll = chosen_train = None
    if train:
        chosen_train = min(train, key=lambda cr: cr[1]["noise_clip"])
        overrides += chosen_train[0].overrides()
        why.append(f"training {chosen_train[0].recipe}: lowest pure-noise clip share of the audited recipes "
                   f"({chosen_train[1]['noise_clip']:.4f})")
    elif fp8_recipe not in (None, "off"):
        overrides.append(f"fp8={fp8_recipe}")
    elif any(c.side == "rollout" for c in configs):
        # a BF16 run's rollout is high precision whatever rollout.fp8 says: the rollout overrides need a recipe
        overrides.append("fp8=auto")
        why.append("fp8=auto: no training recipe audited (the rollout's FP8 applies only with training FP8; "
                   "add train:RECIPE to audit.configs to compare recipes)")
    if roll:
        best = min(r["noise_clip"] for _, r in roll)
        ok = [cr for cr in roll if cr[1]["noise_clip"] <= best + max_extra_clip]
        chosen_roll = max(ok, key=lambda cr: (cr[0].fp8_amount(), -cr[1]["noise_clip"]))
        overrides += chosen_roll[0].overrides()
        why.append(f"rollout {chosen_roll[0].name}: the most in FP8 within {max_extra_clip} of the lowest pure-noise "
                   f"clip share ({chosen_roll[1]['noise_clip']:.4f} vs {best:.4f})")
    pair_stats = None
    if chosen_roll and chosen_train and pair is not None:
        pair_stats = pair(chosen_train[0].name, chosen_roll[0].name)
    if chosen_roll or chosen_train:
        low, whose = ((pair_stats["noise_clip_low"], "the trainer's ratio of this pair") if pair_stats else
                      (chosen_roll[1]["noise_clip_low"], "the rollout's ratio") if chosen_roll else
                      (chosen_train[1]["noise_clip_low"], "the training recipe's ratio"))
        if low > calibrate_above:
            overrides.append("calibration=paper")
            why.append(f"calibration=paper: {low:.4f} of the tokens fall below 1 - eps_low in {whose} from FP8 "
                       f"rounding alone (> audit.calibrate_above={calibrate_above})")
        else:
            overrides.append("calibration=off")
            why.append(f"calibration=off: {whose} puts {low:.4f} <= {calibrate_above} below 1 - eps_low")
    line = "nemo-fp8rl-train " + " ".join(overrides)
    return {"overrides": overrides, "line": line, "rollout": chosen_roll[0].name if chosen_roll else None,
            "train": chosen_train[0].name if chosen_train else None, "pair": pair_stats, "why": "; ".join(why)}
