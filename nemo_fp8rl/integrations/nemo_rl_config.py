"""The ``loss_fn`` config of the NeMo RL drop-in: keys, defaults, validation, the calibration controller.

NeMo RL passes its ``loss_fn`` section as a mapping or as its typed (pydantic) ``ClippedPGLossConfig``.
:func:`parse_loss_config` turns either into a frozen :class:`LossConfig` - NeMo RL's attribute names and
defaults at the pinned commit (:data:`CONFIG_DEFAULTS`), checked once - and splits off our one extra key,
``calibration``, which :func:`make_calibration` turns into a
:class:`~nemo_fp8rl.algorithms.calibration.CalibratedClipping` controller. Every error is a ValueError that
names ``loss_fn.<key>`` and the fix, raised at construction (NeMo RL asserts, some only at the first call).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_fp8rl.algorithms.calibration import CalibratedClipping
from nemo_fp8rl.algorithms.losses import KL_KINDS
from nemo_fp8rl.integrations.nemo_rl_interfaces import LossType

CONFIG_DEFAULTS: dict[str, Any] = {
    "disable_ppo_ratio": False,
    "token_level_loss": True,
    "sequence_level_importance_ratios": False,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "use_kl_in_reward": False,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
    "use_on_policy_kl_approximation": False,
    "force_on_policy_ratio": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}
"""NeMo RL ``ClippedPGLossConfig`` keys and defaults at the pinned commit (``calibration`` is ours)."""

TIS_TYPES = ("tis", "icepop", "seq-mask-tis")
"""NeMo RL's ``truncated_importance_sampling_type`` values."""


@dataclass(frozen=True)
class LossConfig:
    """A validated ``loss_fn`` section, under the attribute names of NeMo RL's ``ClippedPGLossFn``."""

    disable_ppo_ratio: bool
    """REINFORCE: the "ratio" is the log-prob itself, nothing is clipped."""
    ratio_clip_min: float
    """eps_low: the nominal lower bound is 1 - ratio_clip_min."""
    ratio_clip_max: float
    """eps_high: the nominal upper bound is 1 + ratio_clip_max."""
    ratio_clip_c: float | None
    """Dual clip c > 1 (l_t = min(l_t, -c A_t) where A_t < 0), or None."""
    use_kl_in_reward: bool
    """KL goes into the reward (Reinforce++), so the loss has none."""
    reference_policy_kl_penalty: float
    """beta of the KL term; 0 when ``use_kl_in_reward``."""
    reference_policy_kl_type: str
    """KL estimator: ``k1``, ``k2`` or ``k3``."""
    kl_input_clamp_value: float | None
    """|lp - ref| is clamped to this before the estimator (None: no clamp)."""
    kl_output_clamp_value: float | None
    """The weighted per-token KL is clamped to +-this (None: no clamp)."""
    use_importance_sampling_correction: bool
    """Weight the actor loss by w = exp(prev - gen) (the trainer/rollout-engine mismatch)."""
    truncated_importance_sampling_type: str | None
    """``tis``, ``icepop``, ``seq-mask-tis`` (:data:`TIS_TYPES`) or None."""
    truncated_importance_sampling_ratio: float | None
    """Upper bound of the truncation."""
    truncated_importance_sampling_ratio_min: float | None
    """Lower bound of the truncation (``tis``: defaults to 0)."""
    use_on_policy_kl_approximation: bool
    """KL weight exp(lp - gen) instead of exp(lp - sg(lp))."""
    force_on_policy_ratio: bool
    """r = exp(lp - sg(lp)) = 1, not clipped (one update per rollout)."""
    sequence_level_importance_ratios: bool
    """GSPO: one length-normalised ratio (and one IS weight) per sequence."""
    positive_example_nll_weight: float
    """VAPO's mu: + mu mean(-lp) over the valid tokens of samples with reward > 0."""
    use_cispo: bool
    """CISPO: l_t = -A_t sg(clip(r_t, L, H)) lp_t."""
    loss_type: Any
    """``LossType.TOKEN_LEVEL`` (``token_level_loss: true``) or ``LossType.SEQUENCE_LEVEL``."""

    @property
    def clips_tokens(self) -> bool:
        """Whether the loss clips per-token ratios (GSPO, REINFORCE, force_on_policy_ratio do not)."""
        return not (
            self.disable_ppo_ratio or self.force_on_policy_ratio or self.sequence_level_importance_ratios
        )


