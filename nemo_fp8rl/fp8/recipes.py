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
Transformer Engine equivalent, so it runs emulated or on torch's FP8 GEMMs (``fp8.backend=torch``), never
on ``te``. ``hybrid`` = E4M3 for inputs and weights, E5M2 for output gradients.
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
    accumulation: Optional[str] = None
    """Forward-GEMM accumulation. None (default): each backend's own default, i.e. fast (un-promoted) on
    the torch and TE backends (TE's and torchao's forward default; dgrad and wgrad always accumulate in full)
    and exact float32 in the emulation; fp32: full accumulation everywhere; fast: fast on the real
    backends, and the emulation models it (14 significant bits per 32-term chunk, slow on a CPU)."""
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
        if self.accumulation not in (None, "fp32", "fast"):
            raise ValueError(
                f"fp8 recipe {self.name!r}: accumulation={self.accumulation!r}; use 'fp32', 'fast' or null (the backend's default)"
            )
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

    @property
    def block_e5m2_grads(self) -> bool:
        """``blockwise`` with E5M2 gradients (``fp8_format=hybrid``): torch's 1x128/128x128 GEMMs take E4M3 x
        E4M3 only, so the torch backend runs dgrad and wgrad of such a recipe differently."""
        return self.scaling == "blockwise" and self.format_for("grad_output").name == "e5m2"

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


AUTO_RECIPE = "auto"
"""``fp8.recipe`` value (the ``fp8=auto`` group) that picks the recipe by hardware: :func:`auto_recipe_name`."""

AUTO_CANDIDATES = ("blockwise", "mxfp8", "tensorwise")
"""The recipes ``fp8=auto`` can pick; the ``fp8`` group's overrides must suit each of them."""

_AUTO_PICKS = "mxfp8 on sm100+, blockwise on sm90, tensorwise on sm89, emulated tensorwise elsewhere"


def auto_recipe_name(device=None, capability: Optional[tuple] = None, backend: Optional[str] = None) -> tuple[str, str]:
    """The recipe ``fp8=auto`` picks for ``device`` and one line saying why: ``(name, why)``.

    The recipe the hardware's FP8 tensor cores scale natively (SkyRL's ``fp8_recipe=auto`` idea):

    ==================================== ============ ==========================================
    device (compute capability)          recipe       why
    ==================================== ============ ==========================================
    Blackwell or newer (sm100+)          mxfp8        1x32 blocks with E8M0 scales in hardware
    Hopper (sm90)                        blockwise    1x128 / 128x128 blocks (DeepSeek-V3, TE)
    Ada (sm89)                           tensorwise   FP8 tensor cores, no block-scaled GEMMs
    older GPU, or the CPU                tensorwise   emulated (no FP8 tensor cores)
    ==================================== ============ ==========================================

    With the ``torch`` GEMM backend the pick is what torch runs natively: torch has no MX GEMM, so
    Blackwell gets ``tensorwise``; Hopper gets ``blockwise`` only with ``torch.nn.functional.scaled_mm``
    (torch >= 2.10), else ``tensorwise`` (fp8/backends.py lists what each backend runs).

    Args:
        device: a torch device or its name; None = ``cuda`` when CUDA is available, else ``cpu``.
        capability: ``(major, minor)`` of the CUDA device; None = read it from the device (tests pass it).
        backend: the resolved ``fp8.backend`` (``te`` | ``torch`` | ``emulate``), None = do not consider it.
    """
    import torch

    if device is None:
        device = "cuda" if capability is not None or torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return "tensorwise", f"no CUDA device ({dev.type}): tensorwise (per-tensor current scaling), emulated"
    major, minor = capability if capability is not None else torch.cuda.get_device_capability(dev)
    sm = f"sm{major}{minor}"
    if (major, minor) < (8, 9):
        return "tensorwise", (f"{sm} has no FP8 tensor cores (they need sm89+): tensorwise, emulated; fp8=off "
                              "trains this GPU faster")
    if major >= 10:
        if backend == "torch":
            return "tensorwise", (f"{sm} (Blackwell) with fp8.backend=torch: torch has no MX-scaled GEMM, so "
                                  "tensorwise (fp8.backend=te gives mxfp8)")
        return "mxfp8", f"{sm} (Blackwell or newer): mxfp8, the 1x32-block E8M0 scaling its tensor cores run natively"
    if major == 9:
        if backend == "torch":
            import torch.nn.functional as F

            if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
                return "tensorwise", (f"{sm} (Hopper) with fp8.backend=torch: this torch has no block-scaled GEMM "
                                      "(torch.nn.functional.scaled_mm, torch >= 2.10), so tensorwise")
        return "blockwise", (f"{sm} (Hopper): blockwise (1x128 activation, 128x128 weight blocks), the "
                             "block-scaled FP8 of Hopper's GEMMs; mxfp8 needs sm100")
    return "tensorwise", f"{sm} (Ada): FP8 tensor cores without block-scaled GEMMs: tensorwise"


