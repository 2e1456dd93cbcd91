"""Transformer Engine recipe objects for our :class:`~nemo_fp8rl.fp8.recipes.Fp8Recipe` (GPU path).

Transformer Engine is imported lazily: nothing here is needed on CPU, and importing
``nemo_fp8rl.fp8`` never imports it. Mapping:

============ =====================================================================
delayed      ``DelayedScaling(fp8_format, margin, amax_history_len, amax_compute_algo)``
tensorwise   ``Float8CurrentScaling(fp8_format)``
blockwise    ``Float8BlockScaling(fp8_format)``; power-of-two scales unless
             ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` (set from ``pow2_scales``)
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
            "(pip install 'nemo-fp8rl[gpu]') or use the emulated FP8 path (fp8.use_te=false)."
        ) from e
    return te, te_recipe


def te_recipe(recipe: Fp8Recipe):
    """Build the Transformer Engine recipe object for ``recipe`` (sets the blockwise env var)."""
    _, R = require_te()
    fmt = R.Format.HYBRID if recipe.fp8_format == "hybrid" else R.Format.E4M3
    if recipe.scaling == "delayed":
        return R.DelayedScaling(
            fp8_format=fmt,
            margin=recipe.margin,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
        )
    if recipe.scaling == "tensorwise":
        return R.Float8CurrentScaling(fp8_format=fmt)
    if recipe.scaling == "blockwise":
        os.environ.update(recipe.te_env())
        return R.Float8BlockScaling(fp8_format=fmt)
    if recipe.scaling == "mxfp8":
        return R.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(
        f"FP8 recipe {recipe.name!r} ({recipe.scaling}) has no Transformer Engine equivalent; "
        "use tensorwise, delayed, blockwise or mxfp8 with TE, or the emulated path"
    )


@contextlib.contextmanager
def te_autocast(recipe: "Fp8Recipe | None", enabled: bool = True) -> Iterator[None]:
    """TE FP8 autocast for ``recipe``; ``enabled=False`` (or no recipe) runs TE layers in high precision.

    Uses ``te.autocast`` on TE >= 2.8 and ``te.fp8_autocast`` on older releases.
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
