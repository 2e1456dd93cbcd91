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
:func:`clipped_pg_loss` computes them as detached 0-dim tensors (``algorithms.metrics`` convention,
reduction ``"sum"``, ``"min"``/``"max"`` for the extrema) without a host sync; ``ClippedPGLossFn.__call__``
turns them into floats with one ``metrics_to_floats`` after the loss is built, because NeMo RL's workers
add Python numbers.

Known difference, kept on purpose: in GSPO mode NeMo RL's ``sampling_importance_ratio`` broadcasts the
``[B, 1]`` weights against the ``[B]`` sample mask (it reports sum_i w_i times the number of valid samples
over N_seq); ours reports sum_i s_i w_i / N_seq, the mean weight it names.

What comes from ``algorithms/``: the clipped surrogate and dual clip (``losses.clipped_surrogate``), the
aggregation with global counts (``losses.agg_loss``), the k1/k2/k3 estimators (``losses.kl_penalty``),
masked reductions (``_common``), the bounds (``calibration.CalibratedClipping``). What is NeMo RL's own
and stays here: the ratio without a log-ratio clamp (GSPO with NeMo RL's ``+ 1e-8``), CISPO, the KL weight
v_t, and the importance weights. ``rollout_correction`` is not NeMo RL's weight: it clamps the log-ratio to
+-20 (NeMo RL keeps w < e^-20 and, untruncated, w > e^20), turns gen = -inf into e^20 and NaN into NaN
(NeMo RL: weight 0), has no lower clamp for ``tis`` and no ``seq-mask-tis`` or per-sequence (GSPO) weight;
tests/integrations/test_nemo_rl.py checks that the two agree where those do not apply.

Files: this module is the loss; ``nemo_rl_config`` parses and validates ``loss_fn`` and builds the
controller; ``nemo_rl_interfaces`` holds NeMo RL's enums; ``nemo_rl_worker`` the FP8-off shadow forward in
NeMo RL's Megatron workers. Every public name is importable from here. Pure torch: NeMo RL is imported only
to reuse its enums when it is installed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

import torch

from nemo_fp8rl.algorithms._common import masked_max, masked_min, masked_sum
from nemo_fp8rl.algorithms.calibration import CalibratedClipping
from nemo_fp8rl.algorithms.losses import agg_loss, clipped_surrogate, kl_penalty
from nemo_fp8rl.algorithms.metrics import Metric, make_metric, metrics_to_floats
from nemo_fp8rl.integrations.nemo_rl_config import (
    CONFIG_DEFAULTS,
    LossConfig,
    make_calibration,
    parse_loss_config,
)
from nemo_fp8rl.integrations.nemo_rl_interfaces import LossInputType, LossType, MetricNormalizer
from nemo_fp8rl.integrations.nemo_rl_worker import Fp8ShadowWorkerMixin, shadow_logprobs

NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
"""NVIDIA-NeMo/RL main commit (2026-08-22) whose ``ClippedPGLossFn`` this module matches."""

Reduce = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------------
# The loss (tensors in, tensors out: no host sync)
# ---------------------------------------------------------------------------------------------------


def clipped_pg_loss(
    config: LossConfig,
    next_token_logprobs: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | float | None = None,
    global_valid_toks: torch.Tensor | float | None = None,
    *,
    lower: float,
    upper: float,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """NeMo RL's ``ClippedPGLossFn`` of one microbatch with bounds (L, H) = (``lower``, ``upper``).

    The formulas are in the module docstring. Args and data keys as :meth:`ClippedPGLossFn.__call__`;
    ``config`` is the parsed ``loss_fn`` section (:func:`~nemo_fp8rl.integrations.nemo_rl_config.
    parse_loss_config`).

    Returns:
        ``(loss, metrics)``: 0-dim loss with the graph; the module docstring's metrics as detached 0-dim
        tensors with a reduction (``dict[str, Metric]``), never synced to the host here.
    """
    c = config
    lp = next_token_logprobs
    token_mask = data["token_mask"][:, 1:]
    sample_mask = data["sample_mask"]
    adv = data["advantages"][:, 1:]
    gen = data["generation_logprobs"][:, 1:]
    prev = lp.detach() if c.force_on_policy_ratio else data["prev_logprobs"][:, 1:]
    if lp.shape != adv.shape:
        raise ValueError(
            f"next_token_logprobs has shape {tuple(lp.shape)}; expected {tuple(adv.shape)} "
            f"(data tensors [B, S] without their first column)"
        )
    mask = token_mask * sample_mask.unsqueeze(-1)
    valid = mask != 0
    mode = "token-mean" if c.loss_type == LossType.TOKEN_LEVEL else "seq-mean-token-mean"

    def tok_mean(x: torch.Tensor) -> torch.Tensor:
        return agg_loss(x, valid, "token-mean", global_tokens=global_valid_toks)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return agg_loss(x, valid, mode, global_tokens=global_valid_toks, global_seqs=global_valid_seqs)

    # Graph order as NeMo RL's (KL, then the actor loss): autograd sums lp's gradient contributions in
    # that order, so another order moves the gradient in its last bits.
    kl = _kl_term(c, lp, data, gen, reduce)
    ratios, ratios_clamped, lo, hi = _ratios(c, lp, prev, token_mask, lower, upper)
    if c.use_cispo:  # CISPO (MiniMax-M1, arXiv 2506.13585): the clipped ratio is a detached weight
        per_token = -adv * ratios_clamped.detach() * lp
    else:
        per_token = clipped_surrogate(ratios, adv, lo, hi, c.ratio_clip_c)
    weights, oob = _importance_weights(
        c, prev, gen, valid, token_mask, sample_mask, global_valid_seqs, global_valid_toks
    )
    actor_loss = reduce((weights if c.use_importance_sampling_correction else 1.0) * per_token)
    nll = _positive_nll(c, lp, data, valid)
    loss = actor_loss + kl + c.positive_example_nll_weight * nll

    with torch.no_grad():
        r, rc = ratios.detach(), ratios_clamped.detach()
        kind = c.reference_policy_kl_type
        log_mix = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
        js = 0.5 * kl_penalty(log_mix, prev, "k3") + 0.5 * kl_penalty(log_mix, gen, "k3")
        if c.sequence_level_importance_ratios:
            s = sample_mask.to(weights.dtype)
            sampling_ratio = agg_loss(
                weights.squeeze(-1)[None], s[None] != 0, "token-mean", global_tokens=global_valid_seqs
            )
        else:
            sampling_ratio = tok_mean(weights)
        if c.disable_ppo_ratio or c.force_on_policy_ratio:
            low = high = torch.zeros_like(valid)
        else:
            low, high = (adv < 0) & (r < lower), (adv > 0) & (r > upper)
        share = tok_mean(torch.ones_like(lp))  # this microbatch's share of the global valid tokens
        # kl / beta in float64, as NeMo RL's Python division of kl.item(); 0 when kl is 0 (beta = 0)
        kl_metric = torch.where(kl != 0, kl.double() / c.reference_policy_kl_penalty, 0.0)
        metrics: dict[str, Metric] = {
            "loss": make_metric(loss, "sum"),
            "probs_ratio": make_metric(tok_mean(r), "sum"),
            "probs_ratio_clamped": make_metric(tok_mean(rc), "sum"),
            "probs_ratio_min": (masked_min(r, valid, empty=math.inf), "min"),
            "probs_ratio_max": (masked_max(r, valid, empty=-math.inf), "max"),
            "probs_ratio_clamped_min": (masked_min(rc, valid, empty=math.inf), "min"),
            "probs_ratio_clamped_max": (masked_max(rc, valid, empty=-math.inf), "max"),
            "kl_penalty": make_metric(kl_metric, "sum"),
            "token_mult_prob_error": make_metric(tok_mean(torch.exp((gen - prev).abs() * mask)), "sum"),
            # KL(P_gen || P_train) with d = gen - prev, then KL(P_train || P_gen)
            "gen_kl_error": make_metric(tok_mean(kl_penalty(gen, prev, kind)), "sum"),
            "policy_kl_error": make_metric(tok_mean(kl_penalty(prev, gen, kind)), "sum"),
            "js_divergence_error": make_metric(tok_mean(js), "sum"),
            "sampling_importance_ratio": make_metric(sampling_ratio, "sum"),
            "num_valid_samples": make_metric(sample_mask.sum(), "sum"),
            "approx_entropy": make_metric(-tok_mean(torch.exp(lp - gen) * lp), "sum"),
            **({} if oob is None else {"is_oob_ratio": make_metric(oob, "sum")}),
            "positive_nll_loss": make_metric(nll, "sum"),
            "clip/lower": make_metric(share * lower, "sum"),
            "clip/upper": make_metric(share * upper, "sum"),
            "clip/low_clipped": make_metric(tok_mean(low.to(lp.dtype)), "sum"),
            "clip/high_clipped": make_metric(tok_mean(high.to(lp.dtype)), "sum"),
        }
    return loss, metrics


def _ratios(
    c: LossConfig, lp: torch.Tensor, prev: torch.Tensor, token_mask: torch.Tensor, lower: float, upper: float
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(r, clip(r, L, H), and the (lo, hi) the surrogate clips with) of the branch the config selects."""
    if c.force_on_policy_ratio:
        ratios = torch.exp(lp - lp.detach())
        return ratios, ratios, -math.inf, math.inf
    if c.disable_ppo_ratio:
        return lp, lp, -math.inf, math.inf
    log_ratios = lp - prev
    if c.sequence_level_importance_ratios:
        tm = token_mask != 0
        seq = masked_sum(log_ratios, tm, dim=-1) / (tm.sum(-1) + 1e-8)
        ratios = seq.exp().unsqueeze(-1).expand_as(log_ratios)
    else:
        ratios = log_ratios.exp()
    return ratios, ratios.clamp(lower, upper), lower, upper


def _importance_weights(
    c: LossConfig,
    prev: torch.Tensor,
    gen: torch.Tensor,
    valid: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    n_seq: torch.Tensor | float | None,
    n_tok: torch.Tensor | float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """NeMo RL's off-policy weights (``[B, S-1]``, GSPO ``[B, 1]``) and ``is_oob_ratio`` (None untruncated).

    Not :func:`~nemo_fp8rl.algorithms.rollout_correction.rollout_correction`: the module docstring says why.
    """
    if c.sequence_level_importance_ratios:
        w = torch.exp(masked_sum(prev - gen, valid, dim=-1)).detach().unsqueeze(-1)
    else:
        w = torch.exp(prev - gen)
    w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
    t = c.truncated_importance_sampling_type
    hi, lo = c.truncated_importance_sampling_ratio, c.truncated_importance_sampling_ratio_min
    if t is None:
        return w, None
    with torch.no_grad():
        if t == "seq-mask-tis":
            tm = token_mask != 0
            d = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
            g = torch.exp(masked_sum(d, tm, dim=-1) / (tm.sum(-1) + 1e-8))
            kept = ((g >= lo) & (g <= hi)).to(w.dtype)
            oob = agg_loss((1.0 - kept)[None], (sample_mask != 0)[None], "token-mean", global_tokens=n_seq)
        else:
            lo_t = (0.0 if lo is None else lo) if t == "tis" else lo
            inside = (w >= lo_t) & (w <= hi)
            oob = agg_loss((~inside).to(w.dtype).expand_as(valid), valid, "token-mean", global_tokens=n_tok)
    if t == "tis":
        w = w.clamp(min=lo_t, max=hi)
    elif t == "icepop":
        w = torch.where(inside, w, torch.zeros_like(w))
    else:
        w = w * kept.unsqueeze(-1)
    return w, oob


def _kl_term(
    c: LossConfig, lp: torch.Tensor, data: Mapping[str, torch.Tensor], gen: torch.Tensor, reduce: Reduce
) -> torch.Tensor:
    """beta * reduce(clamp_out(v * k_n(lp, ref))) with v = exp(lp - sg(lp)) (or exp(lp - gen)), v
    detached where the input clamp binds; a 0-dim zero when beta = 0."""
    beta = c.reference_policy_kl_penalty
    if beta == 0:
        return torch.zeros((), dtype=lp.dtype, device=lp.device)
    lp_u = data.get("curr_logprobs_unfiltered", lp)
    ref = data["reference_policy_logprobs"][:, 1:]
    v = torch.exp(lp_u - gen) if c.use_on_policy_kl_approximation else torch.exp(lp_u - lp_u.detach())
    v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    c_in = c.kl_input_clamp_value
    if c_in is not None:
        inside = (lp_u - ref).abs() <= c_in
        v = torch.where(inside, v, v.detach())
    k = kl_penalty(lp_u, ref, c.reference_policy_kl_type, input_clamp=c_in) * v
    if c.kl_output_clamp_value is not None:
        k = k.clamp(-c.kl_output_clamp_value, c.kl_output_clamp_value)
    return beta * reduce(k)


def _positive_nll(
    c: LossConfig, lp: torch.Tensor, data: Mapping[str, torch.Tensor], valid: torch.Tensor
) -> torch.Tensor:
    """VAPO: mean(-lp) over the valid tokens of samples with reward > 0; 0 without any (or when off)."""
    if c.positive_example_nll_weight > 0 and "rewards" in data:
        correct = valid & (data["rewards"] > 0).unsqueeze(-1)
        return masked_sum(-lp, correct) / correct.sum().clamp(min=1)  # 0 / 1 when none: no host sync
    return torch.zeros((), dtype=lp.dtype, device=lp.device)


def metric_normalizations(c: LossConfig) -> dict[str, Any]:
    """NeMo RL's ``metric_normalizations``: the global count each metric of :func:`clipped_pg_loss` is
    normalised by (NeMo RL's split-API trainers use it to undo the normalisation)."""
    grad = MetricNormalizer.TOKENS if c.loss_type == LossType.TOKEN_LEVEL else MetricNormalizer.SEQUENCES
    tok, seq, none = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE
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
        "sampling_importance_ratio": seq if c.sequence_level_importance_ratios else tok,
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
    if c.truncated_importance_sampling_type is not None:
        out["is_oob_ratio"] = seq if c.truncated_importance_sampling_type == "seq-mask-tis" else tok
    return out


# ---------------------------------------------------------------------------------------------------
# NeMo RL's class
# ---------------------------------------------------------------------------------------------------


class ClippedPGLossFn:
    """NeMo RL ``ClippedPGLossFn`` (PPO / GRPO / DAPO / REINFORCE / GSPO / CISPO) with calibrated bounds.

    Args:
        cfg: NeMo RL's ``loss_fn`` section: a mapping or its typed ``ClippedPGLossConfig``. Keys and
            defaults are :data:`CONFIG_DEFAULTS`; unknown keys raise (typos would otherwise be silent).
            One key of ours, ``calibration``: a mapping of :class:`CalibratedClipping` arguments other than
            ``eps_low``/``eps_high`` (taken from ``ratio_clip_min``/``ratio_clip_max``), or ``false`` to
            turn Calibrated Clipping off. Absent: a controller with the defaults of docs/design.md, "Calibrated Clipping"
            (bounds nominal until the first ``calibration.update``). GSPO, REINFORCE and
            ``force_on_policy_ratio`` do not clip token ratios, so they get no controller.
        use_fused_linear_logprobs: as NeMo RL's (read by its ``prepare_loss_input``).
        calibration: a ready controller instead of ``cfg["calibration"]`` (its eps must match).

    The formula, data keys and metrics are in the module docstring. Config errors raise ValueError naming
    the ``loss_fn.<key>`` and the fix, at construction (NeMo RL asserts, some only at the first call).
    ``self.config`` is the parsed section; NeMo RL's attributes (``ratio_clip_min``, ``loss_type``,
    ``reference_policy_kl_penalty``, ...) read it and are read-only: build a new loss to change one.
    """

    input_type = LossInputType.LOGPROB

    def __init__(
        self,
        cfg: Any,
        use_fused_linear_logprobs: bool = False,
        *,
        calibration: CalibratedClipping | None = None,
    ) -> None:
        self.config, spec = parse_loss_config(cfg)
        self.use_fused_linear_logprobs = bool(use_fused_linear_logprobs)
        self.calibration = make_calibration(self.config, spec, calibration)
        self.metric_normalizations = metric_normalizations(self.config)

    @property
    def bounds(self) -> tuple[float, float]:
        """(L, H) used now: the controller's bounds in force, or (1 - ratio_clip_min, 1 + ratio_clip_max)."""
        if self.calibration is not None:
            return self.calibration.bounds
        return 1.0 - self.config.ratio_clip_min, 1.0 + self.config.ratio_clip_max

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
        lower, upper = self.bounds
        loss, metrics = clipped_pg_loss(
            self.config,
            next_token_logprobs,
            data,
            global_valid_seqs,
            global_valid_toks,
            lower=lower,
            upper=upper,
        )
        return loss, metrics_to_floats(metrics)  # one host sync, after the loss: NeMo RL adds floats

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


def _config_attribute(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (NeMo RL's attribute).")


for _field in fields(LossConfig):  # NeMo RL's attribute names, read from the one parsed config
    setattr(ClippedPGLossFn, _field.name, _config_attribute(_field.name))
del _field


__all__ = [
    "CONFIG_DEFAULTS",
    "NEMO_RL_COMMIT",
    "ClippedPGLossFn",
    "Fp8ShadowWorkerMixin",
    "LossInputType",
    "LossType",
    "MetricNormalizer",
    "clipped_pg_loss",
    "shadow_logprobs",
]
