"""FP8 for megatron-core models: emulated tensor-parallel linears (any device) and the TE switch.

Two ways a Megatron GPT runs FP8 here, chosen by the layer spec (``nemo_fp8rl.models.gpt``):

1. **Our linears: emulated or on torch's FP8 GEMMs (``fp8.backend`` emulate | torch).** The local layer spec uses
   :class:`Fp8ColumnParallelLinear` / :class:`Fp8RowParallelLinear`, subclasses of megatron's
   ``ColumnParallelLinear`` / ``RowParallelLinear``. Megatron funnels every GEMM of those classes
   through ``_forward_impl(input, weight, bias, ..., allreduce_dgrad, sequence_parallel, tp_group)``;
   we override only that hook. With ``fp8_enabled`` False it calls megatron's own implementation
   unchanged (so the high-precision "shadow" forward is bit-identical to a model built without FP8);
   with ``fp8_enabled`` True it performs the same tensor-parallel communication megatron would
   (identity forward / all-reduce of dgrad for column-parallel, all-gather for sequence parallel) and
   then calls :func:`nemo_fp8rl.fp8.fp8_linear` on this rank's shard: ``y_r = Q(x) Q(W_r)^T + b_r``,
   with the layer's backend (``torch``: the FP8 data on ``torch._scaled_mm``; the shard's shape decides
   whether torch can run it, so TP can change which layers fall back).
   Scales are computed from the local shard (per-tensor recipes therefore see the amax of the shard,
   not of the full weight; Transformer Engine reduces delayed-scaling amaxes over the TP group, the
   emulation does not). :func:`apply_fp8_to_megatron_model` attaches a recipe and a per-linear
   :class:`~nemo_fp8rl.fp8.Fp8LinearState` to every such linear in the transformer layers, keeping
   the layers selected by ``first_last_layers_bf16`` in high precision.

2. **Transformer Engine (GPU).** The TE layer spec plus the recipe's megatron fields
   (:meth:`Fp8Recipe.to_megatron_kwargs`) in ``TransformerConfig``; megatron's ``TransformerBlock``
   enters ``te.fp8_autocast`` per layer (or around the block for delayed scaling) and skips
   ``first_last_layers_bf16`` layers itself.

:func:`fp8_disabled` switches both off for a block of code: it clears ``fp8_enabled`` on emulated
linears (``disable_fp8``) and, for the TE path, sets ``config.fp8 = None`` on the model's shared
``TransformerConfig`` so megatron enters no FP8 autocast. The embedding, LM head (megatron's plain
``ColumnParallelLinear`` ``output_layer``), norms and attention are never converted.

This module imports megatron (and is the only file of ``nemo_fp8rl.fp8`` besides ``te.py`` allowed to).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from nemo_fp8rl.fp8 import layer_filter
from nemo_fp8rl.fp8.linear import ConversionCounter, Fp8LinearState, disable_fp8, fp8_linear, layer_backend
from nemo_fp8rl.fp8.recipes import Fp8Recipe

log = logging.getLogger(__name__)


class _Fp8ParallelMixin:
    """Shared FP8 switch of the two parallel linears (attributes read by ``disable_fp8``)."""

    fp8_enabled: bool
    fp8_recipe: Optional[Fp8Recipe]
    fp8_state: Optional[Fp8LinearState]
    fp8_backend: str

    def _init_fp8_attrs(self) -> None:
        self.fp8_enabled = False
        self.fp8_recipe = None
        self.fp8_state = None
        self.fp8_backend = "emulate"

    def set_fp8(self, recipe: Optional[Fp8Recipe], backend: str = "emulate") -> None:
        """Attach ``recipe`` (fresh state) and enable FP8 on GEMM ``backend`` (emulate | torch), or disable
        it with ``None``. The state does not depend on the backend (checkpoints resume under either)."""
        self.fp8_recipe = recipe
        self.fp8_state = Fp8LinearState(recipe) if recipe is not None else None
        self.fp8_enabled = recipe is not None
        self.fp8_backend = backend

    def _fp8_forward(self, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group):
        """Emulated FP8 GEMM on this rank's shard with megatron's TP communication.

        input: [s, b, K_in] (column-parallel: full K, or the sequence shard [s/tp, b, K] under
        sequence parallelism; row-parallel: K/tp shard), weight: [N_local, K_local], bias: [N_local]
        or None -> [s, b, N_local] (pre-reduction partial sums for row-parallel).
        """
        if allreduce_dgrad:
            # Column-parallel without sequence parallelism: identity forward, all-reduce of dx backward.
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        if sequence_parallel:
            # All-gather the sequence shards forward, reduce-scatter dx backward.
            input = gather_from_sequence_parallel_region(input, group=tp_group)
        return fp8_linear(input, weight, bias, self.fp8_recipe, self.fp8_state, backend=self.fp8_backend)

    def extra_repr(self) -> str:
        name = self.fp8_recipe.name if self.fp8_recipe is not None else None
        return f"fp8={name}, backend={self.fp8_backend}, enabled={self.fp8_enabled}"


class Fp8ColumnParallelLinear(_Fp8ParallelMixin, ColumnParallelLinear):
    """Megatron ``ColumnParallelLinear`` whose GEMM runs the emulated FP8 recipe when enabled.

    Weight [N/tp, K] on each rank; forward y_r = x W_r^T (+ b_r), gathered only if megatron's
    ``gather_output`` asks for it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8_attrs()

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self.fp8_enabled:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if args:
            raise TypeError("Fp8ColumnParallelLinear._forward_impl expects keyword arguments (megatron 0.15+)")
        return self._fp8_forward(
            input, weight, kwargs.get("bias"), kwargs.get("allreduce_dgrad", False),
            kwargs.get("sequence_parallel", False), kwargs.get("tp_group"),
        )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, {self.extra_repr()})"


