"""verl plugin: the ``calibrated_clip`` policy loss and the shadow-ratio hook (install ``nemo-fp8rl[verl]``).

Importing this module registers ``calibrated_clip`` in verl's own policy-loss registry
(``verl.trainer.ppo.core_algos.register_policy_loss``; tested against verl 0.9.1), so a verl user sets::

    actor_rollout_ref.actor.policy_loss.loss_mode=calibrated_clip

and makes the worker processes import it, e.g. with verl's ``VERL_USE_EXTERNAL_MODULES=
nemo_fp8rl.integrations.verl`` (read by ``import verl`` in every process). The loss is verl's ``vanilla``
PPO loss with the clip bounds replaced by the ones in force in a
:class:`~nemo_fp8rl.algorithms.calibration.CalibratedClipping` controller: with r = exp(clamp(logp -
old_logp, -20, 20)), (L, H) the bounds in force and c = ``clip_ratio_c``,

    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, L, H)), and l_t = min(l_t, -c A_t) where A_t < 0,

(w_t = ``rollout_is_weights`` when verl passes them), aggregated with verl's own ``agg_loss`` and the
actor's ``loss_agg_mode`` and ``global_batch_info``, so every aggregation mode and parallel layout behaves as
``vanilla``. Config keys are verl's: ``actor.clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
``clip_ratio_c``, ``loss_agg_mode``. Nominal bounds are (1 - clip_ratio_low, 1 + clip_ratio_high).

The controller of a worker process is the one given to :func:`set_calibration`; if none was given, the
first loss call builds one with the defaults of docs/design.md (Calibrated Clipping) and the actor's
clip ratios (bounds nominal until it is updated, so the loss then equals ``vanilla``);
``set_calibration(None)`` turns calibration off. The controller moves only when it is fed shadow ratios: :class:`ShadowRatioHook` does that
at calibration steps, from a forward with FP8 off on the same weights (see docs/integrations.md for where
it goes in verl's Megatron actor).

Metrics: verl's ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (same definitions),
plus ``actor/clip_lower``, ``actor/clip_upper`` (bounds in force) and ``actor/clip_low_frac`` /
``actor/clip_high_frac`` (fraction of negative-advantage tokens with r < L, of positive ones with r > H).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from nemo_fp8rl.algorithms.calibration import CalibratedClipping
from nemo_fp8rl.algorithms.losses import LOG_RATIO_CLAMP, clipped_surrogate
from nemo_fp8rl.algorithms.metrics import Metric

LOSS_MODE = "calibrated_clip"
"""The name registered in verl's policy-loss registry."""

_UNSET = object()
_controller: Any = _UNSET


def set_calibration(controller: CalibratedClipping | None) -> None:
    """Make ``controller`` the one this process's ``calibrated_clip`` loss reads (None: nominal bounds)."""
    global _controller
    if controller is not None and not isinstance(controller, CalibratedClipping):
        raise ValueError(
            f"set_calibration takes a CalibratedClipping or None, got {type(controller).__name__}"
        )
    _controller = controller


def get_calibration(config: Any = None) -> CalibratedClipping | None:
    """This process's controller; built from ``config``'s clip ratios with defaults if none was set."""
    global _controller
    if _controller is _UNSET:
        if config is None:
            return None
        eps_low, eps_high, _ = _clip_config(config)
        _controller = CalibratedClipping(eps_low=eps_low, eps_high=eps_high)
    return _controller


def _clip_config(config: Any) -> tuple[float, float, float]:
    """(eps_low, eps_high, c) from verl's actor config, with ``vanilla``'s fallbacks."""
    if config is None:
        raise ValueError("calibrated_clip needs the actor config (verl passes config=actor config)")
    eps = config.clip_ratio
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else eps
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else eps
    c = config.clip_ratio_c  # verl's ActorConfig field (its default 3.0 lives there)
    if not c > 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1 (the dual clip, usually 3), got {c}")
    return float(eps_low), float(eps_high), float(c)


