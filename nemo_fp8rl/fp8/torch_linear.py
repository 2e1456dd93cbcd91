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
runs in float32 on the dequantized operands, the emulation's numbers (``backends.kernel_refusal``).

Accumulation: the forward GEMM uses fast (un-promoted) accumulation when :func:`forward_fast_accum`
says so, dgrad and wgrad always accumulate in full precision (Transformer Engine's split: only the
forward output tolerates the truncated sum; the gradients feed the optimizer).
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_fp8rl.fp8.backends import QuantizedOperand, scaled_gemm
from nemo_fp8rl.fp8.linear import Fp8LinearState, _delayed_scale
from nemo_fp8rl.fp8.quantize import _quantize_impl
from nemo_fp8rl.fp8.recipes import Fp8Recipe


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
        wq = quantize_operand_fp8(weight, "weight", recipe, state, record)
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
            if ctx.reuse_w:
                wq_t = QuantizedOperand(w_saved, w_sinv, ctx.gran_w).t()  # W^T [K, N]
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
                grad_w = scaled_gemm(gq_w, xq_w, torch.float32)
            else:
                grad_w = g.t().float() @ x_saved.float()  # wgrad_fp8=False: the high-precision GEMM
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_b, None, None, None
