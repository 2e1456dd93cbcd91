"""Triton kernels of the torch FP8 backend: every FP8 layout of an operand from one read of it.

An FP8 linear runs three GEMMs on Hopper's scaled-GEMM kernels, which take A row-major and B
column-major only (``C = A @ B^T``, both reduced along their last dim):

    forward  y  = x  W^T     A = x   [M, K]   B = W   [N, K]
    dgrad    dx = dy W       A = dy  [M, N]   B = W^T [K, N]
    wgrad    dW = dy^T x     A = dy^T [N, M]  B = x^T [K, M]

so each operand is needed in both layouts: x and x^T, W and W^T, dy and dy^T. The readable reference
(``quantize.py`` + ``.t().contiguous()`` in ``torch_linear.py``) reads the operand once per layout and
copies transposes; these kernels read a tile of the operand once and write every layout the three GEMMs
need (Transformer Engine's "cast + transpose"):

* :func:`cast_transpose_tensorwise` (``tensorwise``, ``delayed``): one scale for the whole tensor.
  Current scaling needs the amax before the first element can be cast, so it is two launches: an amax
  reduction (``_amax_kernel``: each program reduces a tile, one integer ``atomic_max`` per program;
  |x| compared as int32 bit patterns, which orders non-negative floats and puts NaN above inf, as
  ``amax`` propagates NaN), then the cast kernel, which computes the scale from that amax itself.
  Delayed scaling is one launch: the scale is given, the amax the history records is reduced in the same
  pass.
* :func:`cast_transpose_rowwise` (``rowwise``): one scale per row of the operand for its own layout and one
  per column for its transpose (x per token, x^T per input channel; W per output channel, W^T per input
  channel). A row's scale needs the whole row and a column's the whole column, so it is two launches like
  current scaling: one read reduces every row's and every column's amax (``_row_amax_kernel``: per tile,
  one integer ``atomic_max`` per row and per column), a second read casts each tile with its rows' scales
  into x and with its columns' scales into x^T. Scale-inverses are float32 vectors, [R, 1] for an A operand
  (torch's RowWise layout; a B operand takes the [1, R] view).
* :func:`cast_transpose_blockwise` (``blockwise``): 1x128 groups along the reduction dimension. A
  128x128 tile holds every group of both layouts (128 row groups of x, 128 column groups of x^T), so one
  program computes both sets of scales from the tile it read: one launch per operand, no global pass.
  Weights (128x128 tiles) get one scale per tile; their transpose keeps it.
  With ``dequant_bf16`` a layout is written as its dequantized values in bf16 in the operand's own
  layout (what ``fp8_format=hybrid`` runs its E5M2 GEMMs on, see ``torch_linear.py``).

Numerics are the eager quantizer's, bit for bit (``tests/fp8/test_kernels.py`` runs these kernels in
Triton's interpreter on the CPU against ``quantize.py``; the GPU check's parity part on the GPU):

    s = fp32(M 2^-margin / max(amax, eps));  amax in {0, inf, NaN} -> s = 1;  s = inf -> INF_CAP;
    pow2: s <- 2^floor(log2 s);   q = fp8_rtne(clamp(fp32(x) * s, -M, M));   scale_inv = fp32(1 / s)

The division is IEEE round-to-nearest (``div_rn``: Triton's ``/`` is approximate on the GPU). The cast to
FP8 (and bf16 in and out) has two spellings, picked at compile time (``HW``): on the GPU the hardware's own
conversion (``cvt.rn.satfinite.e4m3x2.f32``: round to nearest even, one instruction per two elements; the
GPU check's parity part compares its bytes with the CPU reference), in Triton's interpreter integer bit
operations (:func:`_fp8_bits`), because the interpreter's float32 -> E4M3 cast is wrong when rounding carries
into the exponent (triton 3.9: -124.2 becomes -64 where torch and the GPU give -128) and its bf16 -> float32
conversion loses subnormals. The bit version is what ``tests/fp8/_kernel_checks.py`` pins on every 16-bit
pattern; the only difference between the two is the sign of a NaN (the hardware writes 0x7F for any NaN,
torch keeps the sign: 0xFF), which no comparison of values sees.

Shapes: the operand is 2-D, any strides, float32, bf16 or fp16. Outputs are allocated by the launchers
in exactly the layouts ``backends.scaled_mm_args`` would build (row-padded where torch needs it), so the
GEMMs take them without a copy. This module imports triton at import time: import it through
``kernels.__init__`` (:func:`~nemo_fp8rl.fp8.kernels.kernel_unavailable`), never from ``fp8/`` top level.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

_FP32_MAX = 3.4028234663852886e38
_DTYPE_MAX = {torch.float32: _FP32_MAX, torch.bfloat16: 3.3895313892515355e38, torch.float16: 65504.0}
_FMT = {"e4m3": (448.0, True, torch.float8_e4m3fn), "e5m2": (57344.0, False, torch.float8_e5m2)}
"""format -> (largest finite value M, is E4M3, torch dtype)"""


# ------------------------------------------------------------------------------------------------------
# device functions
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_bits(y, E4M3: tl.constexpr, HW: tl.constexpr):
    """FP8 bit pattern (int32 in [0, 255]) of float32 ``y``, already clamped to [-M, M] or NaN, rounded to
    nearest even. E4M3 (bias 7, 3 mantissa bits, subnormal step 2^-9) or E5M2 (bias 15, 2 bits, 2^-16).

    normal (|y| >= smallest FP8 normal): drop the float32 mantissa's low 20 (21) bits with round-half-even
    by integer addition, whose carry moves into the exponent by itself, then rebias the exponent;
    subnormal: |y| / step rounded to an integer by adding 2^23 in float32 (exact: the sum's ulp is 1).
    NaN -> 0x7F with its sign, as torch's cast; the sign bit is kept for zeros (-0 -> 0x80).
    """
    if HW:  # the GPU's own conversion (cvt.rn.satfinite): one instruction per two elements, same rounding
        if E4M3:
            return y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
        return y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.where(is_nan, 0, a)
    if E4M3:
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # 960 = (127 - 7) << 3
        r = a.to(tl.float32, bitcast=True) * 512.0
        min_normal = 0x3C800000  # 2^-6
    else:
        normal = ((a + 0xFFFFF + ((a >> 21) & 1)) >> 21) - 448  # 448 = (127 - 15) << 2
        r = a.to(tl.float32, bitcast=True) * 65536.0
        min_normal = 0x38800000  # 2^-14
    sub = (r + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a >= min_normal, normal, sub)
    code = tl.where(is_nan, 0x7F, code)
    return code | sign


@triton.jit
def _fp8_value(code, E4M3: tl.constexpr, HW: tl.constexpr):
    """float32 value of an FP8 bit pattern (int32 in [0, 255]) produced by :func:`_fp8_bits`."""
    if HW:
        if E4M3:
            return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return code.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    sign = (code & 0x80) << 24
    mag = code & 0x7F
    if E4M3:
        e = mag >> 3
        m = mag & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
        val = tl.where(e == 0, sub, normal)
        val = tl.where(mag == 0x7F, float("nan"), val)
    else:
        e = mag >> 2
        m = mag & 3
        normal = (((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.0000152587890625  # m * 2^-16
        val = tl.where(e == 0, sub, normal)
        val = tl.where(mag > 0x7C, float("nan"), val)
    return (val.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax, TOP: tl.constexpr, EPS: tl.constexpr, INF_CAP: tl.constexpr, POW2: tl.constexpr):
    """``compute_scale`` of ``quantize.py``, element-wise on float32 amaxes (any shape)."""
    a = amax
    if EPS > 0:
        a = tl.where(a < EPS, EPS, a)  # clamp(min=eps); a NaN stays NaN
    s = tl.math.div_rn(tl.zeros_like(a) + TOP, a)
    s = tl.where(s == float("inf"), INF_CAP, s)
    bad = (a == 0) | (a != a) | (a == float("inf"))
    s = tl.where(bad, 1.0, s)
    if POW2:  # 2^floor(log2 s): s is a positive normal float here, so keep its exponent bits
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _saturate(y, FMAX: tl.constexpr):
    """clamp(y, -M, M) with NaN kept (comparisons with NaN are false)."""
    y = tl.where(y > FMAX, FMAX, y)
    return tl.where(y < -FMAX, -FMAX, y)


@triton.jit
def _to_f32(v, IN_BF16: tl.constexpr, HW: tl.constexpr):
    """float32 of a loaded element: bf16 arrives as its int16 bits and is widened by a shift (exact for
    every pattern, subnormals included: Triton's interpreter converts bf16 subnormals wrongly)."""
    if IN_BF16:
        if HW:
            return v.to(tl.bfloat16, bitcast=True).to(tl.float32)
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _bf16_bits(v, HW: tl.constexpr):
    """bf16 bit pattern (int16) of float32 ``v``, rounded to nearest even (NaN stays NaN), as the GPU's
    ``cvt.rn.bf16.f32``; written with integer operations so the interpreter gives the same bits."""
    if HW:
        return v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, r)
    return r.to(tl.int16)


@triton.jit
def _load_tile(x_ptr, pid_r, pid_c, R, C, sxr, sxc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               IN_BF16: tl.constexpr, HW: tl.constexpr):
    """Tile (pid_r, pid_c) of x [R, C] (any strides) as float32, zeros outside x:
    ``(x_tile [BLOCK_R, BLOCK_C], rows [BLOCK_R] int64, cols [BLOCK_C] int64, in-bounds mask)``."""
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0)
    return _to_f32(x, IN_BF16, HW), rows, cols, mask


