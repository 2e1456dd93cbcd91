"""Small shared helpers: argument validation and masked reductions (pure torch)."""

from __future__ import annotations

import math
from numbers import Real

import torch

Number = float | int


def check_2d(name: str, x: torch.Tensor) -> torch.Tensor:
    """Require a ``[batch, seq]`` tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [batch, seq], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, seq], got shape {tuple(x.shape)}")
    return x


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Require every tensor in ``others`` (None skipped) to have the shape of ``ref``."""
    for name, x in others.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                f"pass tensors of the same [batch, seq] layout"
            )


def as_bool_mask(mask: torch.Tensor | None, like: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor of ``like``'s shape (None = all tokens valid).

    Accepts bool masks or 0/1 numeric masks (NeMo RL passes float/long masks).
    """
    if mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of 0/1 or bool, got {type(mask).__name__}")
    if mask.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)}, expected {tuple(like.shape)} (same as the data)"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def expand_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages ``[batch]`` to ``[batch, seq]``; pass ``[batch, seq]`` through."""
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if advantages.dim() == 1 and like.dim() == 2 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(-1).expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected [batch, seq] = {tuple(like.shape)} "
            f"or per-sequence [batch] = ({like.shape[0]},)"
        )
    return advantages


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_t m_t x_t; padding positions are excluded with ``where`` (so NaN/inf there cannot leak)."""
    z = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t m_t x_t / max(sum_t m_t, 1): 0-dim, 0 when nothing is valid."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1)


def masked_min(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Min over valid entries; ``empty`` when none is valid (no host sync)."""
    inf = torch.full((), math.inf, dtype=x.dtype, device=x.device)
    v = torch.where(mask, x, inf).amin() if x.numel() else inf
    return torch.where(mask.any(), v, torch.full_like(v, empty))


def masked_max(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Max over valid entries; ``empty`` when none is valid (no host sync)."""
    ninf = torch.full((), -math.inf, dtype=x.dtype, device=x.device)
    v = torch.where(mask, x, ninf).amax() if x.numel() else ninf
    return torch.where(mask.any(), v, torch.full_like(v, empty))


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    hint: str = "",
) -> float:
    """Validate a real number in [low, high] (or (low, high] with ``low_open``) and return it as float."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}. {hint}".rstrip())
    v = float(value)
    if low is not None and (v <= low if low_open else v < low):
        op = ">" if low_open else ">="
        raise ValueError(f"{name} must be {op} {low}, got {v}. {hint}".rstrip())
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {v}. {hint}".rstrip())
    return v


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16/fp16 log-probs are upcast; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
