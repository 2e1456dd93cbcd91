"""The BF16 shadow forward inside NeMo RL's Megatron workers: FP8 off on the same weights, then back on.

Calibrated Clipping needs rho_t = exp(hp_logp - hp_old_logp) from forwards of the trainer's own weights with
FP8 off (docs/design.md, "Calibrated Clipping"). In NeMo RL that is the worker's ``get_logprobs`` while
:class:`Fp8ShadowWorkerMixin` has FP8 switched off; :func:`shadow_logprobs` does it on every worker from the
driver. The loss side (``ClippedPGLossFn.observe_shadow``) is in :mod:`nemo_fp8rl.integrations.nemo_rl`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


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


__all__ = ["Fp8ShadowWorkerMixin", "shadow_logprobs"]
