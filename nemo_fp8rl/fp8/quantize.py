"""Scaled FP8 quantization at every granularity used by the recipes.

A tensor x is quantized group by group: every group g (the whole tensor, a row, a 1x128 or 128x128
block, a 1x32 MX block) gets a scale s_g chosen so its largest magnitude lands at the top of the FP8
range, ``q = sat_fp8(x * s_g)``, and is read back as ``x_hat = float32(q) * fp32(1 / s_g)``.

Scale rule (docs/design.md, FP8; Transformer Engine's ``compute_scale_from_amax``):

    a = max(amax, eps);  s = fp32(M * 2^-margin / a)      M = 448 (E4M3) / 57344 (E5M2)
    a in {0, inf, NaN}  ->  s = 1
    s = inf (a tiny)    ->  fp32 max (per tensor / row), the input dtype's max (1x128, 128x128 blocks)
    power-of-two mode:  s <- 2^floor(log2 s)       (exact, via frexp)

MX (OCP microscaling, ``mxfp8``) uses an E8M0 scale, a pure power of two chosen from the block amax,
M the max of the format the block is cast to (E5M2 gradients under ``hybrid`` use 57344):

    e = ceil(log2(amax * fp32(1/M))),  clamped to [-127, 127];   q = sat(x * 2^-e),  x_hat = q * 2^e

Speed: every entry point runs two passes over x (:func:`_quantize_impl`): the amax reduction with the
scale rule, then the fused scale-saturate-cast (and read-back); under ``fp8.compile`` each is one
compiled kernel (:mod:`~nemo_fp8rl.fp8.fused`), bit-equal to the eager ops. Groups are formed as views
of x in its own layout (no transposed copy, whatever the reduction dimension), and x is read in its
own dtype.

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
Checked bit for bit against readable ports of TE's and vLLM's own rules (``tests/fp8/test_upstream_references.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from nemo_fp8rl.fp8 import fused
from nemo_fp8rl.fp8.formats import Fp8Format, cast_to_fp8, get_format

Granularity = Union[str, Tuple[int, int]]



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
    input_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP8 scale from an amax, as Transformer Engine's ``compute_scale_from_amax`` computes it.

        a = max(amax, eps)                    (clamped first: an all-zero group gets M / eps when eps > 0)
        s = fp32(M * 2^-margin / a)
        a in {0, inf, NaN}  ->  s = 1
        s = inf (a tiny)    ->  s = the largest finite value of ``input_dtype``
        pow2:  s <- 2^floor(log2 s)

    Args:
        amax: float tensor of any shape (one amax per scaling group).
        fmt: FP8 format giving M.
        margin: extra headroom in powers of two (delayed scaling's ``margin``).
        pow2: round s down to a power of two.
        eps: lower clamp of amax (TE's ``amax_epsilon``, 0 by default).
        input_dtype: dtype of the quantized tensor. TE's 1x128 / 128x128 kernels replace an infinite
            scale by that dtype's largest value (3.39e38 for bf16), its per-tensor kernel by float32's
            (the default). The two differ only with pow2 off: both round down to 2^127.
    Returns:
        float32 tensor shaped like ``amax``.
    """
    f = get_format(fmt)
    amax = amax.float()
    if eps > 0:
        amax = torch.clamp(amax, min=eps)
    top = torch.tensor(f.max * 2.0 ** (-margin), dtype=torch.float32)
    s = top / amax
    s = torch.where(torch.isinf(s), torch.full_like(s, torch.finfo(input_dtype).max), s)
    bad = (amax == 0) | ~torch.isfinite(amax)
    s = torch.where(bad, torch.ones_like(s), s)
    if pow2:
        s = pow2_floor(s)
    return s


def e8m0_exponent(amax: torch.Tensor, fmt: "str | Fp8Format" = "e4m3") -> torch.Tensor:
    """MX E8M0 shared exponent ``e = ceil(log2(amax * fp32(1/M)))`` clamped to [-127, 127].

    M is the max of the format the block is cast to: 448 for E4M3, 57344 for E5M2 (hybrid's gradients),
    as Transformer Engine's MX kernel computes ``float_to_e8m0(amax * max_norm_rcp<OType>)``.
    Computed exactly with frexp: v = m * 2^k, m in [0.5, 1); ceil(log2 v) = k - 1 if m == 0.5 else k.
    amax = 0 gives -127 (the smallest E8M0 scale); amax = inf gives 127 (TE's saturating conversion:
    the block's finite values then cast to 0, its infs to +-M); a NaN amax gives 0 (scale 1; TE's
    NaN-skipping amax never produces one).

    Args:
        amax: float tensor, any shape. fmt: the block's FP8 format. Returns int32 tensor of amax's shape.
    """
    v = amax.float() * torch.tensor(1.0 / get_format(fmt).max, dtype=torch.float32)
    m, k = torch.frexp(v)
    e = torch.where(m == 0.5, k - 1, k)
    e = torch.where(v == 0, torch.full_like(e, -127), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 127), e)
    e = torch.where(torch.isnan(v), torch.zeros_like(e), e)
    return e.clamp(-127, 127).to(torch.int32)


