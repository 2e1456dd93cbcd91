"""A readable reference of torch's scaled GEMM, for checking argument layouts where the kernel cannot run.

It first applies the rules torch's CUDA scaled GEMM enforces (:func:`check_scaled_mm`, read from torch's
aten sources: the scaled-GEMM dispatch table and its per-recipe checks, the cuBLASLt scale-mode setup),
raising as torch does, then reads ``(mat_a, mat_b, scale_a, scale_b)`` the way torch documents each
scaling type, multiplies every element by its scale in float64, adds the bias and rounds once to the
output dtype. Tests put it in place of ``nemo_fp8rl.fp8.backends.scaled_mm_kernel`` (row-wise and
block-scaled kernels need a GPU) and compare with the emulation; a wrong layout (a transposed tile grid,
a wrong stride) reads the wrong scale, and a combination torch refuses raises here too.
"""

from __future__ import annotations

import torch

from nemo_fp8rl.fp8 import backends


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _outer_major(scale: torch.Tensor, rows: int) -> bool:
    """torch's stride rule for a [rows, blocks] scale: stride (1, rows); a single column may have any stride."""
    return scale.stride(0) == 1 and (scale.stride(1) == rows or (scale.shape[1] == 1 and scale.stride(1) == 1))


def check_scaled_mm(mat_a, mat_b, scale_a, kind_a, scale_b, kind_b, out_dtype, fast_accum=False, bias=None) -> None:
    """Raise as torch's CUDA ``scaled_mm`` does for arguments it refuses (``RuntimeError``/``ValueError``).

    mat_a [M, K] and mat_b [K, N] FP8. The rules, in torch's words where it has them:

    1. Operand dtypes: both FP8; not both E5M2 ("Multiplication of two Float8_e5m2 matrices is not
       supported").
    2. Shapes: K % 16 == 0, N % 16 == 0.
    3. Recipe table (the v2 dispatch): TensorWise x TensorWise and RowWise x RowWise accept any FP8
       dtypes; the block-scaled ("DeepSeek") pairs 1x128 x 128x128, 128x128 x 1x128 and 1x128 x 1x128
       accept E4M3 x E4M3 only; anything else is "Invalid scaling configuration".
    4. Scale layouts: TensorWise one float; RowWise [M, 1] and N floats; 1x128 on A [M, ceil(K/128)] with
       strides (1, M); 1x128 on B [N, ceil(K/128)] with strides (1, N); 128x128 on B
       [round_up(ceil(K/128), 4), ceil(N/128)] with strides (1, that first size). A dimension of size 1
       may have any stride.
    5. Fast accumulation is refused with 1x128 and 128x128 scaling (the cuBLASLt scale-mode setup).
    6. Bias: none with a float32 output; BFloat16 for a BFloat16 output, Float16 for a Float16 output.
    7. Not a torch check but cuBLASLt's layout, as Transformer Engine allocates it: every column of a 1x128
       scale (the scales of one 128-block of K, one per row) starts at a 16-byte aligned address, i.e. the
       leading dimension (M for A, N for B) is a multiple of 4 floats.
    """
    st = torch.nn.functional.ScalingType
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if mat_a.dtype not in fp8 or mat_b.dtype not in fp8:
        raise ValueError(f"Expected both inputs to be fp8, got {mat_a.dtype} and {mat_b.dtype}")
    if mat_a.dtype == torch.float8_e5m2 and mat_b.dtype == torch.float8_e5m2:
        raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
    m, k = mat_a.shape
    n = mat_b.shape[1]
    if k % 16 or mat_b.shape[0] % 16 or n % 16:
        raise ValueError(f"mat_a [{m}, {k}] / mat_b {list(mat_b.shape)}: K and N must be multiples of 16")
    block = {st.BlockWise1x128, st.BlockWise128x128}
    pairs = {(st.TensorWise, st.TensorWise), (st.RowWise, st.RowWise), (st.BlockWise1x128, st.BlockWise128x128),
             (st.BlockWise128x128, st.BlockWise1x128), (st.BlockWise1x128, st.BlockWise1x128)}
    deepseek = kind_a in block or kind_b in block
    e4m3_both = mat_a.dtype == torch.float8_e4m3fn and mat_b.dtype == torch.float8_e4m3fn
    if (kind_a, kind_b) not in pairs or (deepseek and not e4m3_both):
        raise ValueError(f"Invalid scaling configuration: {kind_a} x {kind_b} with {mat_a.dtype} x {mat_b.dtype}")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError("scales must be float32")
    kb = _ceil_div(k, 128)
    if kind_a == st.TensorWise and (scale_a.numel() != 1 or scale_b.numel() != 1):
        raise ValueError("scale_a and scale_b must have 1 Float element")
    if kind_a == st.RowWise and (tuple(scale_a.shape) != (m, 1) or scale_b.numel() != n):
        raise ValueError(f"scale_a must have shape [{m}, 1] and scale_b {n} elements")
    if kind_a == st.BlockWise1x128:
        if tuple(scale_a.shape) != (m, kb) or not _outer_major(scale_a, m):
            raise ValueError(f"scale_a must have shape [{m}, {kb}] and strides (1, {m}); got "
                             f"{list(scale_a.shape)} {scale_a.stride()}")
        if kind_b == st.BlockWise1x128 and (tuple(scale_b.shape) != (n, kb) or not _outer_major(scale_b, n)):
            raise ValueError(f"scale_b must have shape [{n}, {kb}] and strides (1, {n}); got "
                             f"{list(scale_b.shape)} {scale_b.stride()}")
        if kind_b == st.BlockWise128x128:
            l4 = _round_up(kb, 4)
            if tuple(scale_b.shape) != (l4, _ceil_div(n, 128)) or not _outer_major(scale_b, l4):
                raise ValueError(f"scale_b must have shape [{l4}, {_ceil_div(n, 128)}] and strides (1, {l4}); got "
                                 f"{list(scale_b.shape)} {scale_b.stride()}")
        # 7: cuBLASLt's 16-byte aligned columns of a 1x128 scale
        for name, s, lead in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
            kind = kind_a if name == "scale_a" else kind_b
            if kind == st.BlockWise1x128 and s.shape[1] > 1 and lead % 4:
                raise RuntimeError(f"{name}: a 1x128 scale's columns must be 16-byte aligned (leading dimension "
                                   f"{lead} is not a multiple of 4)")
    if deepseek and fast_accum:
        raise RuntimeError("scaled_gemm doesn't support fast accum with 1x128 / 128x128 blockwise scaling")
    if bias is not None:
        if out_dtype == torch.float32:
            raise ValueError("Bias is not supported when out_dtype is set to Float32")
        if bias.dtype != out_dtype:
            raise ValueError(f"Bias must be {out_dtype} to compute {out_dtype} output, but got {bias.dtype}")


