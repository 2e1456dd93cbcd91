"""FP8 training recipes: how each GEMM operand is scaled, and the registry that names them.

Every linear layer runs three GEMMs per training step, and each operand is quantized along that
GEMM's reduction dimension (that is what makes per-group scales legal: a scale that is constant
along the summed dimension factors out of the dot product):

    forward  y  = x  @ W^T    x [M, K] groups along K,  W [N, K] groups along K
    dgrad    dx = dy @ W      dy [M, N] along N,        W along N (dim 0)
    wgrad    dW = dy^T @ x    dy along M (dim 0),       x along M (dim 0)

Recipes (names follow Megatron's ``fp8_recipe`` and Transformer Engine):

============ ================================== ============================== ==========
recipe       inputs / grads                     weights                        default fmt
============ ================================== ============================== ==========
delayed      per tensor, scale from amax        per tensor, from history       hybrid
             history of previous steps
tensorwise   per tensor, current amax           per tensor, current amax       hybrid
rowwise      per row along the reduction dim    per output channel / column    e4m3
blockwise    1x128 along the reduction dim      128x128 tiles                  e4m3
mxfp8        1x32 along the reduction dim, E8M0 1x32 along the reduction dim   e4m3
============ ================================== ============================== ==========

``rowwise`` follows torchao's rowwise recipe (power-of-two scales, E4M3 everywhere); it has no
Transformer Engine equivalent, so it runs emulated only. ``hybrid`` = E4M3 for inputs and weights,
E5M2 for output gradients.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from nemo_fp8rl.fp8.formats import E4M3, E5M2, Fp8Format
from nemo_fp8rl.registry import Registry

SCALINGS = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 training recipe. Frozen: use ``get_recipe(name, **overrides)`` or ``replace``."""

    name: str
    """Registry name (informational)."""
    scaling: str
    """One of delayed, tensorwise, rowwise, blockwise, mxfp8."""
    fp8_format: str = "hybrid"
    """e4m3 (every tensor), hybrid (E4M3 forward, E5M2 output gradients), or e5m2 (every tensor;
    emulation only: a stress setting with 4x coarser activations, used to provoke FP8 instability)."""
    pow2_scales: bool = False
    """Round scales down to powers of two (blockwise default True: NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0)."""
    amax_history_len: int = 1
    """Delayed scaling: amax history length (Megatron default 1, not TE's 1024)."""
    amax_compute_algo: str = "most_recent"
    """Delayed scaling: ``most_recent`` or ``max`` over the history."""
    margin: int = 0
    """Delayed scaling: scale = M * 2^-margin / amax."""
    amax_epsilon: float = 0.0
    """Lower clamp of amax before the scale division (TE's amax_epsilon)."""
    input_block: int = 128
    """Blockwise: 1 x input_block groups for inputs and gradients."""
    weight_block: int = 128
    """Blockwise: weight_block x weight_block tiles for weights."""
    mx_block: int = 32
    """MXFP8 block length."""
    wgrad_fp8: bool = True
    """Run the weight-gradient GEMM in FP8 (Megatron's fp8_wgrad); False keeps it high precision."""
    accumulation: str = "fp32"
    """fp32, or fast: model Hopper's un-promoted FP8 accumulation (14 significant bits per 32-term chunk)."""
    accumulation_chunk: int = 32
    """Fast accumulation: reduction terms summed before each truncation."""
    accumulation_bits: int = 14
    """Fast accumulation: significant bits kept in the running sum."""
    dequant: str = "scale_inv"
    """Read-back convention: scale_inv (TE: q * fp32(1/s)) or divide (torchao: q / s)."""
    first_last_layers_bf16: bool = False
    """Keep the first/last transformer layers in high precision (Megatron; not with delayed)."""
    num_layers_at_start_in_bf16: int = 1
    """Layers at the start kept high precision when first_last_layers_bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Layers at the end kept high precision when first_last_layers_bf16."""
    fp8_param: bool = False
    """Megatron/TE: keep parameters in FP8 (GPU only; the emulation keeps float32 master weights)."""
    aliases: tuple = field(default=(), compare=False)
    """Other names this recipe is registered under (informational)."""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"fp8 recipe {self.name!r}: scaling={self.scaling!r}; valid: {list(SCALINGS)}")
        if self.fp8_format not in ("e4m3", "hybrid", "e5m2"):
            raise ValueError(
                f"fp8 recipe {self.name!r}: fp8_format={self.fp8_format!r}; use 'e4m3', 'hybrid' or 'e5m2'"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"fp8 recipe {self.name!r}: amax_compute_algo={self.amax_compute_algo!r}; use 'max' or 'most_recent'"
            )
        if self.amax_history_len < 1:
            raise ValueError(f"fp8 recipe {self.name!r}: amax_history_len must be >= 1")
        if self.accumulation not in ("fp32", "fast"):
            raise ValueError(f"fp8 recipe {self.name!r}: accumulation={self.accumulation!r}; use 'fp32' or 'fast'")
        if self.dequant not in ("scale_inv", "divide"):
            raise ValueError(f"fp8 recipe {self.name!r}: dequant={self.dequant!r}; use 'scale_inv' or 'divide'")
        if self.first_last_layers_bf16 and self.scaling == "delayed":
            raise ValueError(
                f"fp8 recipe {self.name!r}: first_last_layers_bf16 is not supported with delayed scaling "
                "(Megatron rejects it); use tensorwise/blockwise/mxfp8 or set first_last_layers_bf16=false"
            )
        for k in ("input_block", "weight_block", "mx_block", "accumulation_chunk"):
            if getattr(self, k) < 1:
                raise ValueError(f"fp8 recipe {self.name!r}: {k} must be >= 1")

    def format_for(self, role: str) -> Fp8Format:
        """FP8 format of an operand role (``input``, ``weight``, ``grad_output``)."""
        if role not in ROLES:
            raise ValueError(f"unknown FP8 operand role {role!r}; valid: {list(ROLES)}")
        if self.fp8_format == "e5m2" or (role == "grad_output" and self.fp8_format == "hybrid"):
            return E5M2
        return E4M3

    def granularity_for(self, role: str):
        """Grouping of an operand for :func:`nemo_fp8rl.fp8.quantize.quantize` (along its reduction dim)."""
        if self.scaling in ("delayed", "tensorwise"):
            return "tensor"
        if self.scaling == "rowwise":
            return "row"
        if self.scaling == "mxfp8":
            return "mx"
        if role == "weight":
            return (self.weight_block, self.weight_block)
        return (1, self.input_block)

    def replace(self, **overrides) -> "Fp8Recipe":
        """A copy with fields changed; unknown keys raise with the list of valid ones."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(f"unknown FP8 recipe field(s) {unknown}; valid fields: {sorted(valid)}")
        return dataclasses.replace(self, **overrides)

    def to_megatron_kwargs(self) -> Dict[str, object]:
        """The megatron-core ``TransformerConfig`` FP8 fields for this recipe.

        Megatron turns them into a Transformer Engine recipe (``megatron.core.fp8_utils.get_fp8_recipe``).
        ``rowwise`` has no TE recipe and raises.
        """
        if self.fp8_format == "e5m2":
            raise ValueError(
                "fp8_format=e5m2 (E5M2 activations and weights) is an emulation-only stress setting; "
                "Megatron/TE accept fp8 formats e4m3 and hybrid"
            )
        if self.scaling == "rowwise":
            raise ValueError(
                "fp8 recipe 'rowwise' has no Transformer Engine/Megatron equivalent (it is torchao's recipe); "
                "use fp8=tensorwise, blockwise or mxfp8 on GPU, or fp8.backend=torch|emulate (our linears)"
            )
        kw: Dict[str, object] = {
            "fp8": self.fp8_format,
            "fp8_recipe": self.scaling,
            "fp8_margin": self.margin,
            "fp8_amax_history_len": self.amax_history_len,
            "fp8_amax_compute_algo": self.amax_compute_algo,
            "fp8_wgrad": self.wgrad_fp8,
            "fp8_param": self.fp8_param,
            "first_last_layers_bf16": self.first_last_layers_bf16,
        }
        if self.first_last_layers_bf16:
            kw["num_layers_at_start_in_bf16"] = self.num_layers_at_start_in_bf16
            kw["num_layers_at_end_in_bf16"] = self.num_layers_at_end_in_bf16
        return kw

    def te_env(self) -> Dict[str, str]:
        """Environment variables Transformer Engine reads for this recipe (blockwise scale type)."""
        if self.scaling == "blockwise":
            return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" if self.pow2_scales else "1"}
        return {}


RECIPES: Registry[Fp8Recipe] = Registry("FP8 recipe", "fp8.recipe")
"""The FP8 recipes by name, with their Megatron-Bridge aliases."""


def register_fp8_recipe(name: str, recipe: Fp8Recipe, *, aliases: tuple = ()) -> Fp8Recipe:
    """Register ``recipe`` under ``name`` (and ``aliases``). Re-registering a name raises."""
    return RECIPES.register(name, recipe, aliases=aliases)


def list_recipes(include_aliases: bool = False) -> List[str]:
    """Registered recipe names (sorted), optionally followed by their aliases (sorted)."""
    names = RECIPES.names()
    return names + sorted(set(RECIPES.names(include_aliases=True)) - set(names)) if include_aliases else names


def get_recipe(name: "str | Fp8Recipe", **overrides) -> Fp8Recipe:
    """Look up a recipe by name or Megatron-Bridge alias and apply field overrides.

    ``get_recipe("blockwise", pow2_scales=False)``; unknown names raise with the valid list.
    """
    if isinstance(name, Fp8Recipe):
        return name.replace(**overrides) if overrides else name
    if name not in RECIPES:
        aliases = sorted(set(RECIPES.names(include_aliases=True)) - set(RECIPES.names()))
        raise ValueError(f"unknown FP8 recipe {name!r}; valid recipes: {list_recipes()} "
                         f"(Megatron-Bridge aliases: {aliases})")
    recipe = RECIPES.get(name)
    return recipe.replace(**overrides) if overrides else recipe


def _register_builtins() -> None:
    builtin = [
        (Fp8Recipe("delayed", "delayed", fp8_format="hybrid"), ("bf16_with_fp8_delayed_scaling_mixed",)),
        (Fp8Recipe("tensorwise", "tensorwise", fp8_format="hybrid"), ("bf16_with_fp8_current_scaling_mixed",)),
        (Fp8Recipe("rowwise", "rowwise", fp8_format="e4m3", pow2_scales=True), ()),
        (
            Fp8Recipe("blockwise", "blockwise", fp8_format="e4m3", pow2_scales=True),
            ("bf16_with_fp8_subchannel_scaling_mixed",),
        ),
        (Fp8Recipe("mxfp8", "mxfp8", fp8_format="e4m3"), ("bf16_with_mxfp8_mixed",)),
    ]
    for recipe, aliases in builtin:
        register_fp8_recipe(recipe.name, dataclasses.replace(recipe, aliases=aliases), aliases=aliases)


_register_builtins()


def resolve_recipe(name: Optional[str], **overrides) -> Optional[Fp8Recipe]:
    """``None``/``"off"`` -> None (FP8 disabled); otherwise :func:`get_recipe`."""
    if name is None or name == "off":
        return None
    return get_recipe(name, **overrides)


# ---------------------------------------------------------------------------- from a TrainConfig
def _fp8_keys(msg: str) -> str:
    """A recipe error names recipe fields (``first_last_layers_bf16``); a config error must name the
    config key the user sets (``fp8.first_last_layers_bf16``). ``recipe`` itself is left alone: the
    recipe's messages start with "fp8 recipe 'name':"."""
    from nemo_fp8rl.config.schema import Fp8Config

    names = sorted((f.name for f in dataclasses.fields(Fp8Config) if f.name != "recipe"), key=len, reverse=True)
    return re.sub(r"(?<![\w.])(" + "|".join(names) + r")\b", r"fp8.\1", msg)