@triton.jit
def _abs_bits(x):
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------------------
# per-tensor scale: amax, then cast + transpose
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _amax_kernel(x_ptr, R, C, sxr, sxc, amax_ptr, IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr, HW: tl.constexpr):
    """amax_ptr (int32 [1], zeroed) <- max over x [R, C] of the bit pattern of |x| (= amax bits)."""
    x, _, _, _ = _load_tile(x_ptr, tl.program_id(0), tl.program_id(1), R, C, sxr, sxc, BLOCK_R, BLOCK_C, IN_BF16, HW)
    m = tl.max(tl.max(_abs_bits(x), axis=1), axis=0)
    tl.atomic_max(amax_ptr, m)


@triton.jit
def _tensor_cast_kernel(
    x_ptr, R, C, sxr, sxc,
    amax_ptr, scale_ptr,
    q_ptr, qt_ptr, RT, sinv_ptr,
    amax_out_ptr, sat_ptr, numel_ptr, bad_ptr,
    TOP: tl.constexpr, EPS: tl.constexpr, INF_CAP: tl.constexpr, POW2: tl.constexpr, FMAX: tl.constexpr,
    E4M3: tl.constexpr, CURRENT: tl.constexpr, WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
    RECORD_AMAX: tl.constexpr, STATS: tl.constexpr, IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, HW: tl.constexpr,
):
    """q [R, C] and/or qt [C, RT] (columns R..RT zero) of x [R, C] with one per-tensor scale.

    CURRENT: s from amax_ptr (int32 bits, from ``_amax_kernel``); else s = scale_ptr[0] (delayed), and
    RECORD_AMAX reduces this tensor's amax into amax_out_ptr (int32 bits). sinv_ptr[0] <- fp32(1 / s).
    STATS: saturated count (given scale only), numel and the non-finite amax count (current scale; a
    delayed caller adds that one itself) into int64 counters.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    x, rows, cols, in_mask = _load_tile(x_ptr, pid_r, pid_c, R, C, sxr, sxc, BLOCK_R, BLOCK_C, IN_BF16, HW)
    if CURRENT:
        amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
        s = _scale_of(amax, TOP, EPS, INF_CAP, POW2)
    else:
        s = tl.load(scale_ptr)
    y = x * s
    if STATS:
        if not CURRENT:
            n_sat = tl.sum(tl.sum((tl.abs(y) > FMAX).to(tl.int64), axis=1), axis=0)
            tl.atomic_add(sat_ptr, n_sat)
    code = _fp8_bits(_saturate(y, FMAX), E4M3, HW).to(tl.uint8)
    if WRITE_ROW:
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], code, mask=in_mask)
    if WRITE_COL:
        t_mask = (rows[None, :] < RT) & (cols[:, None] < C)
        tl.store(qt_ptr + cols[:, None] * RT + rows[None, :], tl.trans(code), mask=t_mask)
    if RECORD_AMAX:
        tl.atomic_max(amax_out_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
    if (pid_r == 0) & (pid_c == 0):
        tl.store(sinv_ptr, tl.math.div_rn(tl.zeros_like(s) + 1.0, s))
        if STATS:
            tl.atomic_add(numel_ptr, (tl.zeros((), tl.int64) + R) * C)
            if CURRENT:
                tl.atomic_add(bad_ptr, ((amax != amax) | (amax == float("inf"))).to(tl.int64))


def _compile_options() -> dict:
    """Launch options: libdevice without flush-to-zero (``enable_reflect_ftz=False``, what Inductor's
    ``eager_numerics.disable_ftz`` sets), so ``div_rn`` of a subnormal amax is eager's, and no FMA
    contraction; only the options this Triton has (the interpreter takes none)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - no CUDA backend (CPU interpreter)
        return {}
    known = getattr(CUDAOptions, "__dataclass_fields__", {})
    # no FMA contraction either: every product here is exact or followed by no add, but keep it that way
    return {k: False for k in ("enable_reflect_ftz", "enable_fp_fusion") if k in known}


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_OPTS = {} if _INTERPRET else _compile_options()
_HW = not _INTERPRET
"""Compiled for a GPU: FP8 and bf16 conversions by the hardware's own instructions (round to nearest even,
saturating; the GPU check's parity part compares their bytes with the CPU reference). Interpreted: the
integer-bit versions, exact where the interpreter's own float conversions are not."""