def expand_scale(scale: torch.Tensor, kind, rows: int, cols: int, operand: str) -> torch.Tensor:
    """Scale of every element of mat_a [M, K] ('a') or mat_b [K, N] ('b'), from torch's documented layouts."""
    st = torch.nn.functional.ScalingType
    if kind == st.TensorWise:
        return scale.reshape(()).expand(rows, cols)
    if kind == st.RowWise:  # a: [M, 1] per row; b: [1, N] per column
        return scale.expand(rows, cols)
    idx_r, idx_c = torch.arange(rows), torch.arange(cols)
    if kind == st.BlockWise1x128:
        # a: [M, K/128], element (i, k) -> scale[i, k // 128]; b: [N, K/128], element (k, j) -> scale[j, k // 128]
        if operand == "a":
            return scale[idx_r[:, None], (idx_c // 128)[None, :]]
        return scale[idx_c[None, :], (idx_r // 128)[:, None]]
    if kind == st.BlockWise128x128:  # b only here: [L4, N/128], element (k, j) -> scale[k // 128, j // 128]
        return scale[(idx_r // 128)[:, None], (idx_c // 128)[None, :]]
    raise AssertionError(kind)


def reference_kernel(calls, exact_output: bool = False, check: bool = True):
    """The kernel; every call is appended to ``calls`` as ``(mat_a, mat_b, scale_a, kind_a, scale_b, kind_b,
    out_dtype, fast_accum, bias)``. ``exact_output``: return the float64 product as float32 instead of
    rounding it to the requested output dtype, to compare a whole model with the emulation at float noise.
    ``check``: apply :func:`check_scaled_mm` first (raise where torch would)."""
    def kernel(mat_a, mat_b, scale_a, gran_a, scale_b, gran_b, out_dtype, fast_accum, bias=None):
        ka, kb = backends._scaling_type(gran_a), backends._scaling_type(gran_b)
        if check:
            check_scaled_mm(mat_a, mat_b, scale_a, ka, scale_b, kb, out_dtype, fast_accum, bias)
        calls.append((mat_a, mat_b, scale_a, ka, scale_b, kb, out_dtype, fast_accum, bias))
        a = mat_a.double() * expand_scale(scale_a.double(), ka, *mat_a.shape, "a")
        b = mat_b.double() * expand_scale(scale_b.double(), kb, *mat_b.shape, "b")
        c = a @ b
        if bias is not None:
            c = c + bias.double()
        return c.to(torch.float32 if exact_output else out_dtype)
    return kernel


def cuda_meta_check(calls) -> None:
    """Run torch's own CUDA shape/stride checks of ``_scaled_mm_v2`` (its meta registration, with the device
    taken as CUDA) on recorded kernel calls ``(mat_a, mat_b, scale_a, kind_a, scale_b, kind_b, out_dtype,
    fast_accum, bias)``; skips the test on a torch without that registration."""
    import pytest

    meta = pytest.importorskip("torch._meta_registrations")
    fn = getattr(meta, "meta_scaled_mm_v2", None)
    if fn is None:
        pytest.skip("this torch has no meta registration of _scaled_mm_v2")

    def on_meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    orig = meta.device_hint
    meta.device_hint = lambda t: "cuda"
    try:
        for mat_a, mat_b, sa, ka, sb, kb, od, fast, bias in calls:
            out = fn(on_meta(mat_a), on_meta(mat_b), [on_meta(sa)], [ka.value], [], [on_meta(sb)], [kb.value], [],
                     None if bias is None else on_meta(bias), od, [], fast)
            assert out.shape == (mat_a.shape[0], mat_b.shape[1])
    finally:
        meta.device_hint = orig
