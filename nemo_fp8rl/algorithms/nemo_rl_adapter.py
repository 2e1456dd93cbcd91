"""``ClippedPGLoss``: our losses behind NeMo RL's ``ClippedPGLossFn`` config keys and data keys.

NeMo RL (github.com/NVIDIA-NeMo/RL, ``nemo_rl/algorithms/loss_functions.py``) configures its policy
loss with a flat dict and calls it as ``loss_fn(logits, data, global_valid_seqs, global_valid_toks)``.
This adapter accepts the same config keys and data keys and computes the loss with this package's
registered losses, rollout correction, KL penalty and (optionally) Calibrated Clipping bounds, so it
can replace ``ClippedPGLossFn`` in a NeMo RL pipeline. Pure torch; NeMo RL is not imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_fp8rl.algorithms._common import check_number, upcast
from nemo_fp8rl.algorithms.calibration import CalibratedClipping
from nemo_fp8rl.algorithms.losses import KL_KINDS, agg_loss, get_policy_loss, kl_penalty
from nemo_fp8rl.algorithms.metrics import Metric
from nemo_fp8rl.algorithms.mismatch import mismatch_metrics
from nemo_fp8rl.algorithms.rollout_correction import rollout_correction

NEMO_RL_CONFIG_KEYS = (
    "ratio_clip_min",
    "ratio_clip_max",
    "ratio_clip_c",
    "use_importance_sampling_correction",
    "truncated_importance_sampling_ratio",
    "truncated_importance_sampling_type",
    "truncated_importance_sampling_ratio_min",
    "reference_policy_kl_penalty",
    "reference_policy_kl_type",
    "kl_input_clamp_value",
    "kl_output_clamp_value",
    "use_on_policy_kl_approximation",
    "token_level_loss",
    "disable_ppo_ratio",
    "sequence_level_importance_ratios",
    "force_on_policy_ratio",
    "use_kl_in_reward",
)
_DEFAULTS: dict[str, Any] = {
    "ratio_clip_c": None,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio_min": None,
    "reference_policy_kl_penalty": 0.0,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": None,
    "kl_output_clamp_value": None,
    "use_on_policy_kl_approximation": False,
    "token_level_loss": True,
    "disable_ppo_ratio": False,
    "sequence_level_importance_ratios": False,
    "force_on_policy_ratio": False,
    "use_kl_in_reward": False,
}


class ClippedPGLoss:
    """Drop-in for NeMo RL's ``ClippedPGLossFn`` built on ``nemo_fp8rl.algorithms``.

    Loss (NeMo RL's formula, our names): with r_t = exp(logp - prev_logprobs), bounds
    (L, H) = (1 - ratio_clip_min, 1 + ratio_clip_max) or the calibrated ones, importance weight w_t,
    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, L, H)) (dual clip: min(., -c A_t) for A_t < 0), and
    loss = agg(l) + beta * agg(kl_t), kl_t = k_n(logp, reference_policy_logprobs).

    Config key mapping (NeMo RL key -> here):

    - ``ratio_clip_min`` (required): eps_low, lower = 1 - ratio_clip_min
    - ``ratio_clip_max`` (required): eps_high, upper = 1 + ratio_clip_max
    - ``ratio_clip_c``: ``dual_clip`` (None = off)
    - ``use_importance_sampling_correction``: weights from :func:`rollout_correction` (else none)
    - ``truncated_importance_sampling_ratio``: ``cap`` of ``tis`` / ``hi`` of ``icepop``
      (None = plain importance sampling, mode ``is``)
    - ``truncated_importance_sampling_type``: ``"tis"`` (default) or ``"icepop"``
    - ``truncated_importance_sampling_ratio_min``: ``lo`` of ``icepop``
    - ``reference_policy_kl_penalty``: beta of the KL term (0 = off)
    - ``reference_policy_kl_type``: ``kind`` of :func:`kl_penalty` (k1/k2/k3)
    - ``kl_input_clamp_value`` / ``kl_output_clamp_value``: ``input_clamp`` / ``output_clamp`` of
      :func:`kl_penalty`
    - ``use_on_policy_kl_approximation``: KL weighted by exp(logp - generation_logprobs), detached
    - ``token_level_loss``: True -> ``token-mean``; False -> ``seq-mean-token-mean``
    - ``disable_ppo_ratio``: loss ``reinforce`` (else ``ppo_clip``)
    - ``sequence_level_importance_ratios``: loss ``gspo`` (needs ``token_level_loss=False``)
    - ``use_kl_in_reward``: True -> no KL term in the loss (it is in the reward)
    - ``force_on_policy_ratio``: not supported (must be False)

    Data keys (NeMo RL layout, ``[batch, seq]`` aligned with ``input_ids``, position 0 has no log-prob and
    is dropped with ``[:, 1:]``): ``advantages``, ``prev_logprobs`` (old_logp), ``generation_logprobs``
    (rollout_logp), ``reference_policy_logprobs`` (ref_logp, needed when beta != 0), ``token_mask``,
    ``sample_mask`` ``[batch]``; optional ``hp_logprobs``/``hp_prev_logprobs`` (BF16 shadow log-probs,
    same layout): when present and a calibration controller is attached, rho = exp(hp_logprobs -
    hp_prev_logprobs) and r are passed to ``calibration.observe`` (call the loss with them only on
    calibration steps, then ``calibration.update`` at the end of the step).

    Call: ``loss_fn(logp_or_logits, data, global_valid_seqs=None, global_valid_toks=None)``. The first
    argument is either the current log-probs ``[batch, seq]`` (same layout as ``prev_logprobs``) or
    ``[batch, seq - 1]`` (already shifted), or full logits ``[batch, seq, vocab]`` (not vocab-parallel;
    log-probs are gathered at ``data["input_ids"][:, 1:]``). ``global_valid_*`` are NeMo RL's global
    counts (see :func:`agg_loss`); ``loss_type`` is ``"token_level"`` or ``"sequence_level"`` like NeMo
    RL's ``LossType`` values. Returns ``(loss, metrics)`` with ``dict[str, Metric]`` metrics: the policy
    loss metrics, rollout-correction and mismatch metrics, ``policy/loss`` and ``policy/ref_kl``.
    """

    def __init__(self, cfg: Mapping[str, Any], *, calibration: CalibratedClipping | None = None) -> None:
        if not isinstance(cfg, Mapping):
            raise ValueError(
                f"cfg must be a mapping of NeMo RL ClippedPGLossFn keys, got {type(cfg).__name__}"
            )
        unknown = sorted(set(cfg) - set(NEMO_RL_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"unknown ClippedPGLoss config keys {unknown}; valid keys: {list(NEMO_RL_CONFIG_KEYS)}"
            )
        for key in ("ratio_clip_min", "ratio_clip_max"):
            if key not in cfg:
                raise ValueError(f"ClippedPGLoss config needs {key!r} (eps of the clip, e.g. 0.2)")
        c = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k not in _DEFAULTS}}
        self.eps_low = check_number("ratio_clip_min", c["ratio_clip_min"], low=0.0, high=1.0)
        self.eps_high = check_number("ratio_clip_max", c["ratio_clip_max"], low=0.0)
        self.dual_clip = (
            None
            if c["ratio_clip_c"] is None
            else check_number(
                "ratio_clip_c",
                c["ratio_clip_c"],
                low=1.0,
                low_open=True,
                hint="dual clip is usually 3; None disables it",
            )
        )
        if c["force_on_policy_ratio"]:
            raise ValueError("force_on_policy_ratio=True is not supported by ClippedPGLoss; set it to False")
        if c["sequence_level_importance_ratios"] and c["token_level_loss"]:
            raise ValueError("sequence_level_importance_ratios=True (GSPO) needs token_level_loss=False")
        if c["disable_ppo_ratio"] and c["sequence_level_importance_ratios"]:
            raise ValueError("disable_ppo_ratio and sequence_level_importance_ratios cannot both be True")
        self.loss_name = (
            "reinforce"
            if c["disable_ppo_ratio"]
            else "gspo"
            if c["sequence_level_importance_ratios"]
            else "ppo_clip"
        )
        self.loss_fn = get_policy_loss(self.loss_name)
        self.agg_mode = "token-mean" if c["token_level_loss"] else "seq-mean-token-mean"
        self.loss_type = "token_level" if c["token_level_loss"] else "sequence_level"

        self.correction: str = "none"
        self.correction_kw: dict[str, float] = {}
        trunc = c["truncated_importance_sampling_ratio"]
        if trunc is not None and not c["use_importance_sampling_correction"]:
            raise ValueError(
                "truncated_importance_sampling_ratio needs use_importance_sampling_correction=True"
            )
        if c["use_importance_sampling_correction"]:
            kind = c["truncated_importance_sampling_type"] or "tis"
            if trunc is None:
                self.correction = "is"
            elif kind == "tis":
                self.correction, self.correction_kw = (
                    "tis",
                    {
                        "cap": check_number(
                            "truncated_importance_sampling_ratio", trunc, low=0.0, low_open=True
                        )
                    },
                )
            elif kind == "icepop":
                lo = c["truncated_importance_sampling_ratio_min"]
                if lo is None:
                    raise ValueError("icepop needs truncated_importance_sampling_ratio_min (e.g. 0.5)")
                self.correction, self.correction_kw = "icepop", {"lo": float(lo), "hi": float(trunc)}
            else:
                raise ValueError(
                    f"truncated_importance_sampling_type {kind!r} is not supported; use 'tis' or 'icepop'"
                )

        self.kl_coef = (
            0.0
            if c["use_kl_in_reward"]
            else check_number("reference_policy_kl_penalty", c["reference_policy_kl_penalty"], low=0.0)
        )
        if c["reference_policy_kl_type"] not in KL_KINDS:
            raise ValueError(
                f"reference_policy_kl_type must be one of {list(KL_KINDS)}, "
                f"got {c['reference_policy_kl_type']!r}"
            )
        self.kl_kind = c["reference_policy_kl_type"]
        self.kl_input_clamp = c["kl_input_clamp_value"]
        self.kl_output_clamp = c["kl_output_clamp_value"]
        self.kl_on_policy_approx = bool(c["use_on_policy_kl_approximation"])

        if calibration is not None:
            if not isinstance(calibration, CalibratedClipping):
                raise ValueError("calibration must be a CalibratedClipping controller or None")
            if (
                abs(calibration.eps_low - self.eps_low) > 1e-12
                or abs(calibration.eps_high - self.eps_high) > 1e-12
            ):
                raise ValueError(
                    f"calibration eps ({calibration.eps_low}, {calibration.eps_high}) "
                    f"differ from ratio_clip_min/max "
                    f"({self.eps_low}, {self.eps_high}); build both from the same values"
                )
        self.calibration = calibration

    @property
    def bounds(self) -> tuple[float, float]:
        """Clip bounds used now: the controller's, or (1 - ratio_clip_min, 1 + ratio_clip_max)."""
        if self.calibration is not None:
            return self.calibration.bounds
        return 1.0 - self.eps_low, 1.0 + self.eps_high

    @staticmethod
    def _shift(x: torch.Tensor, name: str) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"data[{name!r}] must be [batch, seq], got shape {tuple(x.shape)}")
        return x[:, 1:]

    def __call__(
        self,
        logp_or_logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: float | torch.Tensor | None = None,
        global_valid_toks: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        for key in ("advantages", "prev_logprobs", "generation_logprobs", "token_mask", "sample_mask"):
            if key not in data:
                raise ValueError(f"data is missing {key!r} (NeMo RL ClippedPGLossDataDict key)")
        prev = self._shift(data["prev_logprobs"], "prev_logprobs")
        gen = self._shift(data["generation_logprobs"], "generation_logprobs")
        adv = self._shift(data["advantages"], "advantages")
        sample_mask = data["sample_mask"]
        if sample_mask.dim() != 1 or sample_mask.shape[0] != prev.shape[0]:
            raise ValueError(
                f"data['sample_mask'] must be [batch] = ({prev.shape[0]},), got {tuple(sample_mask.shape)}"
            )
        mask = (self._shift(data["token_mask"], "token_mask") != 0) & (sample_mask != 0).unsqueeze(-1)

        x = logp_or_logits
        if x.dim() == 3:
            if "input_ids" not in data:
                raise ValueError("logits were given: data needs 'input_ids' to gather the token log-probs")
            logp = (
                torch.log_softmax(upcast(x[:, :-1]), dim=-1)
                .gather(-1, data["input_ids"][:, 1:].to(x.device).unsqueeze(-1))
                .squeeze(-1)
            )
        elif x.dim() == 2 and x.shape[1] == prev.shape[1] + 1:
            logp = x[:, 1:]
        elif x.dim() == 2 and x.shape == prev.shape:
            logp = x
        else:
            raise ValueError(
                f"first argument has shape {tuple(x.shape)}; pass log-probs [batch, seq] like prev_logprobs "
                f"{tuple(data['prev_logprobs'].shape)}, shifted [batch, seq-1], or logits [batch, seq, vocab]"
            )

        metrics: dict[str, Metric] = {}
        weights = None
        if self.correction != "none":
            weights, m_rc = rollout_correction(prev, gen, mask, self.correction, **self.correction_kw)
            metrics.update(m_rc)
        lower, upper = self.bounds
        loss, m_pl = self.loss_fn(
            logp,
            prev,
            adv,
            mask,
            lower=lower,
            upper=upper,
            dual_clip=self.dual_clip,
            weights=weights,
            agg_mode=self.agg_mode,
            global_tokens=global_valid_toks,
            global_seqs=global_valid_seqs,
        )
        metrics.update(m_pl)
        if self.kl_coef != 0.0:
            if "reference_policy_logprobs" not in data:
                raise ValueError("reference_policy_kl_penalty != 0 needs data['reference_policy_logprobs']")
            ref = self._shift(data["reference_policy_logprobs"], "reference_policy_logprobs")
            kl = kl_penalty(
                logp, ref, self.kl_kind, input_clamp=self.kl_input_clamp, output_clamp=self.kl_output_clamp
            )
            if self.kl_on_policy_approx:
                w = torch.exp(upcast(logp.detach()) - upcast(gen))
                kl = kl * torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
            kl_term = agg_loss(
                kl, mask, self.agg_mode, global_tokens=global_valid_toks, global_seqs=global_valid_seqs
            )
            loss = loss + self.kl_coef * kl_term
            metrics["policy/ref_kl"] = (
                kl_term.detach(),
                "sum" if self._global(global_valid_toks, global_valid_seqs) else "mean",
            )
        metrics["policy/loss"] = (
            loss.detach(),
            "sum" if self._global(global_valid_toks, global_valid_seqs) else "mean",
        )
        metrics.update(mismatch_metrics(prev, gen, mask))

        if self.calibration is not None and "hp_logprobs" in data and "hp_prev_logprobs" in data:
            hp = upcast(self._shift(data["hp_logprobs"], "hp_logprobs"))
            hp_prev = upcast(self._shift(data["hp_prev_logprobs"], "hp_prev_logprobs"))
            ratio = torch.exp((upcast(logp.detach()) - upcast(prev)).clamp(-20.0, 20.0))
            ref_ratio = torch.exp((hp - hp_prev).clamp(-20.0, 20.0))
            self.calibration.observe(ratio, ref_ratio, adv, mask)
        return loss, metrics

    def _global(self, toks: object, seqs: object) -> bool:
        return (toks if self.agg_mode == "token-mean" else seqs) is not None