def _in(x: torch.Tensor) -> torch.Tensor:
    """What a kernel reads: bf16 as its int16 bits (widened exactly in the kernel, :func:`_to_f32`)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _out(t: torch.Tensor) -> torch.Tensor:
    """What a kernel writes into: a bf16 output as int16 bits (:func:`_bf16_bits`)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# ------------------------------------------------------------------------------------------------------
# launch configurations: measured once per process and GPU
# ------------------------------------------------------------------------------------------------------

TENSOR_CONFIGS = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 256, 4))
"""(BLOCK_R, BLOCK_C, num_warps) candidates of the per-tensor kernels (amax and cast + transpose) and of the
row-scale kernels (row and column amaxes, cast + transpose), each timed on its own."""
BLOCK_WARPS = (4, 8, 16)
"""num_warps candidates of the 128x128 block kernel."""
TUNE_SHAPE = (8192, 4096)
"""The bf16 tensor the candidates are timed on (an 8B model's activation at 8192 tokens, 64 MiB)."""
_DEFAULT = {"amax": (64, 64, 4), "tensor": (64, 64, 4), "row_amax": (64, 64, 4), "row": (64, 64, 4), "block": 8}
_CHOSEN: dict = {}


def tuned_configs() -> dict:
    """``{(kind, device index): config}`` chosen in this process (empty before the first GPU launch)."""
    return dict(_CHOSEN)


def _time_ms(fn, reps: int = 5) -> float:
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _config(kind: str, dev: torch.device):
    """The launch configuration of ``kind`` (amax | tensor | row_amax | row | block) on ``dev``.

    Every configuration writes the same bits (the tiling changes which program handles an element, never
    its value: ``_kernel_checks.py`` runs several), so the fastest one is picked by timing each candidate
    once per process on a :data:`TUNE_SHAPE` tensor of this GPU (a few milliseconds plus one compile per
    candidate, cached on disk by Triton). Not on the CPU interpreter, and not with NEMO_FP8RL_KERNEL_TUNE=0
    (then the defaults)."""
    if dev.type != "cuda" or _INTERPRET or os.environ.get("NEMO_FP8RL_KERNEL_TUNE", "1") == "0":
        return _DEFAULT[kind]
    key = (kind, dev.index if dev.index is not None else torch.cuda.current_device())
    if key not in _CHOSEN:
        _CHOSEN[key] = _DEFAULT[kind]  # while timing (and if timing fails)
        try:
            x = torch.randn(*TUNE_SHAPE, device=dev, dtype=torch.bfloat16)
            if kind == "block":
                times = {w: _time_ms(lambda w=w: cast_transpose_blockwise(x, "e4m3", _warps=w)) for w in BLOCK_WARPS}
            else:
                amax = torch.zeros(1, dtype=torch.int32, device=dev)

                def run(c):
                    if kind == "amax":
                        _amax_kernel[(triton.cdiv(x.shape[0], c[0]), triton.cdiv(x.shape[1], c[1]))](
                            _in(x), x.shape[0], x.shape[1], x.stride(0), x.stride(1), amax, IN_BF16=True,
                            BLOCK_R=c[0], BLOCK_C=c[1], num_warps=c[2], HW=_HW, **_OPTS)
                    elif kind == "row_amax":
                        ramax = torch.zeros(x.shape[0] + x.shape[1], dtype=torch.int32, device=dev)
                        _row_amax_kernel[(triton.cdiv(x.shape[0], c[0]), triton.cdiv(x.shape[1], c[1]))](
                            _in(x), x.shape[0], x.shape[1], x.stride(0), x.stride(1), ramax[:x.shape[0]],
                            ramax[x.shape[0]:], ROW=True, COL=True, IN_BF16=True, BLOCK_R=c[0], BLOCK_C=c[1],
                            num_warps=c[2], HW=_HW, **_OPTS)
                    elif kind == "row":
                        cast_transpose_rowwise(x, "e4m3", _tiles=c)  # both layouts, as the rowwise linear runs
                    else:
                        cast_transpose_tensorwise(x, "e4m3", _tiles=c)  # current scaling, as tensorwise runs

                times = {c: _time_ms(lambda c=c: run(c)) for c in TENSOR_CONFIGS}
            _CHOSEN[key] = min(times, key=times.get)
            logger.info("FP8 kernels: %s launch config %s on %s (timed: %s)", kind, _CHOSEN[key],
                        torch.cuda.get_device_name(dev), {str(k): round(v, 4) for k, v in times.items()})
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile: keep the default
            logger.warning("FP8 kernels: timing the %s launch configs failed (%s); using %s", kind, e, _DEFAULT[kind])
    return _CHOSEN[key]


