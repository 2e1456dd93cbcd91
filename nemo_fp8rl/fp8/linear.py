"""Emulated FP8 linear layers: the autograd function, the module, the converter, and ``disable_fp8``.

``fp8_linear`` reproduces what an FP8 GEMM *sees*: each operand is replaced by its FP8 value
(``fake_quantize`` along the GEMM's reduction dimension, see ``recipes.py``), then the product is
computed in float32 (or with the ``fast`` accumulation model). Gradients flow through the quantized
operands exactly as in Transformer Engine: dgrad uses the quantized output gradient and weight, wgrad
the quantized output gradient and input; the bias gradient is the high-precision sum of dy.

Delayed scaling keeps per-operand state (``Fp8LinearState``): the scale used at step t comes from the
amax history of steps < t; the history is recorded only when autograd is recording (training
forwards and all backwards), never under ``torch.no_grad`` (evaluation/log-prob passes).

``backend="torch"`` (``fp8.backend=torch``, see ``backends.py``) keeps every step above (same quantizer,
same state, same recorded amaxes, same operand reuse between forward and backward) but hands the FP8
data and scale-inverses to torch's scaled GEMM instead of multiplying fake-quantized float32 values.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_fp8rl.fp8.backends import FP8_BACKENDS, torch_gemm_support
from nemo_fp8rl.fp8.quantize import _quantize_impl
from nemo_fp8rl.fp8.recipes import Fp8Recipe
from nemo_fp8rl.fp8.state import (  # noqa: F401 (DelayedScalingMeta, WeightCache: re-exported)
    DelayedScalingMeta, Fp8LinearState, WeightCache, _delayed_scale, cached_weight,
)

logger = logging.getLogger(__name__)


def quantize_operand(
    t: torch.Tensor, role: str, dim: int, recipe: Fp8Recipe, state: Optional[Fp8LinearState], record: bool,
    size_hint: Optional[int] = None,
) -> torch.Tensor:
    """FP8 value of one GEMM operand under ``recipe``, grouped along reduction dim ``dim``.

    Args:
        t: 2-D operand ([M, K] input, [N, K] weight or [M, N] output gradient), any float dtype (read as
            it is: no float32 copy is made before the fused quantizer).
        role: ``input``, ``weight`` or ``grad_output`` (selects format and granularity).
        dim: the GEMM reduction dimension of t in this use (0 or 1).
        state: delayed-scaling metas, stats and the weight cache (optional).
        record: update the delayed-scaling history with this tensor's amax.
        size_hint: the layer's weight size, which ``fp8.compile=auto`` judges on a CPU (fused.wants_compile).
    Returns:
        float32 tensor shaped like t: ``float32(q) * fp32(1/s)`` per group. A weight inside
        :func:`fp8_weight_cache` is quantized once along K (per-tensor and 2-D tile recipes) and reused (Transformer Engine's
        first-micro-batch caching): its amax is recorded by that first quantization only.
    """
    # cached: the forward's weight (along K) of the recipes that keep it for the backward anyway (per-tensor
    # scales, 2-D tiles); row/MX weights are re-quantized per use and keep no float32 copy between GEMMs,
    # which the memory plan counts on (launcher/memory.py, weight_copy_bytes)
    cacheable = role == "weight" and dim == 1 and recipe.granularity_for("weight") not in ("row", "mx")

    def make() -> torch.Tensor:
        meta, scale = _delayed_scale(t, role, recipe, state)
        # float32 read-back whatever t's dtype: an FP8 GEMM multiplies q * scale_inv exactly, so rounding the
        # dequantized value to a bf16 input's dtype would add an error no FP8 kernel has
        out, _, amax = _quantize_impl(
            t, recipe.format_for(role), recipe.granularity_for(role), dim, recipe.pow2_scales, 0,
            recipe.amax_epsilon, recipe.mx_block, scale, state.stats if state is not None else None, True,
            recipe.dequant == "divide", torch.float32, size_hint,
        )
        if meta is not None and record:
            meta.record_and_update(amax.detach(), recipe, role)  # delayed = per tensor: the stage-1 amax is t's
        return out

    return cached_weight(state, t, dim, make) if cacheable else make()


def _truncate_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round float32 x toward zero to ``bits`` significant bits (zero the low 24-bits mantissa bits)."""
    drop = 24 - bits
    if drop <= 0:
        return x
    as_int = x.contiguous().view(torch.int32)
    return (as_int & -(1 << drop)).view(torch.float32)  # -(2^drop) = ones above the dropped bits


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, recipe: Optional[Fp8Recipe] = None, fast: bool = False) -> torch.Tensor:
    """``a @ b.T`` for a [M, K], b [N, K] -> [M, N], in float32.

    With ``fast=True`` (Hopper un-promoted FP8 accumulation) the reduction runs in chunks of
    ``accumulation_chunk`` terms; after each chunk the running sum is truncated to
    ``accumulation_bits`` significant bits: ``acc_{c+1} = trunc(acc_c + a[:, C_c] @ b[:, C_c].T)``.
    """
    if not fast:
        return a @ b.t()
    chunk = recipe.accumulation_chunk if recipe is not None else 32
    bits = recipe.accumulation_bits if recipe is not None else 14
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for k0 in range(0, a.shape[1], chunk):
        acc = _truncate_bits(acc + a[:, k0:k0 + chunk] @ b[:, k0:k0 + chunk].t(), bits)
    return acc


