"""Triton block-scaled FP8 GEMM that takes E5M2 operands: ``blockwise`` + ``fp8_format=hybrid`` on a GPU.

torch's 1x128 / 128x128 block-scaled GEMMs (cuBLAS) multiply E4M3 x E4M3 only, so under ``fp8_format=hybrid``
(E5M2 gradients) the dgrad and wgrad GEMMs had to run as bf16 GEMMs of the dequantized operands
(``torch_linear.py``): exact with power-of-two scales, but at BF16's speed (the H200 check: hybrid 0.73-0.83x
blockwise). This kernel multiplies the FP8 codes themselves, E5M2 x E4M3 (or any pair), on the FP8 tensor
cores, promoting every 128-long K block into a float32 accumulator with its scales (the DeepSeek-V3
recipe):

    C[m, n] = sum_{kb} sa[m, kb] * sb(n, kb) * sum_{k in block kb} a[m, k] * b[n, k]

Shapes: A [M, K] FP8 (float8_e4m3fn or float8_e5m2), one scale-inverse per 1x128 block of a row
(``sa`` [M, K/128]); B [N, K] codes, scales per 128x128 tile (``sb`` [N/128, K/128]: dgrad's W^T) or per 1x128
block of a row (``sb`` [N, K/128]: wgrad's x^T); K a multiple of 128 (the blockwise cast kernels pad the token
dimension to 128); C [M, N] in float32, bf16 or fp16. Operands come as :class:`~nemo_fp8rl.fp8.backends.
QuantizedOperand` in either layout: the readable one, or ``prepared`` (torch's scale layouts, as the cast
kernels write them: ``backends.scaled_mm_args``); the scales are read through their strides, never copied.

Numerics: the products of two FP8 values are exact in float32. In Triton's interpreter every sum is float32
(``tl.dot`` in IEEE float32); on Hopper the FP8 tensor cores add within one instruction (K = 32) with reduced
precision, and Triton promotes to the float32 accumulator after each instruction
(``max_num_imprecise_acc=32``). :func:`block_gemm_error_bound` bounds both; the tests (interpreter) and the
GPU check's parity part (device) hold the kernel to it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nemo_fp8rl.fp8.kernels.cast_transpose import _HW, _INTERPRET, _OPTS, _bf16_bits, _fp8_value, _time_ms

BLOCK_K = 128
"""K per scale block (torch's and DeepSeek's 1x128 / 128x128 groups)."""
GEMM_CONFIGS = ((128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4))
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) candidates, timed once per process and GPU on
:data:`TUNE_MNK`; the tiling never changes a value's summation order within a K block, and blocks are added
in K order, so every candidate writes the same bits."""
TUNE_MNK = (8192, 4096, 4096)
"""(M, N, K) the candidates and the hybrid-GEMM choice are timed on: dgrad of an 8B model's projection at
8192 tokens."""
IMPRECISE_K = 32
"""Hopper's FP8 MMA adds K = 32 products per instruction in reduced precision; Triton promotes after each."""
_DEFAULT = (128, 128, 8, 3)
_CHOSEN: dict = {}


