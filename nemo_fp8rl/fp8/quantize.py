"""Scaled FP8 quantization at every granularity used by the recipes.

A tensor x is quantized group by group: every group g (the whole tensor, a row, a 1x128 or 128x128
block, a 1x32 MX block) gets a scale s_g chosen so its largest magnitude lands at the top of the FP8
range, ``q = sat_fp8(x * s_g)``, and is read back as ``x_hat = float32(q) * fp32(1 / s_g)``.

Scale rule (docs/design.md, FP8; Transformer Engine's ``compute_scale_from_amax``):

    s = fp32(M * 2^-margin / max(amax, eps))      M = 448 (E4M3) / 57344 (E5M2)
    amax in {0, inf, NaN}  ->  s = 1;   s = inf (amax tiny)  ->  s = fp32 max
    power-of-two mode:  s <- 2^floor(log2 s)       (exact, via frexp)

MX (OCP microscaling, ``mxfp8``) uses an E8M0 scale, a pure power of two chosen from the block amax:

    e = ceil(log2(amax * fp32(1/448))),  clamped to [-127, 127];   q = sat(x * 2^-e),  x_hat = q * 2^e

Granularities (``granularity`` argument):

* ``"tensor"``: one scale for the whole tensor.
* ``"row"``: one scale per vector along ``dim`` (the GEMM's reduction dimension), i.e. per row of
  an activation [M, K] with dim=-1, per output channel of a weight [N, K] with dim=-1.
* ``(1, B)``: 1-D blocks of B consecutive elements along ``dim`` (blockwise 1x128 activations and
  gradients); the last block is zero-padded (zeros do not change an amax).
* ``(B, B)``: 2-D B x B tiles of a 2-D tensor (blockwise 128x128 weights; transposing the weight
  keeps the same tiles, which is why weights use them).
* ``"mx"``: 1-D blocks of ``block`` (default 32) along ``dim`` with E8M0 scales.

Only the *values* fed to the GEMM are reproduced; the GEMM runs in float32 (see ``linear.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from nemo_fp8rl.fp8.formats import Fp8Format, cast_to_fp8, get_format

Granularity = Union[str, Tuple[int, int]]

_FP32_MAX = torch.finfo(torch.float32).max
_FP32_INV_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # fp32(1/448), as TE computes it


def pow2_floor(s: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 s)`` for positive finite float32 s, exactly (no log2 rounding).

    frexp writes s = m * 2^e with m in [0.5, 1), so floor(log2 s) = e - 1.
    """
    _, e = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), e - 1)


def compute_scale(
    amax: torch.Tensor,
    fmt: "str | Fp8Format",
    *,
    margin: int = 0,
    pow2: bool = False,
    eps: float = 0.0,
) -> torch.Tensor:
    """FP8 scale from an amax: ``s = fp32(M * 2^-margin / max(amax, eps))``.

    Args:
        amax: float tensor of any shape (one amax per scaling group).
        fmt: FP8 format giving M.
        margin: extra headroom in powers of two (delayed scaling's ``margin``).
        pow2: round s down to a power of two.
        eps: lower clamp of amax (TE's ``amax_epsilon``, 0 by default).
    Returns:
        float32 tensor shaped like ``amax``. Groups whose amax is 0, inf or NaN get s = 1.
    """
    f = get_format(fmt)
    amax = amax.float()
    top = torch.tensor(f.max * 2.0 ** (-margin), dtype=torch.float32)
    s = top / torch.clamp(amax, min=eps) if eps > 0 else top / amax
    s = torch.where(torch.isinf(s), torch.full_like(s, _FP32_MAX), s)
    bad = (amax == 0) | ~torch.isfinite(amax)
    s = torch.where(bad, torch.ones_like(s), s)
    if pow2:
        s = pow2_floor(s)
    return s


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """MX E8M0 shared exponent ``e = ceil(log2(amax * fp32(1/448)))`` clamped to [-127, 127].

    Computed exactly with frexp: v = m * 2^k, m in [0.5, 1); ceil(log2 v) = k - 1 if m == 0.5 else k.
    amax = 0 gives -127 (the smallest E8M0 scale); a non-finite amax gives 0 (scale 1).

    Args:
        amax: float tensor, any shape. Returns int32 tensor of the same shape.
    """
    v = amax.float() * _FP32_INV_448
    m, k = torch.frexp(v)
    e = torch.where(m == 0.5, k - 1, k)
    e = torch.where(v == 0, torch.full_like(e, -127), e)
    e = torch.where(torch.isfinite(v), e, torch.zeros_like(e))
    return e.clamp(-127, 127).to(torch.int32)


