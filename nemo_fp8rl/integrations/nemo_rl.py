"""NeMo RL drop-in: ``ClippedPGLossFn`` with Calibrated Clipping bounds.

Matched against NeMo RL main at commit ``7ea279abfbeb698b092856d0dab61e7cf39bc909`` (2026-08-22,
github.com/NVIDIA-NeMo/RL, ``nemo_rl/algorithms/loss/loss_functions.py``; :data:`NEMO_RL_COMMIT`). A NeMo
RL user swaps one import::

    from nemo_fp8rl.integrations.nemo_rl import ClippedPGLossFn  # was: from nemo_rl.algorithms.loss
    loss_fn = ClippedPGLossFn(master_config.loss_fn)

and keeps everything else: the call ``loss_fn(data=..., global_valid_seqs=..., global_valid_toks=...,
next_token_logprobs=...)``, ``input_type``/``loss_type`` (NeMo RL's own enums when NeMo RL is importable),
the ``loss_fn`` config keys (a mapping or NeMo RL's typed ``ClippedPGLossConfig``, same defaults), the
metric names and their plain-number, sum-over-microbatches semantics, and ``metric_normalizations``.
The only behavioural difference: the PPO clip bounds are the ones in force in a
:class:`~nemo_fp8rl.algorithms.calibration.CalibratedClipping` controller (``self.calibration``), which
moves them only after it has been fed BF16 shadow ratios (:meth:`ClippedPGLossFn.observe_shadow`) and
``calibration.update(step)``; without that, every number equals NeMo RL's. tests/integrations holds golden
values from NeMo RL's real class at the pinned commit and compares loss, gradient and metrics.

Per token t of the response (NeMo RL layout: ``[batch, seq]`` tensors aligned with ``input_ids``, column 0
dropped, so shapes below are ``[B, S-1]``), with lp = ``next_token_logprobs``, prev = ``prev_logprobs``,
gen = ``generation_logprobs``, ref = ``reference_policy_logprobs``, m_t = token_mask * sample_mask,
(L, H) the bounds in force (nominal: 1 - ratio_clip_min, 1 + ratio_clip_max):

- ratio r_t = exp(lp - prev); GSPO (``sequence_level_importance_ratios``): r_t = exp(mean over the
  sequence's tokens of (lp - prev)) for every token of the sequence (gradient through all its tokens);
  ``force_on_policy_ratio``: r_t = exp(lp - sg(lp)) = 1, not clipped; ``disable_ppo_ratio``: "r_t" = lp.
- per-token loss l_t = max(-A_t r_t, -A_t clip(r_t, L, H)); CISPO (``use_cispo``):
  l_t = -A_t sg(clip(r_t, L, H)) lp_t; dual clip c: l_t = min(l_t, -c A_t) where A_t < 0.
- importance weight (``use_importance_sampling_correction``): w_t = exp(prev - gen) (GSPO: one weight per
  sequence, exp(sum_t m_t (prev - gen))), NaN/inf -> 0; truncation: ``tis`` w = clamp(w, min, max)
  (min defaults to 0), ``icepop`` w = w 1[min <= w <= max], ``seq-mask-tis`` w = w 1[min <= g_i <= max]
  with g_i = exp(mean over sequence i of (prev - gen)).
- actor loss: token level sum(m w l) / N_tok; sequence level sum_i s_i mean_t(w l) / N_seq, with the global
  counts ``global_valid_toks`` / ``global_valid_seqs``.
- KL (beta = ``reference_policy_kl_penalty``, 0 when ``use_kl_in_reward``): k = clamp_out(v_t k_n(lp, ref))
  with the k1/k2/k3 estimator on d = clamp_in(lp - ref) and the weight v_t = exp(lp - sg(lp)) (value 1, it
  adds the score-function gradient beta v k grad(lp)), or exp(lp - gen) with
  ``use_on_policy_kl_approximation``; v is detached where the input clamp binds. Reduced like the actor
  loss, times beta.
- VAPO (``positive_example_nll_weight`` mu > 0 and ``data["rewards"]``): + mu mean(-lp) over the valid
  tokens of samples with reward > 0 (local mean).

Metrics (Python floats; the NeMo RL workers divide them by the number of global batches and ``grpo.py``
sums them over microbatches, min/max for the extrema): NeMo RL's ``loss``, ``probs_ratio``,
``probs_ratio_clamped``, ``probs_ratio_{min,max}``, ``probs_ratio_clamped_{min,max}``, ``kl_penalty``,
``token_mult_prob_error``, ``gen_kl_error``, ``policy_kl_error``, ``js_divergence_error``,
``sampling_importance_ratio``, ``num_valid_samples``, ``approx_entropy``, ``is_oob_ratio`` (with
truncation), ``positive_nll_loss``; plus ours, token-normalised so that the sum over microbatches is the
step's value: ``clip/lower``, ``clip/upper`` (bounds in force) and ``clip/low_clipped`` /
``clip/high_clipped`` (fraction of valid tokens with A < 0 and r < L / A > 0 and r > H).

Known difference, kept on purpose: in GSPO mode NeMo RL's ``sampling_importance_ratio`` broadcasts the
``[B, 1]`` weights against the ``[B]`` sample mask (it reports sum_i w_i times the number of valid samples
over N_seq); ours reports sum_i s_i w_i / N_seq, the mean weight it names.

Pure torch: NeMo RL is imported only to reuse its enums when it is installed.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping
from typing import Any

import torch

from nemo_fp8rl.algorithms._common import masked_sum
from nemo_fp8rl.algorithms.calibration import CalibratedClipping
from nemo_fp8rl.algorithms.losses import KL_KINDS, agg_loss, clipped_surrogate, kl_penalty

NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
"""NVIDIA-NeMo/RL main commit (2026-08-22) whose ``ClippedPGLossFn`` this module matches."""


try:  # NeMo RL's workers compare with ``==``: inside NeMo RL these must be its own enum classes
    from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType, MetricNormalizer
except ImportError:  # NeMo RL not installed: same names and values

    class LossType(enum.Enum):  # type: ignore[no-redef]
        TOKEN_LEVEL = "token_level"
        SEQUENCE_LEVEL = "sequence_level"

    class LossInputType(enum.Enum):  # type: ignore[no-redef]
        LOGIT = "logit"
        LOGPROB = "logprob"
        DISTILLATION = "distillation"
        DISTILLATION_CROSS_TOKENIZER = "distillation_cross_tokenizer"
        DRAFT = "draft"

    class MetricNormalizer(enum.Enum):  # type: ignore[no-redef]
        TOKENS = "tokens"
        SEQUENCES = "sequences"
        NONE = "none"


CONFIG_DEFAULTS: dict[str, Any] = {
    "disable_ppo_ratio": False,
    "token_level_loss": True,
    "sequence_level_importance_ratios": False,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "use_kl_in_reward": False,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
    "use_on_policy_kl_approximation": False,
    "force_on_policy_ratio": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}
"""NeMo RL ``ClippedPGLossConfig`` keys and defaults at :data:`NEMO_RL_COMMIT`, plus our ``calibration``."""

TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


def _config_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "model_dump"):  # NeMo RL's pydantic ClippedPGLossConfig
        return dict(cfg.model_dump())
    if hasattr(cfg, "__dict__"):
        return {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
    raise ValueError(
        f"loss config must be a mapping or NeMo RL's ClippedPGLossConfig, got {type(cfg).__name__}"
    )


def _bad(key: str, msg: str) -> ValueError:
    return ValueError(f"loss_fn.{key}: {msg}")


class ClippedPGLossFn:
    """NeMo RL ``ClippedPGLossFn`` (PPO / GRPO / DAPO / REINFORCE / GSPO / CISPO) with calibrated bounds.

    Args:
        cfg: NeMo RL's ``loss_fn`` section: a mapping or its typed ``ClippedPGLossConfig``. Keys and
            defaults are :data:`CONFIG_DEFAULTS`; unknown keys raise (typos would otherwise be silent).
            One key of ours, ``calibration``: a mapping of :class:`CalibratedClipping` arguments other than
            ``eps_low``/``eps_high`` (taken from ``ratio_clip_min``/``ratio_clip_max``), or ``false`` to
            turn Calibrated Clipping off. Absent: a controller with the defaults of DESIGN.md section 4
            (bounds nominal until the first ``calibration.update``). GSPO, REINFORCE and
            ``force_on_policy_ratio`` do not clip token ratios, so they get no controller.
        use_fused_linear_logprobs: as NeMo RL's (read by its ``prepare_loss_input``).
        calibration: a ready controller instead of ``cfg["calibration"]`` (its eps must match).

    The formula, data keys and metrics are in the module docstring. Config errors raise ValueError naming
    the ``loss_fn.<key>`` and the fix, at construction (NeMo RL asserts, some only at the first call).
    """

    input_type = LossInputType.LOGPROB

    def __init__(
        self,
        cfg: Any,
        use_fused_linear_logprobs: bool = False,
        *,
        calibration: CalibratedClipping | None = None,
    ) -> None:
        raw = _config_dict(cfg)
        unknown = sorted(set(raw) - set(CONFIG_DEFAULTS) - {"calibration"})
        if unknown:
            raise ValueError(
                f"unknown loss_fn keys {unknown} for ClippedPGLossFn; remove them (valid keys: "
                f"{sorted(CONFIG_DEFAULTS) + ['calibration']})"
            )
        c = {**CONFIG_DEFAULTS, **{k: v for k, v in raw.items() if k != "calibration"}}
        self.use_fused_linear_logprobs = bool(use_fused_linear_logprobs)
        self.disable_ppo_ratio = bool(c["disable_ppo_ratio"])
        self.ratio_clip_min = float(c["ratio_clip_min"])
        self.ratio_clip_max = float(c["ratio_clip_max"])
        self.ratio_clip_c = None if c["ratio_clip_c"] is None else float(c["ratio_clip_c"])
        self.use_kl_in_reward = bool(c["use_kl_in_reward"])
        self.reference_policy_kl_penalty = (
            0.0 if self.use_kl_in_reward else float(c["reference_policy_kl_penalty"])
        )
        self.reference_policy_kl_type = c["reference_policy_kl_type"]
        self.kl_input_clamp_value = c["kl_input_clamp_value"]
        self.kl_output_clamp_value = c["kl_output_clamp_value"]
        self.use_importance_sampling_correction = bool(c["use_importance_sampling_correction"])
        self.truncated_importance_sampling_type = c["truncated_importance_sampling_type"]
        self.truncated_importance_sampling_ratio = c["truncated_importance_sampling_ratio"]
        self.truncated_importance_sampling_ratio_min = c["truncated_importance_sampling_ratio_min"]
        self.use_on_policy_kl_approximation = bool(c["use_on_policy_kl_approximation"])
        self.force_on_policy_ratio = bool(c["force_on_policy_ratio"])
        self.sequence_level_importance_ratios = bool(c["sequence_level_importance_ratios"])
        self.positive_example_nll_weight = float(c["positive_example_nll_weight"])
        self.use_cispo = bool(c["use_cispo"])
        self.loss_type = LossType.TOKEN_LEVEL if c["token_level_loss"] else LossType.SEQUENCE_LEVEL
        self._validate()
        self.calibration = self._make_calibration(raw.get("calibration", {}), calibration)
        self.metric_normalizations = self._metric_normalizations()

    # ------------------------------------------------------------------ config
    def _validate(self) -> None:
        if self.reference_policy_kl_type not in KL_KINDS:
            raise _bad(
                "reference_policy_kl_type",
                f"must be one of {list(KL_KINDS)}, got {self.reference_policy_kl_type!r}",
            )
        if self.ratio_clip_c is not None and not self.ratio_clip_c > 1:
            raise _bad(
                "ratio_clip_c", f"the dual clip must be > 1 (usually 3) or null, got {self.ratio_clip_c}"
            )
        if not self.disable_ppo_ratio and not self.force_on_policy_ratio:
            if not 0.0 <= self.ratio_clip_min < 1.0:
                raise _bad(
                    "ratio_clip_min",
                    f"must be in [0, 1) so that 1 - ratio_clip_min > 0, got {self.ratio_clip_min}",
                )
            if self.ratio_clip_max < 0.0:
                raise _bad("ratio_clip_max", f"must be >= 0, got {self.ratio_clip_max}")
        if self.sequence_level_importance_ratios and self.loss_type == LossType.TOKEN_LEVEL:
            raise _bad("sequence_level_importance_ratios", "GSPO needs token_level_loss: false")
        if self.use_cispo:
            for key, bad in (
                ("disable_ppo_ratio", self.disable_ppo_ratio),
                ("force_on_policy_ratio", self.force_on_policy_ratio),
                ("sequence_level_importance_ratios", self.sequence_level_importance_ratios),
                ("ratio_clip_c", self.ratio_clip_c is not None),
                ("token_level_loss", self.loss_type != LossType.TOKEN_LEVEL),
            ):
                if bad:
                    fix = (
                        "true"
                        if key == "token_level_loss"
                        else ("null" if key == "ratio_clip_c" else "false")
                    )
                    raise _bad(key, f"use_cispo: true needs {key}: {fix}")
        t, hi, lo = (
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        if t is None and hi is not None:
            raise _bad(
                "truncated_importance_sampling_type",
                f"truncated_importance_sampling_ratio={hi} is set but the type is null; set the type to one "
                f"of {list(TIS_TYPES)} (NeMo RL raises at the first step)",
            )
        if t is not None:
            if not self.use_importance_sampling_correction:
                raise _bad(
                    "use_importance_sampling_correction",
                    f"truncated_importance_sampling_type={t!r} needs it true",
                )
            if t not in TIS_TYPES:
                raise _bad(
                    "truncated_importance_sampling_type",
                    f"must be one of {list(TIS_TYPES)} or null, got {t!r}",
                )
            if hi is None or not hi > 0:
                raise _bad(
                    "truncated_importance_sampling_ratio", f"must be > 0 with a truncation type, got {hi}"
                )
            if lo is not None and lo > hi:
                raise _bad(
                    "truncated_importance_sampling_ratio_min",
                    f"must be <= truncated_importance_sampling_ratio ({hi}), got {lo}",
                )
            if t in ("icepop", "seq-mask-tis") and lo is None:
                raise _bad(
                    "truncated_importance_sampling_ratio_min",
                    f"{t!r} needs a lower bound (e.g. 0.5 for icepop)",
                )
            if t == "seq-mask-tis" and self.sequence_level_importance_ratios:
                raise _bad(
                    "sequence_level_importance_ratios", "seq-mask-tis uses token-level weights; set it false"
                )

    def _make_calibration(self, spec: Any, given: CalibratedClipping | None) -> CalibratedClipping | None:
        clips_tokens = not (
            self.disable_ppo_ratio or self.force_on_policy_ratio or self.sequence_level_importance_ratios
        )
        if given is not None:
            if not isinstance(given, CalibratedClipping):
                raise ValueError("calibration must be a CalibratedClipping controller or None")
            if spec not in ({}, None):
                raise _bad("calibration", "pass the controller or the config key, not both")
            if (
                abs(given.eps_low - self.ratio_clip_min) > 1e-12
                or abs(given.eps_high - self.ratio_clip_max) > 1e-12
            ):
                raise _bad(
                    "calibration",
                    f"controller eps ({given.eps_low}, {given.eps_high}) differ from ratio_clip_min/max "
                    f"({self.ratio_clip_min}, {self.ratio_clip_max}); build both from the same values",
                )
            if not clips_tokens:
                raise _bad(
                    "calibration", "this loss clips no token ratio (GSPO, REINFORCE or force_on_policy_ratio)"
                )
            return given
        if spec is False or spec is None:
            return None
        if not isinstance(spec, Mapping) and hasattr(spec, "items"):
            spec = dict(spec.items())
        if not isinstance(spec, Mapping):
            raise _bad(
                "calibration", f"must be a mapping of CalibratedClipping arguments or false, got {spec!r}"
            )
        if not clips_tokens:
            if spec:
                raise _bad(
                    "calibration",
                    "this loss clips no token ratio (GSPO, REINFORCE or force_on_policy_ratio); set it false",
                )
            return None
        for key in ("eps_low", "eps_high"):
            if key in spec:
                raise _bad(f"calibration.{key}", "comes from ratio_clip_min/ratio_clip_max; remove it")
        try:
            return CalibratedClipping(eps_low=self.ratio_clip_min, eps_high=self.ratio_clip_max, **spec)
        except TypeError as e:
            raise _bad("calibration", f"{e}; valid keys are CalibratedClipping's arguments") from None
        except ValueError as e:
            raise _bad("calibration", f"{e} (or set loss_fn.calibration: false)") from None

    def _metric_normalizations(self) -> dict[str, Any]:
        grad = (
            MetricNormalizer.TOKENS if self.loss_type == LossType.TOKEN_LEVEL else MetricNormalizer.SEQUENCES
        )
        tok, none = MetricNormalizer.TOKENS, MetricNormalizer.NONE
        out = {
            "loss": grad,
            "kl_penalty": grad,
            "probs_ratio": tok,
            "probs_ratio_clamped": tok,
            "token_mult_prob_error": tok,
            "gen_kl_error": tok,
            "policy_kl_error": tok,
            "js_divergence_error": tok,
            "approx_entropy": tok,
            "sampling_importance_ratio": MetricNormalizer.SEQUENCES
            if self.sequence_level_importance_ratios
            else tok,
            "num_valid_samples": none,
            "positive_nll_loss": none,
            "probs_ratio_min": none,
            "probs_ratio_max": none,
            "probs_ratio_clamped_min": none,
            "probs_ratio_clamped_max": none,
            "clip/lower": tok,
            "clip/upper": tok,
            "clip/low_clipped": tok,
            "clip/high_clipped": tok,
        }
        if self.truncated_importance_sampling_type is not None:
            out["is_oob_ratio"] = (
                MetricNormalizer.SEQUENCES
                if self.truncated_importance_sampling_type == "seq-mask-tis"
                else tok
            )
        return out

    @property
    def bounds(self) -> tuple[float, float]:
        """(L, H) used now: the controller's bounds in force, or (1 - ratio_clip_min, 1 + ratio_clip_max)."""
        if self.calibration is not None:
            return self.calibration.bounds
        return 1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max

    # ------------------------------------------------------------------ loss
    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float | None = None,
        global_valid_toks: torch.Tensor | float | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics of one microbatch (NeMo RL keyword call; see the module docstring).

        Args:
            next_token_logprobs: ``[B, S-1]`` log-probs of ``input_ids[:, 1:]`` under the current policy.
            data: NeMo RL microbatch: ``token_mask``, ``advantages``, ``prev_logprobs``,
                ``generation_logprobs`` (``[B, S]``), ``sample_mask`` ``[B]``; ``reference_policy_logprobs``
                when the KL coefficient is non-zero; optional ``curr_logprobs_unfiltered`` ``[B, S-1]``
                and ``rewards`` ``[B]``.
            global_valid_seqs, global_valid_toks: valid sequences / tokens of the whole global batch.

        Returns:
            ``(loss, metrics)``: 0-dim loss with the graph, ``dict[str, float]``.
        """
        lp = next_token_logprobs
        token_mask = data["token_mask"][:, 1:]
        sample_mask = data["sample_mask"]
        adv = data["advantages"][:, 1:]
        gen = data["generation_logprobs"][:, 1:]
        prev = lp.detach() if self.force_on_policy_ratio else data["prev_logprobs"][:, 1:]
        if lp.shape != adv.shape:
            raise ValueError(
                f"next_token_logprobs has shape {tuple(lp.shape)}; expected {tuple(adv.shape)} "
                f"(data tensors [B, S] without their first column)"
            )
        mask = token_mask * sample_mask.unsqueeze(-1)
        valid = mask != 0
        token_level = self.loss_type == LossType.TOKEN_LEVEL
        mode = "token-mean" if token_level else "seq-mean-token-mean"

        def tok_mean(x: torch.Tensor) -> torch.Tensor:
            return agg_loss(x, valid, "token-mean", global_tokens=global_valid_toks)

        def reduce(x: torch.Tensor) -> torch.Tensor:
            return agg_loss(x, valid, mode, global_tokens=global_valid_toks, global_seqs=global_valid_seqs)

        with torch.no_grad():
            mult_prob_error = tok_mean(torch.exp((gen - prev).abs() * mask))
            kind = self.reference_policy_kl_type
            gen_kl_error = tok_mean(kl_penalty(gen, prev, kind))  # KL(P_gen || P_train), d = gen - prev
            policy_kl_error = tok_mean(kl_penalty(prev, gen, kind))  # KL(P_train || P_gen)
            log_mix = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
            js = 0.5 * kl_penalty(log_mix, prev, "k3") + 0.5 * kl_penalty(log_mix, gen, "k3")
            js_divergence_error = tok_mean(js)

        kl = self._kl_term(lp, data, gen, reduce)
        lower, upper = self.bounds
        ratios, ratios_clamped, clip_loss = self._clip_loss(lp, prev, adv, token_mask, lower, upper)
        weights, is_metrics = self._importance_weights(
            prev, gen, mask, token_mask, sample_mask, global_valid_seqs, global_valid_toks
        )
        actor_loss = reduce((weights if self.use_importance_sampling_correction else 1.0) * clip_loss)

        with torch.no_grad():
            if self.sequence_level_importance_ratios:
                s = sample_mask.to(weights.dtype)
                sampling_ratio = agg_loss(
                    weights.squeeze(-1)[None], s[None] != 0, "token-mean", global_tokens=global_valid_seqs
                )
            else:
                sampling_ratio = tok_mean(weights)
            approx_entropy = -tok_mean(torch.exp(lp - gen) * lp)

        nll = torch.zeros((), dtype=lp.dtype, device=lp.device)
        if self.positive_example_nll_weight > 0 and "rewards" in data:
            correct = valid & (data["rewards"] > 0).unsqueeze(-1)
            n_correct = correct.sum()
            if n_correct > 0:
                nll = masked_sum(-lp, correct) / n_correct
        loss = actor_loss + kl + self.positive_example_nll_weight * nll

        with torch.no_grad():
            r, rc = ratios.detach(), ratios_clamped.detach()
            share = tok_mean(torch.ones_like(lp))  # this microbatch's share of the global valid tokens
            metrics: dict[str, float] = {
                "loss": loss.item(),
                "probs_ratio": tok_mean(r).item(),
                "probs_ratio_clamped": tok_mean(rc).item(),
                **self._extrema(r, rc, valid),
                "kl_penalty": kl.item() / self.reference_policy_kl_penalty if kl.item() != 0 else 0,
                "token_mult_prob_error": mult_prob_error.item(),
                "gen_kl_error": gen_kl_error.item(),
                "policy_kl_error": policy_kl_error.item(),
                "js_divergence_error": js_divergence_error.item(),
                "sampling_importance_ratio": sampling_ratio.item(),
                "num_valid_samples": sample_mask.sum().item(),
                "approx_entropy": approx_entropy.item(),
                **is_metrics,
                "positive_nll_loss": nll.item(),
                "clip/lower": (share * lower).item(),
                "clip/upper": (share * upper).item(),
            }
            if self.disable_ppo_ratio or self.force_on_policy_ratio:
                low = high = torch.zeros_like(valid)
            else:
                low, high = (adv < 0) & (r < lower), (adv > 0) & (r > upper)
            metrics["clip/low_clipped"] = tok_mean(low.to(lp.dtype)).item()
            metrics["clip/high_clipped"] = tok_mean(high.to(lp.dtype)).item()
        return loss, metrics

    def _kl_term(self, lp, data, gen, reduce) -> torch.Tensor:
        """beta * reduce(clamp_out(v * k_n(lp, ref))) with v = exp(lp - sg(lp)) (or exp(lp - gen)), v
        detached where the input clamp binds; a 0-dim zero when beta = 0."""
        beta = self.reference_policy_kl_penalty
        if beta == 0:
            return torch.zeros((), dtype=lp.dtype, device=lp.device)
        lp_u = data.get("curr_logprobs_unfiltered", lp)
        ref = data["reference_policy_logprobs"][:, 1:]
        v = torch.exp(lp_u - gen) if self.use_on_policy_kl_approximation else torch.exp(lp_u - lp_u.detach())
        v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        c_in = self.kl_input_clamp_value
        if c_in is not None:
            inside = (lp_u - ref).abs() <= c_in
            v = torch.where(inside, v, v.detach())
        k = kl_penalty(lp_u, ref, self.reference_policy_kl_type, input_clamp=c_in) * v
        if self.kl_output_clamp_value is not None:
            k = k.clamp(-self.kl_output_clamp_value, self.kl_output_clamp_value)
        return beta * reduce(k)

    def _clip_loss(self, lp, prev, adv, token_mask, lower, upper):
        """(ratios, clamped ratios, per-token loss) of the branch the config selects."""
        if self.force_on_policy_ratio:
            ratios = torch.exp(lp - lp.detach())
            ratios_clamped = ratios
            lo, hi = -torch.inf, torch.inf
        elif self.disable_ppo_ratio:
            ratios = ratios_clamped = lp
            lo, hi = -torch.inf, torch.inf
        else:
            log_ratios = lp - prev
            if self.sequence_level_importance_ratios:
                tm = token_mask != 0
                seq = masked_sum(log_ratios, tm, dim=-1) / (tm.sum(-1) + 1e-8)
                ratios = seq.exp().unsqueeze(-1).expand_as(log_ratios)
            else:
                ratios = log_ratios.exp()
            ratios_clamped = ratios.clamp(lower, upper)
            lo, hi = lower, upper
        if self.use_cispo:
            loss = -adv * ratios_clamped.detach() * lp
        else:
            loss = clipped_surrogate(ratios, adv, lo, hi, None)
        if self.ratio_clip_c is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -adv * self.ratio_clip_c), loss)
        return ratios, ratios_clamped, loss

    def _importance_weights(self, prev, gen, mask, token_mask, sample_mask, n_seq, n_tok):
        """NeMo RL's off-policy weights (module docstring; [B, S-1] or [B, 1]) and ``is_oob_ratio``."""
        valid = mask != 0
        if self.sequence_level_importance_ratios:
            w = torch.exp(masked_sum(prev - gen, valid, dim=-1)).detach().unsqueeze(-1)
        else:
            w = torch.exp(prev - gen)
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        t, hi, lo = (
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        if t is None:
            return w, {}
        with torch.no_grad():
            if t == "seq-mask-tis":
                tm = token_mask != 0
                d = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
                g = torch.exp(masked_sum(d, tm, dim=-1) / (tm.sum(-1) + 1e-8))
                kept = ((g >= lo) & (g <= hi)).to(w.dtype)
                oob = agg_loss(
                    (1.0 - kept)[None], (sample_mask != 0)[None], "token-mean", global_tokens=n_seq
                )
            else:
                lo_t = (0.0 if lo is None else lo) if t == "tis" else lo
                inside = (w >= lo_t) & (w <= hi)
                oob = agg_loss(
                    (~inside).to(w.dtype).expand_as(mask), valid, "token-mean", global_tokens=n_tok
                )
        if t == "tis":
            w = w.clamp(min=lo_t, max=hi)
        elif t == "icepop":
            w = torch.where(inside, w, torch.zeros_like(w))
        else:
            w = w * kept.unsqueeze(-1)
        return w, {"is_oob_ratio": oob.item()}

    @staticmethod
    def _extrema(r: torch.Tensor, rc: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        if not bool(valid.any()):
            return {
                "probs_ratio_min": float("inf"),
                "probs_ratio_max": float("-inf"),
                "probs_ratio_clamped_min": float("inf"),
                "probs_ratio_clamped_max": float("-inf"),
            }
        rv, rcv = r.expand_as(valid)[valid], rc.expand_as(valid)[valid]
        return {
            "probs_ratio_min": rv.min().item(),
            "probs_ratio_max": rv.max().item(),
            "probs_ratio_clamped_min": rcv.min().item(),
            "probs_ratio_clamped_max": rcv.max().item(),
        }

    # ------------------------------------------------------------------ calibration
    def observe_shadow(
        self,
        data: Mapping[str, torch.Tensor],
        *,
        logprobs: torch.Tensor,
        hp_logprobs: torch.Tensor,
        hp_prev_logprobs: torch.Tensor,
        step: int | None = None,
    ) -> None:
        """Feed one batch of a calibration step to the controller (then call ``calibration.update(step)``).

        r_t = exp(logprobs - prev_logprobs) (the FP8 trainer's ratios) and rho_t = exp(hp_logprobs -
        hp_prev_logprobs) (the BF16 shadow forwards of the same weights, FP8 off, on the same tokens) go to
        ``calibration.observe`` with the advantages and the valid-token mask. All log-prob tensors have
        NeMo RL's ``[B, S]`` layout of ``policy.get_logprobs(...)["logprobs"]`` (column 0 unused).
        ``hp_prev_logprobs`` comes from the weights that produced ``prev_logprobs``; ``logprobs`` and
        ``hp_logprobs`` from the weights a minibatch is trained with (docs/integrations.md says where to
        take them in NeMo RL).
        """
        if self.calibration is None:
            raise ValueError("this loss has no calibration controller (loss_fn.calibration is false)")
        prev = data["prev_logprobs"]
        for name, x in (
            ("logprobs", logprobs),
            ("hp_logprobs", hp_logprobs),
            ("hp_prev_logprobs", hp_prev_logprobs),
        ):
            if x.shape != prev.shape:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}; expected prev_logprobs' {tuple(prev.shape)}"
                )
        mask = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)) != 0
        r = torch.exp((logprobs[:, 1:] - prev[:, 1:]).detach())
        rho = torch.exp((hp_logprobs[:, 1:] - hp_prev_logprobs[:, 1:]).detach())
        self.calibration.observe(r, rho, data["advantages"][:, 1:], mask, step=step)