def cast_transpose_tensorwise(
    x: torch.Tensor, fmt: str, *, scale: Optional[torch.Tensor] = None, pow2: bool = False, eps: float = 0.0,
    margin: int = 0, write_row: bool = True, write_col: bool = True, col_pad: int = 16,
    stats=None, count_nonfinite: bool = True, _tiles=None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 of x [R, C] in both layouts: ``(q [R, C], qt [C, RT], scale_inv [], amax [])``.

    ``q = fp8(clamp(x * s, -M, M))`` row-major; ``qt`` = q^T row-major with its columns zero-padded to
    RT = R rounded up to ``col_pad`` (the wgrad GEMM reduces along them; zeros change no sum). s is the
    current scale of ``compute_scale(amax(x), fmt, margin, pow2, eps)`` or the given delayed ``scale``
    ([] float32); ``amax`` (float32 []) is x's amax either way (delayed scaling records it).
    ``stats`` (:class:`~nemo_fp8rl.fp8.quantize.Fp8Stats`): counted as the eager quantizer counts
    (``count_nonfinite=False``: a given scale's non-finite amax is left to the caller, who counts it in
    :func:`delayed_update`'s launch).
    Layouts not asked for are None. Two launches for a current scale, one for a given one.
    ``_tiles``: (BLOCK_R, BLOCK_C, num_warps) of the cast kernel, default the tuned one (:func:`_config`).
    """
    R, C = x.shape
    fmax, e4m3, dt = _FMT[fmt]
    dev = x.device
    RT = -(-R // col_pad) * col_pad
    q = torch.empty(R, C, dtype=torch.uint8, device=dev) if write_row else None
    qt = torch.empty(C, RT, dtype=torch.uint8, device=dev) if write_col else None
    sinv = torch.empty((), dtype=torch.float32, device=dev)
    amax_bits = torch.zeros(1, dtype=torch.int32, device=dev)
    br, bc, nw = _tiles if _tiles is not None else _config("tensor", dev)
    current = scale is None
    if current:
        ar, ac, aw = _config("amax", dev)
        _amax_kernel[(triton.cdiv(R, ar), triton.cdiv(C, ac))](_in(x), R, C, x.stride(0), x.stride(1), amax_bits,
                                                              IN_BF16=x.dtype == torch.bfloat16, BLOCK_R=ar,
                                                              BLOCK_C=ac, num_warps=aw, HW=_HW, **_OPTS)
    if stats is not None:
        stats.to_device(dev)
    dummy = amax_bits
    grid = (triton.cdiv(max(R, RT if write_col else R), br), triton.cdiv(C, bc))
    _tensor_cast_kernel[grid](
        _in(x), R, C, x.stride(0), x.stride(1),
        amax_bits, scale if scale is not None else sinv,
        q if q is not None else dummy, qt if qt is not None else dummy, RT, sinv,
        amax_bits, *(
            (stats.saturated, stats.numel, stats.nonfinite_amax) if stats is not None else (dummy, dummy, dummy)),
        TOP=fmax * 2.0 ** (-margin), EPS=float(eps), INF_CAP=_FP32_MAX, POW2=bool(pow2), FMAX=fmax, E4M3=e4m3,
        CURRENT=current, WRITE_ROW=write_row, WRITE_COL=write_col, RECORD_AMAX=not current,
        STATS=stats is not None, IN_BF16=x.dtype == torch.bfloat16, BLOCK_R=br, BLOCK_C=bc, num_warps=nw, HW=_HW, **_OPTS,
    )
    amax = amax_bits.view(torch.float32).reshape(())
    if stats is not None and not current and count_nonfinite:
        stats.nonfinite_amax += (~torch.isfinite(amax)).to(torch.int64)
    return (q.view(dt) if q is not None else None, qt.view(dt) if qt is not None else None, sinv, amax)


# ------------------------------------------------------------------------------------------------------
# block scales: 1x128 groups along both dims of a tile, or one 128x128 tile scale
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _block_cast_kernel(
    x_ptr, R, C, sxr, sxc,
    q_ptr, RQ, sq_ptr,
    qt_ptr, RT, sqt_ptr,
    numel_ptr, bad_ptr,
    TOP: tl.constexpr, EPS: tl.constexpr, INF_CAP: tl.constexpr, POW2: tl.constexpr, FMAX: tl.constexpr,
    E4M3: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, TILE: tl.constexpr,
    ROW_BF16: tl.constexpr, COL_BF16: tl.constexpr, STATS: tl.constexpr, IN_BF16: tl.constexpr, B: tl.constexpr,
    HW: tl.constexpr,
):
    """One B x B tile of x [R, C] (zeros outside it), B = 128.

    ROW (1xB groups along C): codes q [RQ, C] (rows R..RQ zero, scale 1) and scale_inv at
    ``sq[c_block * RQ + r]`` (the column-major [RQ, C/B] torch's 1x128 operand wants); ROW_BF16 writes
    the dequantized values into a bf16 [R, C] instead (no scales).
    COL (Bx1 groups along R): codes of x^T, qt [C, RT] (columns R..RT zero), scale_inv at
    ``sqt[r_block * C + c]`` (column-major [C, RT/B]); COL_BF16: dequantized bf16 values in x's own
    [R, C] layout instead.
    TILE (one scale per tile, weights): codes q [R, C] and qt [C, R]; scale_inv at ``sq[i * L + j]`` for
    q's tile (i, j) and ``sqt[j * LT + i]`` for qt's (L, LT: the row strides RQ, RT given by the
    launcher); COL_BF16: the dequantized tile into a bf16 [R, C].
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    x, rows, cols, in_mask = _load_tile(x_ptr, pid_r, pid_c, R, C, sxr, sxc, B, B, IN_BF16, HW)
    ab = _abs_bits(x)
    if TILE:
        amax = tl.max(tl.max(ab, axis=1), axis=0).to(tl.float32, bitcast=True)
        s = _scale_of(amax, TOP, EPS, INF_CAP, POW2)
        code = _fp8_bits(_saturate(x * s, FMAX), E4M3, HW)
        sinv = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], code.to(tl.uint8), mask=in_mask)
        tl.store(sq_ptr + pid_r * RQ + pid_c, sinv)
        if COL_BF16:  # hybrid: W's dequantized values for the bf16 dgrad GEMM, in W's layout
            val = _fp8_value(code, E4M3, HW) * sinv
            tl.store(qt_ptr + rows[:, None] * C + cols[None, :], _bf16_bits(val, HW), mask=in_mask)
        else:
            tl.store(qt_ptr + cols[:, None] * R + rows[None, :], tl.trans(code.to(tl.uint8)),
                     mask=(rows[None, :] < R) & (cols[:, None] < C))
            tl.store(sqt_ptr + pid_c * RT + pid_r, sinv)
        if STATS:
            if (pid_r == 0) & (pid_c == 0):
                tl.atomic_add(numel_ptr, (tl.zeros((), tl.int64) + R) * C)
            tl.atomic_add(bad_ptr, ((amax != amax) | (amax == float("inf"))).to(tl.int64))
    if ROW:
        amax_r = tl.max(ab, axis=1).to(tl.float32, bitcast=True)  # [B]
        s_r = _scale_of(amax_r, TOP, EPS, INF_CAP, POW2)
        code = _fp8_bits(_saturate(x * s_r[:, None], FMAX), E4M3, HW)
        sinv_r = tl.math.div_rn(tl.zeros_like(s_r) + 1.0, s_r)
        if ROW_BF16:
            val = _fp8_value(code, E4M3, HW) * sinv_r[:, None]
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], _bf16_bits(val, HW), mask=in_mask)
        else:
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], code.to(tl.uint8),
                     mask=(rows[:, None] < RQ) & (cols[None, :] < C))
            tl.store(sq_ptr + pid_c * RQ + rows, sinv_r, mask=rows < RQ)
        if STATS:
            if (pid_r == 0) & (pid_c == 0):
                tl.atomic_add(numel_ptr, (tl.zeros((), tl.int64) + R) * C)
            n_bad = tl.sum(((amax_r != amax_r) | (amax_r == float("inf"))).to(tl.int64) * (rows < R).to(tl.int64), axis=0)
            tl.atomic_add(bad_ptr, n_bad)
    if COL:
        amax_c = tl.max(ab, axis=0).to(tl.float32, bitcast=True)  # [B]
        s_c = _scale_of(amax_c, TOP, EPS, INF_CAP, POW2)
        code = _fp8_bits(_saturate(x * s_c[None, :], FMAX), E4M3, HW)
        sinv_c = tl.math.div_rn(tl.zeros_like(s_c) + 1.0, s_c)
        if COL_BF16:
            val = _fp8_value(code, E4M3, HW) * sinv_c[None, :]
            tl.store(qt_ptr + rows[:, None] * C + cols[None, :], _bf16_bits(val, HW), mask=in_mask)
        else:
            tl.store(qt_ptr + cols[:, None] * RT + rows[None, :], tl.trans(code.to(tl.uint8)),
                     mask=(rows[None, :] < RT) & (cols[:, None] < C))
            tl.store(sqt_ptr + pid_r * C + cols, sinv_c, mask=cols < C)
        if STATS:
            if (pid_r == 0) & (pid_c == 0):
                tl.atomic_add(numel_ptr, (tl.zeros((), tl.int64) + C) * RT)
            n_bad = tl.sum(((amax_c != amax_c) | (amax_c == float("inf"))).to(tl.int64) * (cols < C).to(tl.int64), axis=0)
            tl.atomic_add(bad_ptr, n_bad)


