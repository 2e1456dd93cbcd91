"""Policy-gradient losses (registry, one signature), loss aggregation, KL penalty, entropy.

Notation (docs/design.md, "RL math"), per response token t of shape ``[batch, seq]``:
``logp`` = log pi_theta(y_t) from the trainer now, ``old_logp`` = the same at the start of the step,
advantage A_t, mask m_t, ratio r_t = exp(logp_t - old_logp_t).

Every policy loss is a small function registered by name (verl's registry idea) with one signature::

    loss_fn(logp, old_logp, advantages, mask, *, lower, upper, dual_clip=None, weights=None,
            agg_mode="token-mean", global_tokens=None, global_seqs=None, norm_len=None)
        -> (loss: 0-dim tensor, metrics: dict[str, Metric])

``lower``/``upper`` are the clip bounds in force: (1 - eps_low, 1 + eps_high) by default, or the
calibrated ones from :class:`~nemo_fp8rl.algorithms.calibration.CalibratedClipping`. ``weights`` is a
per-token weight, detached here (rollout correction, see ``rollout_correction.py``). The loss is built
in two phases (TRL's structure): a per-token loss matrix, then :func:`agg_loss`.

Metrics (0-dim tensors with a reduction hint, never ``.item()`` here):
``clip/low_frac`` fraction of negative-advantage tokens with r < lower (N below L, the quantity that
Calibrated Clipping matches), ``clip/high_frac`` fraction of positive-advantage tokens with r > upper,
``clip/dual_frac`` fraction of negative-advantage tokens where the dual clip binds (r > c),
``clip/lower``/``clip/upper`` the bounds in force, ``policy/ratio_{mean,min,max}``,
``policy/approx_kl`` = mean of (r - 1) - log r (Schulman's k3 estimator of KL(old || new)).
Note: TRL's ``clip_ratio/low_mean`` divides by all tokens; ours divides by |N| (resp. |P|) so it is
directly comparable with ``calib/alpha_bf16``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nemo_fp8rl.algorithms._common import (
    as_bool_mask,
    check_2d,
    check_number,
    check_same_shape,
    expand_advantages,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    upcast,
)
from nemo_fp8rl.algorithms.metrics import Metric
from nemo_fp8rl.registry import Registry

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0
"""|logp - old_logp| is clamped to this before exp() so a single bad token cannot produce inf."""


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        lower: float | torch.Tensor,
        upper: float | torch.Tensor,
        dual_clip: float | None = None,
        weights: torch.Tensor | None = None,
        agg_mode: str = "token-mean",
        global_tokens: float | torch.Tensor | None = None,
        global_seqs: float | torch.Tensor | None = None,
        norm_len: int | None = None,
    ) -> tuple[torch.Tensor, dict[str, Metric]]: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "algorithm.policy_loss", plural="policy losses")


# the public functions of this registry: register (a decorator: ``@register_policy_loss("name")``), look up, list
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get
list_policy_losses = POLICY_LOSSES.names


# ---------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------


def _denominator(value: float | torch.Tensor | None, local: torch.Tensor, name: str) -> torch.Tensor:
    if value is None:
        return local.clamp(min=1)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a scalar (0-dim tensor or number), got shape {tuple(value.shape)}"
            )
        return value.reshape(()).to(local.device).clamp(min=1)
    v = check_number(
        name, value, low=0.0, hint=f"pass the number of valid {name.split('_')[1]} in the minibatch"
    )
    return torch.tensor(max(v, 1.0), device=local.device)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor | None,
    mode: str = "token-mean",
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix ``[batch, seq]`` into a scalar.

    With m the mask, l the loss, |s| = sum_t m_{s,t} the valid tokens of sequence s, N_tok the number of
    valid tokens and N_seq the number of sequences with at least one valid token:

    - ``token-mean`` (DAPO, arXiv 2503.14476): sum_{s,t} m l / N_tok
    - ``seq-mean-token-mean`` (GRPO, arXiv 2402.03300): sum_s (sum_t m l / |s|) / N_seq
    - ``seq-mean-token-sum``: sum_s (sum_t m l) / N_seq
    - ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv 2503.20783): sum_s (sum_t m l / T) / N_seq with the
      constant T = ``norm_len`` (default ``loss_mat.shape[-1]``; pass the maximum response length so it
      does not change with padding).

    Global normalisation: ``global_tokens`` / ``global_seqs`` replace N_tok / N_seq by the counts of the
    whole minibatch (all microbatches and data-parallel ranks). Each chunk then returns its share, and
    the SUM of the chunk losses equals the loss of the unsplit minibatch, whatever the split (1x8 ==
    2x4 == 8x1). A framework that averages over microbatches or DP ranks (Megatron divides by the number
    of microbatches, DDP averages gradients) must multiply by that count to undo the average. Without
    them the local counts are used (correct only for an unsplit minibatch). Denominators are clamped to
    >= 1, so a chunk without valid tokens gives 0.

    Args:
        loss_mat: ``[batch, seq]`` per-token loss.
        mask: ``[batch, seq]`` bool or 0/1, or None (all valid).
        mode: one of :data:`AGG_MODES`.
        global_tokens: valid tokens in the minibatch (number or 0-dim tensor), for ``token-mean``.
        global_seqs: valid sequences in the minibatch, for the ``seq-mean-*`` modes.
        norm_len: constant T of ``seq-mean-token-sum-norm``.

    Returns:
        0-dim tensor.
    """
    check_2d("loss_mat", loss_mat)
    m = as_bool_mask(mask, loss_mat)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {mode!r}; valid modes: {list(AGG_MODES)}")
    if mode == "token-mean":
        return masked_sum(loss_mat, m) / _denominator(global_tokens, m.sum(), "global_tokens")
    tokens_per_seq = m.sum(-1)
    n_seq = _denominator(global_seqs, (tokens_per_seq > 0).sum(), "global_seqs")
    seq_sum = masked_sum(loss_mat, m, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / tokens_per_seq.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        t = (
            loss_mat.shape[-1]
            if norm_len is None
            else int(
                check_number(
                    "norm_len", norm_len, low=0, low_open=True, hint="use the maximum response length"
                )
            )
        )
        per_seq = seq_sum / t
    return per_seq.sum() / n_seq


# ---------------------------------------------------------------------------------------------------
# KL and entropy
# ---------------------------------------------------------------------------------------------------


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str = "k3",
    *,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimator of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

    With d_t = logp_t - ref_logp_t (clamped to [-input_clamp, input_clamp] when given), following
    Schulman, "Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html):

    - ``k1`` = d (unbiased, can be negative)
    - ``k2`` = d^2 / 2 (biased, low variance)
    - ``k3`` = exp(-d) - 1 + d (unbiased, always >= 0; GRPO's choice, arXiv 2402.03300 eq. 4)

    The result is clamped to [-output_clamp, output_clamp] when given (NeMo RL's
    ``kl_input_clamp_value``/``kl_output_clamp_value``). Shapes: any, ``logp`` and ``ref_logp`` equal;
    returns the same shape (aggregate with :func:`agg_loss`, times the coefficient beta).
    """
    check_same_shape("logp", logp, ref_logp=ref_logp)
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {list(KL_KINDS)}")
    d = upcast(logp) - upcast(ref_logp)
    if input_clamp is not None:
        c = check_number("input_clamp", input_clamp, low=0.0, low_open=True)
        d = d.clamp(-c, c)
    if kind == "k1":
        kl = d
    elif kind == "k2":
        kl = 0.5 * d.square()
    else:
        kl = torch.expm1(-d) + d
    if output_clamp is not None:
        c = check_number("output_clamp", output_clamp, low=0.0, low_open=True)
        kl = kl.clamp(-c, c)
    return kl


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension, in float32 (float64 for float64 logits).

    H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v with p = softmax(z). Tokens with z = -inf
    (masked vocabulary) contribute 0. Shape: ``[..., vocab]`` -> ``[...]``. This needs the full
    vocabulary; for vocab-parallel logits the models/ package reduces across tensor-parallel ranks.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError("logits must be a tensor of shape [..., vocab]")
    z = upcast(logits)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros((), device=z.device))
    return -plogp.sum(-1)


# ---------------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------------


def _check_bounds(lower: object, upper: object, dual_clip: object) -> None:
    if isinstance(lower, torch.Tensor) or isinstance(upper, torch.Tensor):
        for name, b in (("lower", lower), ("upper", upper)):
            if isinstance(b, torch.Tensor) and b.numel() != 1:
                raise ValueError(f"{name} must be a number or a 0-dim tensor, got shape {tuple(b.shape)}")
    else:
        lo = check_number("lower", lower, low=0.0, high=1.0, hint="lower is 1 - eps_low (e.g. 0.8)")
        hi = check_number("upper", upper, low=1.0, hint="upper is 1 + eps_high (e.g. 1.28)")
        if lo >= hi:
            raise ValueError(f"lower ({lo}) must be < upper ({hi})")
    if dual_clip is not None:
        check_number(
            "dual_clip", dual_clip, low=1.0, low_open=True, hint="dual clip c must be > 1 (usually 3) or None"
        )


def _prepare(logp, old_logp, advantages, mask, weights):
    check_2d("logp", logp)
    check_same_shape("logp", logp, old_logp=old_logp, weights=weights)
    m = as_bool_mask(mask, logp)
    adv = upcast(expand_advantages(advantages, logp))
    return m, adv


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Per-token clipped surrogate loss (PPO, arXiv 1707.06347; decoupled bounds, DAPO arXiv 2503.14476).

    l_t = max(-A_t r_t, -A_t clip(r_t, L, H)); with dual clip c > 1 (Ye et al., arXiv 1912.09729),
    l_t = min(l_t, -c A_t) for A_t < 0. The gradient is zero exactly when (A_t > 0 and r_t > H) or
    (A_t < 0 and r_t < L) (or A_t < 0 and r_t > c with dual clip). Shapes: ``[batch, seq]`` in and out.
    """
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, lower, upper)
    loss = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss


def _policy_metrics(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    m: torch.Tensor,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor,
    dual_clip: float | None,
    clipped: bool,
) -> dict[str, Metric]:
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        ratio = log_ratio.exp()
        neg = m & (adv < 0)
        pos = m & (adv > 0)
        n_neg = neg.sum().clamp(min=1)
        n_pos = pos.sum().clamp(min=1)
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        if clipped:
            low_frac = (neg & (ratio < lower)).sum() / n_neg
            high_frac = (pos & (ratio > upper)).sum() / n_pos
            dual_frac = (neg & (ratio > dual_clip)).sum() / n_neg if dual_clip is not None else zero
        else:
            low_frac = high_frac = dual_frac = zero

        def as_t(b):
            return torch.as_tensor(b, dtype=torch.float32, device=ratio.device).detach().reshape(())

        return {
            "clip/low_frac": (low_frac.to(ratio.dtype), "mean"),
            "clip/high_frac": (high_frac.to(ratio.dtype), "mean"),
            "clip/dual_frac": (dual_frac.to(ratio.dtype), "mean"),
            "clip/lower": (as_t(lower), "mean"),
            "clip/upper": (as_t(upper), "mean"),
            "policy/ratio_mean": (masked_mean(ratio, m), "mean"),
            "policy/ratio_min": (masked_min(ratio, m, empty=1.0), "min"),
            "policy/ratio_max": (masked_max(ratio, m, empty=1.0), "max"),
            "policy/approx_kl": (masked_mean(torch.expm1(log_ratio) - log_ratio, m), "mean"),
        }


def _finish(loss_mat, m, weights, agg_mode, global_tokens, global_seqs, norm_len):
    if weights is not None:
        loss_mat = loss_mat * weights.detach().to(loss_mat.dtype)
    return agg_loss(
        loss_mat, m, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len
    )


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Clipped surrogate with decoupled bounds and optional dual clip (PPO / GRPO / DAPO).

    r_t = exp(clamp(logp_t - old_logp_t, -20, 20)); l_t = w_t * max(-A_t r_t, -A_t clip(r_t, L, H)),
    dual clip: l_t = w_t * min(., -c A_t) for A_t < 0; loss = agg_loss(l, m, agg_mode).
    PPO (arXiv 1707.06347), GRPO (arXiv 2402.03300: L, H = 0.8, 1.2, seq-mean-token-mean), DAPO
    clip-higher (arXiv 2503.14476: 0.8, 1.28, token-mean), dual clip (arXiv 1912.09729).

    Args:
        logp, old_logp: ``[batch, seq]`` log-probs of the sampled tokens (``logp`` carries the graph).
        advantages: ``[batch, seq]`` or per-sequence ``[batch]``.
        mask: ``[batch, seq]`` bool or 0/1 (None = all valid).
        lower, upper: clip bounds L < H in force (numbers, or 0-dim tensors which are not validated).
        dual_clip: c > 1 or None.
        weights: ``[batch, seq]`` per-token weight, detached here (rollout correction).
        agg_mode, global_tokens, global_seqs, norm_len: see :func:`agg_loss`.

    Returns:
        ``(loss, metrics)``: 0-dim loss, and the metrics listed in the module docstring.
    """
    _check_bounds(lower, upper, dual_clip)
    m, adv = _prepare(logp, old_logp, advantages, mask, weights)
    log_ratio = (upcast(logp) - upcast(old_logp).detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss_mat = clipped_surrogate(log_ratio.exp(), adv, lower, upper, dual_clip)
    loss = _finish(loss_mat, m, weights, agg_mode, global_tokens, global_seqs, norm_len)
    return loss, _policy_metrics(log_ratio, adv, m, lower, upper, dual_clip, clipped=True)


@register_policy_loss("reinforce")
def reinforce_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """REINFORCE / RLOO policy gradient without a ratio (Williams 1992; RLOO, arXiv 2402.14740).

    l_t = -w_t A_t logp_t, so grad = -w_t A_t grad(logp_t); loss = agg_loss(l, m, agg_mode).
    ``lower``/``upper``/``dual_clip`` are validated but not used (nothing is clipped, so the clip
    fractions are 0); ``old_logp`` only feeds the ratio metrics. Shapes and returns as
    :func:`ppo_clip_loss`. NeMo RL's ``disable_ppo_ratio=True`` is this loss.
    """
    _check_bounds(lower, upper, dual_clip)
    m, adv = _prepare(logp, old_logp, advantages, mask, weights)
    loss_mat = -adv * upcast(logp)
    loss = _finish(loss_mat, m, weights, agg_mode, global_tokens, global_seqs, norm_len)
    log_ratio = (upcast(logp.detach()) - upcast(old_logp)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return loss, _policy_metrics(log_ratio, adv, m, lower, upper, dual_clip, clipped=False)


@register_policy_loss("gspo")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """GSPO: clipped surrogate on the length-normalised sequence ratio (Zheng et al., arXiv 2507.18071).

    log s_i = (1/|y_i|) sum_t m_{i,t} (logp_{i,t} - old_logp_{i,t}) (sequence-level, length normalised).
    Token form ("GSPO-token", same paper): log s_{i,t} = sg[log s_i] + logp_{i,t} - sg[logp_{i,t}], whose
    value is s_i and whose gradient is s_i grad(logp_{i,t}). Then l_{i,t} = clipped surrogate of
    s_{i,t} with bounds L, H (the paper uses eps of order 3e-4 / 4e-4) and per-token advantages.
    With per-sequence advantages and ``agg_mode="seq-mean-token-mean"`` this is exactly GSPO's
    sequence objective; other modes weight sequences differently. Shapes and returns as
    :func:`ppo_clip_loss`; the clip metrics count tokens of clipped sequences.
    """
    _check_bounds(lower, upper, dual_clip)
    m, adv = _prepare(logp, old_logp, advantages, mask, weights)
    lp = upcast(logp)
    tok_log_ratio = lp - upcast(old_logp).detach()
    seq_log_ratio = masked_sum(tok_log_ratio.detach(), m, dim=-1) / m.sum(-1).clamp(min=1)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = seq_log_ratio.unsqueeze(-1) + lp - lp.detach()
    loss_mat = clipped_surrogate(log_ratio.exp(), adv, lower, upper, dual_clip)
    loss = _finish(loss_mat, m, weights, agg_mode, global_tokens, global_seqs, norm_len)
    return loss, _policy_metrics(log_ratio, adv, m, lower, upper, dual_clip, clipped=True)
