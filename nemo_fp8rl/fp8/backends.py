"""FP8 GEMM backends: who multiplies the FP8 operands our quantizer produced.

``fp8.backend`` picks one of three, all fed by the same quantizer (``quantize.py``) and the same
per-operand state (the delayed-scaling amax history), so a checkpoint written under one resumes under
any other:

* ``emulate``: fake-quantized operands (the FP8 value of every element, in float32), float32 GEMM
  (``linear.fp8_gemm``). Runs everywhere; the reference the other two are checked against.
* ``torch``: the FP8 data (``torch.float8_e4m3fn`` / ``float8_e5m2``) and the scale-inverses go to
  torch's native scaled GEMM (``torch.nn.functional.scaled_mm``, or ``torch._scaled_mm`` on older torch),
  the route the paper's own stack took through TorchAO. What torch runs:

  ============ ================================ ==================================== ===============
  recipe       scaling type (A x B)              hardware                             output dtypes
  ============ ================================ ==================================== ===============
  tensorwise   TensorWise x TensorWise          sm89+, and the CPU                   fp32 / bf16
  delayed      TensorWise x TensorWise          sm89+, and the CPU                   fp32 / bf16
  rowwise      RowWise x RowWise                sm89+ (cuBLAS on sm90 with 12.9+,    fp32 on cuBLAS,
                                                else torch's CUTLASS kernel)         bf16 on CUTLASS
  blockwise    1x128 x 128x128 (fwd, dgrad),    sm90, cuBLAS >= 12.9                 fp32 / bf16
               1x128 x 1x128 (wgrad);
               E4M3 x E4M3 only
  mxfp8        BlockWise1x32 (E8M0)             sm100 only: emulated on Hopper        -
  ============ ================================ ==================================== ===============

  Shape rules (torch's checks): the reduction dimension and the output columns are multiples of 16;
  blockwise needs in/out features that are multiples of 128. The token dimension is free: where it is
  the reduction dimension (wgrad) it is zero-padded to a multiple of 16 (128 for blockwise), which
  changes neither an amax nor a sum; where it is the rows of a 1x128-scaled operand (forward, dgrad) it
  is zero-padded to a multiple of 4 (:func:`scaled_mm_args`). E5M2 x E5M2 has no kernel
  (``fp8_format=e5m2``). A layer whose recipe or shape torch cannot run falls back to ``emulate`` and is
  counted by the converter.

  Per GEMM (:func:`kernel_refusal`): torch's 1x128/128x128 ("DeepSeek") kernels take E4M3 x E4M3 only,
  so under ``blockwise`` + ``hybrid`` the dgrad and wgrad GEMMs (an E5M2 gradient operand) run on our
  Triton block-scaled GEMM where Triton runs (``kernels/block_gemm.py``), else as a float32 GEMM of the
  dequantized operands, the emulation's numbers, counted in :func:`gemm_fallbacks` and logged once per
  reason; the forward GEMM stays on torch's kernel.

  Output dtype (:func:`kernel_out_dtype`): a bf16/fp16 model gets its own dtype from the kernel. A
  float32 request (a float32 model, and every wgrad: main grads are float32) gets float32 where the
  kernel writes it: per-tensor scaling everywhere, row-wise and block-wise scaling on cuBLAS (sm90 with
  cuBLAS >= 12.9, compiled and loaded: :func:`cublas_version`); elsewhere (torch's CUTLASS row-wise
  kernel) bf16, returned as float32. A kernel that still refuses float32 is asked for bf16 from then on
  (logged once). Bias: added by the kernel's epilogue for per-tensor and row-wise scaling when the
  output is bf16/fp16 and the bias has that dtype (torch allows no bias with a float32 output); else
  added to the output in its dtype. Fast accumulation: per-tensor and row-wise only (torch refuses it
  with block scaling).
* ``te``: Transformer Engine layers and autocast (``te.py``; GPU only).

Default (``fp8.backend: null``): ``te`` when Transformer Engine imports on a GPU, else ``torch`` on an
FP8-capable GPU (compute capability >= 8.9), else ``emulate``.

This module imports only torch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_fp8rl.fp8.formats import Fp8Format
from nemo_fp8rl.fp8.recipes import Fp8Recipe

logger = logging.getLogger(__name__)

FP8_BACKENDS = ("emulate", "torch", "te")

_TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def torch_fp8_dtype(fmt: Fp8Format) -> torch.dtype:
    """The torch dtype of an FP8 format (E4M3 -> float8_e4m3fn, E5M2 -> float8_e5m2)."""
    return _TORCH_DTYPES[fmt.name]


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _capability(device) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(torch.device(device))


def _has_scaled_mm_v2() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def fp8_gpu(device) -> bool:
    """True for a CUDA device with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell)."""
    return _is_cuda(device) and torch.cuda.is_available() and _capability(device) >= (8, 9)


def resolve_fp8_backend(requested: Optional[str], device, te_available: Optional[bool] = None) -> str:
    """The backend a model on ``device`` uses for ``fp8.backend = requested``.

    ``None`` (auto): ``te`` if Transformer Engine imports and the device is a GPU, else ``torch`` on an
    FP8-capable GPU, else ``emulate``. An explicit ``te`` off a GPU (or without TE) raises; an explicit
    ``torch`` is always accepted (layers torch cannot run on this device fall back, counted).
    """
    if requested == "auto":  # = null; the per-layer rule of fp8.backend=auto is the model builder's (layer_filter.py)
        requested = None
    if requested is not None and requested not in FP8_BACKENDS:
        raise ValueError(f"fp8.backend={requested!r}; valid: {list(FP8_BACKENDS)}, auto or null")
    on_gpu = _is_cuda(device)
    if te_available is None:
        te_available = False
        if on_gpu:
            try:
                import importlib

                importlib.import_module("transformer_engine.pytorch")
                te_available = True
            except Exception:  # noqa: BLE001 - ImportError or a CUDA/driver error at import
                te_available = False
    if requested is None:
        if on_gpu and te_available:
            return "te"
        return "torch" if fp8_gpu(device) else "emulate"
    if requested == "te" and not (on_gpu and te_available):
        raise ValueError(
            "fp8.backend=te needs a GPU and Transformer Engine (pip install 'nemo-fp8rl[gpu]'); "
            "use fp8.backend=torch (torch's FP8 GEMMs) or fp8.backend=emulate"
        )
    return requested


def torch_gemm_support(recipe: Fp8Recipe, device, out_features: int, in_features: int) -> Optional[str]:
    """Why torch cannot run ``recipe``'s GEMMs for a [out_features, in_features] linear on ``device``.

    Returns None when it can (forward, dgrad and wgrad), else a one-line reason; the layer then runs
    the emulation. Covers the recipe (scaling, formats), the device (CPU: per-tensor scales only;
    GPU: compute capability) and the shapes (multiples of 16; 128 for blockwise).
    """
    scaling = recipe.scaling
    if recipe.fp8_format == "e5m2":
        return "fp8_format=e5m2: torch has no E5M2 x E5M2 GEMM"
    if scaling == "mxfp8":
        if _is_cuda(device) and torch.cuda.is_available() and _capability(device) >= (10, 0):
            return "mxfp8: the torch backend does not run MX block scaling yet (use fp8.backend=te)"
        return "mxfp8: MX block scaling needs sm100 (Blackwell); no Hopper or CPU kernel"
    if not _is_cuda(device):
        if scaling not in ("tensorwise", "delayed"):
            return f"{scaling}: torch's CPU scaled GEMM supports per-tensor scales only"
    else:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        cap = _capability(device)
        if cap < (8, 9):
            return f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores (needs 8.9+)"
        if scaling == "blockwise":
            if cap[0] != 9:
                return f"blockwise: torch's 1x128/128x128 kernels are sm90 only (this GPU is sm{cap[0]}{cap[1]})"
            if not _has_scaled_mm_v2():
                return "blockwise: needs torch.nn.functional.scaled_mm (torch >= 2.10)"
    mult = 128 if scaling == "blockwise" else 16
    if scaling == "blockwise" and (recipe.input_block != 128 or recipe.weight_block != 128):
        return f"blockwise with blocks {recipe.input_block}/{recipe.weight_block}: torch runs 128 only"
    if out_features % mult or in_features % mult:
        return f"shape [{out_features}, {in_features}] is not a multiple of {mult}"
    return None


# ----------------------------------------------------------------------------------------------------
# One GEMM C = A @ B^T from quantized operands
# ----------------------------------------------------------------------------------------------------


@dataclass
class QuantizedOperand:
    """One GEMM operand in FP8, with its reduction dimension last: ``x_hat[r, k] = data[r, k] * s_inv(r, k)``.

    data: [R, K] FP8, contiguous (row-major). scale_inv (float32) by granularity:
    ``tensor`` [] ; ``row`` [R, 1] ; ``(1, B)`` [R, K/B] (one per 1xB block of a row) ;
    ``(B, B)`` [R/B, K/B] (one per BxB tile).

    ``prepared``: data and scale_inv are already in the layout torch's scaled GEMM takes for this
    operand's position (the Triton kernels write them so: ``kernels/cast_transpose.py``), and
    :func:`scaled_mm_args` passes them through untouched; ``rows``: the logical row count when data
    carries padding rows (a 1x128 A operand padded to a multiple of 4), so the result keeps the first
    ``rows``.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    granularity: object
    prepared: bool = False
    rows: Optional[int] = None

    def t(self) -> "QuantizedOperand":
        """The transposed operand (same FP8 values): valid for per-tensor scales and 2-D tiles."""
        if self.granularity == "tensor":
            return QuantizedOperand(self.data.t().contiguous(), self.scale_inv, "tensor")
        if isinstance(self.granularity, tuple) and self.granularity[0] != 1:
            return QuantizedOperand(self.data.t().contiguous(), self.scale_inv.t().contiguous(), self.granularity)
        raise ValueError(f"a {self.granularity} operand cannot be transposed without re-quantizing")

    def pad_reduction(self, multiple: int) -> "QuantizedOperand":
        """Zero-pad K to a multiple of ``multiple`` (tensor/row scales only: their scales do not change)."""
        r, k = self.data.shape
        kp = -(-k // multiple) * multiple
        if kp == k:
            return self
        if self.granularity not in ("tensor", "row"):
            raise ValueError("pad block-scaled operands before quantizing them")
        out = torch.zeros(r, kp, dtype=self.data.dtype, device=self.data.device)
        out[:, :k] = self.data
        return QuantizedOperand(out, self.scale_inv, self.granularity)

    def dequantize(self) -> torch.Tensor:
        """x_hat [R, K] float32: every element times its group's scale-inverse (the readable definition)."""
        if self.prepared and isinstance(self.granularity, tuple):
            raise ValueError("a prepared block-scaled operand holds torch's scale layout; dequantize the reference")
        q = self.data.float()
        g = self.granularity
        if g == "tensor":
            return q * self.scale_inv
        if g == "row":
            return q * self.scale_inv.reshape(-1, 1)
        br, bc = g
        s = self.scale_inv
        if br != 1:
            s = s.repeat_interleave(br, 0)
        s = s.repeat_interleave(bc, 1)
        return q * s[: q.shape[0], : q.shape[1]]


def _scaling_type(granularity):
    st = F.ScalingType
    if granularity == "tensor":
        return st.TensorWise
    if granularity == "row":
        return st.RowWise
    if tuple(granularity) == (1, 128):
        return st.BlockWise1x128
    if tuple(granularity) == (128, 128):
        return st.BlockWise128x128
    raise ValueError(f"no torch scaled-GEMM scaling type for granularity {granularity}")


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, column-major strides (stride(0) == 1)."""
    return t.t().contiguous().t()


def _pad_rows(data: torch.Tensor, scale_inv: torch.Tensor, multiple: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zero rows appended to data [M, K] (FP8) and rows of ones to its 1x128 scales [M, K/128] up to a
    multiple of ``multiple``: the padded rows are zeros whatever their scale, the real rows are untouched."""
    m = data.shape[0]
    mp = -(-m // multiple) * multiple
    if mp == m:
        return data, scale_inv
    d = torch.zeros(mp, data.shape[1], dtype=data.dtype, device=data.device)
    d[:m] = data
    sc = torch.ones(mp, scale_inv.shape[1], dtype=torch.float32, device=scale_inv.device)
    sc[:m] = scale_inv
    return d, sc


def scaled_mm_args(a: QuantizedOperand, b: QuantizedOperand) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat_a, mat_b, scale_a, scale_b)`` in the layout torch's scaled GEMM takes for C = A @ B^T.

    mat_a = A.data [M, K] row-major; mat_b = B.data^T [K, N] column-major. Scales (float32, the
    scale-inverses: torch multiplies them in):
    tensor x tensor: [] and [];  row x row: [M, 1] and [1, N];
    1x128 x 128x128: [M4, K/128] column-major and [L4, N/128] with stride (1, L4), L4 = K/128 rounded up
    to a multiple of 4 (cuBLASLt's K-major tile layout; padding entries are 1);
    1x128 x 1x128: [M4, K/128] and [N, K/128], both column-major.

    M4: a 1x128-scaled A gets M rounded up to a multiple of 4 (zero rows with scale 1, so mat_a is
    [M4, K] and the result has M4 rows: :func:`scaled_gemm` keeps the first M). torch requires that scale
    to be [M, K/128] with strides (1, M), and cuBLAS reads each column of it (one 128-block of K for
    every row) from a 16-byte aligned address, which is why Transformer Engine allocates it with M
    rounded up to 4; padding M itself satisfies both. B needs nothing: torch requires N % 16 == 0.
    """
    ga, gb = a.granularity, b.granularity
    mat_a, mat_b = a.data, b.data.t()
    if a.prepared and b.prepared:
        return mat_a, mat_b, a.scale_inv, b.scale_inv
    if ga == "tensor" and gb == "tensor":
        return mat_a, mat_b, a.scale_inv.reshape(()).float(), b.scale_inv.reshape(()).float()
    if ga == "row" and gb == "row":
        return mat_a, mat_b, a.scale_inv.reshape(-1, 1).float().contiguous(), b.scale_inv.reshape(1, -1).float().contiguous()
    if tuple(ga) == (1, 128) and tuple(gb) in ((128, 128), (1, 128)):
        mat_a, sa = _pad_rows(a.data, a.scale_inv.float(), 4)
        if tuple(gb) == (1, 128):
            return mat_a, mat_b, _col_major(sa), _col_major(b.scale_inv.float())
        kb = b.scale_inv.shape[1]
        l4 = -(-kb // 4) * 4
        buf = torch.ones(b.scale_inv.shape[0], l4, dtype=torch.float32, device=b.scale_inv.device)
        buf[:, :kb] = b.scale_inv
        return mat_a, mat_b, _col_major(sa), buf.t()
    raise ValueError(f"no torch scaled GEMM for operand granularities {ga} x {gb}")


def _is_block(granularity) -> bool:
    return isinstance(granularity, tuple)


def kernel_refusal(a: QuantizedOperand, b: QuantizedOperand) -> Optional[str]:
    """Why torch's scaled GEMM refuses to multiply these two operands (None: it takes them).

    torch's rules by operand dtypes (aten's scaled-GEMM dispatch): E5M2 x E5M2 has no kernel at all;
    the 1x128 / 128x128 block-scaled ("DeepSeek") kernels accept E4M3 x E4M3 only, so E5M2 gradients
    (``fp8_format=hybrid``) cannot go to them ("Invalid scaling configuration"). Per-tensor and row-wise
    scaling take E4M3 and E5M2 in either position.
    """
    e4m3 = torch.float8_e4m3fn
    if a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2:
        return "E5M2 x E5M2: torch has no scaled GEMM for two E5M2 operands"
    if (_is_block(a.granularity) or _is_block(b.granularity)) and (a.data.dtype != e4m3 or b.data.dtype != e4m3):
        return ("1x128/128x128 block scaling with an E5M2 operand: torch's block-scaled kernels take E4M3 x E4M3 "
                "only (fp8_format=hybrid gradients); this GEMM runs in float32 on the dequantized operands")
    return None


_GEMM_FALLBACKS: dict = {}


def gemm_fallbacks() -> dict:
    """``{reason: count}`` of the GEMMs :func:`scaled_gemm` ran in float32 because torch's kernel refuses
    their operands (:func:`kernel_refusal`), since the process started (or :func:`reset_gemm_fallbacks`)."""
    return dict(_GEMM_FALLBACKS)


def reset_gemm_fallbacks() -> None:
    _GEMM_FALLBACKS.clear()


def _count_fallback(reason: str) -> None:
    if reason not in _GEMM_FALLBACKS:
        logger.warning("FP8 torch backend: %s (logged once; counted in backends.gemm_fallbacks())", reason)
    _GEMM_FALLBACKS[reason] = _GEMM_FALLBACKS.get(reason, 0) + 1


def _version_number(major_minor: str) -> Optional[int]:
    """``"12.9"`` -> 120900 (cuBLAS's ``major * 10000 + minor * 100 + patch``); None if unreadable."""
    try:
        parts = [int(p) for p in major_minor.split(".")[:3]]
    except ValueError:
        return None
    parts += [0] * (3 - len(parts))
    return parts[0] * 10000 + parts[1] * 100 + parts[2]


def _loaded_cublaslt_version() -> Optional[int]:
    """``cublasLtGetVersion()`` of the libcublasLt this process loaded with torch's CUDA library (found in
    /proc/self/maps, called through ctypes); None when it is not loaded or cannot be asked."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcublasLt" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).cublasLtGetVersion
            fn.restype = ctypes.c_size_t
            return int(fn())
        except (OSError, AttributeError):
            continue
    return None


_CUBLAS_VERSION: list = []


def cublas_version() -> Optional[int]:
    """The cuBLAS(Lt) version torch's scaled GEMM works with, as ``major * 10000 + minor * 100 + patch``.

    torch takes its cuBLAS paths only when both the cuBLAS it was compiled against (``CUBLAS_VERSION``;
    read here from ``torch.version.cuda``, which the toolkit's cuBLAS matches in major.minor) and the
    library loaded at run time (``cublasLtGetVersion()``) are new enough, so this is the smaller of the
    two (the compiled one alone when the loaded library cannot be asked). None for a CPU-only torch.
    Computed once per process.
    """
    if not _CUBLAS_VERSION:
        compiled = _version_number(torch.version.cuda) if torch.version.cuda else None
        loaded = _loaded_cublaslt_version() if compiled is not None else None
        _CUBLAS_VERSION.append(min(v for v in (compiled, loaded) if v is not None) if compiled is not None else None)
    return _CUBLAS_VERSION[0]


_FACTS: dict = {}


def _device_facts(device) -> Tuple[bool, Optional[Tuple[int, int]], Optional[int]]:
    """``(is_cuda, compute capability, cuBLAS version)`` of ``device`` (capability and version None on CPU);
    asked once per device (every FP8 GEMM needs them: host time matters for small GEMMs)."""
    dev = torch.device(device)
    key = (dev.type, dev.index)
    facts = _FACTS.get(key)
    if facts is None:
        if dev.type != "cuda" or not torch.cuda.is_available():
            facts = (False, None, None)
        else:
            facts = (True, _capability(dev), cublas_version())
        _FACTS[key] = facts
    return facts


CUBLAS_SCALED_MIN = 120900  # cuBLAS 12.9: row-wise (outer-vector) and 1x128/128x128 block scaling modes


def kernel_out_dtype(granularity, want: torch.dtype, is_cuda: bool, capability: Optional[Tuple[int, int]],
                     cublas: Optional[int]) -> torch.dtype:
    """The output dtype to ask torch's scaled GEMM for, to return ``want`` (bf16, fp16 or float32).

    bf16/fp16: themselves (every kernel writes them). float32: per-tensor scaling -> float32 (cuBLAS and
    the CPU kernel write it). Row-wise and block-wise scaling -> float32 only where torch runs them on
    cuBLAS: compute capability 9.x and cuBLAS >= 12.9 (torch sends row-wise scaling to its CUTLASS
    kernel on older cuBLAS, on sm89 and on sm100+; its block-scaled kernels exist only there); bf16
    otherwise (the caller casts the bf16 result to float32).
    """
    if want != torch.float32 or granularity == "tensor":
        return want
    on_cublas = is_cuda and capability is not None and capability[0] == 9 and (cublas or 0) >= CUBLAS_SCALED_MIN
    return torch.float32 if on_cublas else torch.bfloat16


_FP32_REFUSED: dict = {}  # scaling kind -> the kernel's error, once a float32 request failed


def _kernel_takes_bias(granularity, kernel_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> bool:
    """torch's rule: a bias of the output's dtype (bf16 or fp16), never with a float32 output; used here for
    per-tensor and row-wise scaling only (whether cuBLAS's block-scaled kernels have a bias epilogue is
    not documented)."""
    return (bias is not None and granularity in ("tensor", "row") and kernel_dtype in (torch.bfloat16, torch.float16)
            and bias.dtype == kernel_dtype)


def _block_e5m2_on_triton(a: QuantizedOperand, b: QuantizedOperand) -> bool:
    """A 1x128 x (128x128 | 1x128) GEMM with an E5M2 operand, where the Triton block-scaled GEMM runs
    (``kernels/block_gemm.py``: CUDA with Triton; the interpreter in tests) and was chosen
    (``block_gemm.hybrid_uses_fp8_gemm``)."""
    def gran(op):
        return tuple(op.granularity) if isinstance(op.granularity, (tuple, list)) else op.granularity

    if gran(a) != (1, 128) or gran(b) not in ((1, 128), (128, 128)):
        return False
    if a.data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or b.data.dtype not in (
            torch.float8_e4m3fn, torch.float8_e5m2):
        return False
    from nemo_fp8rl.fp8 import kernels

    # the same run-time choice as the kernel path's (a GPU where the Triton GEMM failed or was slower keeps
    # the float32 fallback below, counted)
    return (kernels.kernel_unavailable(a.data.device) is None
            and kernels.block_gemm_ops().hybrid_uses_fp8_gemm(a.data.device))


def scaled_gemm(a: QuantizedOperand, b: QuantizedOperand, out_dtype: torch.dtype, fast_accum: bool = False,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C [M, N] = A_hat @ B_hat^T (+ bias [N]) in ``out_dtype``, on torch's FP8 GEMM (A [M, K], B [N, K]
    quantized along K; A_hat, B_hat their dequantized values).

    ``out_dtype``: float32, bfloat16 or float16; the kernel is asked for :func:`kernel_out_dtype` and the
    result cast when that differs. ``fast_accum``: Hopper's un-promoted accumulation (per-tensor and
    row-wise scaling only; ignored for block scaling, which torch refuses, and on CPU). ``bias``: added
    by the kernel where torch allows it (:func:`_kernel_takes_bias`), else added to the output in
    ``out_dtype``. Operands torch refuses (:func:`kernel_refusal`) are multiplied in float32 from their
    dequantized values instead, counted in :func:`gemm_fallbacks`, except block-scaled ones with an E5M2
    operand where Triton runs: those go to ``kernels/block_gemm.py``'s FP8 GEMM.
    """
    why = kernel_refusal(a, b)
    if why and _block_e5m2_on_triton(a, b):
        from nemo_fp8rl.fp8 import kernels

        out = kernels.block_gemm_ops().block_scaled_mm(a, b, out_dtype)
        return out if bias is None else out + bias.to(out_dtype)
    if why:
        _count_fallback(why)
        out = a.dequantize() @ b.dequantize().t()  # float32, as the emulation multiplies the same FP8 values
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    is_cuda, cap, cublas = _device_facts(a.data.device)
    kind = "tensor" if a.granularity == "tensor" else ("row" if a.granularity == "row" else "block")
    kernel_dtype = kernel_out_dtype(a.granularity, out_dtype, is_cuda, cap, cublas)
    if kernel_dtype == torch.float32 and kind in _FP32_REFUSED:
        kernel_dtype = torch.bfloat16
    fast = fast_accum and not _is_block(a.granularity)
    kbias = bias if _kernel_takes_bias(a.granularity, kernel_dtype, bias) else None
    mat_a, mat_b, sa, sb = scaled_mm_args(a, b)
    try:
        out = scaled_mm_kernel(mat_a, mat_b, sa, a.granularity, sb, b.granularity, kernel_dtype, fast, bias=kbias)
    except (RuntimeError, ValueError) as e:
        if kernel_dtype != torch.float32 or not is_cuda:
            raise
        # kernel_out_dtype promised float32 on this GPU and the kernel disagrees: try bf16 (which raises on its
        # own if the output dtype was not the problem) and keep asking for bf16 from now on
        kbias = bias if _kernel_takes_bias(a.granularity, torch.bfloat16, bias) else None
        out = scaled_mm_kernel(mat_a, mat_b, sa, a.granularity, sb, b.granularity, torch.bfloat16, fast, bias=kbias)
        _FP32_REFUSED[kind] = f"{type(e).__name__}: {e}"[:300]
        logger.warning("FP8 torch backend: the %s-scaled kernel refused a float32 output (%s); asking for bf16 "
                       "from now on (logged once)", kind, _FP32_REFUSED[kind])
    m = a.rows if a.rows is not None else a.data.shape[0]
    if out.shape[0] != m:
        out = out[:m]
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    if bias is not None and kbias is None:
        out = out + bias.to(out_dtype)
    return out


def scaled_mm_kernel(mat_a, mat_b, scale_a, granularity_a, scale_b, granularity_b, out_dtype, fast_accum, bias=None):
    """torch's FP8 GEMM on arguments laid out by :func:`scaled_mm_args` (the one place torch is called).

    ``torch.nn.functional.scaled_mm`` where it exists (torch >= 2.10: explicit scaling types), else
    ``torch._scaled_mm`` (per-tensor and row-wise scales, inferred from the scale shapes).
    """
    if _has_scaled_mm_v2():
        return F.scaled_mm(mat_a, mat_b, scale_a, _scaling_type(granularity_a), scale_b, _scaling_type(granularity_b),
                           bias=bias, output_dtype=out_dtype, use_fast_accum=fast_accum)
    # torch < 2.10: torch_gemm_support refuses blockwise there
    return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


# ----------------------------------------------------------------------------------------------------
# What two GEMMs of the same operands may differ by
# ----------------------------------------------------------------------------------------------------


def gemm_error_bound(a_hat: torch.Tensor, b_hat: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                     fast_accum: bool = False, accumulation_bits: int = 14,
                     promote_every: Optional[int] = None) -> torch.Tensor:
    """Per-element bound on |GEMM(a_hat, b_hat) - exact| for any summation order, [M, N] float64.

    a_hat [M, K], b_hat [N, K]: the dequantized FP8 operands as the emulation computes them
    (``data * scale_inv`` in float32). With float32 accumulation in any order (Higham, Thm 3.1):
    |err| <= gamma_K * S, gamma_K = K u / (1 - K u), u = 2^-24, S = sum_k |a_ik| |b_jk|. Fast
    (un-promoted) accumulation truncates to ``accumulation_bits`` significant bits: u_acc =
    2^-(bits-1) in place of u; with ``promote_every`` = c the truncated sums run over chunks of c products
    only, added in float32 (Hopper's FP8 MMA promoted after each instruction, ``kernels/block_gemm.py``):
    c u_acc / (1 - c u_acc) + gamma_{ceil(K/c) + 1} in place of gamma_K. A kernel that multiplies the scales in after the sum (torch) instead of
    into each operand (the emulation) differs by the operands' dequantization roundings and the final
    scale product: 3 u S more. A bf16/fp16 output adds half an ulp: u_out (|C| + err), u_out = 2^-8 /
    2^-11. The bound holds for each of two implementations against the exact result, so two of them
    differ by at most twice it.
    """
    a64, b64 = a_hat.double(), b_hat.double()
    k = a64.shape[1]
    s = a64.abs() @ b64.abs().t()
    # truncation to `bits` significant bits loses < 2^-(bits-1) relative; round-to-nearest 2^-24
    u = 2.0 ** -(accumulation_bits - 1) if fast_accum else 2.0 ** -24

    def gamma(n: int, unit: float) -> float:
        return n * unit / (1 - n * unit) if n * unit < 1 else math.inf

    if fast_accum and promote_every:
        rel = gamma(promote_every, u) + gamma(-(-k // promote_every) + 1, 2.0 ** -24)
    else:
        rel = gamma(k, u)
    bound = (rel + 3 * 2.0 ** -24) * s
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (s + bound)
    elif out_dtype == torch.float16:
        bound = bound + 2.0 ** -11 * (s + bound)
    # the smallest normal of the output dtype bounds what underflow can lose
    return bound + torch.finfo(out_dtype).tiny


__all__ = [
    "FP8_BACKENDS", "QuantizedOperand", "cublas_version", "fp8_gpu", "gemm_error_bound", "gemm_fallbacks",
    "kernel_out_dtype", "kernel_refusal", "reset_gemm_fallbacks", "resolve_fp8_backend", "scaled_gemm",
    "scaled_mm_args", "torch_fp8_dtype", "torch_gemm_support",
]
