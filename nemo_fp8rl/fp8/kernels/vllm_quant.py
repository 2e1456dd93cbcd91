"""Triton kernels of the rollout's activation quantizers: vLLM's dynamic per-token and 1x128-group FP8.

The torch rollout engine quantizes the input of every FP8 linear at every decode step
(``fp8/rollout.py``: ``vllm_w8a8`` per token, ``vllm_block`` per 1x128 group along K). Through the
compiled quantizer (``fused.run``) each call costs about 0.6 ms of host time in Dynamo's guards
(issue 38's profile), which a decode step of an 8B model pays 4 x 36 times. These kernels are one launch
each (per token: one program reads its rows twice, amax then cast; per group: one program per
[BLOCK_M, 128] tile, one read), with the rules of ``fp8/rollout.py`` bit for bit:

    per token (vllm_w8a8):  s = max(fp32(amax(x_row) / 448), fp32(1 / (448 * 512)))     [M, 1]
    per group (vllm_block): s = fp32(max(amax(x_group), fp32(1e-10)) / 448)               [M, ceil(K / 128)]
    q = fp8_e4m3_rtne(clamp(fp32(x) / s, -448, 448))                                      [M, K]

The divisions are IEEE round-to-nearest (``div_rn``; Triton's ``/`` is approximate on a GPU), as vLLM's
CUDA kernels and torch divide. A NaN in a row (group) makes its scale NaN and every value of the row
(group) NaN, as the eager quantizer does; an inf amax makes the scale inf (finite x -> 0).

Outputs: the E4M3 data and the scales (:func:`quantize_per_token` / :func:`quantize_per_group` with
``readback=False``: what torch's scaled GEMM takes), or the read-back values ``float32(q) * s`` in float32
or bf16 (``readback=True``: the emulated GEMM's input; bf16 is the round-to-nearest-even of that float32
product, what ``.to(torch.bfloat16)`` of it gives). FP8 conversion and bf16 handling are the cast-transpose
kernels' device functions (:mod:`~nemo_fp8rl.fp8.kernels.cast_transpose`: the hardware's conversion on a
GPU, integer bit operations in Triton's interpreter). ``tests/fp8/_kernel_checks.py`` checks every output
bit for bit against ``fp8/rollout.py`` in the interpreter. Import through ``kernels.vllm_ops()``.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from nemo_fp8rl.fp8.kernels.cast_transpose import (
    _HW, _OPTS, _abs_bits, _bf16_bits, _fp8_bits, _fp8_value, _in, _load_tile, _out, _saturate,
)

E4M3_MAX = 448.0
TOKEN_MIN_SCALE = 1.0 / (448.0 * 512.0)
"""vLLM's smallest per-token scale (``dynamic_per_token_scaled_fp8_quant``'s ``min_scaling_factor``)."""
GROUP_EPS = 1e-10
"""vLLM's amax floor of a 1xB group (``per_token_group_quant_8bit``'s ``eps``)."""
TOKEN_TILE = (4, 1024, 4)
"""(BLOCK_M rows, BLOCK_K columns per loop iteration, num_warps) of the per-token kernel."""
GROUP_TILE = (16, 4)
"""(BLOCK_M rows, num_warps) of the per-group kernel; its columns are one group."""


@triton.jit
def _write(out_ptr, offs, code, s, mask, READBACK: tl.constexpr, OUT_BF16: tl.constexpr, HW: tl.constexpr):
    """Store the E4M3 codes (uint8) or, READBACK, their value times the scale (float32, or bf16 bits)."""
    if READBACK:
        v = _fp8_value(code, True, HW) * s
        if OUT_BF16:
            tl.store(out_ptr + offs, _bf16_bits(v, HW), mask=mask)
        else:
            tl.store(out_ptr + offs, v, mask=mask)
    else:
        tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def _token_quant_kernel(x_ptr, M, K, sxm, sxk, out_ptr, s_ptr, MIN_SCALE: tl.constexpr, FMAX: tl.constexpr,
                        READBACK: tl.constexpr, OUT_BF16: tl.constexpr, IN_BF16: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HW: tl.constexpr):
    """Rows [pid * BLOCK_M, +BLOCK_M) of x [M, K]: amax over K (first loop), then cast (second loop).

    s_ptr [M] <- s = max(amax / FMAX, MIN_SCALE);  out [M, K] (row-major) <- fp8(sat(x / s)) or its read-back.
    """
    pid = tl.program_id(0)
    amax_bits = tl.zeros([BLOCK_M], dtype=tl.int32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        x, rows, cols, mask = _load_tile(x_ptr, pid, kb, M, K, sxm, sxk, BLOCK_M, BLOCK_K, IN_BF16, HW)
        amax_bits = tl.maximum(amax_bits, tl.max(_abs_bits(x), axis=1))
    amax = amax_bits.to(tl.float32, bitcast=True)
    s = tl.math.div_rn(amax, tl.zeros_like(amax) + FMAX)
    s = tl.where(s < MIN_SCALE, MIN_SCALE, s)  # a NaN scale stays NaN (torch.clamp keeps it)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(s_ptr + rows, s, mask=rows < M)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        x, rows, cols, mask = _load_tile(x_ptr, pid, kb, M, K, sxm, sxk, BLOCK_M, BLOCK_K, IN_BF16, HW)
        sb = s[:, None] + tl.zeros_like(x)
        code = _fp8_bits(_saturate(tl.math.div_rn(x, sb), FMAX), True, HW)
        _write(out_ptr, rows[:, None] * K + cols[None, :], code, sb, mask, READBACK, OUT_BF16, HW)


@triton.jit
def _group_quant_kernel(x_ptr, M, K, sxm, sxk, out_ptr, s_ptr, NG, EPS: tl.constexpr, FMAX: tl.constexpr,
                        READBACK: tl.constexpr, OUT_BF16: tl.constexpr, IN_BF16: tl.constexpr,
                        BLOCK_M: tl.constexpr, GROUP: tl.constexpr, HW: tl.constexpr):
    """Group ``pid_g`` (columns [pid_g * GROUP, +GROUP), zeros past K) of rows [pid_m * BLOCK_M, +BLOCK_M):

    s_ptr [M, NG] <- s = max(amax, EPS) / FMAX;  out [M, K] <- fp8(sat(x / s)) or its read-back.
    """
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    x, rows, cols, mask = _load_tile(x_ptr, pid_m, pid_g, M, K, sxm, sxk, BLOCK_M, GROUP, IN_BF16, HW)
    amax = tl.max(_abs_bits(x), axis=1).to(tl.float32, bitcast=True)
    a = tl.where(amax < EPS, EPS, amax)  # clamp(min=eps); a NaN stays NaN
    s = tl.math.div_rn(a, tl.zeros_like(a) + FMAX)
    tl.store(s_ptr + rows * NG + pid_g, s, mask=rows < M)
    sb = s[:, None] + tl.zeros_like(x)
    code = _fp8_bits(_saturate(tl.math.div_rn(x, sb), FMAX), True, HW)
    _write(out_ptr, rows[:, None] * K + cols[None, :], code, sb, mask, READBACK, OUT_BF16, HW)


def _outputs(x: torch.Tensor, readback: bool, out_dtype: torch.dtype) -> torch.Tensor:
    if not readback:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"read-back in {out_dtype}: the kernels write float32 or bfloat16")
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"rollout activation kernels take x [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rollout activation kernels read float32, bfloat16 or float16, not {x.dtype}")


def _result(out: torch.Tensor, readback: bool) -> torch.Tensor:
    return out if readback else out.view(torch.float8_e4m3fn)


def quantize_per_token(x: torch.Tensor, *, readback: bool = False,
                       out_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token E4M3 of x [M, K] (any strides): ``(q [M, K], s [M, 1] float32)``.

    ``s = max(amax(x_row) / 448, 1 / (448 * 512))``; q is ``fp8(sat(x / s))`` (E4M3, row-major), or with
    ``readback`` its value ``float32(q) * s`` in ``out_dtype`` (float32 or bfloat16). One launch.
    """
    _check(x)
    M, K = x.shape
    out = _outputs(x, readback, out_dtype)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return _result(out, readback), s.fill_(TOKEN_MIN_SCALE)
    bm, bk, nw = TOKEN_TILE
    _token_quant_kernel[(triton.cdiv(M, bm),)](
        _in(x), M, K, x.stride(0), x.stride(1), _out(out), s, MIN_SCALE=TOKEN_MIN_SCALE, FMAX=E4M3_MAX,
        READBACK=readback, OUT_BF16=out.dtype == torch.bfloat16, IN_BF16=x.dtype == torch.bfloat16,
        BLOCK_M=bm, BLOCK_K=bk, num_warps=nw, HW=_HW, **_OPTS)
    return _result(out, readback), s