class Fp8RowParallelLinear(_Fp8ParallelMixin, RowParallelLinear):
    """Megatron ``RowParallelLinear`` whose GEMM runs the emulated FP8 recipe when enabled.

    Weight [N, K/tp]; each rank computes the partial product of its input shard, megatron then
    all-reduces (or reduce-scatters) the partial sums in high precision and adds the bias.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8_attrs()

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self.fp8_enabled:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if args:
            raise TypeError("Fp8RowParallelLinear._forward_impl expects keyword arguments (megatron 0.15+)")
        # Megatron calls the row-parallel GEMM with allreduce_dgrad=False, sequence_parallel=False.
        return self._fp8_forward(input, weight, kwargs.get("bias"), False, False, None)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, {self.extra_repr()})"


def bf16_layer_numbers(recipe: Fp8Recipe, num_layers: int) -> set[int]:
    """0-based global indices of transformer layers kept high precision by ``first_last_layers_bf16``.

    Same rule as ``megatron.core.fp8_utils.is_first_last_bf16_layer``: layer l is high precision when
    ``l < num_layers_at_start_in_bf16`` or ``l >= num_layers - num_layers_at_end_in_bf16``.
    """
    if not recipe.first_last_layers_bf16:
        return set()
    start, end = recipe.num_layers_at_start_in_bf16, recipe.num_layers_at_end_in_bf16
    return {i for i in range(num_layers) if i < start or i >= num_layers - end}


@dataclass
class Fp8ConversionReport:
    """What :func:`apply_fp8_to_megatron_model` did on this rank (this pipeline stage)."""

    converted: int
    kept_high_precision: int
    total: int
    backend: str = "emulate"
    """The requested GEMM backend (emulate | torch)."""
    torch_gemm: int = 0
    """Converted linears that run torch's FP8 GEMMs."""
    emulated_fallback: int = 0
    """Converted linears that asked for torch but run the emulation (recipe or shape torch cannot run)."""
    fallback_reasons: Optional[dict] = None
    """``{reason: count}`` of those fallbacks."""
    auto_kept: Optional[dict] = None
    """``{reason: count}`` of the linears ``fp8.backend=auto`` kept high precision (counted in
    ``kept_high_precision``)."""