def _block_common(x: torch.Tensor, fmt: str, pow2: bool, eps: float):
    fmax, e4m3, _ = _FMT[fmt]
    return dict(TOP=fmax, EPS=float(eps), INF_CAP=_DTYPE_MAX[x.dtype], POW2=bool(pow2), FMAX=fmax, E4M3=e4m3)


def _stats_args(stats, dev, dummy):
    if stats is None:
        return dummy, dummy
    stats.to_device(dev)
    return stats.numel, stats.nonfinite_amax


def cast_transpose_blockwise(
    x: torch.Tensor, fmt: str, *, pow2: bool = True, eps: float = 0.0, row: bool = True, col: bool = True,
    row_bf16: bool = False, col_bf16: bool = False, row_pad: int = 4, block: int = 128, stats=None, _warps=None,
):
    """1x``block`` FP8 groups of x [R, C] along C (``row``) and along R (``col``), one launch.

    Returns ``(row_out, col_out)``, each None when not asked for:
    row: ``(q [RQ, C] FP8, scale_inv [RQ, C/B])``, RQ = R rounded up to ``row_pad`` (rows R..RQ are zeros
    with scale_inv 1), scale_inv column-major (strides (1, RQ)): torch's 1x128 A operand as it is; or with
    ``row_bf16`` the dequantized values ``q * scale_inv`` as bf16 [R, C].
    col: ``(q^T [C, RT] FP8, scale_inv [C, RT/B])``, RT = R rounded up to B (columns R..RT zero: the
    wgrad GEMM reduces along them), scale_inv column-major (strides (1, C)); or with ``col_bf16`` the
    dequantized values as bf16 [R, C] (x's layout: a bf16 GEMM transposes for free).
    C must be a multiple of B (the torch backend requires it of blockwise layers).
    """
    R, C = x.shape
    B = block
    if C % B:
        raise ValueError(f"cast_transpose_blockwise: {C} columns is not a multiple of the block {B}")
    dev = x.device
    RQ, RT = -(-R // row_pad) * row_pad, -(-R // B) * B
    dummy = torch.empty(1, dtype=torch.int64, device=dev)
    fdummy = torch.empty(1, dtype=torch.float32, device=dev)
    q = sq = qt = sqt = None
    if row:
        q = torch.empty(R, C, dtype=torch.bfloat16, device=dev) if row_bf16 else torch.empty(RQ, C, dtype=torch.uint8, device=dev)
        sq = None if row_bf16 else torch.empty(C // B, RQ, dtype=torch.float32, device=dev)
    if col:
        qt = torch.empty(R, C, dtype=torch.bfloat16, device=dev) if col_bf16 else torch.empty(C, RT, dtype=torch.uint8, device=dev)
        sqt = None if col_bf16 else torch.empty(RT // B, C, dtype=torch.float32, device=dev)
    rows = max(R, RQ if (row and not row_bf16) else 0, RT if (col and not col_bf16) else 0)
    numel, bad = _stats_args(stats, dev, dummy)
    _block_cast_kernel[(triton.cdiv(rows, B), C // B)](
        _in(x), R, C, x.stride(0), x.stride(1),
        _out(q) if q is not None else dummy, RQ, sq if sq is not None else fdummy,
        _out(qt) if qt is not None else dummy, RT, sqt if sqt is not None else fdummy,
        numel, bad, **_block_common(x, fmt, pow2, eps), ROW=row, COL=col, TILE=False,
        ROW_BF16=row_bf16, COL_BF16=col_bf16, STATS=stats is not None, IN_BF16=x.dtype == torch.bfloat16, B=B,
        num_warps=_warps if _warps is not None else _config("block", dev), HW=_HW, **_OPTS,
    )
    dt = _FMT[fmt][2]
    row_out = col_out = None
    if row:
        row_out = q if row_bf16 else (q.view(dt), sq.t())
    if col:
        col_out = qt if col_bf16 else (qt.view(dt), sqt.t())
    return row_out, col_out


def cast_weight_tiles(
    w: torch.Tensor, fmt: str, *, pow2: bool = True, eps: float = 0.0, transpose_bf16: bool = False,
    block: int = 128, stats=None,
):
    """128x128-tile FP8 of a weight w [N, K] and of its transpose, one launch: ``(fwd, bwd)``.

    fwd: ``(q [N, K] FP8, scale_inv [L, N/B])`` with scale_inv[j, i] the inverse scale of tile (i, j),
    L = K/B rounded up to 4 (padding entries 1), strides (1, L): torch's 128x128 B operand of the forward
    GEMM as it is. bwd: ``(q^T [K, N] FP8, scale_inv [LT, K/B])`` (LT = N/B rounded up to 4), the B operand
    of dgrad (a tile's transpose keeps its scale); or with ``transpose_bf16`` the dequantized weight as
    bf16 [N, K] (``fp8_format=hybrid``: dgrad runs in bf16). N and K must be multiples of B.
    """
    N, K = w.shape
    B = block
    if N % B or K % B:
        raise ValueError(f"cast_weight_tiles: weight [{N}, {K}] is not a multiple of the tile {B}")
    dev = w.device
    nb, kb = N // B, K // B
    L, LT = -(-kb // 4) * 4, -(-nb // 4) * 4
    dummy = torch.empty(1, dtype=torch.int64, device=dev)
    q = torch.empty(N, K, dtype=torch.uint8, device=dev)
    sq = torch.ones(nb, L, dtype=torch.float32, device=dev)
    if transpose_bf16:
        qt, sqt = torch.empty(N, K, dtype=torch.bfloat16, device=dev), torch.empty(1, dtype=torch.float32, device=dev)
    else:
        qt, sqt = torch.empty(K, N, dtype=torch.uint8, device=dev), torch.ones(kb, LT, dtype=torch.float32, device=dev)
    numel, bad = _stats_args(stats, dev, dummy)
    _block_cast_kernel[(nb, kb)](
        _in(w), N, K, w.stride(0), w.stride(1), q, L, sq, _out(qt), LT, sqt, numel, bad,
        **_block_common(w, fmt, pow2, eps), ROW=False, COL=False, TILE=True, ROW_BF16=False,
        COL_BF16=transpose_bf16, STATS=stats is not None, IN_BF16=w.dtype == torch.bfloat16, B=B,
        num_warps=_config("block", dev), HW=_HW, **_OPTS,
    )
    dt = _FMT[fmt][2]
    fwd = (q.view(dt), sq.t())
    bwd = qt if transpose_bf16 else (qt.view(dt), sqt.t())
    return fwd, bwd


# ------------------------------------------------------------------------------------------------------
# row scales (rowwise): every row's and every column's amax, then cast + transpose
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _row_amax_kernel(x_ptr, R, C, sxr, sxc, ramax_ptr, camax_ptr, ROW: tl.constexpr, COL: tl.constexpr,
                     IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HW: tl.constexpr):
    """Per-row and per-column amaxes of x [R, C] in one read, as int32 bit patterns of |x| (zeroed buffers):

        ROW: ramax[r] <- max_c bits|x[r, c]|   (ramax int32 [R])
        COL: camax[c] <- max_r bits|x[r, c]|   (camax int32 [C])

    Each program reduces its tile along both axes and adds BLOCK_R + BLOCK_C ``atomic_max`` (the bit patterns
    of non-negative floats order as the floats do, NaN above inf: ``amax`` propagates NaN)."""
    x, rows, cols, _ = _load_tile(x_ptr, tl.program_id(0), tl.program_id(1), R, C, sxr, sxc, BLOCK_R, BLOCK_C,
                                  IN_BF16, HW)
    ab = _abs_bits(x)
    # relaxed: only the next launch reads the amaxes, and the launch boundary orders them
    if ROW:
        tl.atomic_max(ramax_ptr + rows, tl.max(ab, axis=1), mask=rows < R, sem="relaxed")
    if COL:
        tl.atomic_max(camax_ptr + cols, tl.max(ab, axis=0), mask=cols < C, sem="relaxed")


@triton.jit
def _row_cast_kernel(
    x_ptr, R, C, sxr, sxc,
    ramax_ptr, q_ptr, sq_ptr,
    camax_ptr, qt_ptr, RT, sqt_ptr,
    numel_ptr, bad_ptr,
    TOP: tl.constexpr, EPS: tl.constexpr, INF_CAP: tl.constexpr, POW2: tl.constexpr, FMAX: tl.constexpr,
    E4M3: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, STATS: tl.constexpr, IN_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HW: tl.constexpr,
):
    """One tile of x [R, C] cast with its rows' scales and with its columns' scales (amaxes from
    ``_row_amax_kernel``):

        ROW: s_r = scale(ramax[r]);  q[r, c] = fp8(sat(x[r, c] * s_r))  into q [R, C];  sq[r] = fp32(1 / s_r)
        COL: s_c = scale(camax[c]);  qt[c, r] = fp8(sat(x[r, c] * s_c)) into qt [C, RT] (columns R..RT
             zero: the grid covers RT rows, read as zeros);  sqt[c] = fp32(1 / s_c)

    The scale-inverses are written by the first column (row) of programs, which also count the groups with a
    non-finite amax under STATS; program (0, 0) adds R * C per layout to numel.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    x, rows, cols, in_mask = _load_tile(x_ptr, pid_r, pid_c, R, C, sxr, sxc, BLOCK_R, BLOCK_C, IN_BF16, HW)
    if ROW:
        amax_r = tl.load(ramax_ptr + rows, mask=rows < R, other=0).to(tl.float32, bitcast=True)  # [BLOCK_R]
        s_r = _scale_of(amax_r, TOP, EPS, INF_CAP, POW2)
        code = _fp8_bits(_saturate(x * s_r[:, None], FMAX), E4M3, HW).to(tl.uint8)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], code, mask=in_mask)
        if pid_c == 0:
            tl.store(sq_ptr + rows, tl.math.div_rn(tl.zeros_like(s_r) + 1.0, s_r), mask=rows < R)
            if STATS:
                bad_r = ((amax_r != amax_r) | (amax_r == float("inf"))) & (rows < R)
                tl.atomic_add(bad_ptr, tl.sum(bad_r.to(tl.int64), axis=0))
    if COL:
        amax_c = tl.load(camax_ptr + cols, mask=cols < C, other=0).to(tl.float32, bitcast=True)  # [BLOCK_C]
        s_c = _scale_of(amax_c, TOP, EPS, INF_CAP, POW2)
        code_t = _fp8_bits(_saturate(x * s_c[None, :], FMAX), E4M3, HW).to(tl.uint8)
        tl.store(qt_ptr + cols[:, None] * RT + rows[None, :], tl.trans(code_t),
                 mask=(rows[None, :] < RT) & (cols[:, None] < C))
        if pid_r == 0:
            tl.store(sqt_ptr + cols, tl.math.div_rn(tl.zeros_like(s_c) + 1.0, s_c), mask=cols < C)
            if STATS:
                bad_c = ((amax_c != amax_c) | (amax_c == float("inf"))) & (cols < C)
                tl.atomic_add(bad_ptr, tl.sum(bad_c.to(tl.int64), axis=0))
    if STATS:
        if (pid_r == 0) & (pid_c == 0):
            tl.atomic_add(numel_ptr, (tl.zeros((), tl.int64) + R) * C * (ROW + COL))


def cast_transpose_rowwise(
    x: torch.Tensor, fmt: str, *, pow2: bool = True, eps: float = 0.0, row: bool = True, col: bool = True,
    col_pad: int = 16, stats=None, _tiles=None, _amax_tiles=None,
):
    """Row-scaled FP8 of x [R, C] along C and of x^T along R (one scale per column of x), two launches.

    Per group g (a row of x for ``row``, a column of x for ``col``), as ``quantize(.., "row")``:

        s_g = fp32(M / max(amax_g, eps));  amax_g in {0, inf, NaN} -> s_g = 1;  s_g = inf -> fp32 max;
        pow2: s_g <- 2^floor(log2 s_g);     q = fp8_rtne(clamp(fp32(x) * s_g, -M, M));  scale_inv = fp32(1 / s_g)

    Returns ``(row_out, col_out)``, each None when not asked for:
    row: ``(q [R, C] FP8, scale_inv [R, 1])``: torch's RowWise A operand as it is (fprop's x, dgrad's dy);
    the B operand (the weight) takes ``scale_inv.view(1, -1)``.
    col: ``(q^T [C, RT] FP8, scale_inv [C, 1])``, RT = R rounded up to ``col_pad`` (columns R..RT zero: the
    wgrad GEMM reduces along them; zeros change no sum): wgrad's dy^T (A) or x^T (B, ``scale_inv.view(1, -1)``),
    or with ``col_pad=1`` W^T, dgrad's B operand.
    The first launch reduces every row's and column's amax from one read of x (``_row_amax_kernel``), the
    second reads x again and writes both layouts (``_row_cast_kernel``). ``stats``: counted as the eager
    quantizer counts its two quantizations (numel per layout, groups with an inf/NaN amax; no saturation with
    a current scale). ``_tiles`` / ``_amax_tiles``: (BLOCK_R, BLOCK_C, num_warps) of the cast / amax launch,
    default the tuned ones (:func:`_config`).
    """
    R, C = x.shape
    fmax, e4m3, dt = _FMT[fmt]
    dev = x.device
    RT = -(-R // col_pad) * col_pad
    R4 = -(-R // 4) * 4
    amax = torch.zeros(R4 + C, dtype=torch.int32, device=dev)  # one fill: rows' amaxes, then columns'
    q = torch.empty(R, C, dtype=torch.uint8, device=dev) if row else None
    sq = torch.empty(R, 1, dtype=torch.float32, device=dev) if row else None
    qt = torch.empty(C, RT, dtype=torch.uint8, device=dev) if col else None
    sqt = torch.empty(C, 1, dtype=torch.float32, device=dev) if col else None
    ar, ac, aw = _amax_tiles if _amax_tiles is not None else _config("row_amax", dev)
    in_bf16 = x.dtype == torch.bfloat16
    ramax, camax = amax[:R4], amax[R4:]
    _row_amax_kernel[(triton.cdiv(R, ar), triton.cdiv(C, ac))](
        _in(x), R, C, x.stride(0), x.stride(1), ramax, camax, ROW=row, COL=col, IN_BF16=in_bf16,
        BLOCK_R=ar, BLOCK_C=ac, num_warps=aw, HW=_HW, **_OPTS)
    dummy = torch.empty(1, dtype=torch.int64, device=dev)
    fdummy = torch.empty(1, dtype=torch.float32, device=dev)
    numel, bad = _stats_args(stats, dev, dummy)
    br, bc, nw = _tiles if _tiles is not None else _config("row", dev)
    grid = (triton.cdiv(max(R, RT if col else R), br), triton.cdiv(C, bc))
    _row_cast_kernel[grid](
        _in(x), R, C, x.stride(0), x.stride(1),
        ramax, q if q is not None else dummy, sq if sq is not None else fdummy,
        camax, qt if qt is not None else dummy, RT, sqt if sqt is not None else fdummy,
        numel, bad, TOP=fmax, EPS=float(eps), INF_CAP=_FP32_MAX, POW2=bool(pow2), FMAX=fmax, E4M3=e4m3,
        ROW=row, COL=col, STATS=stats is not None, IN_BF16=in_bf16, BLOCK_R=br, BLOCK_C=bc, num_warps=nw,
        HW=_HW, **_OPTS,
    )
    return ((q.view(dt), sq) if row else None), ((qt.view(dt), sqt) if col else None)


# ------------------------------------------------------------------------------------------------------
# delayed scaling's bookkeeping in one launch
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _delayed_update_kernel(hist_ptr, amax_ptr, new_hist_ptr, scale_ptr, count_ptr, L, MOST_RECENT: tl.constexpr,
                           TOP: tl.constexpr, EPS: tl.constexpr, INF_CAP: tl.constexpr, POW2: tl.constexpr,
                           COUNT: tl.constexpr, BLOCK_L: tl.constexpr):
    """:func:`delayed_update` in one program: read the history [L] and the amax, write the new scale and the
    rolled history (another buffer: no thread reads a slot another writes); COUNT: add 1 to the int64 counter
    when the amax is inf or NaN."""
    offs = tl.arange(0, BLOCK_L)
    m = offs < L
    h = tl.load(hist_ptr + offs, mask=m, other=0.0)
    a = tl.load(amax_ptr).to(tl.float32)
    if COUNT:
        bad = (a != a) | (a == float("inf")) | (a == float("-inf"))
        tl.store(count_ptr, tl.load(count_ptr) + tl.where(bad, 1, 0).to(tl.int64))
    h = tl.where(offs == 0, a, h)
    if MOST_RECENT:
        ref = a
    else:  # torch.max: NaN if any entry is NaN
        nan = tl.max(tl.where(m & (h != h), 1, 0), axis=0)
        ref = tl.max(tl.where(m, h, float("-inf")), axis=0)
        ref = tl.where(nan > 0, float("nan"), ref)
    tl.store(scale_ptr, _scale_of(ref, TOP, EPS, INF_CAP, POW2))
    tl.store(new_hist_ptr + offs + 1, h, mask=(offs + 1) < L)
    tl.store(new_hist_ptr + offs, 0.0, mask=offs == 0)


def delayed_update(history: torch.Tensor, amax: torch.Tensor, fmt: str, *, most_recent: bool, margin: int = 0,
                   pow2: bool = False, eps: float = 0.0, nonfinite: Optional[torch.Tensor] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling's update after a quantization, one launch instead of ~25 small torch ops (issue 38:
    the ``delayed`` recipe's host overhead):

        h = history with h[0] = amax;   ref = amax (most_recent) or max(h) (NaN if any is NaN)
        scale = compute_scale(ref, fmt, margin, pow2, eps)        (``quantize.py``; float32's max for inf)
        new_history = roll(h, 1) with new_history[0] = 0

    Shapes: history [L] float32, amax one float element (any float dtype) -> (new_history [L] float32,
    scale [] float32), on the history's device; the same bits as ``state.DelayedScalingMeta``'s torch ops.
    ``nonfinite``: an int64 [] counter (``Fp8Stats.nonfinite_amax``) that gains 1 when the amax is inf or NaN."""
    fmax = _FMT[fmt][0]
    L = history.numel()
    new_hist = torch.empty_like(history)
    scale = torch.empty((), dtype=torch.float32, device=history.device)
    _delayed_update_kernel[(1,)](
        history, amax, new_hist, scale, nonfinite if nonfinite is not None else scale, L, MOST_RECENT=most_recent,
        TOP=fmax * 2.0 ** (-margin), EPS=float(eps), INF_CAP=_FP32_MAX, POW2=bool(pow2), COUNT=nonfinite is not None,
        BLOCK_L=max(16, triton.next_power_of_2(L)), num_warps=1, **_OPTS)
    return new_hist, scale
