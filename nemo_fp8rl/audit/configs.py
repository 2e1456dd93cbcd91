"""The FP8 configurations an audit compares, by name (``audit.configs=[...]``).

A name is a base, optionally followed by ``+``-joined modifiers. Rollout bases score the tokens with the
rollout engine's numerics (the torch engine, which emulates vLLM's FP8 rules); train bases with the
trainer's own model (megatron, ``fp8.backend``: emulated on CPU, torch or Transformer Engine GEMMs on GPU).

Rollout bases (the linears' scheme is ``rollout.fp8.scheme``, ``vllm_w8a8`` when that is ``off``; the KV
format ``rollout.fp8.kv_cache``, ``e4m3`` when that is ``off``):

=====================  ===============================================================================
``linear``             FP8 linears, KV cache in high precision ("linear-only FP8")
``kv_static``          FP8 linears + FP8 KV cache with vLLM's static scales (1.0)
``kv_calibrated``      FP8 linears + FP8 KV cache with calibrated scales (``rollout.fp8.kv_calib_*``)
``kvonly_static``      high-precision linears, FP8 KV cache, static scales (the cache alone)
``kvonly_calibrated``  high-precision linears, FP8 KV cache, calibrated scales
``rollout``            exactly what ``rollout.fp8.*`` on the command line configures
=====================  ===============================================================================

Modifiers of a rollout base: ``edge`` (keep the first and last decoder layers in high precision: the
``rollout.fp8.num_layers_at_{start,end}_in_bf16`` given, or 1 and 1 when both are 0), ``edge:N`` (N first
and N last), ``edge:A:B`` (A first, B last), ``scheme:NAME`` (another linear scheme: vllm_w8a8, vllm_block,
same_as_train), ``kv:e4m3`` / ``kv:e5m2`` (the cache format), ``kernel:cuda`` / ``kernel:cpu`` (vLLM's GPU or
CPU cache writer; default ``audit.kv_kernel``).

Train bases: ``train`` (the ``fp8=`` recipe with its ``fp8.*`` overrides) and ``train:RECIPE`` (a recipe by
name, e.g. ``train:blockwise``). ``delayed`` is refused: its scales come from the amax history of training
steps, which an audit does not run (with Megatron's history of 1 it is the previous step's tensorwise).

Example: ``audit.configs=[linear,kv_static,kv_calibrated,kv_calibrated+edge,train:blockwise]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_fp8rl.config.schema import ConfigError

__all__ = ["AuditConfiguration", "DEFAULT_LADDER", "ROLLOUT_BASES", "default_configs", "parse_configs"]

ROLLOUT_BASES = ("linear", "kv_static", "kv_calibrated", "kvonly_static", "kvonly_calibrated", "rollout")
TRAIN_BASES = ("train", "train:RECIPE")
MODIFIERS = ("edge", "edge:N", "edge:A:B", "scheme:NAME", "kv:e4m3", "kv:e5m2", "kernel:cuda", "kernel:cpu")
DEFAULT_LADDER = ("linear", "kv_static", "kv_calibrated", "kv_calibrated+edge")
"""The rollout configurations audited by default: linear-only FP8, + KV static, + KV calibrated, + BF16 edges."""

_FIX = ("e.g. audit.configs=[linear,kv_static,kv_calibrated,kv_calibrated+edge,train:blockwise] "
        "(nemo_fp8rl/audit/configs.py lists every name)")


@dataclass(frozen=True)
class AuditConfiguration:
    """One FP8 configuration, resolved.

    ``side``: ``rollout`` (scored by the rollout engine) or ``train`` (by the trainer's model).
    Rollout: ``scheme`` (linears), ``kv_cache`` (``off`` | ``e4m3`` | ``e5m2``), ``kv_scales`` (``static`` |
    ``calibrated``), ``edge`` (first, last high-precision layers), ``kv_kernel``. Train: ``recipe``.
    """

    name: str
    side: str
    scheme: str = "off"
    kv_cache: str = "off"
    kv_scales: str = "static"
    edge: tuple[int, int] = (0, 0)
    kv_kernel: str = "cuda"
    recipe: Optional[str] = None
    recipe_overrides: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def kv_on(self) -> bool:
        """Whether the KV cache is FP8 (the rollout's own rule, :class:`RolloutFp8Setup`)."""
        from nemo_fp8rl.rollout.fp8_setup import RolloutFp8Setup

        return RolloutFp8Setup(kv_cache=self.kv_cache, kv_scales=self.kv_scales).kv_on

    @property
    def calibrated(self) -> bool:
        """Whether the KV-cache scales are calibrated (the rollout's own rule)."""
        from nemo_fp8rl.rollout.fp8_setup import RolloutFp8Setup

        return RolloutFp8Setup(kv_cache=self.kv_cache, kv_scales=self.kv_scales).calibrated

    def high_precision_layers(self, num_layers: int) -> tuple[int, ...]:
        from nemo_fp8rl.rollout.fp8_setup import edge_layers

        return edge_layers(num_layers, *self.edge)

    def setup(self, num_layers: int, rollout_fp8: Any) -> Any:
        """The :class:`~nemo_fp8rl.rollout.fp8_setup.RolloutFp8Setup` of a rollout configuration
        (``rollout_fp8``: the config's ``rollout.fp8`` section, for the calibration recipe)."""
        from nemo_fp8rl.rollout.fp8_setup import RolloutFp8Setup

        return RolloutFp8Setup(
            scheme=self.scheme, kv_cache=self.kv_cache, kv_scales=self.kv_scales,
            high_precision_layers=self.high_precision_layers(num_layers),
            kv_calib_percentile=float(rollout_fp8.kv_calib_percentile), kv_calib_margin=float(rollout_fp8.kv_calib_margin),
            kv_calib_max_tokens=int(rollout_fp8.kv_calib_max_tokens),
        )

    def fp8_amount(self) -> tuple:
        """Sort key, larger = more of the rollout in FP8 (faster): FP8 KV cache, FP8 linears, fewer
        high-precision layers."""
        return (self.kv_on, self.scheme != "off", -sum(self.edge))

    def overrides(self) -> list[str]:
        """The trainer overrides that run this configuration."""
        if self.side == "train":
            return [f"fp8={self.recipe}"]
        out = [f"rollout.fp8.scheme={self.scheme}", f"rollout.fp8.kv_cache={self.kv_cache}"]
        if self.kv_on:
            out.append(f"rollout.fp8.kv_scales={self.kv_scales}")
        out += [f"rollout.fp8.num_layers_at_start_in_bf16={self.edge[0]}",
                f"rollout.fp8.num_layers_at_end_in_bf16={self.edge[1]}"]
        return out

    def describe(self) -> str:
        if self.side == "train":
            return f"training recipe {self.recipe} (trainer's model)"
        kv = f"KV {self.kv_cache} {self.kv_scales}" if self.kv_on else "KV high precision"
        lin = f"linears {self.scheme}" if self.scheme != "off" else "linears high precision"
        edge = f", edge layers {self.edge[0]}+{self.edge[1]} high precision" if any(self.edge) else ""
        kern = ", vLLM-CPU cache writer" if self.kv_on and self.kv_kernel == "cpu" else ""
        return f"{lin}, {kv}{edge}{kern}"


def _int(text: str, what: str, name: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise ConfigError(f"audit.configs: {name!r}: {what} must be an integer >= 0, got {text!r}; {_FIX}")
    return v


def _edge(mod: str, cfg: Any, name: str) -> tuple[int, int]:
    parts = mod.split(":")
    if len(parts) == 1:
        r = cfg.rollout.fp8
        a, b = int(r.num_layers_at_start_in_bf16), int(r.num_layers_at_end_in_bf16)
        return (a, b) if a or b else (1, 1)
    if len(parts) == 2:
        n = _int(parts[1], "edge:N", name)
        return n, n
    if len(parts) == 3:
        return _int(parts[1], "edge:A:B's A", name), _int(parts[2], "edge:A:B's B", name)
    raise ConfigError(f"audit.configs: {name!r}: {mod!r} is not edge, edge:N or edge:A:B; {_FIX}")


def _train(name: str, base: str, cfg: Any) -> AuditConfiguration:
    from nemo_fp8rl.fp8.recipes import AUTO_RECIPE, RECIPES, _recipe_overrides, auto_recipe_name, get_recipe, list_recipes

    if base == "train":
        recipe = cfg.fp8.recipe
        if recipe in (None, "off"):
            raise ConfigError(f"audit.configs: {name!r} audits the fp8= training recipe, but fp8=off; pass fp8=RECIPE "
                              "(e.g. fp8=blockwise) or name one: train:blockwise")
        overrides = _recipe_overrides(cfg.fp8)
    else:
        recipe = base.split(":", 1)[1]
        overrides = {}
        if recipe not in RECIPES and recipe != AUTO_RECIPE:
            raise ConfigError(f"audit.configs: {name!r}: unknown training recipe {recipe!r}; valid: "
                              f"{list_recipes()} or auto, e.g. train:blockwise")
    if recipe == AUTO_RECIPE:
        recipe = auto_recipe_name()[0]
    if get_recipe(recipe).scaling == "delayed":
        raise ConfigError(f"audit.configs: {name!r}: delayed scaling takes its scales from the amax history of "
                          "training steps, which an audit does not run; audit train:tensorwise (delayed with "
                          "Megatron's history of 1 is the previous step's tensorwise scaling)")
    return AuditConfiguration(name=name, side="train", recipe=recipe, recipe_overrides=overrides)


def parse_config(name: str, cfg: Any, num_layers: int) -> AuditConfiguration:
    """One configuration name -> :class:`AuditConfiguration` (module docstring); ``cfg``: the audit's
    whole config (the ``rollout.fp8`` and ``fp8`` sections fill the defaults)."""
    from nemo_fp8rl.fp8 import ROLLOUT_SCHEMES

    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"audit.configs: {name!r} is not a configuration name; {_FIX}")
    name = name.strip()
    base, *mods = name.split("+")
    if base == "train" or base.startswith("train:"):
        if mods:
            raise ConfigError(f"audit.configs: {name!r}: a training configuration takes no modifiers ({mods}); "
                              "the rollout's edge layers, KV cache and scheme are rollout configurations, e.g. "
                              "kv_calibrated+edge")
        return _train(name, base, cfg)
    if base not in ROLLOUT_BASES:
        raise ConfigError(f"audit.configs: unknown configuration {base!r} in {name!r}; rollout bases: "
                          f"{list(ROLLOUT_BASES)}, training: train, train:RECIPE; modifiers: {list(MODIFIERS)}; {_FIX}")
    r = cfg.rollout.fp8
    scheme = r.scheme if r.scheme != "off" else "vllm_w8a8"
    fmt = r.kv_cache if r.kv_cache != "off" else "e4m3"
    if base == "rollout":
        c = dict(scheme=r.scheme, kv_cache=r.kv_cache, kv_scales=r.kv_scales if r.kv_cache != "off" else "static",
                 edge=(int(r.num_layers_at_start_in_bf16), int(r.num_layers_at_end_in_bf16)))
    else:
        c = dict(scheme="off" if base.startswith("kvonly") else scheme,
                 kv_cache="off" if base == "linear" else fmt,
                 kv_scales="calibrated" if base.endswith("calibrated") else "static", edge=(0, 0))
    kernel = cfg.audit.kv_kernel
    for mod in mods:
        key = mod.split(":", 1)[0]
        if key == "edge":
            c["edge"] = _edge(mod, cfg, name)
        elif key == "scheme" and ":" in mod:
            s = mod.split(":", 1)[1]
            if s not in ROLLOUT_SCHEMES:
                raise ConfigError(f"audit.configs: {name!r}: unknown rollout scheme {s!r}; valid: {list(ROLLOUT_SCHEMES)}")
            c["scheme"] = s
        elif key == "kv" and ":" in mod:
            f = mod.split(":", 1)[1]
            if f not in ("e4m3", "e5m2"):
                raise ConfigError(f"audit.configs: {name!r}: KV-cache format {f!r}; choose kv:e4m3 or kv:e5m2")
            if c["kv_cache"] == "off":
                raise ConfigError(f"audit.configs: {name!r}: {mod} sets the FP8 KV cache's format but {base!r} keeps "
                                  f"the cache in high precision; use kv_static+{mod} or kv_calibrated+{mod}")
            c["kv_cache"] = f
        elif key == "kernel" and ":" in mod:
            k = mod.split(":", 1)[1]
            if k not in ("cuda", "cpu"):
                raise ConfigError(f"audit.configs: {name!r}: cache writer {k!r}; choose kernel:cuda or kernel:cpu")
            kernel = k
        else:
            raise ConfigError(f"audit.configs: {name!r}: unknown modifier {mod!r}; valid: {list(MODIFIERS)}; {_FIX}")
    if c["scheme"] == "off" and c["kv_cache"] == "off":
        raise ConfigError(f"audit.configs: {name!r} puts nothing in FP8 (rollout.fp8.scheme=off and kv_cache=off); "
                          "set rollout.fp8.* or audit another configuration, e.g. linear")
    if c["scheme"] == "same_as_train" and cfg.fp8.recipe in (None, "off"):
        raise ConfigError(f"audit.configs: {name!r}: scheme same_as_train runs the training recipe, but fp8=off; "
                          "pass fp8=RECIPE")
    if sum(c["edge"]) > num_layers:
        raise ConfigError(f"audit.configs: {name!r}: {c['edge'][0]} + {c['edge'][1]} edge layers exceed the model's "
                          f"{num_layers} layers; lower N in edge:N")
    return AuditConfiguration(name=name, side="rollout", kv_kernel=kernel, **c)


def default_configs(cfg: Any) -> list[str]:
    """``audit.configs=null``: :data:`DEFAULT_LADDER`, plus ``train`` when ``fp8`` is not off."""
    names = list(DEFAULT_LADDER)
    if cfg.fp8.recipe not in (None, "off"):
        names.append("train")
    return names


def parse_configs(cfg: Any, num_layers: int) -> list[AuditConfiguration]:
    """``audit.configs`` (or :func:`default_configs`) -> configurations; duplicate names are refused."""
    names = list(cfg.audit.configs) if cfg.audit.configs is not None else default_configs(cfg)
    seen = [n for i, n in enumerate(names) if n in names[:i]]
    if seen:
        raise ConfigError(f"audit.configs names {seen} twice; list each configuration once")
    return [parse_config(n, cfg, num_layers) for n in names]