def _no_autocast(t: torch.Tensor):
    """Autocast off for the emulated GEMM: its operands are exact FP8 values in float32, and a bf16
    autocast region (Megatron's schedule wraps the forward in one when params are float32) would round
    them to bf16 and change the numbers of every emulated layer on a GPU."""
    return torch.autocast(t.device.type, enabled=False) if torch.is_autocast_enabled(t.device.type) else contextlib.nullcontext()


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, state: Optional[Fp8LinearState], record: bool):
        x2 = x.reshape(-1, x.shape[-1])
        hint = weight.numel()  # fp8.compile=auto: the layer's size decides for all its operands
        xq = quantize_operand(x2, "input", 1, recipe, state, record, hint)
        wq = quantize_operand(weight, "weight", 1, recipe, state, record, hint)
        with _no_autocast(x):
            y = fp8_gemm(xq, wq, recipe, fast=recipe.accumulation == "fast")
            if bias is not None:
                y = y + bias.float()
        per_tensor = recipe.granularity_for("input") == "tensor" and recipe.wgrad_fp8
        weight_tiles = recipe.granularity_for("weight") not in ("row", "mx")
        # Per-tensor scales and 2-D weight tiles are the same in both orientations: reuse the forward
        # FP8 values in backward (as TE does); otherwise keep the raw operand and quantize along the
        # backward GEMM's reduction dimension.
        ctx.save_for_backward(
            xq if per_tensor else x2, wq if weight_tiles else weight, bias if bias is not None else None
        )
        ctx.reuse_x, ctx.reuse_w, ctx.has_bias = per_tensor, weight_tiles, bias is not None
        ctx.recipe, ctx.state, ctx.x_shape, ctx.x_dtype = recipe, state, x.shape, x.dtype
        ctx.size_hint = hint
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_saved, w_saved, _ = ctx.saved_tensors
        with _no_autocast(grad_y):
            return _Fp8LinearFn._backward(ctx, grad_y, x_saved, w_saved)

    @staticmethod
    def _backward(ctx, grad_y, x_saved, w_saved):
        recipe, state, hint = ctx.recipe, ctx.state, ctx.size_hint
        g = grad_y.reshape(-1, grad_y.shape[-1])  # quantized from its own dtype (no float32 copy)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gq = quantize_operand(g, "grad_output", 1, recipe, state, True, hint)
            wq = w_saved if ctx.reuse_w else quantize_operand(w_saved, "weight", 0, recipe, state, False, hint)
            grad_x = (gq @ wq).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad_fp8:
                per_tensor_g = recipe.granularity_for("grad_output") == "tensor"
                if per_tensor_g and ctx.needs_input_grad[0]:
                    gq_w = gq
                else:
                    gq_w = quantize_operand(g, "grad_output", 0, recipe, state, not ctx.needs_input_grad[0], hint)
                xq_w = x_saved if ctx.reuse_x else quantize_operand(x_saved, "input", 0, recipe, state, False, hint)
                grad_w = gq_w.t() @ xq_w
            else:
                grad_w = g.float().t() @ x_saved.float()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    recipe: Fp8Recipe,
    state: Optional[Fp8LinearState] = None,
    backend: str = "emulate",
) -> torch.Tensor:
    """FP8 linear ``y = Q(x) @ Q(W)^T + b`` with FP8 gradients (emulated, or on torch's FP8 GEMMs).

    Args:
        x: [..., K] input (any float dtype; output has the same dtype).
        weight: [N, K].
        bias: [N] or None (added in high precision).
        recipe: the FP8 recipe (formats, granularity, accumulation).
        state: per-layer state; required for ``delayed`` scaling, collects saturation stats.
        backend: ``emulate`` (float32 GEMMs of the FP8 values) or ``torch`` (the FP8 data on
            ``torch._scaled_mm``; the caller checks :func:`~nemo_fp8rl.fp8.backends.torch_gemm_support`).
    Returns:
        y: [..., N]. Backward: dx = Q(dy) @ Q(W), dW = Q(dy)^T @ Q(x) (each along its reduction
        dim), db = sum(dy).
    """
    # Delayed-scaling history is recorded only by forwards that autograd records (training steps).
    if backend == "torch":
        from nemo_fp8rl.fp8.torch_linear import _Fp8KernelLinearFn, _Fp8TorchLinearFn, kernel_path_refusal

        # the Triton cast-transpose kernels where they run (CUDA), else the compiled quantizer; same bits
        fn = _Fp8KernelLinearFn if kernel_path_refusal(recipe, x.device) is None else _Fp8TorchLinearFn
        return fn.apply(x, weight, bias, recipe, state, torch.is_grad_enabled())
    if backend != "emulate":
        raise ValueError(f"fp8_linear backend={backend!r}; use 'emulate' or 'torch' ('te' runs TE's own layers)")
    return _Fp8LinearFn.apply(x, weight, bias, recipe, state, torch.is_grad_enabled())