class Fp8Stats:
    """Running FP8 health counters of one quantizer, kept as tensors (no host sync).

    ``saturated``: elements with |x * s| > M before the clamp (overflowed and were saturated);
    ``numel``: elements quantized; ``nonfinite_amax``: groups whose amax was inf or NaN.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.saturated = torch.zeros((), dtype=torch.int64)
        self.numel = torch.zeros((), dtype=torch.int64)
        self.nonfinite_amax = torch.zeros((), dtype=torch.int64)

    def add(self, scaled: torch.Tensor, amax: torch.Tensor, fmt: Fp8Format, current: bool) -> None:
        """Count one quantization. ``current``: the scale came from this tensor's own amax.

        With a current scale no finite element can exceed M (s * amax <= M by construction), so the
        element-wise overflow pass is needed only for a given (delayed) scale; non-finite groups are
        counted from the per-group amax either way.
        """
        dev = self.saturated.device
        if scaled.device != dev:
            self.saturated, self.numel, self.nonfinite_amax = (
                t.to(scaled.device) for t in (self.saturated, self.numel, self.nonfinite_amax)
            )
        if not current:
            self.saturated += (scaled.abs() > fmt.max).sum()
        self.numel += scaled.numel()
        self.nonfinite_amax += (~torch.isfinite(amax)).sum()


def _move_last(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim in (-1, x.dim() - 1) else x.movedim(dim, -1)


def _restore(x: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    return x if dim in (-1, ndim - 1) else x.movedim(-1, dim)


def _blocks_1d(x: torch.Tensor, block: int) -> Tuple[torch.Tensor, int]:
    """[..., K] -> [..., ceil(K/B), B] with zero padding; returns the padded length too."""
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (k + pad) // block, block), k


def _blocks_2d(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[R, C] -> [R/br, C/bc, br, bc] tiles (zero padded)."""
    r, c = x.shape
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    rr, cc = (r + pr) // br, (c + pc) // bc
    return x.reshape(rr, br, cc, bc).permute(0, 2, 1, 3).contiguous()


def _unblocks_2d(t: torch.Tensor, r: int, c: int) -> torch.Tensor:
    rr, cc, br, bc = t.shape
    return t.permute(0, 2, 1, 3).reshape(rr * br, cc * bc)[:r, :c]