def _config_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "model_dump"):  # NeMo RL's pydantic ClippedPGLossConfig
        return dict(cfg.model_dump())
    if hasattr(cfg, "__dict__"):
        return {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
    raise ValueError(
        f"loss config must be a mapping or NeMo RL's ClippedPGLossConfig, got {type(cfg).__name__}"
    )


def _bad(key: str, msg: str) -> ValueError:
    return ValueError(f"loss_fn.{key}: {msg}")


def parse_loss_config(cfg: Any) -> tuple[LossConfig, Any]:
    """``(LossConfig, calibration spec)`` from NeMo RL's ``loss_fn`` section; unknown keys raise.

    The spec is ``cfg["calibration"]`` as given (``{}`` when absent): see :func:`make_calibration`.
    """
    raw = _config_dict(cfg)
    unknown = sorted(set(raw) - set(CONFIG_DEFAULTS) - {"calibration"})
    if unknown:
        raise ValueError(
            f"unknown loss_fn keys {unknown} for ClippedPGLossFn; remove them (valid keys: "
            f"{sorted(CONFIG_DEFAULTS) + ['calibration']})"
        )
    c = {**CONFIG_DEFAULTS, **{k: v for k, v in raw.items() if k != "calibration"}}
    use_kl_in_reward = bool(c["use_kl_in_reward"])
    config = LossConfig(
        disable_ppo_ratio=bool(c["disable_ppo_ratio"]),
        ratio_clip_min=float(c["ratio_clip_min"]),
        ratio_clip_max=float(c["ratio_clip_max"]),
        ratio_clip_c=None if c["ratio_clip_c"] is None else float(c["ratio_clip_c"]),
        use_kl_in_reward=use_kl_in_reward,
        reference_policy_kl_penalty=0.0 if use_kl_in_reward else float(c["reference_policy_kl_penalty"]),
        reference_policy_kl_type=c["reference_policy_kl_type"],
        kl_input_clamp_value=c["kl_input_clamp_value"],
        kl_output_clamp_value=c["kl_output_clamp_value"],
        use_importance_sampling_correction=bool(c["use_importance_sampling_correction"]),
        truncated_importance_sampling_type=c["truncated_importance_sampling_type"],
        truncated_importance_sampling_ratio=c["truncated_importance_sampling_ratio"],
        truncated_importance_sampling_ratio_min=c["truncated_importance_sampling_ratio_min"],
        use_on_policy_kl_approximation=bool(c["use_on_policy_kl_approximation"]),
        force_on_policy_ratio=bool(c["force_on_policy_ratio"]),
        sequence_level_importance_ratios=bool(c["sequence_level_importance_ratios"]),
        positive_example_nll_weight=float(c["positive_example_nll_weight"]),
        use_cispo=bool(c["use_cispo"]),
        loss_type=LossType.TOKEN_LEVEL if c["token_level_loss"] else LossType.SEQUENCE_LEVEL,
    )
    _validate(config)
    return config, raw.get("calibration", {})


def _validate(c: LossConfig) -> None:
    if c.reference_policy_kl_type not in KL_KINDS:
        raise _bad(
            "reference_policy_kl_type", f"must be one of {list(KL_KINDS)}, got {c.reference_policy_kl_type!r}"
        )
    if c.ratio_clip_c is not None and not c.ratio_clip_c > 1:
        raise _bad("ratio_clip_c", f"the dual clip must be > 1 (usually 3) or null, got {c.ratio_clip_c}")
    if not c.disable_ppo_ratio and not c.force_on_policy_ratio:
        if not 0.0 <= c.ratio_clip_min < 1.0:
            raise _bad(
                "ratio_clip_min", f"must be in [0, 1) so that 1 - ratio_clip_min > 0, got {c.ratio_clip_min}"
            )
        if c.ratio_clip_max < 0.0:
            raise _bad("ratio_clip_max", f"must be >= 0, got {c.ratio_clip_max}")
    if c.sequence_level_importance_ratios and c.loss_type == LossType.TOKEN_LEVEL:
        raise _bad("sequence_level_importance_ratios", "GSPO needs token_level_loss: false")
    if c.use_cispo:
        for key, bad, fix in (
            ("disable_ppo_ratio", c.disable_ppo_ratio, "false"),
            ("force_on_policy_ratio", c.force_on_policy_ratio, "false"),
            ("sequence_level_importance_ratios", c.sequence_level_importance_ratios, "false"),
            ("ratio_clip_c", c.ratio_clip_c is not None, "null"),
            ("token_level_loss", c.loss_type != LossType.TOKEN_LEVEL, "true"),
        ):
            if bad:
                raise _bad(key, f"use_cispo: true needs {key}: {fix}")
    t = c.truncated_importance_sampling_type
    hi, lo = c.truncated_importance_sampling_ratio, c.truncated_importance_sampling_ratio_min
    if t is None and hi is not None:
        raise _bad(
            "truncated_importance_sampling_type",
            f"truncated_importance_sampling_ratio={hi} is set but the type is null; set the type to one "
            f"of {list(TIS_TYPES)} (NeMo RL raises at the first step)",
        )
    if t is None:
        return
    if not c.use_importance_sampling_correction:
        raise _bad(
            "use_importance_sampling_correction", f"truncated_importance_sampling_type={t!r} needs it true"
        )
    if t not in TIS_TYPES:
        raise _bad(
            "truncated_importance_sampling_type", f"must be one of {list(TIS_TYPES)} or null, got {t!r}"
        )
    if hi is None or not hi > 0:
        raise _bad("truncated_importance_sampling_ratio", f"must be > 0 with a truncation type, got {hi}")
    if lo is not None and lo > hi:
        raise _bad(
            "truncated_importance_sampling_ratio_min",
            f"must be <= truncated_importance_sampling_ratio ({hi}), got {lo}",
        )
    if t in ("icepop", "seq-mask-tis") and lo is None:
        raise _bad(
            "truncated_importance_sampling_ratio_min", f"{t!r} needs a lower bound (e.g. 0.5 for icepop)"
        )
    if t == "seq-mask-tis" and c.sequence_level_importance_ratios:
        raise _bad("sequence_level_importance_ratios", "seq-mask-tis uses token-level weights; set it false")


def make_calibration(
    config: LossConfig, spec: Any, given: CalibratedClipping | None
) -> CalibratedClipping | None:
    """The controller whose bounds the loss uses, or None (nominal bounds).

    Args:
        config: the parsed ``loss_fn`` section (its eps are ``ratio_clip_min``/``ratio_clip_max``).
        spec: ``loss_fn.calibration``: a mapping of :class:`CalibratedClipping` arguments other than
            ``eps_low``/``eps_high``, ``{}`` (defaults), or ``false``/None (off). A loss that clips no
            token ratio gets no controller; a non-empty spec for it raises.
        given: a ready controller instead of ``spec`` (its eps must match the config's).
    """
    if given is not None:
        if not isinstance(given, CalibratedClipping):
            raise ValueError("calibration must be a CalibratedClipping controller or None")
        if spec not in ({}, None):
            raise _bad("calibration", "pass the controller or the config key, not both")
        if (
            abs(given.eps_low - config.ratio_clip_min) > 1e-12
            or abs(given.eps_high - config.ratio_clip_max) > 1e-12
        ):
            raise _bad(
                "calibration",
                f"controller eps ({given.eps_low}, {given.eps_high}) differ from ratio_clip_min/max "
                f"({config.ratio_clip_min}, {config.ratio_clip_max}); build both from the same values",
            )
        if not config.clips_tokens:
            raise _bad(
                "calibration", "this loss clips no token ratio (GSPO, REINFORCE or force_on_policy_ratio)"
            )
        return given
    if spec is False or spec is None:
        return None
    if not isinstance(spec, Mapping) and hasattr(spec, "items"):
        spec = dict(spec.items())
    if not isinstance(spec, Mapping):
        raise _bad("calibration", f"must be a mapping of CalibratedClipping arguments or false, got {spec!r}")
    if not config.clips_tokens:
        if spec:
            raise _bad(
                "calibration",
                "this loss clips no token ratio (GSPO, REINFORCE or force_on_policy_ratio); set it false",
            )
        return None
    for key in ("eps_low", "eps_high"):
        if key in spec:
            raise _bad(f"calibration.{key}", "comes from ratio_clip_min/ratio_clip_max; remove it")
    try:
        return CalibratedClipping(eps_low=config.ratio_clip_min, eps_high=config.ratio_clip_max, **spec)
    except TypeError as e:
        raise _bad("calibration", f"{e}; valid keys are CalibratedClipping's arguments") from None
    except ValueError as e:
        raise _bad("calibration", f"{e} (or set loss_fn.calibration: false)") from None


__all__ = ["CONFIG_DEFAULTS", "TIS_TYPES", "LossConfig", "make_calibration", "parse_loss_config"]