class Fp8Stats:
    """Running FP8 health counters of one quantizer, kept as tensors (no host sync).

    ``saturated``: elements with |x * s| > M before the clamp (overflowed and were saturated);
    ``numel``: elements quantized; ``nonfinite_amax``: groups whose amax was inf or NaN.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero the counters on the device they live on (no host round trip)."""
        dev = self.numel.device if hasattr(self, "numel") else torch.device("cpu")
        self.saturated = torch.zeros((), dtype=torch.int64, device=dev)
        self.numel = torch.zeros((), dtype=torch.int64, device=dev)
        self.nonfinite_amax = torch.zeros((), dtype=torch.int64, device=dev)

    def to_device(self, dev) -> None:
        """Move the counters to ``dev`` (once; the kernels add into them in place)."""
        dev = torch.device(dev)
        if self.numel.device != dev:
            self.saturated, self.numel, self.nonfinite_amax = (
                t.to(dev) for t in (self.saturated, self.numel, self.nonfinite_amax)
            )

    def add(self, saturated: Optional[torch.Tensor], numel: int, nonfinite: torch.Tensor) -> None:
        """Add one quantization's counts (tensors from the quantizer; no host sync).

        ``saturated`` is None for a current scale: no finite element can exceed M then (s * amax <= M
        by construction), so only a given (delayed) scale pays for the element-wise overflow count.
        """
        dev = nonfinite.device
        if self.saturated.device != dev:
            self.saturated, self.numel, self.nonfinite_amax = (
                t.to(dev) for t in (self.saturated, self.numel, self.nonfinite_amax)
            )
        if saturated is not None:
            self.saturated += saturated
        self.numel += numel
        self.nonfinite_amax += nonfinite


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