def _bounds(config: Any) -> tuple[float, float]:
    eps_low, eps_high, _ = _clip_config(config)
    ctrl = get_calibration(config)
    if ctrl is None:
        return 1.0 - eps_low, 1.0 + eps_high
    if abs(ctrl.eps_low - eps_low) > 1e-12 or abs(ctrl.eps_high - eps_high) > 1e-12:
        raise ValueError(
            f"the CalibratedClipping controller has eps ({ctrl.eps_low}, {ctrl.eps_high}) but the actor's "
            f"clip_ratio_low/high are ({eps_low}, {eps_high}); build the controller from the same values"
        )
    return ctrl.bounds


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_calibrated_clip(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss ``calibrated_clip``: ``vanilla`` with the calibrated bounds (module docstring).

    Args:
        old_log_prob, log_prob: ``[batch, response_length]`` log-probs at the start of the step / now.
        advantages: ``[batch, response_length]``.
        response_mask: ``[batch, response_length]`` valid response tokens.
        loss_agg_mode: verl's aggregation mode (``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``).
        config: verl's actor config (``clip_ratio*``, ``global_batch_info``).
        rollout_is_weights: ``[batch, response_length]`` rollout-correction weights or None.

    Returns:
        ``(loss, metrics)`` with plain-float metrics, as verl's losses.
    """
    eps_low, eps_high, c = _clip_config(config)
    lower, upper = _bounds(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped_dual = clipped_surrogate(ratio, advantages, lower, upper, None)
    pg_losses = clipped_surrogate(ratio, advantages, lower, upper, c)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    with torch.no_grad():
        r = ratio.detach()
        neg, pos = advantages < 0, advantages > 0
        low, high = neg & (r < lower), pos & (r > upper)
        m = response_mask.bool()

        def frac(num: torch.Tensor, den: torch.Tensor) -> float:
            return float((num & m).sum() / (den & m).sum().clamp(min=1))

        metrics = {
            "actor/pg_clipfrac": verl_F.masked_mean((low | high).float(), response_mask).item(),
            "actor/ppo_kl": verl_F.masked_mean(-log_ratio.detach(), response_mask).item(),
            "actor/pg_clipfrac_lower": verl_F.masked_mean(
                ((unclipped_dual.detach() > -advantages * c) & neg).float(), response_mask
            ).item(),
            "actor/clip_lower": float(lower),
            "actor/clip_upper": float(upper),
            "actor/clip_low_frac": frac(low, neg),
            "actor/clip_high_frac": frac(high, pos),
        }
    return pg_loss, metrics


def _fp8_off(modules: Iterable[torch.nn.Module]) -> contextlib.ExitStack:
    from nemo_fp8rl.fp8.megatron import fp8_disabled  # megatron-core: present in verl's Megatron workers

    stack = contextlib.ExitStack()
    for module in modules:
        stack.enter_context(fp8_disabled(module))
    return stack


class ShadowRatioHook:
    """Feeds a :class:`CalibratedClipping` controller the FP8 and BF16 ratios of each minibatch.

    At a calibration step (``should_calibrate(step)``) the actor calls :meth:`old_pass` once with the
    step's batch (same weights as ``old_log_prob``), then :meth:`observe_minibatch` before each
    minibatch's update (the weights that minibatch trains with), then :meth:`update` once after the last
    update. With ``logprob_fn(batch) -> [batch, response_length]`` log-probs (no grad), this computes

        hp_old = logprob_fn(batch) with FP8 off;
        r = exp(logprob_fn(mb) - old_log_prob), rho = exp(logprob_fn(mb) with FP8 off - hp_old[mb])

    and passes (r, rho, advantages, response_mask) to ``controller.observe``. FP8 is turned off with
    :func:`nemo_fp8rl.fp8.megatron.fp8_disabled` on every module of ``modules`` (Megatron's
    ``config.fp8 = None``, so Transformer Engine layers run in BF16 on the same weights, and our emulated
    FP8 linears off). Cost: three extra forwards of the step's tokens per calibration step.
    """

    def __init__(self, controller: CalibratedClipping, modules: torch.nn.Module | Iterable[torch.nn.Module]):
        if not isinstance(controller, CalibratedClipping):
            raise ValueError(f"controller must be a CalibratedClipping, got {type(controller).__name__}")
        self.controller = controller
        self.modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        if not self.modules:
            raise ValueError("modules is empty: pass the actor's model (or its list of model chunks)")

    def should_calibrate(self, step: int) -> bool:
        return self.controller.should_calibrate(step)

    @torch.no_grad()
    def shadow_log_probs(self, logprob_fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
        """``logprob_fn(batch)`` with FP8 off on every module (the BF16 shadow forward)."""
        with _fp8_off(self.modules):
            return logprob_fn(batch)

    def old_pass(self, logprob_fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
        """hp_old: the shadow log-probs of the step's batch at the weights of ``old_log_prob``."""
        return self.shadow_log_probs(logprob_fn, batch)

    @torch.no_grad()
    def observe_minibatch(
        self,
        logprob_fn: Callable[[Any], torch.Tensor],
        minibatch: Any,
        *,
        old_log_prob: torch.Tensor,
        hp_old_log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        step: int,
    ) -> None:
        """Observe one minibatch (all tensors ``[mb, response_length]``, rows of ``minibatch``)."""
        lp = logprob_fn(minibatch)
        hp = self.shadow_log_probs(logprob_fn, minibatch)
        if lp.shape != old_log_prob.shape or hp.shape != hp_old_log_prob.shape:
            raise ValueError(
                f"logprob_fn gave {tuple(lp.shape)}, old_log_prob is {tuple(old_log_prob.shape)} and "
                f"hp_old_log_prob {tuple(hp_old_log_prob.shape)}: pass the minibatch's rows of both"
            )
        clamp = lambda x: x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # noqa: E731
        r = torch.exp(clamp(lp - old_log_prob))
        rho = torch.exp(clamp(hp - hp_old_log_prob))
        self.controller.observe(r, rho, advantages, response_mask, step=step)

    def update(self, step: int, group=None) -> dict[str, Metric]:
        """``controller.update`` (all-gather over the data-parallel ``group``); the ``calib/*`` metrics."""
        return self.controller.update(step, group=group)


__all__ = [
    "LOSS_MODE",
    "ShadowRatioHook",
    "compute_policy_loss_calibrated_clip",
    "get_calibration",
    "set_calibration",
]