def quantize_per_group(x: torch.Tensor, group: int = 128, *, readback: bool = False,
                       out_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic 1 x ``group`` E4M3 of x [M, K] along K: ``(q [M, K], s [M, ceil(K / group)] float32)``.

    ``s = max(amax(x_group), 1e-10) / 448`` (a last partial group counts its missing columns as zeros);
    q is ``fp8(sat(x / s))``, or with ``readback`` ``float32(q) * s`` in ``out_dtype``. One launch.
    ``group`` is a power of two (Triton's tile width).
    """
    _check(x)
    if group <= 0 or group & (group - 1):
        raise ValueError(f"group {group}: the kernel's tile width must be a power of two")
    M, K = x.shape
    ng = -(-K // group)
    out = _outputs(x, readback, out_dtype)
    s = torch.empty(M, ng, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return _result(out, readback), s
    bm, nw = GROUP_TILE
    _group_quant_kernel[(triton.cdiv(M, bm), ng)](
        _in(x), M, K, x.stride(0), x.stride(1), _out(out), s, ng, EPS=GROUP_EPS, FMAX=E4M3_MAX,
        READBACK=readback, OUT_BF16=out.dtype == torch.bfloat16, IN_BF16=x.dtype == torch.bfloat16,
        BLOCK_M=bm, GROUP=group, num_warps=nw, HW=_HW, **_OPTS)
    return _result(out, readback), s