def apply_fp8_to_megatron_model(model: torch.nn.Module, recipe: Optional[Fp8Recipe],
                                backend: str = "emulate", auto_tokens: Optional[int] = None) -> Fp8ConversionReport:
    """Enable the FP8 recipe on every FP8-capable linear of a megatron GPT model (in place).

    Walks ``model.decoder.layers`` (this stage's layers; ``layer.layer_number`` is the 1-based global
    index). Linears of layers in :func:`bf16_layer_numbers` stay high precision; ``recipe=None``
    disables FP8 everywhere. ``backend``: ``emulate`` or ``torch`` (torch's FP8 GEMMs; a linear whose
    local shard shape or recipe torch cannot run on its device falls back to the emulation, counted).
    Logs ``FP8 (<recipe>): converted N/M linear layers ... backend=...``.

    ``auto_tokens`` (``fp8.backend=auto``: the rows of one micro-batch): a linear that would run torch's FP8
    GEMMs on a GPU but measured slower than BF16 at that size stays high precision
    (:func:`~nemo_fp8rl.fp8.layer_filter.keep_bf16_reason`), counted in ``auto_kept`` with the reasons.
    """
    num_layers = model.config.num_layers
    keep = bf16_layer_numbers(recipe, num_layers) if recipe is not None else set()
    kept = 0
    auto_kept: dict = {}
    counter = ConversionCounter(recipe, backend) if recipe is not None else None
    for layer in model.decoder.layers:
        for m in layer.modules():
            if isinstance(m, _Fp8ParallelMixin):
                if recipe is None or (layer.layer_number - 1) in keep:
                    m.set_fp8(None)
                    kept += 1
                else:
                    out_f, in_f = m.weight.shape
                    b, reason = layer_backend(recipe, backend, m.weight.device, out_f, in_f)
                    slow = layer_filter.auto_keep_reason(recipe, b, auto_tokens, out_f, in_f, m.weight.device)
                    if slow:
                        m.set_fp8(None)
                        kept += 1
                        auto_kept[slow] = auto_kept.get(slow, 0) + 1
                        continue
                    m.set_fp8(recipe, backend=b)
                    counter.add(b, reason)
    converted = counter.converted if counter is not None else 0
    total = converted + kept
    if recipe is not None:
        (log.warning if counter.emulated_fallback else log.info)("FP8 (%s): converted %d/%d linear layers on this stage (%d kept high precision; "
                 "embedding and LM head always high precision); %s", recipe.name, converted, total, kept,
                 counter.summary())
        layer_filter.log_auto_kept(log, auto_kept)
    return Fp8ConversionReport(
        converted=converted, kept_high_precision=kept, total=total, backend=backend,
        torch_gemm=counter.torch_gemm if counter else 0,
        emulated_fallback=counter.emulated_fallback if counter else 0,
        fallback_reasons=dict(counter.fallback_reasons) if counter else {},
        auto_kept=auto_kept,
    )


@contextlib.contextmanager
def fp8_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """High-precision forward of the same weights: emulated linears off and TE autocast off.

    Restores both switches on exit, even on error.
    """
    config = getattr(model, "config", None)
    saved_fp8 = getattr(config, "fp8", None)
    with disable_fp8(model):
        try:
            if saved_fp8 is not None:
                config.fp8 = None
            yield model
        finally:
            if saved_fp8 is not None:
                config.fp8 = saved_fp8


def fp8_states(model: torch.nn.Module) -> dict[str, dict]:
    """``{module name: Fp8LinearState.state_dict()}`` of every emulated FP8 linear (delayed scaling)."""
    return {
        name: m.fp8_state.state_dict()
        for name, m in model.named_modules()
        if isinstance(m, _Fp8ParallelMixin) and m.fp8_state is not None
    }


def load_fp8_states(model: torch.nn.Module, states: dict[str, dict]) -> None:
    """Inverse of :func:`fp8_states`. Raises if the module sets differ (recipe or layout changed)."""
    mods = {name: m for name, m in model.named_modules() if isinstance(m, _Fp8ParallelMixin) and m.fp8_state is not None}
    if set(mods) != set(states):
        raise ValueError(
            f"FP8 state of {len(states)} linears in the checkpoint, {len(mods)} FP8 linears in the model; "
            "resume with the same fp8 recipe, first_last_layers_bf16 and parallel layout"
        )
    for name, m in mods.items():
        m.fp8_state.load_state_dict(states[name])


__all__ = [
    "Fp8ColumnParallelLinear",
    "Fp8RowParallelLinear",
    "Fp8ConversionReport",
    "apply_fp8_to_megatron_model",
    "bf16_layer_numbers",
    "fp8_disabled",
    "fp8_states",
    "load_fp8_states",
]