def resolve_auto_recipe(cfg, device=None) -> Optional[str]:
    """``fp8=auto``: pick the recipe for ``device`` (:func:`auto_recipe_name`, with the ``fp8.backend`` that
    will run there), log why, and write it into ``cfg.fp8.recipe``; returns it (None when not auto).

    The trainer calls this once it knows its device, before it builds the model, so ``config.yaml`` and the
    checkpoints record the recipe that ran: a resume on the same hardware picks the same one, and on other
    hardware the checkpoint's ``fp8.recipe`` check names the difference. Validation and the launcher keep
    ``auto`` (a login node is not the GPU the job runs on).
    """
    if cfg.fp8.recipe != AUTO_RECIPE:
        return None
    import logging

    import torch

    from nemo_fp8rl.fp8.backends import resolve_fp8_backend

    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    try:
        backend = resolve_fp8_backend(cfg.fp8.backend, dev)
    except ValueError:
        backend = cfg.fp8.backend  # an impossible backend is refused where the model is built
    name, why = auto_recipe_name(dev, backend=backend)
    logging.getLogger(__name__).info("fp8=auto: %s -> fp8.recipe=%s", why, name)
    cfg.fp8.recipe = name
    return name


def _recipe_overrides(f) -> Dict[str, object]:
    """The ``fp8`` group's fields that override a recipe's (``fp8_format`` / ``pow2_scales`` when set)."""
    overrides: Dict[str, object] = dict(
        amax_history_len=f.amax_history_len, amax_compute_algo=f.amax_compute_algo, margin=f.margin,
        accumulation=f.accumulation, first_last_layers_bf16=f.first_last_layers_bf16,
        num_layers_at_start_in_bf16=f.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=f.num_layers_at_end_in_bf16,
    )
    if f.fp8_format is not None:
        overrides["fp8_format"] = f.fp8_format
    if f.pow2_scales is not None:
        overrides["pow2_scales"] = f.pow2_scales
    return overrides


def build_fp8_recipe(cfg) -> Optional[Fp8Recipe]:
    """The training :class:`Fp8Recipe` from a :class:`~nemo_fp8rl.config.schema.TrainConfig`'s ``fp8``
    group (the named recipe with the group's field overrides); None when FP8 is off. ``fp8.recipe=auto``
    not yet resolved (:func:`resolve_auto_recipe`) builds what auto picks on this machine's default
    device, leaving the config alone (the launcher's memory plan on a login node)."""
    f = cfg.fp8
    name = auto_recipe_name()[0] if f.recipe == AUTO_RECIPE else f.recipe
    return resolve_recipe(name, **_recipe_overrides(f))


def check_fp8_config(cfg) -> None:
    """``fp8.recipe`` names a registered recipe (or alias, or off, or auto) and the ``fp8`` group's overrides
    build a valid recipe from it (for ``auto``: from every recipe it may pick, :data:`AUTO_CANDIDATES`);
    raises :class:`~nemo_fp8rl.config.schema.ConfigError` naming the key."""
    from nemo_fp8rl.config.schema import ConfigError

    if cfg.fp8.recipe is None or cfg.fp8.recipe == "off":
        return
    if cfg.fp8.recipe == AUTO_RECIPE:
        for name in AUTO_CANDIDATES:
            try:
                resolve_recipe(name, **_recipe_overrides(cfg.fp8))
            except ValueError as e:
                raise ConfigError(f"fp8=auto picks {name} on some hardware ({_AUTO_PICKS}), and "
                                  f"{_fp8_keys(str(e))}; name the recipe (e.g. fp8=tensorwise) or drop the "
                                  "override") from None
        return
    if cfg.fp8.recipe not in RECIPES:
        raise ConfigError(f"fp8.recipe={cfg.fp8.recipe!r} is unknown; valid: {list_recipes()}, auto or fp8=off")
    try:
        build_fp8_recipe(cfg)
    except ValueError as e:
        raise ConfigError(_fp8_keys(str(e))) from None
