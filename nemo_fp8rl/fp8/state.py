"""Per-linear FP8 state shared by every GEMM backend: delayed-scaling metas, health counters, the weight cache.

One module of its own so that ``linear.py`` (the emulation, the module, the converter) and
``torch_linear.py`` (torch's FP8 GEMMs) both import it without importing each other.
"""

from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

import torch

from nemo_fp8rl.fp8.quantize import Fp8Stats, compute_scale
from nemo_fp8rl.fp8.recipes import ROLES, Fp8Recipe


class DelayedScalingMeta:
    """Amax history and current scale of one operand under delayed scaling.

    ``scale`` starts at 1 (first step). After each recorded quantization:
    ``amax_ref = history[0]`` (most_recent) or ``max(history)`` (max);
    ``scale = M * 2^-margin / amax_ref``; then the history rolls one slot (slot 0 is cleared for the
    next step).
    """

    def __init__(self, history_len: int) -> None:
        self.amax_history = torch.zeros(history_len, dtype=torch.float32)
        self.scale = torch.ones((), dtype=torch.float32)

    def record_and_update(self, amax: torch.Tensor, recipe: Fp8Recipe, role: str,
                          nonfinite: Optional[torch.Tensor] = None) -> None:
        """Record ``amax`` (one float element) and compute the next scale (class docstring); ``nonfinite``: an
        int64 [] counter (``Fp8Stats.nonfinite_amax``) that gains 1 when the amax is inf or NaN (the kernel path
        counts it in the same launch)."""
        if self.amax_history.device != amax.device:
            self.amax_history = self.amax_history.to(amax.device)
            self.scale = self.scale.to(amax.device)
        from nemo_fp8rl.fp8 import kernels

        if kernels.kernel_unavailable(amax.device) is None:
            # one Triton launch for what follows (~25 small ops, each a kernel launch on a GPU); the same bits
            self.amax_history, self.scale = kernels.ops().delayed_update(
                self.amax_history, amax, recipe.format_for(role).name,
                most_recent=recipe.amax_compute_algo == "most_recent", margin=recipe.margin, pow2=recipe.pow2_scales,
                eps=recipe.amax_epsilon, nonfinite=nonfinite)
            return
        if nonfinite is not None:
            nonfinite += (~torch.isfinite(amax.reshape(()))).to(torch.int64)
        hist = self.amax_history.clone()
        hist[0] = amax.float()
        ref = hist[0] if recipe.amax_compute_algo == "most_recent" else hist.max()
        self.scale = compute_scale(
            ref, recipe.format_for(role), margin=recipe.margin, pow2=recipe.pow2_scales, eps=recipe.amax_epsilon
        )
        self.amax_history = torch.roll(hist, 1)
        self.amax_history[0] = 0.0

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        if sd["amax_history"].shape != self.amax_history.shape:
            raise ValueError(
                f"delayed-scaling amax_history has length {sd['amax_history'].shape[0]} in the checkpoint but "
                f"{self.amax_history.shape[0]} in the recipe (fp8.amax_history_len); use the same value"
            )
        self.amax_history = sd["amax_history"].clone().float()
        self.scale = sd["scale"].clone().float()


class Fp8LinearState:
    """Per-linear FP8 state: delayed-scaling metas (one per operand role) and health counters."""

    def __init__(self, recipe: Fp8Recipe, track_stats: bool = True) -> None:
        self.recipe = recipe
        self.delayed = {r: DelayedScalingMeta(recipe.amax_history_len) for r in ROLES} if recipe.scaling == "delayed" else {}
        self.stats: Optional[Fp8Stats] = Fp8Stats() if track_stats else None
        self.weight_cache = WeightCache()

    def state_dict(self) -> Dict[str, Dict[str, torch.Tensor]]:
        return {r: m.state_dict() for r, m in self.delayed.items()}

    def load_state_dict(self, sd: Dict[str, Dict[str, torch.Tensor]]) -> None:
        if set(sd) != set(self.delayed):
            raise ValueError(
                f"FP8 state roles {sorted(sd)} in the checkpoint do not match recipe "
                f"{self.recipe.name!r} ({sorted(self.delayed)}); resume with the same fp8 recipe"
            )
        for r, m in self.delayed.items():
            m.load_state_dict(sd[r])


class WeightCache:
    """FP8 weights of one linear, kept while the weights cannot change (:func:`fp8_weight_cache`).

    Entries are keyed by the reduction dim and checked against the weight's storage pointer, shape and
    version counter, so an in-place update inside the block (which should not happen there) misses
    instead of returning stale values. Outside the block nothing is cached.
    """

    def __init__(self) -> None:
        self.active = False
        self.entries: Dict[Hashable, Tuple[Tuple, object]] = {}

    @staticmethod
    def _tag(w: torch.Tensor) -> Tuple:
        return (w.data_ptr(), tuple(w.shape), w.dtype, w._version)

    def get(self, w: torch.Tensor, dim: Hashable):
        hit = self.entries.get(dim)
        return hit[1] if hit is not None and hit[0] == self._tag(w) else None

    def put(self, w: torch.Tensor, dim: Hashable, value) -> None:
        self.entries[dim] = (self._tag(w), value)

    def clear(self) -> None:
        self.entries.clear()


def _delayed_scale(t: torch.Tensor, role: str, recipe: Fp8Recipe, state: Optional[Fp8LinearState]):
    """``(meta, scale)`` of a delayed-scaling operand (its history and the scale in force), else (None, None)."""
    if recipe.scaling != "delayed":
        return None, None
    if state is None:
        raise ValueError("delayed scaling needs an Fp8LinearState (per-layer amax history)")
    meta = state.delayed[role]
    return meta, meta.scale.to(t.device)


def cached_weight(state: Optional[Fp8LinearState], weight: torch.Tensor, key: Hashable, make):
    """``make()``, or its value from this step's weight cache (``linear.fp8_weight_cache``: valid while the
    weight's storage, shape and version are unchanged; nothing is kept outside the block). Every backend's
    FP8 weights go through here, under keys of their own."""
    cache = state.weight_cache if state is not None else None
    if cache is None or not cache.active:
        return make()
    hit = cache.get(weight, key)
    if hit is None:
        hit = make()
        cache.put(weight, key, hit)
    return hit
