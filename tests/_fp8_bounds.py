"""What is true when two computations of one FP8 quantity differ only in GEMM shape, batching or kernel.

Float32 results of different GEMM shapes, batchings, thread counts or instruction sets (AVX2 vs AVX-512)
differ by ~1e-7 relative. Before an FP8 cast that is enough, with small probability per element, to
move a value across a rounding boundary: the value then changes by one FP8 code, and everything computed
from it by that code's share of the quantization error. Seen on an AVX2-only AMD EPYC: the cached and
the full forward of the rollout engine agreed to ~1e-6 on every token but one, which differed by
6.6e-3 nats. A tolerance tuned on one machine (1e-4 there) is therefore wrong, and no tolerance on the
maximum is right. What holds on every CPU, and still fails for a wrong computation (a stale or
misplaced KV cache, a missing reduction), which moves nearly every element far beyond float noise:

- nearly all elements agree to float noise: at most ``max_flip_frac`` of them differ by more than
  ``float_tol`` (a flip is rare: ~1e-7 / 2^-3 per cast element);
- no element differs by more than ``fp8_noise``: the whole FP8 quantization noise of the same
  quantity (FP8 vs high precision on the same inputs, max over the batch). One flipped code is one of the
  thousands of rounding errors that noise is made of, so a flip's effect stays far below it.
"""

from __future__ import annotations

import torch


def fp8_noise_bound(fp8: torch.Tensor, high_precision: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max |fp8 - high_precision| over the (masked) elements: the FP8 quantization noise of the batch."""
    d = (fp8.double() - high_precision.double()).abs()
    if mask is not None:
        d = d[mask.bool()]
    return float(d.max())


def assert_fp8_paths_agree(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    fp8_noise: float,
    float_tol: float,
    mask: torch.Tensor | None = None,
    max_flip_frac: float = 0.1,
    what: str = "",
) -> dict:
    """Assert the module docstring's two bounds; returns the measured counts (for messages and notes).

    Shapes: ``actual``, ``expected`` (and ``mask``) the same shape; compared elementwise in float64.
    """
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    d = (actual.double() - expected.double()).abs()
    if mask is not None:
        d = d[mask.bool()]
    d = d.flatten()
    n = d.numel()
    assert n > 0, what
    assert fp8_noise > float_tol, (what, "the FP8 noise bound must exceed float noise", fp8_noise, float_tol)
    beyond = int((d > float_tol).sum())
    stats = {"n": n, "beyond_float_noise": beyond, "max_diff": float(d.max()), "fp8_noise": fp8_noise}
    assert beyond <= max_flip_frac * n, (f"{what}: {beyond}/{n} elements differ by more than float noise "
                                         f"{float_tol:g} (at most {max_flip_frac:.0%} may, by FP8 rounding flips)",
                                         stats)
    assert float(d.max()) < fp8_noise, (f"{what}: a difference of {float(d.max()):.3g} exceeds the whole FP8 noise "
                                        f"{fp8_noise:.3g} of this quantity: not a rounding flip", stats)
    return stats