class Fp8Linear(torch.nn.Linear):
    """``torch.nn.Linear`` whose GEMMs run FP8 while ``fp8_enabled`` is True.

    ``fp8_backend``: ``emulate`` or ``torch`` (torch's FP8 GEMMs); the FP8 state (``fp8_state``) does
    not depend on it, so the backend can change between a save and a resume.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Fp8Recipe,
                 backend: str = "emulate", **kw) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.fp8_recipe = recipe
        self.fp8_state = Fp8LinearState(recipe)
        self.fp8_enabled = True
        self.fp8_backend = backend

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear, recipe: Fp8Recipe, backend: str = "emulate") -> "Fp8Linear":
        """Wrap an existing linear, sharing its parameters (no copy)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        new.fp8_recipe = recipe
        new.fp8_state = Fp8LinearState(recipe)
        new.fp8_enabled = True
        new.fp8_backend = backend
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, self.fp8_recipe, self.fp8_state, backend=self.fp8_backend)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8={self.fp8_recipe.name}, backend={self.fp8_backend}, "
                f"enabled={self.fp8_enabled}")


def layer_backend(recipe: Fp8Recipe, backend: str, device, out_features: int, in_features: int) -> Tuple[str, Optional[str]]:
    """The GEMM backend one linear runs: ``(backend, fallback_reason)``.

    ``torch`` becomes ``emulate`` (with the reason) for a recipe or shape torch cannot run on ``device``
    (:func:`~nemo_fp8rl.fp8.backends.torch_gemm_support`); ``emulate`` stays. ``te`` is not a per-layer
    backend (TE layers are built by the model spec) and raises here.
    """
    if backend not in ("emulate", "torch"):
        raise ValueError(f"per-layer FP8 backend {backend!r}; valid: emulate, torch (of {list(FP8_BACKENDS)})")
    if backend == "emulate":
        return "emulate", None
    from nemo_fp8rl.fp8.torch_linear import hybrid_blockwise_refusal

    reason = torch_gemm_support(recipe, device, out_features, in_features)
    refused = hybrid_blockwise_refusal(recipe)
    if refused and reason is None:  # a layer torch would run: never silently on a path ~10x slower than BF16
        raise ValueError(refused)
    return ("emulate", reason) if reason else ("torch", None)


