"""Calibrated Clipping inside one RL step (docs/design.md, "One training step", steps 4-6): the shadow passes, the bounds
in force, the token observations and the update, in one object the trainer calls in order.

On a calibration step (``calibration.interval``) the pass

1. runs the high-precision (BF16, FP8 off) shadow forward of the rollout policy on the batch:
   ``logp_hp_old`` [B, T] (masked), before any update (:meth:`CalibrationPass.shadow_old_logprobs`);
2. before each minibatch update, the shadow forward of the current weights on the minibatch, giving the
   reference ratio ``rho = exp((logp_hp - logp_hp_old) * mask)`` [b, T]
   (:meth:`CalibrationPass.add_reference_ratio`);
3. inside the loss, observes the FP8 ratio ``r = exp((logp - old_logp) * mask)`` [b, T] with rho and the
   token advantages (:meth:`CalibrationPass.observe`);
4. after the updates, calibrates the bounds from every data-parallel rank's tokens; under pipeline
   parallelism only the last stage computed log-probs, so its calibrator state and metrics are broadcast
   to the other stages (:meth:`CalibrationPass.finish`). New bounds apply from the next step.
5. after the last minibatch update, one more shadow forward of the step's tokens with the updated weights,
   ``logp_hp_after`` [B, T]: the negative push ``calib/neg_push`` (mean over A < 0 tokens of
   ``logp_hp_after - logp_hp_old``), ``calib/pos_push``, and the tail mass of the negative tokens
   (``calib/neg_alt_mass``, ``calib/neg_alt_mass_gain``; formulas in :mod:`nemo_fp8rl.algorithms.push`),
   summed over the data-parallel group. Cost: one forward without backward over the step's batch (the
   size of the old-log-prob shadow forward of 1.), on calibration steps only, logged as
   ``timing/push_forward`` on those steps (not part of ``timing/shadow``, which the trainer reads before
   this pass).

With FP8 off (a BF16 run with ``calibration=measure``) the shadow forward is the model itself, so every
``calib/`` metric of a BF16 arm is BF16's own: its clipped share (``calib/alpha_bf16`` =
``calib/alpha_fp8_nominal``) and its push, the reference the FP8 arms are compared with.

With calibration off the trainer holds a :class:`NoCalibration`, whose methods do nothing and whose
bounds are the nominal ``(1 - eps_low, 1 + eps_high)``: ``RLTrainer.step`` has no calibration branches.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from nemo_fp8rl.algorithms import CalibratedClipping, make_metric
from nemo_fp8rl.trainer import timing
from nemo_fp8rl.algorithms.metrics import Metric
from nemo_fp8rl.algorithms.push import push_metrics, push_stats


class NoCalibration:
    """The calibration pass of a run without Calibrated Clipping (a null object)."""

    active = False
    shadow_s = 0.0
    """Seconds of shadow forwards in the current step (always 0 here)."""

    def begin(self, step: int) -> bool:
        """Start step ``step``; returns whether it calibrates (never)."""
        return False

    def bounds(self, lower: float, upper: float) -> tuple[float, float]:
        """The clip bounds in force: the nominal ``(lower, upper)`` passed in."""
        return lower, upper

    def shadow_old_logprobs(self, tokens: torch.Tensor, mask: torch.Tensor) -> Optional[torch.Tensor]:
        """None: no shadow pass."""
        return None

    def add_reference_ratio(self, mb: Dict[str, torch.Tensor]) -> None:
        """Nothing to add."""

    def observe(self, logp: torch.Tensor, mb: Dict[str, torch.Tensor]) -> None:
        """Nothing to observe."""

    def finish(self) -> Dict[str, Metric]:
        """No ``calib/*`` metrics."""
        return {}


class CalibrationPass(NoCalibration):
    """The calibration steps of a run with a :class:`~nemo_fp8rl.algorithms.CalibratedClipping` controller.

    Args:
        calibrator: the controller (its state is what checkpoints hold).
        actor: the :class:`~nemo_fp8rl.models.actor.FP8Actor` (shadow forwards, DP group, PP broadcast).
        temperature: the sampling temperature the log-probs are computed at.
    """

    def __init__(self, calibrator: CalibratedClipping, actor, temperature: float):
        self.calibrator = calibrator
        self.actor = actor
        self.temperature = temperature
        self.step: Optional[int] = None

    def begin(self, step: int) -> bool:
        """Start step ``step``: calibrate on it if the controller's schedule says so (returned)."""
        self.step = step
        self.active = self.calibrator.should_calibrate(step)
        self.shadow_s = 0.0
        self._batch_rows = 0  # rows of the step's batch (shadow_old_logprobs)
        self._push_rows: list = []  # (tokens, mask, hp_old_logp, advantages) of the first epoch's minibatches
        return self.active

    def bounds(self, lower: float, upper: float) -> tuple[float, float]:
        """The calibrated ``(lower, upper)`` when the controller applies its bounds (``calibration.apply``),
        else the nominal bounds passed in (``calibration=measure`` measures without changing training)."""
        return self.calibrator.bounds if self.calibrator.apply else (lower, upper)

    def _shadow(self, tokens: torch.Tensor) -> torch.Tensor:
        spent: Dict[str, float] = {}
        with timing.timed(spent, "shadow"):
            logp = self.actor.get_shadow_logprobs(tokens, temperature=self.temperature)[0]
        self.shadow_s += spent["shadow"]
        return logp

    def shadow_old_logprobs(self, tokens: torch.Tensor, mask: torch.Tensor) -> Optional[torch.Tensor]:
        """``logp_hp_old = shadow_logprobs(tokens) * mask`` [B, T] on a calibration step (else None):
        the rollout policy's log-probs in high precision, before the step's updates."""
        if not self.active:
            return None
        self._batch_rows = tokens.shape[0]
        return self._shadow(tokens) * mask

    def add_reference_ratio(self, mb: Dict[str, torch.Tensor]) -> None:
        """On a calibration step, ``mb["ref_ratio"] = exp((logp_hp - mb["hp_old_logp"]) * mb["mask"])``
        [b, T] from a shadow forward of the current weights on ``mb["tokens"]`` [b, T]."""
        if self.active:
            mb["ref_ratio"] = torch.exp((self._shadow(mb["tokens"]) - mb["hp_old_logp"]) * mb["mask"])
            if sum(r[0].shape[0] for r in self._push_rows) < self._batch_rows:  # the first epoch covers the batch
                self._push_rows.append((mb["tokens"], mb["mask"], mb["hp_old_logp"], mb["advantages"]))

    def observe(self, logp: torch.Tensor, mb: Dict[str, torch.Tensor]) -> None:
        """Inside the loss: the FP8 ratios ``r = exp((logp - old_logp) * mask)`` [b, T] (``logp`` masked,
        detached here) with the minibatch's reference ratios and token advantages."""
        if self.active:
            ratio = torch.exp((logp.detach() - mb["old_logp"]) * mb["mask"])
            self.calibrator.observe(ratio, mb["ref_ratio"], mb["advantages"], mb["mask"], step=self.step)

    def finish(self) -> Dict[str, Metric]:
        """After the step's updates: calibrate over the data-parallel group (a collective on every rank of
        it) and share the last pipeline stage's result with the other stages. ``{}`` on other steps."""
        if not self.active:
            return {}
        metrics = self.calibrator.update(self.step, group=self.actor.dp_group)
        metrics.update(self._push())
        if self.actor.pp_size > 1:
            # Only the last pipeline stage sees log-probs, so only its calibrator observed tokens: every
            # stage takes its state and metrics (rank 0 logs them; any rank's state may be checkpointed).
            state, floats = self.actor.broadcast_object_from_last_stage(
                (self.calibrator.state_dict(), {k: (float(v), r) for k, (v, r) in metrics.items()}))
            self.calibrator.load_state_dict(state)
            metrics = {k: make_metric(torch.tensor(v), r) for k, (v, r) in floats.items()}
        return metrics


    def _push(self) -> Dict[str, Metric]:
        """The negative push and tail mass (:mod:`nemo_fp8rl.algorithms.push`) of the step's tokens: one
        shadow forward of the first epoch's minibatch rows (the whole batch, once each) with the weights
        after the last update, against their ``hp_old_logp``; sums all-reduced over the data-parallel group.
        A collective over the pipeline stages (the forward) and the DP group (every rank calls it)."""
        from nemo_fp8rl.models.parallel import comm_device

        if not self._push_rows:  # no minibatch ran (every rank alike: all see the same number)
            return {}
        spent: Dict[str, float] = {}
        with timing.timed(spent, "push_forward"):
            tokens, mask, hp_old, adv = (torch.cat(parts, 0) for parts in zip(*self._push_rows))
            self._push_rows = []
            after = self.actor.get_shadow_logprobs(tokens, temperature=self.temperature)[0] * mask
            stats = push_stats(after, hp_old, adv, mask)
            if self.actor.dp_size > 1:
                stats = stats.to(comm_device())
                torch.distributed.all_reduce(stats, group=self.actor.dp_group)
            out = push_metrics(stats.cpu())
        out["timing/push_forward"] = make_metric(spent["push_forward"], "mean")
        return out


def make_calibration_pass(calibrator: Optional[CalibratedClipping], actor, temperature: float) -> NoCalibration:
    """The step's calibration pass: :class:`CalibrationPass` for a controller, :class:`NoCalibration` for None."""
    return NoCalibration() if calibrator is None else CalibrationPass(calibrator, actor, temperature)


__all__ = ["CalibrationPass", "NoCalibration", "make_calibration_pass"]