class Fp8ShadowWorkerMixin:
    """Mix into NeMo RL's ``MegatronPolicyWorker``: ``set_fp8_shadow(True)`` turns FP8 off for what follows.

    The BF16 shadow forward of Calibrated Clipping is the worker's own ``get_logprobs`` on the same weights
    with FP8 off: :func:`nemo_fp8rl.fp8.megatron.fp8_disabled` sets ``config.fp8 = None`` on each model
    chunk's ``TransformerConfig`` (megatron-core then enters no Transformer Engine FP8 autocast, so the TE
    layers run in BF16) and turns our emulated FP8 linears off. Use it through :func:`shadow_logprobs`::

        class ShadowMegatronPolicyWorker(Fp8ShadowWorkerMixin, MegatronPolicyWorker): ...
        Policy(..., worker_extension_cls_fqn="my_module.ShadowMegatronPolicyWorker")

    ``self.model`` is the worker's model (one module or a list of virtual-pipeline chunks).
    """

    def set_fp8_shadow(self, enabled: bool) -> None:
        """Enter (True) or leave (False) the FP8-off state; idempotent."""
        stack = getattr(self, "_fp8_shadow_stack", None)
        if enabled and stack is None:
            from nemo_fp8rl.fp8.megatron import fp8_disabled  # megatron-core: there in NeMo RL's workers

            stack = contextlib.ExitStack()
            models = self.model if isinstance(self.model, (list, tuple)) else [self.model]
            for model in models:
                stack.enter_context(fp8_disabled(model))
            self._fp8_shadow_stack = stack
        elif not enabled and stack is not None:
            self._fp8_shadow_stack = None
            stack.close()


def shadow_logprobs(policy: Any, data: Any) -> torch.Tensor:
    """``policy.get_logprobs(data)["logprobs"]`` with FP8 off on every worker (:class:`Fp8ShadowWorkerMixin`).

    ``policy`` is NeMo RL's ``Policy`` built with a worker class that has the mixin; returns ``[B, S]`` like
    ``prev_logprobs``. FP8 is switched back on even if the forward raises.
    """
    policy.run_all_workers_single_data("set_fp8_shadow", True)
    try:
        return policy.get_logprobs(data)["logprobs"]
    finally:
        policy.run_all_workers_single_data("set_fp8_shadow", False)


__all__ = [
    "CONFIG_DEFAULTS",
    "NEMO_RL_COMMIT",
    "ClippedPGLossFn",
    "Fp8ShadowWorkerMixin",
    "LossInputType",
    "LossType",
    "MetricNormalizer",
    "shadow_logprobs",
]
