"""FP8 number formats and the saturating cast.

Two 8-bit floating-point formats are used for training (OCP FP8 / NVIDIA Hopper):

* E4M3 ("fn" variant): 4 exponent bits, 3 mantissa bits, bias 7, no infinities, one NaN pattern.
  Largest finite value 448, smallest normal 2^-6, smallest subnormal 2^-9. Used for inputs and
  weights (more precision).
* E5M2: 5 exponent bits, 2 mantissa bits, bias 15, IEEE-like with infinities. Largest finite value
  57344, smallest subnormal 2^-16. Used for gradients (more range) in the ``hybrid`` format.

The cast is ``q = fp8(clamp(x, -M, M))`` with round-to-nearest-even. The explicit clamp matters:
without it, torch's float32 -> E5M2 cast rounds finite overflow to +-inf and older torch releases
turned E4M3 overflow into NaN. NaN inputs stay NaN (clamp propagates NaN), which is what lets the
non-finite checks of the trainer see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: its torch dtype and its largest finite value ``max``."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_subnormal: float

    def __repr__(self) -> str:  # short form in logs and errors
        return self.name.upper()


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 2.0**-9)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 2.0**-16)

_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def get_format(fmt: "str | Fp8Format") -> Fp8Format:
    """Return the :class:`Fp8Format` for ``"e4m3"``/``"e5m2"`` (or pass a format through)."""
    if isinstance(fmt, Fp8Format):
        return fmt
    try:
        return _FORMATS[str(fmt).lower()]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}; valid formats: {sorted(_FORMATS)}") from None


def cast_to_fp8(x: torch.Tensor, fmt: "str | Fp8Format") -> torch.Tensor:
    """Saturating, round-to-nearest-even cast of an already-scaled tensor to FP8.

    ``q = fp8(clamp(float32(x), -M, M))`` with M = 448 (E4M3) or 57344 (E5M2).

    Args:
        x: any shape, any float dtype (already multiplied by its scale).
        fmt: target format.
    Returns:
        tensor of the same shape with dtype ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    """
    f = get_format(fmt)
    return torch.clamp(x.float(), -f.max, f.max).to(f.dtype)


def divide_exact(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` rounded as one IEEE division on every device (x any shape and float dtype; x's shape and dtype).

    ATen's CUDA kernel divides a tensor by a Python scalar as a multiplication by the scalar's reciprocal
    rounded to x's dtype: ``amax * fp32(1/448)`` differs from ``amax / 448`` in the last bit for about half
    of the float32 values, while the CPU kernel and vLLM's GPU kernels divide. Dividing by a 0-d tensor on
    x's device takes the division kernel on both (made on the device: no upload, no host sync).
    """
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def round_to_fp8(x: torch.Tensor, fmt: "str | Fp8Format") -> torch.Tensor:
    """``float32(cast_to_fp8(x))``: the FP8 grid value nearest to x (saturated), as float32."""
    return cast_to_fp8(x, fmt).float()
