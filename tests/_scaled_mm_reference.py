"""A readable reference of torch's scaled GEMM, for checking argument layouts where the kernel cannot run.

It reads ``(mat_a, mat_b, scale_a, scale_b)`` the way torch documents each scaling type, multiplies every
element by its scale in float64 and rounds once to the output dtype. Tests put it in place of
``nemo_fp8rl.fp8.backends.scaled_mm_kernel`` (row-wise and block-scaled kernels need a GPU) and compare
with the emulation; a wrong layout (a transposed tile grid, a wrong stride) reads the wrong scale.
"""

from __future__ import annotations

import torch

from nemo_fp8rl.fp8 import backends


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


def reference_kernel(calls, exact_output: bool = False):
    """The kernel; ``exact_output``: return the float64 product as float32 instead of rounding it to the
    requested (bf16) output dtype, to compare a whole model with the emulation at float noise."""
    def kernel(mat_a, mat_b, scale_a, gran_a, scale_b, gran_b, out_dtype, fast_accum):
        ka, kb = backends._scaling_type(gran_a), backends._scaling_type(gran_b)
        calls.append((mat_a, mat_b, scale_a, ka, scale_b, kb, out_dtype))
        a = mat_a.double() * expand_scale(scale_a.double(), ka, *mat_a.shape, "a")
        b = mat_b.double() * expand_scale(scale_b.double(), kb, *mat_b.shape, "b")
        return (a @ b).to(torch.float32 if exact_output else out_dtype)
    return kernel