def _quantize_groups(
    x: torch.Tensor,
    f: Fp8Format,
    granularity: Granularity,
    dim: int,
    pow2_scales: bool,
    margin: int,
    eps: float,
    block: int,
    scale: Optional[torch.Tensor],
    stats: Optional[Fp8Stats],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group x, compute one scale per group and cast; returns (grouped fp8 data, scale s)."""
    xf = x.float()
    if granularity == "tensor":
        amax = xf.abs().amax()
        s = compute_scale(amax, f, margin=margin, pow2=pow2_scales, eps=eps) if scale is None else scale.float()
        grouped = xf
    elif granularity == "row":
        amax = xf.abs().amax(dim=dim, keepdim=True)
        s = compute_scale(amax, f, margin=margin, pow2=pow2_scales, eps=eps)
        grouped = xf
    elif granularity == "mx":
        grouped, _ = _blocks_1d(_move_last(xf, dim), block)
        amax = grouped.abs().amax(dim=-1, keepdim=True)
        s = torch.ldexp(torch.ones_like(amax), -e8m0_exponent(amax))
    elif isinstance(granularity, (tuple, list)) and len(granularity) == 2:
        br, bc = int(granularity[0]), int(granularity[1])
        if br == 1:
            grouped, _ = _blocks_1d(_move_last(xf, dim), bc)
            amax = grouped.abs().amax(dim=-1, keepdim=True)
        else:
            if xf.dim() != 2:
                raise ValueError(f"2-D block granularity {granularity} needs a 2-D tensor, got {tuple(x.shape)}")
            grouped = _blocks_2d(xf, br, bc)
            # one flat reduction per tile (torch's CPU multi-dim amax is ~100x slower)
            amax = grouped.reshape(*grouped.shape[:2], -1).abs().amax(dim=-1)[..., None, None]
        s = compute_scale(amax, f, margin=margin, pow2=pow2_scales, eps=eps)
    else:
        raise ValueError(
            f"unknown granularity {granularity!r}; use 'tensor', 'row', (1, B), (B, B) or 'mx'"
        )
    scaled = grouped * s
    if stats is not None:
        stats.add(scaled, amax, f, current=scale is None)
    return cast_to_fp8(scaled, f), s


def quantize(
    x: torch.Tensor,
    fmt: "str | Fp8Format",
    granularity: Granularity = "tensor",
    *,
    dim: int = -1,
    pow2_scales: bool = False,
    margin: int = 0,
    eps: float = 0.0,
    block: int = 32,
    scale: Optional[torch.Tensor] = None,
    stats: Optional[Fp8Stats] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize x to FP8 group by group; returns ``(data, scale_inv)``.

    Args:
        x: float tensor. 2-D for ``(B, B)`` tiles; any rank otherwise.
        fmt: ``"e4m3"`` or ``"e5m2"``.
        granularity: ``"tensor"``, ``"row"``, ``(1, B)``, ``(B, B)`` or ``"mx"`` (module docstring).
        dim: the dimension the groups run along (the GEMM reduction dimension) for ``"row"``,
            ``(1, B)`` and ``"mx"``.
        pow2_scales: round scales down to powers of two (ignored by ``"mx"``, always a power of two).
        margin, eps: see :func:`compute_scale`.
        block: MX block length (32).
        scale: use this per-tensor scale instead of the current amax (delayed scaling).
        stats: accumulate saturation / non-finite counters here.
    Returns:
        data: FP8 tensor. Same shape as x for ``"tensor"``/``"row"``; for block granularities the
            grouped layout ``[..., n_blocks, B]`` (1-D, ``dim`` moved last) or
            ``[R/B, C/B, B, B]`` (2-D), zero padded.
        scale_inv: float32 ``fp32(1/s)`` per group: ``[]``, x's shape with 1 at ``dim``,
            ``[..., n_blocks, 1]`` or ``[R/B, C/B, 1, 1]``.
    """
    data, s = _quantize_groups(x, get_format(fmt), granularity, dim, pow2_scales, margin, eps, block, scale, stats)
    return data, 1.0 / s


def dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    like: torch.Tensor,
    granularity: Granularity = "tensor",
    *,
    dim: int = -1,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``x_hat = float32(q) * scale_inv`` back in ``like``'s shape (float32)."""
    return _ungroup(data.float() * scale_inv, like, granularity, dim)


def _ungroup(grouped: torch.Tensor, like: torch.Tensor, granularity: Granularity, dim: int) -> torch.Tensor:
    """Undo the grouping of :func:`_quantize_groups`: back to ``like``'s shape (padding dropped)."""
    if granularity in ("tensor", "row"):
        return grouped
    if isinstance(granularity, (tuple, list)) and granularity[0] != 1:
        return _unblocks_2d(grouped, *like.shape)
    moved = grouped.reshape(*grouped.shape[:-2], -1)[..., : like.shape[dim]]
    return _restore(moved, dim, like.dim())


def fake_quantize(
    x: torch.Tensor,
    fmt: "str | Fp8Format",
    granularity: Granularity = "tensor",
    *,
    dim: int = -1,
    pow2_scales: bool = False,
    margin: int = 0,
    eps: float = 0.0,
    block: int = 32,
    scale: Optional[torch.Tensor] = None,
    stats: Optional[Fp8Stats] = None,
    divide: bool = False,
) -> torch.Tensor:
    """Quantize-dequantize: the FP8 value each element of x is replaced by, in x's shape and dtype.

    ``x_hat = float32(sat_fp8(x * s)) * fp32(1/s)`` per group (Transformer Engine's convention); with
    ``divide=True`` the read-back is ``float32(q) / s`` (torchao's convention). The two agree exactly
    for power-of-two scales and within one float32 ulp otherwise. Arguments as in :func:`quantize`.
    """
    data, s = _quantize_groups(x, get_format(fmt), granularity, dim, pow2_scales, margin, eps, block, scale, stats)
    read_back = data.float() / s if divide else data.float() * (1.0 / s)
    return _ungroup(read_back, x, granularity, dim).to(x.dtype)