class ConversionCounter:
    """Counts what a converter did: layers per backend and the reasons torch layers fell back."""

    def __init__(self, recipe: Fp8Recipe, backend: str) -> None:
        self.recipe, self.backend = recipe, backend
        self.converted = self.total = self.torch_gemm = self.emulated_fallback = 0
        self.fallback_reasons: Dict[str, int] = {}

    def add(self, layer_backend_: str, reason: Optional[str]) -> None:
        self.converted += 1
        if layer_backend_ == "torch":
            self.torch_gemm += 1
        if reason:
            self.emulated_fallback += 1
            self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    def summary(self) -> str:
        """``backend=torch: 10 on torch FP8 GEMMs, 2 emulated (2x shape [8, 8] is not a multiple of 16)``."""
        if self.backend == "emulate":
            return "backend=emulate"
        why = "; ".join(f"{n}x {r}" for r, n in sorted(self.fallback_reasons.items()))
        return (f"backend={self.backend}: {self.torch_gemm} on torch FP8 GEMMs, {self.emulated_fallback} emulated"
                + (f" ({why})" if why else ""))


def default_module_filter(module: torch.nn.Module, fqn: str) -> bool:
    """Which linears to convert: not the LM head, and both dims divisible by 16 (FP8 GEMM rule)."""
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf in ("lm_head", "output_layer"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(
    module: torch.nn.Module,
    recipe: Fp8Recipe,
    module_filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = default_module_filter,
    backend: str = "emulate",
    auto_tokens: Optional[int] = None,
) -> torch.nn.Module:
    """Swap every ``torch.nn.Linear`` in ``module`` (in place) for an :class:`Fp8Linear`.

    ``module_filter_fn(linear, fully_qualified_name) -> bool`` picks which to convert (None = all).
    ``backend``: ``emulate`` or ``torch``; with ``torch`` each layer that torch cannot run on its
    weight's device falls back to ``emulate`` (:func:`layer_backend`), counted. Parameters are shared,
    not copied, so optimizers built before conversion keep working. Logs ``converted N/M linear layers``
    with the backend split; the counts are also returned on ``module.fp8_conversion``.
    ``auto_tokens`` (``fp8.backend=auto``'s rule, the rows of one call): a linear that would run torch's FP8
    GEMMs on a GPU but measured slower than BF16 at that size is left a ``torch.nn.Linear``
    (:func:`~nemo_fp8rl.fp8.layer_filter.keep_bf16_reason`), counted in ``auto_kept``.
    """
    from nemo_fp8rl.fp8 import layer_filter

    auto_kept: Dict[str, int] = {}
    total = 0
    counter = ConversionCounter(recipe, backend)

    def visit(parent: torch.nn.Module, prefix: str) -> None:
        nonlocal total
        for name, child in list(parent.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(child, Fp8Linear):
                total += 1
                counter.add(child.fp8_backend, None)
            elif isinstance(child, torch.nn.Linear):
                total += 1
                if module_filter_fn is None or module_filter_fn(child, fqn):
                    b, reason = layer_backend(recipe, backend, child.weight.device, child.out_features, child.in_features)
                    slow = layer_filter.auto_keep_reason(recipe, b, auto_tokens, child.out_features,
                                                         child.in_features, child.weight.device)
                    if slow:
                        auto_kept[slow] = auto_kept.get(slow, 0) + 1
                        continue
                    setattr(parent, name, Fp8Linear.from_linear(child, recipe, backend=b))
                    counter.add(b, reason)
            else:
                visit(child, fqn)

    if isinstance(module, torch.nn.Linear) and not isinstance(module, Fp8Linear):
        raise ValueError("convert_to_fp8 converts the linears inside a module; wrap a bare Linear with Fp8Linear.from_linear")
    visit(module, "")
    (logger.warning if counter.emulated_fallback else logger.info)("FP8 (%s): converted %d/%d linear layers; %s", recipe.name, counter.converted, total, counter.summary())
    module.fp8_conversion = {
        "converted": counter.converted, "total": total, "skipped": total - counter.converted, "backend": backend,
        "torch_gemm": counter.torch_gemm, "emulated_fallback": counter.emulated_fallback,
        "fallback_reasons": dict(counter.fallback_reasons), "auto_kept": auto_kept,
    }
    layer_filter.log_auto_kept(logger, auto_kept)
    return module


@contextlib.contextmanager
def disable_fp8(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model`` in high precision inside the block: the BF16 shadow forward of Calibrated Clipping.

    Sets ``fp8_enabled = False`` on every submodule that has that attribute (our emulated linears,
    including the Megatron parallel ones) and restores the previous values on exit, even on error.
    The weights are the same tensors, so the shadow forward sees exactly the FP8 run's weights.
    """
    saved = [(m, m.fp8_enabled) for m in model.modules() if hasattr(m, "fp8_enabled")]
    try:
        for m, _ in saved:
            m.fp8_enabled = False
        yield model
    finally:
        for m, flag in saved:
            m.fp8_enabled = flag


@contextlib.contextmanager
def fp8_weight_cache(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Quantize every FP8 weight of ``model`` once inside the block (Transformer Engine's first-micro-batch
    caching, made explicit): use it around work whose weights do not change, i.e. the micro-batches of
    one optimizer step or one log-prob pass. The cache is dropped on exit, so the next optimizer step's
    weights are quantized afresh; entries also miss if a weight's storage, shape or version changes.
    Nested blocks keep the outer block's cache.
    """
    states = [m.fp8_state for m in fp8_modules(model)]
    entered = [st for st in states if not st.weight_cache.active]
    try:
        for st in entered:
            st.weight_cache.active = True
        yield model
    finally:
        for st in entered:
            st.weight_cache.active = False
            st.weight_cache.clear()


def fp8_modules(model: torch.nn.Module):
    """Submodules that carry FP8 state (``fp8_state`` attribute)."""
    return [m for m in model.modules() if getattr(m, "fp8_state", None) is not None]


def collect_fp8_stats(model: torch.nn.Module, reset: bool = True) -> Dict[str, torch.Tensor]:
    """Sum the saturation/non-finite counters of every FP8 layer, with one device-to-host copy.

    Returns ``fp8/saturated`` (elements clamped), ``fp8/quantized`` (elements quantized),
    ``fp8/saturation_frac`` and ``fp8/nonfinite_amax`` (groups whose amax was inf/NaN), CPU tensors.
    The counters are summed where they live (one stacked [3, L] tensor per device) and copied once.
    """
    per_device: Dict[torch.device, list] = {}
    for m in fp8_modules(model):
        st = m.fp8_state.stats
        if st is None:
            continue
        per_device.setdefault(st.numel.device, []).append(torch.stack([st.saturated, st.numel, st.nonfinite_amax]))
        if reset:
            st.reset()
    total = torch.zeros(3, dtype=torch.int64)
    for rows in per_device.values():
        total += torch.stack(rows).sum(0).cpu()
    sat, num, bad = total[0], total[1], total[2]
    frac = sat.double() / num.clamp(min=1).double()
    return {"fp8/saturated": sat, "fp8/quantized": num, "fp8/saturation_frac": frac, "fp8/nonfinite_amax": bad}
