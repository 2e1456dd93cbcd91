"""FP8 GEMM backends: who multiplies the FP8 operands our quantizer produced.

``fp8.backend`` picks one of three, all fed by the same quantizer (``quantize.py``) and the same
per-operand state (the delayed-scaling amax history), so a checkpoint written under one resumes under
any other:

* ``emulate``: fake-quantized operands (the FP8 value of every element, in float32), float32 GEMM
  (``linear.fp8_gemm``). Runs everywhere; the reference the other two are checked against.
* ``torch``: the FP8 data (``torch.float8_e4m3fn`` / ``float8_e5m2``) and the scale-inverses go to
  torch's native scaled GEMM (``torch.nn.functional.scaled_mm``, or ``torch._scaled_mm`` on older torch),
  the route the paper's own stack took through TorchAO. What torch runs:

  ============ ================================ ==================================== ==========
  recipe       scaling type (A x B)              hardware                             notes
  ============ ================================ ==================================== ==========
  tensorwise   TensorWise x TensorWise          sm89+, and the CPU                   fp32/bf16 out
  delayed      TensorWise x TensorWise          sm89+, and the CPU                   fp32/bf16 out
  rowwise      RowWise x RowWise                sm89+                                bf16 out
  blockwise    1x128 x 128x128 (fwd, dgrad),    sm90 (cuBLASLt block scaling)        bf16 out
               1x128 x 1x128 (wgrad)
  mxfp8        BlockWise1x32 (E8M0)             sm100 only: emulated on Hopper        -
  ============ ================================ ==================================== ==========

  Shape rules (torch's checks): the reduction dimension and the output columns are multiples of 16;
  blockwise needs in/out features that are multiples of 128. The token dimension is free: where it is
  the reduction dimension (wgrad) it is zero-padded to a multiple of 16 (128 for blockwise), which
  changes neither an amax nor a sum. E5M2 x E5M2 has no kernel (``fp8_format=e5m2``). A layer whose
  recipe or shape torch cannot run falls back to ``emulate`` and is counted by the converter.
* ``te``: Transformer Engine layers and autocast (``te.py``; GPU only).

Default (``fp8.backend: null``): ``te`` when Transformer Engine imports on a GPU, else ``torch`` on an
FP8-capable GPU (compute capability >= 8.9), else ``emulate``.

Output dtype: a bf16 model gets bf16 GEMM outputs; a float32 model gets float32 outputs where the kernel
offers them (per-tensor scaling) and bf16 rounded outputs otherwise (torch's row- and block-scaled
kernels write bf16 only). This module imports only torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_fp8rl.fp8.formats import Fp8Format
from nemo_fp8rl.fp8.recipes import Fp8Recipe

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
    if requested is not None and requested not in FP8_BACKENDS:
        raise ValueError(f"fp8.backend={requested!r}; valid: {list(FP8_BACKENDS)} or null (auto)")
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
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    granularity: object

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


def scaled_mm_args(a: QuantizedOperand, b: QuantizedOperand) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat_a, mat_b, scale_a, scale_b)`` in the layout torch's scaled GEMM takes for C = A @ B^T.

    mat_a = A.data [M, K] row-major; mat_b = B.data^T [K, N] column-major. Scales (float32, the
    scale-inverses: torch multiplies them in):
    tensor x tensor: [] and [];  row x row: [M, 1] and [1, N];
    1x128 x 128x128: [M, K/128] column-major and [L4, N/128] with stride (1, L4), L4 = K/128 rounded up
    to a multiple of 4 (cuBLASLt's K-major tile layout; padding entries are 1);
    1x128 x 1x128: [M, K/128] and [N, K/128], both column-major.
    """
    ga, gb = a.granularity, b.granularity
    mat_a, mat_b = a.data, b.data.t()
    if ga == "tensor" and gb == "tensor":
        return mat_a, mat_b, a.scale_inv.reshape(()).float(), b.scale_inv.reshape(()).float()
    if ga == "row" and gb == "row":
        return mat_a, mat_b, a.scale_inv.reshape(-1, 1).float().contiguous(), b.scale_inv.reshape(1, -1).float().contiguous()
    if tuple(ga) == (1, 128) and tuple(gb) == (128, 128):
        kb = b.scale_inv.shape[1]
        l4 = -(-kb // 4) * 4
        buf = torch.ones(b.scale_inv.shape[0], l4, dtype=torch.float32, device=b.scale_inv.device)
        buf[:, :kb] = b.scale_inv
        return mat_a, mat_b, _col_major(a.scale_inv.float()), buf.t()
    if tuple(ga) == (1, 128) and tuple(gb) == (1, 128):
        return mat_a, mat_b, _col_major(a.scale_inv.float()), _col_major(b.scale_inv.float())
    raise ValueError(f"no torch scaled GEMM for operand granularities {ga} x {gb}")


def scaled_gemm(a: QuantizedOperand, b: QuantizedOperand, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """C [M, N] = A_hat @ B_hat^T on torch's FP8 GEMM (A [M, K], B [N, K] quantized along K).

    ``out_dtype``: float32 or bfloat16 (row- and block-scaled kernels write bf16: a float32 request is
    computed in bf16 and returned as float32). ``fast_accum``: Hopper's un-promoted accumulation
    (forward GEMMs of per-tensor recipes, as Transformer Engine does); ignored on CPU.
    """
    mat_a, mat_b, sa, sb = scaled_mm_args(a, b)
    kernel_dtype = out_dtype
    if a.granularity != "tensor" and out_dtype == torch.float32:
        kernel_dtype = torch.bfloat16
    out = scaled_mm_kernel(mat_a, mat_b, sa, a.granularity, sb, b.granularity, kernel_dtype, fast_accum)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def scaled_mm_kernel(mat_a, mat_b, scale_a, granularity_a, scale_b, granularity_b, out_dtype, fast_accum):
    """torch's FP8 GEMM on arguments laid out by :func:`scaled_mm_args` (the one place torch is called).

    ``torch.nn.functional.scaled_mm`` where it exists (torch >= 2.10: explicit scaling types), else
    ``torch._scaled_mm`` (per-tensor and row-wise scales, inferred from the scale shapes).
    """
    if _has_scaled_mm_v2():
        return F.scaled_mm(mat_a, mat_b, scale_a, _scaling_type(granularity_a), scale_b, _scaling_type(granularity_b),
                           output_dtype=out_dtype, use_fast_accum=fast_accum)
    # torch < 2.10: torch_gemm_support refuses blockwise there
    return torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


# ----------------------------------------------------------------------------------------------------
# What two GEMMs of the same operands may differ by
# ----------------------------------------------------------------------------------------------------


def gemm_error_bound(a_hat: torch.Tensor, b_hat: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                     fast_accum: bool = False, accumulation_bits: int = 14) -> torch.Tensor:
    """Per-element bound on |GEMM(a_hat, b_hat) - exact| for any summation order, [M, N] float64.

    a_hat [M, K], b_hat [N, K]: the dequantized FP8 operands as the emulation computes them
    (``data * scale_inv`` in float32). With float32 accumulation in any order (Higham, Thm 3.1):
    |err| <= gamma_K * S, gamma_K = K u / (1 - K u), u = 2^-24, S = sum_k |a_ik| |b_jk|. Fast
    (un-promoted) accumulation truncates to ``accumulation_bits`` significant bits: u_acc =
    2^-(bits-1) in place of u. A kernel that multiplies the scales in after the sum (torch) instead of
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
    gamma = k * u / (1 - k * u) if k * u < 1 else math.inf
    bound = (gamma + 3 * 2.0 ** -24) * s
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (s + bound)
    elif out_dtype == torch.float16:
        bound = bound + 2.0 ** -11 * (s + bound)
    # the smallest normal of the output dtype bounds what underflow can lose
    return bound + torch.finfo(out_dtype).tiny


__all__ = [
    "FP8_BACKENDS", "QuantizedOperand", "fp8_gpu", "gemm_error_bound", "resolve_fp8_backend", "scaled_gemm",
    "scaled_mm_args", "torch_fp8_dtype", "torch_gemm_support",
]