def _split_dim(x: torch.Tensor, d: int, block: int) -> torch.Tensor:
    """Split dim ``d`` of x into (n_blocks, block), zero-padding it to a multiple of ``block``.

    [..., D, ...] -> [..., ceil(D/B), B, ...]: a view (plus the pad), no transpose, so the fused kernel
    reads x in its own layout whatever the reduction dimension (zeros do not change an amax).
    """
    n = x.shape[d]
    pad = (-n) % block
    # compiled: pad unconditionally (a zero pad is free inside the fused kernel) so the graph does not
    # guard on n % block and recompile for the other case; eager: skip the copy a zero pad would make
    if torch.compiler.is_compiling() or pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - d) + (0, pad))
    return x.reshape(*x.shape[:d], (n + pad) // block, block, *x.shape[d + 1:])


def _grouped(xf: torch.Tensor, granularity: Granularity, d: int, block: int) -> torch.Tensor:
    """x in its scaling groups, in x's own layout (views plus a zero pad; no transposes, so one fused pass
    reads x as it lies): ``tensor``/``row``: x itself. 1-D blocks (``(1, B)``, ``mx``): ``dim`` split into
    (n_blocks, B), [..., n_blocks, B, ...]. 2-D tiles ``(B, B)``: [R/B, B, C/B, B]. The scales of
    :func:`_group_scales` broadcast against it (``[]``, 1 at ``dim``, [..., n_blocks, 1, ...],
    [R/B, 1, C/B, 1]); :func:`quantize` returns views in its documented layout."""
    if granularity in ("tensor", "row"):
        return xf
    if granularity == "mx":
        return _split_dim(xf, d, block)
    if isinstance(granularity, (tuple, list)) and len(granularity) == 2:
        br, bc = int(granularity[0]), int(granularity[1])
        if br == 1:
            return _split_dim(xf, d, bc)
        if xf.dim() != 2:
            raise ValueError(f"2-D block granularity {granularity} needs a 2-D tensor, got {tuple(xf.shape)}")
        return _split_dim(_split_dim(xf, 1, bc), 0, br)  # [R/br, br, C/bc, bc]
    raise ValueError(f"unknown granularity {granularity!r}; use 'tensor', 'row', (1, B), (B, B) or 'mx'")


def _group_amax(grouped: torch.Tensor, granularity: Granularity, d: int) -> torch.Tensor:
    """amax per group, keepdim in the grouped layout ([] for ``tensor``)."""
    if granularity == "tensor":
        return grouped.abs().amax()
    if granularity == "row":
        return grouped.abs().amax(dim=d, keepdim=True)
    if isinstance(granularity, (tuple, list)) and granularity[0] != 1:
        # two single-dim reductions: exact like one, and fast in eager too (a 2-dim amax of a strided
        # view is ~100x slower on CPU)
        return grouped.abs().amax(dim=3, keepdim=True).amax(dim=1, keepdim=True)
    return grouped.abs().amax(dim=d + 1, keepdim=True)


def _group_scales(
    x: torch.Tensor, f: Fp8Format, granularity: Granularity, d: int, pow2_scales: bool, margin: int, eps: float,
    block: int, scale: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 (one read of x): ``(s, amax, n_nonfinite)``.

    s (float32): the scale of every group, shaped to broadcast against the grouped layout; ``scale``
    (a delayed per-tensor scale) is used as given. amax: per group (keepdim), the tensor's own amax for a
    given scale (what delayed scaling records). n_nonfinite (int64 []): groups whose amax is inf/NaN.
    """
    amax = _group_amax(_grouped(x.float(), granularity, d, block), granularity, d)
    if granularity == "mx":
        s = torch.ldexp(torch.ones_like(amax), -e8m0_exponent(amax, f))
    elif granularity == "tensor" and scale is not None:
        s = scale.float()
    else:
        # TE's block kernels bound an infinite scale by the input dtype's max, its per-tensor kernel by fp32's
        block = isinstance(granularity, (tuple, list))
        s = compute_scale(amax, f, margin=margin, pow2=pow2_scales, eps=eps,
                          input_dtype=x.dtype if block else torch.float32)
    return s, amax, (~torch.isfinite(amax)).sum()


def _group_cast(
    x: torch.Tensor, s: torch.Tensor, f: Fp8Format, granularity: Granularity, d: int, block: int,
    count_saturated: bool, fake: bool, divide: bool, out_dtype: torch.dtype,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Stage 2 (one read of x, one write): scale, saturate, cast; with ``fake`` also read back.

    ``q = fp8(clamp(x * s, -M, M))`` in the grouped layout; ``fake``: ``x_hat = float32(q) * fp32(1/s)``
    (``divide``: ``float32(q) / s``) back in x's shape as ``out_dtype``. n_saturated (int64 []) counts
    |x * s| > M when ``count_saturated`` (a given delayed scale), else None.
    """
    # compiled read-back of block/tile groups: stay in x's own layout and broadcast each group's scale to
    # its elements (an index expression in the fused loop), so the padded grouped read-back is never
    # materialised and copied back (8 B per element more: 20 vs 12 B/el, benchmarks/bench_fp8_linear.py).
    # The same values element for element, so bit-equal to eager (tests/fp8/test_fused.py).
    in_layout = fake and torch.compiler.is_compiling() and granularity not in ("tensor", "row")
    s_g = _scales_in_layout(s, x, granularity, d, block) if in_layout else s
    scaled = (x.float() if in_layout else _grouped(x.float(), granularity, d, block)) * s_g
    n_sat = (scaled.abs() > f.max).sum() if count_saturated else None
    data = cast_to_fp8(scaled, f)
    if not fake:
        return data, n_sat
    if divide:
        read_back = data.float() / s_g
    else:
        inv = 1.0 / s
        read_back = data.float() * (_scales_in_layout(inv, x, granularity, d, block) if in_layout else inv)
    return (read_back if in_layout else _from_layout(read_back, x, granularity, d)).to(out_dtype), n_sat


def _scales_in_layout(
    s: torch.Tensor, like: torch.Tensor, granularity: Granularity, d: int, block: int,
) -> torch.Tensor:
    """Per-group values of :func:`_grouped`'s layout broadcast to every element, in ``like``'s shape.

    1-D blocks: s [..., n_blocks, 1, ...] -> [..., n_blocks * B, ...] narrowed to ``like.shape[d]``;
    2-D tiles: s [R/br, 1, C/bc, 1] -> [R, C]. An expand plus views: Inductor turns it into the index
    ``s[i // B]`` inside the consumer's loop (eager would copy it, so only the compiled path uses it).
    """
    if isinstance(granularity, (tuple, list)) and granularity[0] != 1:
        br, bc = int(granularity[0]), int(granularity[1])
        rr, _, cc, _ = s.shape
        full = s.expand(rr, br, cc, bc).reshape(rr * br, cc * bc)
        return full[: like.shape[0], : like.shape[1]]
    b = block if granularity == "mx" else int(granularity[1])
    shape = list(s.shape)
    shape[d + 1] = b
    full = s.expand(shape).reshape(*shape[:d], shape[d] * b, *shape[d + 2:])
    return full.narrow(d, 0, like.shape[d])


def _to_documented_layout(t: torch.Tensor, granularity: Granularity, d: int) -> torch.Tensor:
    """From :func:`_grouped`'s layout to :func:`quantize`'s (a view): 1-D blocks [..., n_blocks, B]
    with ``dim`` moved last, 2-D tiles [R/B, C/B, B, B]."""
    if granularity in ("tensor", "row"):
        return t
    if isinstance(granularity, (tuple, list)) and granularity[0] != 1:
        return t.permute(0, 2, 1, 3)
    return t.movedim((d, d + 1), (-2, -1))


def _from_layout(grouped: torch.Tensor, like: torch.Tensor, granularity: Granularity, d: int) -> torch.Tensor:
    """Undo :func:`_grouped`: back to ``like``'s shape, padding dropped (views)."""
    if granularity in ("tensor", "row"):
        return grouped
    if isinstance(granularity, (tuple, list)) and granularity[0] != 1:
        rr, br, cc, bc = grouped.shape
        return grouped.reshape(rr * br, cc * bc)[: like.shape[0], : like.shape[1]]
    merged = grouped.reshape(*grouped.shape[:d], -1, *grouped.shape[d + 2:])
    return merged.narrow(d, 0, like.shape[d])


def _quantize_impl(
    x: torch.Tensor, f: Fp8Format, granularity: Granularity, dim: int, pow2_scales: bool, margin: int, eps: float,
    block: int, scale: Optional[torch.Tensor], stats: Optional[Fp8Stats], fake: bool, divide: bool,
    out_dtype: torch.dtype, size_hint: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantizer both public entry points run: ``(out, s, amax)`` (``out``: FP8 data in the grouped
    layout, or with ``fake`` the read-back in x's shape; s and amax per group, keepdim).

    Two passes over x, traced as one function and compiled as one graph under ``fp8.compile``
    (:mod:`~nemo_fp8rl.fp8.fused`): the amax reduction with the scale rule, then the fused
    scale-saturate-cast (and read-back). The scales are outputs of the graph, which makes Inductor
    materialise them once per group; computed inside the cast loop only, it would repeat the scale rule
    (a division, isinf/NaN checks) for every element. ``size_hint``: see
    :func:`~nemo_fp8rl.fp8.fused.wants_compile`.
    """
    d = dim % x.dim() if x.dim() else 0
    gran = tuple(granularity) if isinstance(granularity, (tuple, list)) else granularity
    count = stats is not None and scale is not None
    key = (f.name, gran, -1 if gran == "tensor" else d, x.dim(), int(block), bool(pow2_scales), int(margin),
           float(eps), scale is None, count, bool(fake), bool(divide), out_dtype)

    def both(t, sc):
        s_, amax_, n_bad_ = _group_scales(t, f, gran, d, pow2_scales, margin, eps, block, sc)
        out_, n_sat_ = _group_cast(t, s_, f, gran, d, block, count, fake, divide, out_dtype)
        return out_, s_, amax_, n_bad_, n_sat_

    def make():
        return (lambda t: both(t, None)) if scale is None else both

    out, s, amax, n_bad, n_sat = fused.run(key, make, *((x,) if scale is None else (x, scale)), size_hint=size_hint)
    if stats is not None:
        stats.add(n_sat, x.numel(), n_bad)
    return out, s, amax


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
    data, s, _ = _quantize_impl(x, get_format(fmt), granularity, dim, pow2_scales, margin, eps, block, scale, stats,
                                False, False, torch.float32)
    d = dim % x.dim() if x.dim() else 0
    return _to_documented_layout(data, granularity, d), _to_documented_layout(1.0 / s, granularity, d)


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
    """Undo :func:`quantize`'s documented grouping: back to ``like``'s shape (padding dropped)."""
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
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Quantize-dequantize: the FP8 value each element of x is replaced by, in x's shape.

    ``x_hat = float32(sat_fp8(x * s)) * fp32(1/s)`` per group (Transformer Engine's convention); with
    ``divide=True`` the read-back is ``float32(q) / s`` (torchao's convention). The two agree exactly
    for power-of-two scales and within one float32 ulp otherwise. Arguments as in :func:`quantize`;
    ``out_dtype`` (default x's dtype): the read-back's dtype; float32 keeps every FP8 value times its
    scale-inverse exact, as an FP8 GEMM sees it. x is read in its own dtype (a bf16 tensor is not copied
    to float32 first); under ``fp8.compile`` the whole function is one fused pass after the amax.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    out, _, _ = _quantize_impl(x, get_format(fmt), granularity, dim, pow2_scales, margin, eps, block, scale, stats,
                               True, divide, out_dtype)
    return out
