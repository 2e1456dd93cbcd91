"""The outputs of the cast-transpose kernels, built from the readable quantizer (``quantize.py``) and torch ops.

Each function returns exactly what its kernel launcher in ``cast_transpose.py`` returns (same shapes,
padding, scale layouts and dtypes), computed the slow, obvious way: quantize with :func:`quantize`, then
transpose, pad and lay out the scales with torch. ``tests/fp8/_kernel_checks.py`` (Triton's interpreter on
the CPU) and the GPU check's parity part (the GPU's kernels) compare the kernels with these, byte for byte.
This module needs no Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nemo_fp8rl.fp8.formats import get_format
from nemo_fp8rl.fp8.quantize import _quantize_impl, quantize


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tensorwise_layouts(x: torch.Tensor, fmt: str, *, scale: Optional[torch.Tensor] = None, pow2: bool = False,
                       eps: float = 0.0, margin: int = 0, col_pad: int = 16):
    """``(q [R, C], q^T [C, RT] zero-padded, scale_inv [], amax [])`` of ``cast_transpose_tensorwise``."""
    data, s, amax = _quantize_impl(x, get_format(fmt), "tensor", 1, pow2, margin, eps, 32, scale, None, False, False,
                                   torch.float32)
    r, c = x.shape
    qt = torch.zeros(c, _round_up(r, col_pad), dtype=data.dtype, device=x.device)
    qt[:, :r] = data.t()
    return data, qt, (1.0 / s).reshape(()), amax.float().reshape(())


def rowwise_layouts(x: torch.Tensor, fmt: str, *, pow2: bool = True, eps: float = 0.0, col_pad: int = 16):
    """``(row, col)`` of ``cast_transpose_rowwise``: x [R, C] quantized per row (``quantize(x, "row")`` along
    C: ``(q [R, C], scale_inv [R, 1])``) and x^T per row, i.e. per column of x, as the torch backend's
    reference path quantizes it (``x.t()`` along R), zero-padded to RT columns: ``(q^T [C, RT], scale_inv [C, 1])``."""
    r, c = x.shape
    row = quantize(x, fmt, "row", dim=1, pow2_scales=pow2, eps=eps)
    d, s = quantize(x.t(), fmt, "row", dim=1, pow2_scales=pow2, eps=eps)
    qt = torch.zeros(c, _round_up(r, col_pad), dtype=d.dtype, device=x.device)
    qt[:, :r] = d
    return row, (qt, s)


def _rows_1x128(t: torch.Tensor, fmt: str, pow2: bool, eps: float, block: int):
    """1xB quantization of t [R', C'] along C': ``(data [R', C'], scale_inv [R', C'/B])``."""
    data, sinv = quantize(t, fmt, (1, block), dim=1, pow2_scales=pow2, eps=eps)
    return data.reshape(t.shape[0], -1), sinv[..., 0]


def _dequant_bf16(data: torch.Tensor, sinv: torch.Tensor, block: int) -> torch.Tensor:
    r, c = data.shape
    return (data.float().reshape(r, c // block, block) * sinv[..., None]).reshape(r, c).to(torch.bfloat16)


def blockwise_layouts(x: torch.Tensor, fmt: str, *, pow2: bool = True, eps: float = 0.0, row_bf16: bool = False,
                      col_bf16: bool = False, row_pad: int = 4, block: int = 128):
    """``(row, col)`` of ``cast_transpose_blockwise``: x zero-padded to RQ (RT) rows and quantized in 1xB
    groups along C (the row layout) and along R (the column layout, i.e. its transpose along C)."""
    r, c = x.shape
    xr = F.pad(x, (0, 0, 0, _round_up(r, row_pad) - r))
    d, s = _rows_1x128(xr, fmt, pow2, eps, block)
    row = _dequant_bf16(d, s, block)[:r] if row_bf16 else (d, s)
    xc = F.pad(x, (0, 0, 0, _round_up(r, block) - r))
    d, s = _rows_1x128(xc.t(), fmt, pow2, eps, block)
    col = _dequant_bf16(d, s, block)[:, :r].t() if col_bf16 else (d, s)
    return row, col


def weight_tile_layouts(w: torch.Tensor, fmt: str, *, pow2: bool = True, eps: float = 0.0,
                        transpose_bf16: bool = False, block: int = 128):
    """``(fwd, bwd)`` of ``cast_weight_tiles``: BxB tiles of w [N, K], W and W^T, with torch's 128x128
    scale layout (``backends.scaled_mm_args``: [L4, N/B] column-major, padding entries 1)."""
    n, k = w.shape
    data, sinv = quantize(w, fmt, (block, block), pow2_scales=pow2, eps=eps)  # [N/B, K/B, B, B], [.., 1, 1]
    q = data.permute(0, 2, 1, 3).reshape(n, k)
    tiles = sinv[:, :, 0, 0]  # [N/B, K/B]

    def layout(t: torch.Tensor) -> torch.Tensor:  # [rows/B, red/B] -> [L4, rows/B] column-major
        buf = torch.ones(t.shape[0], _round_up(t.shape[1], 4), dtype=torch.float32, device=t.device)
        buf[:, : t.shape[1]] = t
        return buf.t()

    fwd = (q, layout(tiles))
    if transpose_bf16:
        deq = (data.float() * sinv).permute(0, 2, 1, 3).reshape(n, k)
        return fwd, deq.to(torch.bfloat16)
    return fwd, (q.t().contiguous(), layout(tiles.t()))


def same_bytes(a, b) -> bool:
    """Equal shapes, dtypes and bytes (tuples/lists element-wise; NaNs equal whatever their bits)."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(same_bytes(u, v) for u, v in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((a.view(view) == b.view(view)) | nan).all())


__all__ = ["blockwise_layouts", "rowwise_layouts", "same_bytes", "tensorwise_layouts", "weight_tile_layouts"]