def build_fp8_recipe(cfg) -> Optional[Fp8Recipe]:
    """The training :class:`Fp8Recipe` from a :class:`~nemo_fp8rl.config.schema.TrainConfig`'s ``fp8``
    group (the named recipe with the group's field overrides); None when FP8 is off."""
    f = cfg.fp8
    overrides = dict(
        amax_history_len=f.amax_history_len, amax_compute_algo=f.amax_compute_algo, margin=f.margin,
        accumulation=f.accumulation, first_last_layers_bf16=f.first_last_layers_bf16,
        num_layers_at_start_in_bf16=f.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=f.num_layers_at_end_in_bf16,
    )
    if f.fp8_format is not None:
        overrides["fp8_format"] = f.fp8_format
    if f.pow2_scales is not None:
        overrides["pow2_scales"] = f.pow2_scales
    return resolve_recipe(f.recipe, **overrides)


def check_fp8_config(cfg) -> None:
    """``fp8.recipe`` names a registered recipe (or alias, or off) and the ``fp8`` group's overrides
    build a valid recipe from it; raises :class:`~nemo_fp8rl.config.schema.ConfigError` naming the key."""
    from nemo_fp8rl.config.schema import ConfigError

    if cfg.fp8.recipe is None or cfg.fp8.recipe == "off":
        return
    if cfg.fp8.recipe not in RECIPES:
        raise ConfigError(f"fp8.recipe={cfg.fp8.recipe!r} is unknown; valid: {list_recipes()} or fp8=off")
    try:
        build_fp8_recipe(cfg)
    except ValueError as e:
        raise ConfigError(_fp8_keys(str(e))) from None
