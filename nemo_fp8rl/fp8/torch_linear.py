"""The torch FP8 backend's linear: the three GEMMs of an FP8 linear on torch's scaled-GEMM kernels.

``fp8.backend=torch`` keeps every step of the emulation (``linear.py``: same quantizer, same
per-operand state, same recorded amaxes, same operand reuse between forward and backward) but hands
the FP8 data and scale-inverses to ``backends.scaled_gemm`` instead of multiplying fake-quantized
float32 values.

Dtypes: a bf16 (fp16) input stays bf16 outside the GEMM's own accumulator. The forward GEMM writes the
model dtype and adds the bias in its epilogue where torch allows it; the backward quantizes the output
gradient from its own dtype; dgrad writes the model dtype; wgrad asks for float32 (main grads are
float32), which the kernel writes where it can (``backends.kernel_out_dtype``). A GEMM whose operands
torch's kernels refuse (blockwise with E5M2 gradients: dgrad and wgrad under ``fp8_format=hybrid``)
runs on the Triton block-scaled GEMM where Triton runs (``kernels/block_gemm.py``: FP8 MMA promoted to
float32 every 32 products, Hopper's instruction), else in float32 on the dequantized operands, the
emulation's numbers (``backends.kernel_refusal``).

Accumulation: the forward GEMM uses fast (un-promoted) accumulation when :func:`forward_fast_accum`
says so, dgrad and wgrad always accumulate in full precision (Transformer Engine's split: only the
forward output tolerates the truncated sum; the gradients feed the optimizer).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from nemo_fp8rl.fp8 import kernels
from nemo_fp8rl.fp8.backends import QuantizedOperand, scaled_gemm
from nemo_fp8rl.fp8.quantize import _quantize_impl
from nemo_fp8rl.fp8.recipes import Fp8Recipe
from nemo_fp8rl.fp8.state import Fp8LinearState, _delayed_scale, cached_weight


def quantize_operand_fp8(
    t: torch.Tensor, role: str, recipe: Fp8Recipe, state: Optional[Fp8LinearState], record: bool
) -> QuantizedOperand:
    """FP8 data + scale-inverses of one GEMM operand whose reduction dimension is dim 1 (torch backend).

    Same quantizer, arguments and delayed-scaling bookkeeping as :func:`quantize_operand` with
    ``dim=1``, so ``result.dequantize()`` equals ``quantize_operand(t, role, 1, ...)`` bit for bit
    (``dequant="scale_inv"``). t: [R, K] -> data [R, K] FP8 (contiguous), scale_inv as in
    :class:`~nemo_fp8rl.fp8.backends.QuantizedOperand` (K a multiple of the block for 1-D blocks).
    """
    gran = recipe.granularity_for(role)
    meta, scale = _delayed_scale(t, role, recipe, state)
    # the quantizer's own layout is already [R, K] row-major (1-D blocks [R, K/B, B], tiles [R/B, B, K/B, B])
    data, s, amax = _quantize_impl(
        t, recipe.format_for(role), gran, 1, recipe.pow2_scales, 0, recipe.amax_epsilon, recipe.mx_block, scale,
        state.stats if state is not None else None, False, False, torch.float32,
    )
    if meta is not None and record:
        meta.record_and_update(amax.detach(), recipe, role)  # delayed = per tensor: the quantizer's amax
    scale_inv = 1.0 / s
    if gran in ("tensor", "row"):
        return QuantizedOperand(data.contiguous(), scale_inv, gran)
    gran = (int(gran[0]), int(gran[1]))
    rows = data.shape[0] * (data.shape[1] if gran[0] != 1 else 1)
    data = data.reshape(rows, -1).contiguous()
    if gran[0] == 1:  # scale_inv [R, K/B, 1] -> [R, K/B]
        return QuantizedOperand(data, scale_inv[..., 0], gran)
    return QuantizedOperand(data, scale_inv[:, 0, :, 0].contiguous(), gran)  # [R/B, 1, K/B, 1] -> [R/B, K/B]


def _pad_rows_to(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim 1 of a 2-D tensor to a multiple of ``multiple`` (zeros change no amax and no sum)."""
    pad = (-t.shape[1]) % multiple
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _gemm_out_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The model dtype for bf16/fp16 models, else float32 (what torch's scaled GEMM can write)."""
    return x_dtype if x_dtype in (torch.bfloat16, torch.float16) else torch.float32


def forward_fast_accum(recipe: Fp8Recipe) -> bool:
    """Whether the forward GEMM uses fast (un-promoted) accumulation: yes unless ``accumulation="fp32"``.

    ``accumulation=None`` (the default) is the backend's default, and on real FP8 kernels that is fast in the
    forward GEMM, as Transformer Engine and torchao do; ``fast`` is the same here (the emulation models it).
    dgrad and wgrad never use it, and torch's block-scaled kernels refuse it (``backends.scaled_gemm``
    drops it there)."""
    return recipe.accumulation != "fp32"


class _Fp8TorchLinearFn(torch.autograd.Function):
    """The three GEMMs of :class:`_Fp8LinearFn` on torch's FP8 kernels (``backends.scaled_gemm``).

    forward y = Q(x) Q(W)^T; dgrad dx = Q(dy) Q(W) (W quantized along N, or the forward's W reused for
    per-tensor scales and 2-D tiles); wgrad dW = Q(dy)^T Q(x), both quantized along the tokens, which
    are zero-padded to a multiple of 16 (128 for blockwise): the reduction dimension of that GEMM.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, state: Optional[Fp8LinearState], record: bool):
        x2 = x.reshape(-1, x.shape[-1])
        out_dtype = _gemm_out_dtype(x.dtype)
        xq = quantize_operand_fp8(x2, "input", recipe, state, record)
        wq = cached_weight(state, weight, "torch_fwd", lambda: quantize_operand_fp8(weight, "weight", recipe, state, record))
        # the bias goes into the GEMM's epilogue where torch allows it, else it is added in out_dtype
        y = scaled_gemm(xq, wq, out_dtype, fast_accum=forward_fast_accum(recipe), bias=bias)
        per_tensor = recipe.granularity_for("input") == "tensor" and recipe.wgrad_fp8
        weight_tiles = recipe.granularity_for("weight") not in ("row", "mx")
        # Same reuse as the emulation: per-tensor inputs and 2-D weight tiles are kept in FP8 for backward.
        ctx.save_for_backward(
            xq.data if per_tensor else x2, xq.scale_inv if per_tensor else None,
            wq.data if weight_tiles else weight, wq.scale_inv if weight_tiles else None,
        )
        ctx.reuse_x, ctx.reuse_w, ctx.has_bias = per_tensor, weight_tiles, bias is not None
        ctx.gran_w = wq.granularity
        ctx.weight_ref = weight  # the cache key of W^T (not saved for backward: a reference only)
        ctx.w_dtype = weight.dtype
        ctx.recipe, ctx.state, ctx.x_shape, ctx.x_dtype = recipe, state, x.shape, x.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_saved, x_sinv, w_saved, w_sinv = ctx.saved_tensors
        recipe, state = ctx.recipe, ctx.state
        g = grad_y.reshape(-1, grad_y.shape[-1])  # quantized from its own dtype: no float copy
        out_dtype = _gemm_out_dtype(ctx.x_dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gq = quantize_operand_fp8(g, "grad_output", recipe, state, record=True)  # [M, N] along N
            if ctx.reuse_w:  # W^T [K, N], once per step inside fp8_weight_cache
                wq_t = cached_weight(state, ctx.weight_ref, "torch_bwd", lambda: QuantizedOperand(w_saved, w_sinv, ctx.gran_w).t())
            else:
                wq_t = quantize_operand_fp8(w_saved.t(), "weight", recipe, state, record=False)
            grad_x = scaled_gemm(gq, wq_t, out_dtype).to(ctx.x_dtype).reshape(ctx.x_shape)  # .to: no-op unless float64
        if ctx.needs_input_grad[1]:
            if recipe.wgrad_fp8:
                blockwise = isinstance(recipe.granularity_for("grad_output"), tuple)
                mult = 128 if blockwise else 16
                per_tensor_g = recipe.granularity_for("grad_output") == "tensor"
                if per_tensor_g and ctx.needs_input_grad[0]:
                    gq_w = gq.t()  # dy^T [N, M]
                else:
                    g_t = _pad_rows_to(g.t(), mult) if blockwise else g.t()
                    gq_w = quantize_operand_fp8(g_t, "grad_output", recipe, state, record=not ctx.needs_input_grad[0])
                if ctx.reuse_x:
                    xq_w = QuantizedOperand(x_saved, x_sinv, "tensor").t()  # x^T [K, M]
                else:
                    x_t = _pad_rows_to(x_saved.t(), mult) if blockwise else x_saved.t()
                    xq_w = quantize_operand_fp8(x_t, "input", recipe, state, record=False)
                if not blockwise:
                    gq_w, xq_w = gq_w.pad_reduction(mult), xq_w.pad_reduction(mult)
                grad_w = scaled_gemm(gq_w, xq_w, _gemm_out_dtype(ctx.w_dtype))  # the parameter's dtype: no cast after
            else:
                grad_w = (g.t().float() @ x_saved.float()).to(ctx.w_dtype)  # wgrad_fp8=False: the high-precision GEMM
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_b, None, None, None


# ------------------------------------------------------------------------------------------------------
# The kernel path: every layout of an operand from one Triton launch (kernels/cast_transpose.py)
# ------------------------------------------------------------------------------------------------------

KERNEL_SCALINGS = ("tensorwise", "delayed", "rowwise", "blockwise")
"""Recipes whose three GEMMs the Triton kernels feed (mxfp8 keeps the compiled quantizer)."""


def kernel_path_refusal(recipe: Fp8Recipe, device) -> Optional[str]:
    """Why :class:`_Fp8KernelLinearFn` does not run this recipe on ``device`` (None: it does); decided once
    per (recipe, device, current CUDA device, ``NEMO_FP8RL_KERNELS``), as every FP8 linear call asks."""
    dev = torch.device(device)
    current = torch.cuda.current_device() if dev.type == "cuda" else None  # Triton launches there
    key = (recipe, dev.type, dev.index, current, os.environ.get("NEMO_FP8RL_KERNELS", "1"), kernels.interpreting())
    if key not in _REFUSALS:
        _REFUSALS[key] = _kernel_path_refusal(recipe, dev)
    return _REFUSALS[key]


_REFUSALS: dict = {}


def _kernel_path_refusal(recipe: Fp8Recipe, device) -> Optional[str]:
    why = kernels.kernel_unavailable(device)
    if why:
        return why
    if recipe.scaling not in KERNEL_SCALINGS:
        return f"{recipe.scaling}: no cast-transpose kernel (recipes with one: {', '.join(KERNEL_SCALINGS)})"
    if not recipe.wgrad_fp8:
        return "wgrad_fp8=false: the wgrad GEMM is high precision, the reference path runs it"
    if recipe.scaling == "blockwise" and (recipe.input_block != 128 or recipe.weight_block != 128):
        return "blockwise kernels use 128 blocks"
    return hybrid_blockwise_refusal(recipe)


def hybrid_blockwise_refusal(recipe: Fp8Recipe) -> Optional[str]:
    """The torch backend's rule for ``blockwise`` + ``fp8_format=hybrid`` (E5M2 gradients).

    torch's 1x128/128x128 kernels take E4M3 x E4M3 only, so the dgrad and wgrad GEMMs of E5M2 gradients
    run on our Triton block-scaled GEMM or, where that is slower (:func:`_bf16_backward`, decided at run
    time), as bf16 GEMMs of the dequantized operands. The latter is exact only with power-of-two scales: an FP8
    value (<= 4 significant bits) times 2^k is a bf16 value (8 bits) unless it falls below bf16's
    subnormal range (a 1x128 group whose amax is under ~1e-31). With float32 scales it is not, and the
    only exact alternative is a float32 GEMM ~10x slower than BF16: refused (None: allowed).
    """
    if recipe.block_e5m2_grads and not recipe.pow2_scales:
        return ("fp8=blockwise with fp8_format=hybrid and pow2_scales=false cannot run on the torch backend: torch's "
                "block-scaled GEMMs take E4M3 x E4M3 only, and E5M2 gradients with float32 scales are not exact in "
                "the bf16 GEMM that replaces them (it would need a float32 GEMM, ~10x slower than BF16). Use "
                "fp8.pow2_scales=true (the blockwise default), fp8_format=e4m3, or fp8.backend=emulate|te")
    return None


def _weight_layouts(weight: torch.Tensor, recipe: Fp8Recipe, state: Optional[Fp8LinearState], record: bool):
    """``(forward B operand, dgrad B operand)`` of the weight: FP8 W and W^T from one kernel launch.

    tensorwise/delayed: W [N, K] and W^T [K, N] with one scale; rowwise: W [N, K] with one scale per output
    channel (scale_inv [1, N]) and W^T [K, N] with one per input channel (scale_inv [1, K]: W quantized along
    N); blockwise: 128x128 tiles of W and W^T (hybrid on bf16 GEMMs: W^T's place holds W's dequantized bf16 values for the
    bf16 dgrad GEMM).
    """
    ops = kernels.ops()
    fmt = recipe.format_for("weight").name
    stats = state.stats if state is not None else None
    if recipe.scaling == "blockwise":
        bf16_bwd = _bf16_backward(recipe, weight.device)
        (q, s), bwd = ops.cast_weight_tiles(weight, fmt, pow2=recipe.pow2_scales, eps=recipe.amax_epsilon,
                                            transpose_bf16=bf16_bwd, stats=stats)
        fwd = QuantizedOperand(q, s, (128, 128), prepared=True)
        if bf16_bwd:
            return fwd, bwd
        return fwd, QuantizedOperand(bwd[0], bwd[1], (128, 128), prepared=True)
    if recipe.scaling == "rowwise":  # both are B operands: scale_inv [1, rows]
        (q, s), (qt, st) = ops.cast_transpose_rowwise(weight, fmt, pow2=recipe.pow2_scales, eps=recipe.amax_epsilon,
                                                      col_pad=1, stats=stats)
        return (QuantizedOperand(q, s.view(1, -1), "row", prepared=True),
                QuantizedOperand(qt, st.view(1, -1), "row", prepared=True))
    meta, scale = _delayed_scale(weight, "weight", recipe, state)
    rec_amax = meta is not None and record  # then the update's launch counts a non-finite amax
    q, qt, sinv, amax = ops.cast_transpose_tensorwise(weight, fmt, scale=scale, pow2=recipe.pow2_scales,
                                                     eps=recipe.amax_epsilon, col_pad=1, stats=stats,
                                                     count_nonfinite=not rec_amax)
    if rec_amax:
        meta.record_and_update(amax, recipe, "weight", _nonfinite_counter(stats))
    return QuantizedOperand(q, sinv, "tensor", prepared=True), QuantizedOperand(qt, sinv, "tensor", prepared=True)


def _nonfinite_counter(stats) -> Optional[torch.Tensor]:
    """``stats.nonfinite_amax`` (int64 []) where counters are kept, else None."""
    return stats.nonfinite_amax if stats is not None else None


def _bf16_backward(recipe: Fp8Recipe, device) -> bool:
    """``blockwise`` + ``hybrid`` whose dgrad and wgrad run as bf16 GEMMs of the dequantized operands (exact with
    power-of-two scales) rather than on the Triton block-scaled FP8 GEMM (``kernels/block_gemm.py``, which takes
    the E5M2 gradient that torch's kernels refuse): whichever was faster on this GPU, decided once per process
    (``block_gemm.hybrid_uses_fp8_gemm``, ``NEMO_FP8RL_HYBRID_GEMM``). False for every other recipe."""
    if not recipe.block_e5m2_grads:
        return False
    return not kernels.block_gemm_ops().hybrid_uses_fp8_gemm(torch.device(device))


def _unpack(op) -> tuple:
    """``(data, scale_inv)`` of a prepared operand, ``(tensor, None)`` of a bf16 one, ``(None, None)``."""
    if isinstance(op, QuantizedOperand):
        return op.data, op.scale_inv
    return op, None


class _Fp8KernelLinearFn(torch.autograd.Function):
    """:class:`_Fp8TorchLinearFn` with every operand quantized by one Triton launch into all its layouts.

    Same GEMMs, same FP8 values (bit for bit: ``tests/fp8/test_kernels.py``), same delayed-scaling
    bookkeeping; what changes is the traffic around the GEMMs (issue 38's profile: three transposed
    copies, a separate amax pass per operand, the weight re-quantized per call, wgrad cast after):

    * forward: x -> x [M, K] (fprop) and x^T [K, M16] (wgrad, saved instead of x); W -> W and W^T,
      cached per optimizer step inside ``fp8_weight_cache``;
    * backward: dy -> dy [M, N] (dgrad) and dy^T [N, M16] (wgrad) from one read;
    * wgrad is written by the GEMM in the weight's dtype; dgrad in the input's.

    rowwise: one scale per row of x, dy and W (fprop, dgrad's dy) and per column (x^T, dy^T: wgrad's,
    W^T: dgrad's), both layouts from one amax pass (rows and columns) and one cast pass.
    blockwise: 1x128 groups of both layouts from one 128x128 tile read (x^T's groups run along the
    tokens, padded to 128), 128x128 weight tiles. blockwise + hybrid: the forward is E4M3 x E4M3 on torch's
    kernel; dgrad and wgrad multiply the E5M2 gradient with the E4M3 operands either on the Triton
    block-scaled FP8 GEMM (``kernels/block_gemm.py``, through ``scaled_gemm``) or as bf16 GEMMs of their
    dequantized values (exact with power-of-two scales: :func:`hybrid_blockwise_refusal`), whichever was
    faster on this GPU (:func:`_bf16_backward`).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, state: Optional[Fp8LinearState], record: bool):
        ops = kernels.ops()
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        out_dtype = _gemm_out_dtype(x.dtype)
        # record = autograd records this forward (inside forward, grad mode is always off): a no_grad
        # forward (log-probs, rollout) writes no backward layouts
        need_dgrad, need_wgrad = ctx.needs_input_grad[0] and record, ctx.needs_input_grad[1] and record
        stats = state.stats if state is not None else None
        block = recipe.scaling == "blockwise"
        bf16_bwd = _bf16_backward(recipe, x.device)
        wq, wq_bwd = cached_weight(state, weight, "kernel", lambda: _weight_layouts(weight, recipe, state, record))
        fmt = recipe.format_for("input").name
        if block:
            xrow, xcol = ops.cast_transpose_blockwise(x2, fmt, pow2=recipe.pow2_scales, eps=recipe.amax_epsilon,
                                                      col=need_wgrad, col_bf16=bf16_bwd, stats=stats)
            xq = QuantizedOperand(xrow[0], xrow[1], (1, 128), prepared=True, rows=m)
            x_saved = xcol if (bf16_bwd or xcol is None) else QuantizedOperand(xcol[0], xcol[1], (1, 128), prepared=True)
        elif recipe.scaling == "rowwise":
            xrow, xcol = ops.cast_transpose_rowwise(x2, fmt, pow2=recipe.pow2_scales, eps=recipe.amax_epsilon,
                                                    col=need_wgrad, col_pad=16, stats=stats)
            xq = QuantizedOperand(xrow[0], xrow[1], "row", prepared=True)  # A of fprop: scale_inv [M, 1]
            # x^T [K, M16], the B operand of wgrad: scale_inv [1, K]
            x_saved = QuantizedOperand(xcol[0], xcol[1].view(1, -1), "row", prepared=True) if xcol is not None else None
        else:
            meta, scale = _delayed_scale(x2, "input", recipe, state)
            rec_amax = meta is not None and record
            q, qt, sinv, amax = ops.cast_transpose_tensorwise(x2, fmt, scale=scale, pow2=recipe.pow2_scales,
                                                             eps=recipe.amax_epsilon, write_col=need_wgrad,
                                                             col_pad=16, stats=stats, count_nonfinite=not rec_amax)
            if rec_amax:
                meta.record_and_update(amax, recipe, "input", _nonfinite_counter(stats))
            xq = QuantizedOperand(q, sinv, "tensor", prepared=True)
            x_saved = QuantizedOperand(qt, sinv, "tensor", prepared=True) if qt is not None else None
        y = scaled_gemm(xq, wq, out_dtype, fast_accum=forward_fast_accum(recipe), bias=bias)
        # through save_for_backward (freed after backward, kept by retain_graph); an operand is its FP8 data and
        # scale-inverses, or (hybrid on bf16 GEMMs) one bf16 tensor
        w_saved = wq_bwd if need_dgrad else None
        ctx.save_for_backward(*_unpack(x_saved), *_unpack(w_saved))
        ctx.recipe, ctx.state, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = recipe, state, x.shape, x.dtype, weight.dtype
        ctx.block, ctx.bf16_bwd, ctx.has_bias = block, bf16_bwd, bias is not None
        ctx.gran_x, ctx.gran_w = xq.granularity, wq.granularity
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        ops = kernels.ops()
        recipe, state = ctx.recipe, ctx.state
        g = grad_y.reshape(-1, grad_y.shape[-1])
        m = g.shape[0]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        stats = state.stats if state is not None else None
        fmt = recipe.format_for("grad_output").name
        grad_x = grad_w = grad_b = None
        xd, xs, wd, ws = ctx.saved_tensors
        x_saved = xd if xs is None else QuantizedOperand(xd, xs, ctx.gran_x, prepared=True)
        w_saved = wd if ws is None else QuantizedOperand(wd, ws, ctx.gran_w, prepared=True)
        if ctx.block:
            grow, gcol = ops.cast_transpose_blockwise(g, fmt, pow2=recipe.pow2_scales, eps=recipe.amax_epsilon,
                                                      row=need_dgrad, col=need_wgrad, row_bf16=ctx.bf16_bwd,
                                                      col_bf16=ctx.bf16_bwd, stats=stats)
            if need_dgrad:
                if ctx.bf16_bwd:
                    grad_x = torch.mm(grow, w_saved)  # bf16 [M, N] @ [N, K], fp32 accumulation
                else:
                    gq = QuantizedOperand(grow[0], grow[1], (1, 128), prepared=True, rows=m)
                    grad_x = scaled_gemm(gq, w_saved, _gemm_out_dtype(ctx.x_dtype))
            if need_wgrad:
                if ctx.bf16_bwd:
                    grad_w = torch.mm(gcol.t(), x_saved)  # bf16 [N, M] @ [M, K]
                else:
                    gq_w = QuantizedOperand(gcol[0], gcol[1], (1, 128), prepared=True)
                    grad_w = scaled_gemm(gq_w, x_saved, _gemm_out_dtype(ctx.w_dtype))
        elif recipe.scaling == "rowwise":
            # dy [M, N] per row (A of dgrad: scale_inv [M, 1]), dy^T [N, M16] per column of dy (A of wgrad: [N, 1])
            grow, gcol = ops.cast_transpose_rowwise(g, fmt, pow2=recipe.pow2_scales, eps=recipe.amax_epsilon,
                                                    row=need_dgrad, col=need_wgrad, col_pad=16, stats=stats)
            if need_dgrad:
                grad_x = scaled_gemm(QuantizedOperand(grow[0], grow[1], "row", prepared=True), w_saved,
                                     _gemm_out_dtype(ctx.x_dtype))
            if need_wgrad:
                grad_w = scaled_gemm(QuantizedOperand(gcol[0], gcol[1], "row", prepared=True), x_saved,
                                     _gemm_out_dtype(ctx.w_dtype))
        else:
            meta, scale = _delayed_scale(g, "grad_output", recipe, state)
            q, qt, sinv, amax = ops.cast_transpose_tensorwise(g, fmt, scale=scale, pow2=recipe.pow2_scales,
                                                             eps=recipe.amax_epsilon, write_row=need_dgrad,
                                                             write_col=need_wgrad, col_pad=16, stats=stats,
                                                             count_nonfinite=meta is None)
            if meta is not None:
                meta.record_and_update(amax, recipe, "grad_output", _nonfinite_counter(stats))
            if need_dgrad:
                grad_x = scaled_gemm(QuantizedOperand(q, sinv, "tensor", prepared=True), w_saved,
                                     _gemm_out_dtype(ctx.x_dtype))
            if need_wgrad:
                grad_w = scaled_gemm(QuantizedOperand(qt, sinv, "tensor", prepared=True), x_saved,
                                     _gemm_out_dtype(ctx.w_dtype))
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        if grad_w is not None and grad_w.dtype != ctx.w_dtype:
            grad_w = grad_w.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_b, None, None, None
