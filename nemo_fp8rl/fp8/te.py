"""Transformer Engine recipe objects for our :class:`~nemo_fp8rl.fp8.recipes.Fp8Recipe` (GPU path).

Transformer Engine is imported lazily: nothing here is needed on CPU, and importing
``nemo_fp8rl.fp8`` never imports it. Mapping:

============ =====================================================================
delayed      ``DelayedScaling(fp8_format, margin, amax_history_len, amax_compute_algo)``
tensorwise   ``Float8CurrentScaling(fp8_format)``
blockwise    ``Float8BlockScaling(fp8_format)`` with its ``fp8_quant_{fwd_inp,fwd_weight,bwd_grad}`` set to
             ``QParams(power_2_scale=pow2_scales)``
             (TE's own defaults come from ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``, read once when TE is
             imported, so they are passed explicitly; Megatron builds its own recipe from those
             defaults: :func:`check_block_scale_env` refuses a mismatch)
mxfp8        ``MXFP8BlockScaling(fp8_format)``
rowwise      no TE equivalent: error
============ =====================================================================
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from nemo_fp8rl.fp8.recipes import Fp8Recipe


def require_te():
    """Import ``transformer_engine.pytorch`` or raise an actionable error."""
    try:
        import transformer_engine.pytorch as te  # noqa: F401
        from transformer_engine.common import recipe as te_recipe  # noqa: F401
    except Exception as e:  # ImportError, or a CUDA/driver error raised at import
        raise RuntimeError(
            "Transformer Engine is not available "
            f"({type(e).__name__}: {e}). Install the GPU extra on a CUDA machine "
            "(pip install 'nemo-fp8rl[gpu]') or use fp8.backend=torch (torch's FP8 GEMMs) or fp8.backend=emulate."
        ) from e
    return te, te_recipe


_SUPPORT_CHECKS = {"delayed": "check_fp8_support", "tensorwise": "check_fp8_support",
                   "blockwise": "check_fp8_block_scaling_support", "mxfp8": "check_mxfp8_support"}


def te_support(scaling: str) -> tuple[bool, str]:
    """Whether this GPU + Transformer Engine run a scaling (``delayed``, ``tensorwise``, ``blockwise``,
    ``mxfp8``), from TE's own checks (``transformer_engine.pytorch.quantization`` on TE >= 2.9,
    ``transformer_engine.pytorch.fp8`` before). Returns ``(ok, reason)``; never raises."""
    if scaling not in _SUPPORT_CHECKS:
        return False, f"{scaling!r} has no Transformer Engine recipe"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a CUDA error raised at import
        return False, f"transformer_engine unavailable: {type(e).__name__}: {e}"
    import importlib

    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            fn = getattr(importlib.import_module(mod), _SUPPORT_CHECKS[scaling], None)
        except ImportError:
            continue
        if fn is not None:
            try:
                ok, reason = fn()
            except Exception as e:  # noqa: BLE001 - e.g. a CUDA error while querying the device
                return False, f"{_SUPPORT_CHECKS[scaling]} raised {type(e).__name__}: {e}"
            return bool(ok), str(reason or "")
    return False, f"this Transformer Engine has no {_SUPPORT_CHECKS[scaling]}"


def te_recipe(recipe: Fp8Recipe):
    """Build the Transformer Engine recipe object for ``recipe`` (sets the blockwise env var)."""
    _, R = require_te()
    if recipe.fp8_format == "e5m2":
        raise ValueError("fp8_format=e5m2 (E5M2 activations and weights) is an emulation-only stress setting; "
                         "Transformer Engine accepts fp8 formats e4m3 and hybrid")
    fmt = R.Format.HYBRID if recipe.fp8_format == "hybrid" else R.Format.E4M3
    if recipe.scaling == "delayed":
        return R.DelayedScaling(
            fp8_format=fmt,
            margin=recipe.margin,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
        )
    if recipe.scaling == "tensorwise":
        kw = {}
        if recipe.accumulation == "fp32" and hasattr(R, "MMParams"):  # TE's default forward is fast (split off)
            kw["fp8_gemm_fprop"] = R.MMParams(use_split_accumulator=True)
        return R.Float8CurrentScaling(fp8_format=fmt, **kw)
    if recipe.scaling == "blockwise":
        os.environ.update(recipe.te_env())  # for TE code that reads it later (child processes)
        kw = {}
        if "use_f32_scales" in getattr(R.Float8BlockScaling, "__dataclass_fields__", {}):
            kw["use_f32_scales"] = not recipe.pow2_scales
        r = R.Float8BlockScaling(fp8_format=fmt, **kw)
        # TE 2.x: the three QParams are class attributes (not constructor fields) whose power_2_scale
        # was fixed from the environment when TE was imported; set them on this instance.
        if hasattr(R, "QParams"):
            for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
                setattr(r, name, R.QParams(power_2_scale=recipe.pow2_scales, amax_epsilon=0.0))
        return r
    if recipe.scaling == "mxfp8":
        return R.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(
        f"FP8 recipe {recipe.name!r} ({recipe.scaling}) has no Transformer Engine equivalent; "
        "use tensorwise, delayed, blockwise or mxfp8 with TE, or the emulated path"
    )


def check_block_scale_env(recipe: Fp8Recipe) -> None:
    """Refuse a blockwise recipe whose scale type TE's defaults would not follow.

    Megatron builds ``Float8BlockScaling(fp8_format)`` itself, so the scale type is TE's class default,
    fixed from ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` when TE was first imported: power-of-two scales
    unless it was ``1``. Raises ``ValueError`` naming the variable when that default differs from
    ``recipe.pow2_scales``; other recipes pass.
    """
    if recipe.scaling != "blockwise":
        return
    _, R = require_te()
    default = getattr(getattr(R.Float8BlockScaling, "fp8_quant_fwd_inp", None), "power_2_scale", None)
    if default is not None and bool(default) != bool(recipe.pow2_scales):
        want = "0" if recipe.pow2_scales else "1"
        raise ValueError(
            f"fp8.pow2_scales={recipe.pow2_scales} but Transformer Engine was imported with "
            f"{'power-of-two' if default else 'fp32'} block scales; export NVTE_FP8_BLOCK_SCALING_FP32_SCALES={want} "
            "before the process starts (TE reads it once at import; the launcher's sbatch script sets it), "
            f"or set fp8.pow2_scales={bool(default)}"
        )


@contextlib.contextmanager
def te_autocast(recipe: "Fp8Recipe | None", enabled: bool = True) -> Iterator[None]:
    """TE FP8 autocast for ``recipe``; ``enabled=False`` (or no recipe) runs TE layers in high precision.

    Uses ``te.autocast`` on TE >= 2.9 and ``te.fp8_autocast`` on older releases.
    """
    te, _ = require_te()
    on = bool(enabled and recipe is not None)
    r = te_recipe(recipe) if on else None
    ctx = getattr(te, "autocast", None)
    if ctx is not None:
        with ctx(enabled=on, recipe=r):
            yield
    else:
        with te.fp8_autocast(enabled=on, fp8_recipe=r):
            yield