@triton.jit
def _block_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K,
                     sam, sak, sbn, sbk, ssam, ssak, ssbn, ssbk, scm, scn,
                     A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, B_TILES: tl.constexpr, OUT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     IMPRECISE: tl.constexpr, HW: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of C (module docstring); OUT: 0 float32, 1 bf16 (int16 bits), 2 fp16."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * grid_n  # programs of GROUP_M consecutive row tiles run together (L2 reuse of B)
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    mm = rm < M
    nm = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(a_ptr + rm[:, None] * sam + k[None, :] * sak, mask=mm[:, None], other=0)  # [BM, BK]
        b = tl.load(b_ptr + rn[None, :] * sbn + k[:, None] * sbk, mask=nm[None, :], other=0)  # [BK, BN]
        if HW:
            if A_E4M3:
                a8 = a.to(tl.float8e4nv, bitcast=True)
            else:
                a8 = a.to(tl.float8e5, bitcast=True)
            if B_E4M3:
                b8 = b.to(tl.float8e4nv, bitcast=True)
            else:
                b8 = b.to(tl.float8e5, bitcast=True)
            part = tl.dot(a8, b8, max_num_imprecise_acc=IMPRECISE)
        else:  # the interpreter: exact FP8 values in float32, IEEE float32 sums
            part = tl.dot(_fp8_value(a.to(tl.int32), A_E4M3, HW), _fp8_value(b.to(tl.int32), B_E4M3, HW),
                          input_precision="ieee")
        sa = tl.load(sa_ptr + rm * ssam + kb * ssak, mask=mm, other=0.0)
        if B_TILES:
            sb = tl.load(sb_ptr + (rn // BLOCK_K) * ssbn + kb * ssbk, mask=nm, other=0.0)
        else:
            sb = tl.load(sb_ptr + rn * ssbn + kb * ssbk, mask=nm, other=0.0)
        acc += (part * sa[:, None]) * sb[None, :]
    cm = mm[:, None] & nm[None, :]
    cp = c_ptr + rm[:, None] * scm + rn[None, :] * scn
    if OUT == 1:
        tl.store(cp, _bf16_bits(acc, HW), mask=cm)
    elif OUT == 2:
        tl.store(cp, acc.to(tl.float16), mask=cm)
    else:
        tl.store(cp, acc, mask=cm)


def _is_e4m3(t: torch.Tensor) -> bool:
    if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"block_scaled_mm: operand dtype {t.dtype}, expected float8_e4m3fn or float8_e5m2")
    return t.dtype == torch.float8_e4m3fn


def _scale_strides(op, role: str) -> tuple[tuple[int, int], bool]:
    """((stride along rows, stride along K blocks) of ``op``'s scale-inverses, B-tiles?) in either layout."""
    g = tuple(op.granularity) if isinstance(op.granularity, tuple) else op.granularity
    s = op.scale_inv
    if g == (1, BLOCK_K):
        return (s.stride(0), s.stride(1)), False
    if g == (BLOCK_K, BLOCK_K) and role == "b":
        if op.prepared:  # torch's layout: [L4, N/128], K blocks along dim 0 (backends.scaled_mm_args)
            return (s.stride(1), s.stride(0)), True
        return (s.stride(0), s.stride(1)), True
    raise ValueError(f"block_scaled_mm: {role.upper()} with granularity {op.granularity}; A takes (1, 128), "
                     "B (1, 128) or (128, 128)")


def block_scaled_mm(a, b, out_dtype: torch.dtype = torch.float32, _config: tuple | None = None) -> torch.Tensor:
    """C [rows, N] = A_hat @ B_hat^T from block-scaled FP8 operands (module docstring), in ``out_dtype``.

    Args:
        a: QuantizedOperand [M, K] with (1, 128) granularity (``rows``: the logical rows of a padded one).
        b: QuantizedOperand [N, K] with (128, 128) or (1, 128) granularity.
        out_dtype: float32, bfloat16 or float16.
    """
    ad, bd = a.data, b.data
    if ad.dim() != 2 or bd.dim() != 2 or ad.shape[1] != bd.shape[1]:
        raise ValueError(f"block_scaled_mm: A {tuple(ad.shape)} and B {tuple(bd.shape)} need [M, K] and [N, K]")
    M, K = ad.shape
    N = bd.shape[0]
    if K % BLOCK_K:
        raise ValueError(f"block_scaled_mm: K = {K} is not a multiple of {BLOCK_K}")
    out_kind = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(out_dtype)
    if out_kind is None:
        raise ValueError(f"block_scaled_mm: out_dtype {out_dtype}, expected float32, bfloat16 or float16")
    (ssam, ssak), _ = _scale_strides(a, "a")
    (ssbn, ssbk), b_tiles = _scale_strides(b, "b")
    a_e4m3, b_e4m3 = _is_e4m3(ad), _is_e4m3(bd)
    a8, b8 = ad.view(torch.uint8), bd.view(torch.uint8)
    out = torch.empty(M, N, dtype=out_dtype, device=ad.device)
    if M and N:
        bm, bn, warps, stages = _config or _gemm_config(ad.device)
        cv = out.view(torch.int16) if out_kind == 1 else out
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _block_mm_kernel[grid](
            a8, b8, a.scale_inv, b.scale_inv, cv, M, N, K,
            a8.stride(0), a8.stride(1), b8.stride(0), b8.stride(1), ssam, ssak, ssbn, ssbk, cv.stride(0), cv.stride(1),
            A_E4M3=a_e4m3, B_E4M3=b_e4m3, B_TILES=b_tiles, OUT=out_kind, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K,
            GROUP_M=8, IMPRECISE=IMPRECISE_K, HW=_HW, num_warps=warps, num_stages=stages, **_OPTS)
    rows = a.rows if a.rows is not None else M
    return out[:rows] if rows != M else out


def _tune_operands(dev: torch.device, m: int, n: int, k: int):
    """Random dgrad-like operands on ``dev``: A [m, k] E5M2 1x128, B [n, k] E4M3 128x128 tiles."""
    from nemo_fp8rl.fp8.backends import QuantizedOperand

    a = QuantizedOperand(torch.randint(0, 120, (m, k), device=dev, dtype=torch.uint8).view(torch.float8_e5m2),
                         torch.ones(m, k // BLOCK_K, device=dev), (1, BLOCK_K))
    b = QuantizedOperand(torch.randint(0, 120, (n, k), device=dev, dtype=torch.uint8).view(torch.float8_e4m3fn),
                         torch.ones(n // BLOCK_K, k // BLOCK_K, device=dev), (BLOCK_K, BLOCK_K))
    return a, b


def _gemm_config(dev: torch.device) -> tuple:
    """The launch configuration on ``dev``: each of :data:`GEMM_CONFIGS` timed once per process on
    :data:`TUNE_MNK` (the defaults on the interpreter or with NEMO_FP8RL_KERNEL_TUNE=0)."""
    if dev.type != "cuda" or _INTERPRET or os.environ.get("NEMO_FP8RL_KERNEL_TUNE", "1") == "0":
        return _DEFAULT
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _CHOSEN:
        _CHOSEN[key] = _DEFAULT  # while timing (and if timing fails)
        try:
            a, b = _tune_operands(dev, *TUNE_MNK)
            times = {}
            for c in GEMM_CONFIGS:
                try:
                    times[c] = _time_ms(lambda c=c: block_scaled_mm(a, b, torch.bfloat16, _config=c))
                except Exception:  # noqa: BLE001 - a configuration this GPU cannot run (shared memory)
                    continue
            if times:
                _CHOSEN[key] = min(times, key=times.get)
        except Exception:  # noqa: BLE001 - timing is an optimisation; the default is correct
            pass
    return _CHOSEN[key]


_HYBRID: dict = {}


def hybrid_uses_fp8_gemm(dev: torch.device) -> bool:
    """Whether ``blockwise`` + ``hybrid`` runs its dgrad and wgrad GEMMs on this kernel (True) or as bf16
    GEMMs of the dequantized operands (False), on ``dev``.

    ``NEMO_FP8RL_HYBRID_GEMM``: ``fp8`` or ``bf16`` forces one; ``auto`` (default) times both once per process
    and GPU on :data:`TUNE_MNK` (dgrad's shape at 8192 tokens; the cast of the FP8 operands included on
    neither side: both paths cast once) and keeps the faster, so hybrid is never slower than its bf16 path
    there. The choice is fixed for the process (the forward saves the layouts the backward's GEMMs need).
    On the interpreter, ``auto`` means bf16 (the path before this kernel)."""
    mode = os.environ.get("NEMO_FP8RL_HYBRID_GEMM", "auto")
    if mode not in ("auto", "fp8", "bf16"):
        raise ValueError(f"NEMO_FP8RL_HYBRID_GEMM={mode!r}: auto, fp8 or bf16")
    if mode != "auto":
        return mode == "fp8"
    if dev.type != "cuda":
        return False
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _HYBRID:
        _HYBRID[key] = {"fp8_gemm": False}  # while timing (and if the kernel fails here: the bf16 path)
        try:
            m, n, k = TUNE_MNK
            a, b = _tune_operands(dev, m, n, k)
            ab, bb = (torch.randn(m, k, device=dev, dtype=torch.bfloat16),
                      torch.randn(k, n, device=dev, dtype=torch.bfloat16))
            t_fp8 = _time_ms(lambda: block_scaled_mm(a, b, torch.bfloat16))
            t_bf16 = _time_ms(lambda: torch.mm(ab, bb))
            _HYBRID[key] = {"fp8_gemm": t_fp8 < t_bf16, "fp8_gemm_ms": t_fp8, "bf16_ms": t_bf16}
        except Exception as e:  # noqa: BLE001 - no FP8 kernel here: the bf16 path
            _HYBRID[key]["error"] = f"{type(e).__name__}: {e}"[:300]
    return _HYBRID[key]["fp8_gemm"]


def hybrid_choice() -> dict:
    """``{device index: {"fp8_gemm": bool, "fp8_gemm_ms", "bf16_ms" (or "error")}}`` decided in this process."""
    return {k: dict(v) for k, v in _HYBRID.items()}


def tuned_configs() -> dict:
    """``{device index: (BLOCK_M, BLOCK_N, num_warps, num_stages)}`` chosen in this process."""
    return dict(_CHOSEN)


def block_gemm_error_bound(a_hat: torch.Tensor, b_hat: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                           accumulation_bits: int = 14) -> torch.Tensor:
    """Per-element bound on |block_scaled_mm - exact| [M, N] float64, on a GPU or in the interpreter: the
    products are exact; Hopper adds the :data:`IMPRECISE_K` products of one FP8 MMA instruction with
    ``accumulation_bits`` (~14) significant bits, then in float32 across instructions and K blocks; the two
    scale products after each block and a bf16/fp16 output's rounding as ``backends.gemm_error_bound`` counts
    them. a_hat [M, K], b_hat [N, K]: the dequantized operands (``code * scale_inv``). The interpreter sums in
    float32 throughout, inside the bound."""
    from nemo_fp8rl.fp8.backends import gemm_error_bound

    return gemm_error_bound(a_hat, b_hat, out_dtype, fast_accum=True, accumulation_bits=accumulation_bits,
                            promote_every=IMPRECISE_K)


__all__ = ["BLOCK_K", "block_gemm_error_bound", "block_scaled_mm", "hybrid_choice", "hybrid_uses_fp8_gemm",
           "tuned_configs"]
