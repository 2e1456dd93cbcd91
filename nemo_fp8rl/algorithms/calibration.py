"""Calibrated Clipping: clip bounds that make FP8 clip what BF16 would have clipped (docs/design.md, "Calibrated Clipping").

Why: PPO-style clipping zeroes the gradient of a negative-advantage token when r_t < L. FP8 log-prob
noise (std ~0.22 per token on our toy stack vs ~0.014 for BF16) spreads the ratios r_t, so with the
nominal L = 1 - eps_low many more tokens fall below L than with BF16 ratios on the same tokens: the
update loses much of its negative mass (the CPU prototype measured 0.095-0.106 clipped vs 0.046 for FP32; docs/fp8-noise.md).
Calibrated Clipping (arXiv 2609.22870) measures, on a calibration step, the high-precision ratios
rho_t = exp(hp_logp_t - hp_old_logp_t) of a BF16 shadow forward on the same tokens, and picks bounds
for the FP8 ratios r_t that reproduce BF16's clipping statistics:

- lower (quantile matching on N = {t: A_t < 0}): alpha = |{t in N: rho_t < 1 - eps_low}| / |N|,
  L* = the alpha-quantile of {r_t: t in N} with "lower" interpolation, i.e. exactly floor(alpha |N|)
  tokens of N lie strictly below L* (for distinct values; ties can only lower that count).
- upper (``upper_mode``): ``balance`` keeps BF16's ratio of effective positive to negative update mass,
  ``quantile`` matches BF16's fraction of P = {t: A_t > 0} above 1 + eps_high, ``proportional`` scales
  eps_high like eps_low, ``fixed`` keeps 1 + eps_high. See :func:`calibrate_bounds`.
- guards: L in [lower_min, 1 - eps_low], H in [1 + eps_high, upper_max]; too few tokens keeps the
  previous bounds; EMA smoothing across calibrations (:class:`CalibratedClipping`).
- pooling (``window``): a calibration may pool the tokens of ``window`` consecutive steps (a round) before
  it computes the bounds, so that alpha rests on enough negative-advantage tokens to be measured.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from nemo_fp8rl.algorithms._common import as_bool_mask, check_number, expand_advantages
from nemo_fp8rl.algorithms.metrics import Metric, make_metric
from nemo_fp8rl.registry import choices

UPPER_MODES = choices("calibration upper mode", "calibration.upper_mode", ("balance", "quantile", "proportional", "fixed"))
"""How the calibrated upper bound is set (``calibration.upper_mode``; module docstring)."""


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    """Outcome of one :func:`calibrate_bounds` call (Python floats; computed once per calibration step).

    Attributes:
        lower, upper: calibrated bounds after the guards (before EMA smoothing); the nominal bounds
            (1 - eps_low, 1 + eps_high) when ``skipped``.
        alpha_bf16: |{N: rho < 1 - eps_low}| / |N| (BF16 clipped fraction of negative-advantage tokens).
        alpha_fp8_nominal: |{N: r < 1 - eps_low}| / |N| (FP8 clipped fraction under the nominal bound).
        false_clip_rate: P(rho >= 1 - eps_low and r < 1 - eps_low | A < 0).
        balance_bf16: p_ref = M+_rho(1 + eps_high) / M-_rho(1 - eps_low).
        balance_fp8: M+_r(upper) / M-_r(lower), the FP8 balance with the calibrated bounds.
        tokens: tokens used, |N| + |P| (valid, finite, non-zero advantage).
        lower_raw, upper_raw: L*, H* before the guards (NaN when ``skipped``).
        balance_fp8_nominal: M+_r(1 + eps_high) / M-_r(1 - eps_low), the FP8 balance before calibration.
        skipped: True when tokens < min_tokens or N is empty (bounds must not be updated).
    Ratios of masses are inf when only the denominator is 0 and NaN when both are.
    """

    lower: float
    upper: float
    alpha_bf16: float
    alpha_fp8_nominal: float
    false_clip_rate: float
    balance_bf16: float
    balance_fp8: float
    tokens: int
    lower_raw: float = math.nan
    upper_raw: float = math.nan
    balance_fp8_nominal: float = math.nan
    skipped: bool = False


def _check_config(
    eps_low, eps_high, upper_mode, lower_min, upper_max, min_tokens
) -> tuple[float, float, float, float]:
    el = check_number("eps_low", eps_low, low=0.0, high=1.0, low_open=True, hint="e.g. eps_low=0.2")
    eh = check_number(
        "eps_high", eps_high, low=0.0, low_open=True, hint="e.g. eps_high=0.2 (GRPO) or 0.28 (DAPO)"
    )
    if el >= 1.0:
        raise ValueError(f"eps_low must be < 1 so that 1 - eps_low > 0, got {el}")
    UPPER_MODES.check(upper_mode)
    lmin = check_number("lower_min", lower_min, low=0.0, low_open=True)
    if lmin > 1.0 - el:
        raise ValueError(
            f"lower_min ({lmin}) must be <= 1 - eps_low ({1.0 - el}); lower it or reduce eps_low"
        )
    umax = check_number("upper_max", upper_max, low=1.0)
    if umax < 1.0 + eh:
        raise ValueError(
            f"upper_max ({umax}) must be >= 1 + eps_high ({1.0 + eh}); raise it or reduce eps_high"
        )
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"min_tokens must be an int >= 1, got {min_tokens!r}")
    return el, eh, lmin, umax


def _safe_ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return math.inf if num > 0 else math.nan


def _mass_below(x: torch.Tensor, a: torch.Tensor, bound: float | torch.Tensor) -> float:
    """M(bound) = sum_{x_t <= bound} |a_t| x_t, via a sorted cumulative sum (float64).

    Computed the same way for r and rho so that identical inputs give bit-identical masses.
    """
    if x.numel() == 0:
        return 0.0
    xs, order = torch.sort(x, stable=True)
    c = torch.cumsum(a.abs().double()[order] * xs.double(), 0)
    k = int(torch.searchsorted(xs, torch.as_tensor(bound, dtype=xs.dtype, device=xs.device), right=True))
    return float(c[k - 1]) if k > 0 else 0.0


def _mass_above(x: torch.Tensor, a: torch.Tensor, bound: float | torch.Tensor) -> float:
    """M(bound) = sum_{x_t >= bound} |a_t| x_t, via a cumulative sum in descending order (float64)."""
    if x.numel() == 0:
        return 0.0
    xs, order = torch.sort(x, descending=True, stable=True)
    c = torch.cumsum(a.abs().double()[order] * xs.double(), 0)
    k = int((xs >= torch.as_tensor(bound, dtype=xs.dtype, device=xs.device)).sum())
    return float(c[k - 1]) if k > 0 else 0.0


def balance_upper(
    ratio_pos: torch.Tensor,
    adv_pos: torch.Tensor,
    *,
    mass_neg: float,
    mass_pos_ref: float,
    mass_neg_ref: float,
    upper_min: float,
    upper_cap: float,
) -> float:
    """Smallest H >= ``upper_min`` with M+_r(H) / M-_r(L) >= p_ref (the ``balance`` upper bound).

    With M+_r(H) = sum_{t in P, r_t <= H} A_t r_t (``ratio_pos``, ``adv_pos``: 1-D over P),
    M-_r(L) = ``mass_neg`` and p_ref = ``mass_pos_ref`` / ``mass_neg_ref`` (BF16 masses), the condition
    is evaluated division-free as M+_r(H) * mass_neg_ref >= mass_pos_ref * mass_neg. H* is the
    ``upper_min`` when the condition already holds there, else the smallest r_t (t in P) at which the
    sorted cumulative sum reaches the target, else ``upper_cap`` (unreachable). When p_ref is undefined
    (``mass_neg_ref`` = 0) or there is no negative FP8 mass, H* = ``upper_min``. H* is non-decreasing in
    p_ref (the target grows with it and the cumulative sum is non-decreasing).
    """
    if mass_neg_ref <= 0 or mass_neg <= 0 or ratio_pos.numel() == 0:
        return upper_min
    target = mass_pos_ref * mass_neg
    xs, order = torch.sort(ratio_pos, stable=True)
    scaled = torch.cumsum(adv_pos.abs().double()[order] * xs.double(), 0) * mass_neg_ref
    if _mass_below(ratio_pos, adv_pos, upper_min) * mass_neg_ref >= target:
        return upper_min
    j = int(torch.searchsorted(scaled, torch.tensor([target], dtype=torch.float64, device=scaled.device)))
    if j >= xs.numel():
        return upper_cap
    return max(float(xs[j]), upper_min)


def _quantile_lower(sorted_x: torch.Tensor, k: int) -> torch.Tensor:
    """Value with exactly k entries strictly below it (distinct values): x_(k), or just above the max."""
    n = sorted_x.numel()
    if k < n:
        return sorted_x[k]
    top = sorted_x[-1]
    return torch.nextafter(top, torch.full_like(top, math.inf))


def calibrate_bounds(
    ratio: torch.Tensor,
    ref_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    eps_low: float,
    eps_high: float,
    upper_mode: str = "balance",
    lower_min: float = 0.5,
    upper_max: float = 3.0,
    min_tokens: int = 64,
) -> CalibrationResult:
    """Calibrated clip bounds for FP8 ratios from BF16 shadow ratios (arXiv 2609.22870; docs/design.md).

    Inputs are the tokens of a calibration step: ``ratio`` r_t = exp(logp - old_logp) from the FP8
    trainer and ``ref_ratio`` rho_t = exp(hp_logp - hp_old_logp) from the BF16 shadow forwards of the same
    weights on the same tokens, and the advantages A_t. Tokens used: mask, finite r, rho and A, A != 0;
    N = {A < 0}, P = {A > 0}; L0 = 1 - eps_low, H0 = 1 + eps_high.

    Lower: alpha = |{N: rho < L0}| / |N|; L* = r_(k) of the sorted r over N with k = |{N: rho < L0}|
    (exactly floor(alpha |N|) = k tokens strictly below for distinct values; k = |N| gives the next float
    above max r); ``lower`` = clamp(L*, lower_min, L0).

    Upper, with M+_x(H) = sum_{P, x <= H} A x and M-_x(L) = sum_{N, x >= L} |A| x:

    - ``balance``: p_ref = M+_rho(H0) / M-_rho(L0); H* = smallest H >= H0 with
      M+_r(H) / M-_r(lower) >= p_ref (sorted cumulative sums; ``upper_max`` when unreachable).
    - ``quantile``: beta = |{P: rho > H0}| / |P|; H* = the (1 - beta)-quantile of r over P such that
      exactly floor(beta |P|) tokens of P lie strictly above it (mirror of the lower bound).
    - ``proportional``: H* = 1 + (1 - lower) eps_high / eps_low.
    - ``fixed``: H* = H0.

    ``upper`` = clamp(H*, H0, upper_max). The balance and proportional modes use the lower bound after
    its guards (the one that will be applied; equal to L* when the guards do not bind).

    Args:
        ratio, ref_ratio: r and rho, any shape (e.g. ``[batch, seq]`` or flat ``[n]``), equal shapes.
        advantages: same shape, or ``[batch]`` per sequence when the ratios are ``[batch, seq]``.
        mask: same shape as ``ratio`` (bool or 0/1), or None.
        eps_low, eps_high: nominal clip epsilons.
        upper_mode: one of :data:`UPPER_MODES`.
        lower_min, upper_max: guards.
        min_tokens: fewer tokens (|N| + |P|) than this, or an empty N, gives ``skipped=True`` and the
            nominal bounds.

    Returns:
        :class:`CalibrationResult` (Python floats: this syncs with the host, once per calibration).
    """
    el, eh, lmin, umax = _check_config(eps_low, eps_high, upper_mode, lower_min, upper_max, min_tokens)
    for name, x in (("ratio", ratio), ("ref_ratio", ref_ratio)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ref_ratio.shape != ratio.shape:
        raise ValueError(
            f"ref_ratio has shape {tuple(ref_ratio.shape)} but ratio has {tuple(ratio.shape)}; "
            f"pass BF16 shadow ratios of the same tokens"
        )
    adv = expand_advantages(advantages, ratio) if ratio.dim() == 2 else advantages
    if not isinstance(adv, torch.Tensor) or adv.shape != ratio.shape:
        raise ValueError(f"advantages must have the shape of ratio {tuple(ratio.shape)}")
    m = as_bool_mask(mask, ratio)

    wd = torch.promote_types(ratio.dtype, torch.float32)
    r = ratio.detach().to(wd).reshape(-1)
    rho = ref_ratio.detach().to(wd).reshape(-1)
    a = adv.detach().to(wd).reshape(-1)
    ok = m.reshape(-1) & torch.isfinite(r) & torch.isfinite(rho) & torch.isfinite(a)
    neg = ok & (a < 0)
    pos = ok & (a > 0)
    rN, rhoN, aN = r[neg], rho[neg], a[neg]
    rP, rhoP, aP = r[pos], rho[pos], a[pos]
    n_neg, n_pos = rN.numel(), rP.numel()
    tokens = n_neg + n_pos
    L0, H0 = 1.0 - el, 1.0 + eh
    L0_t = torch.tensor(L0, dtype=wd)
    H0_t = torch.tensor(H0, dtype=wd)

    k = int((rhoN < L0_t.to(rhoN.device)).sum())
    if n_neg:
        alpha_bf16 = k / n_neg
        alpha_fp8 = int((rN < L0_t.to(rN.device)).sum()) / n_neg
        false_clip = int(((rhoN >= L0_t.to(rN.device)) & (rN < L0_t.to(rN.device))).sum()) / n_neg
    else:
        alpha_bf16 = alpha_fp8 = false_clip = math.nan
    m_pos_ref = _mass_below(rhoP, aP, H0_t)
    m_neg_ref = _mass_above(rhoN, aN, L0_t)
    balance_bf16 = _safe_ratio(m_pos_ref, m_neg_ref)
    balance_fp8_nominal = _safe_ratio(_mass_below(rP, aP, H0_t), _mass_above(rN, aN, L0_t))

    if tokens < min_tokens or n_neg == 0:
        return CalibrationResult(
            lower=L0,
            upper=H0,
            alpha_bf16=alpha_bf16,
            alpha_fp8_nominal=alpha_fp8,
            false_clip_rate=false_clip,
            balance_bf16=balance_bf16,
            balance_fp8=balance_fp8_nominal,
            tokens=tokens,
            balance_fp8_nominal=balance_fp8_nominal,
            skipped=True,
        )

    lower_raw_t = _quantile_lower(torch.sort(rN).values, k)
    lower_raw = float(lower_raw_t)
    lower = min(max(lower_raw, lmin), L0)
    lower_t = torch.tensor(lower, dtype=wd) if lower != lower_raw else lower_raw_t.cpu()
    m_neg = _mass_above(rN, aN, lower_t)

    if upper_mode == "balance":
        upper_raw = balance_upper(
            rP,
            aP,
            mass_neg=m_neg,
            mass_pos_ref=m_pos_ref,
            mass_neg_ref=m_neg_ref,
            upper_min=H0,
            upper_cap=umax,
        )
    elif upper_mode == "quantile":
        j = int((rhoP > H0_t.to(rhoP.device)).sum())
        if n_pos == 0:
            upper_raw = H0
        elif j < n_pos:
            upper_raw = float(torch.sort(rP).values[n_pos - 1 - j])
        else:
            lo = torch.sort(rP).values[0]
            upper_raw = float(torch.nextafter(lo, torch.full_like(lo, -math.inf)))
    elif upper_mode == "proportional":
        upper_raw = 1.0 + (1.0 - lower) * eh / el
    else:
        upper_raw = H0
    upper = min(max(upper_raw, H0), umax)
    balance_fp8 = _safe_ratio(_mass_below(rP, aP, torch.tensor(upper, dtype=wd)), m_neg)

    return CalibrationResult(
        lower=lower,
        upper=upper,
        alpha_bf16=alpha_bf16,
        alpha_fp8_nominal=alpha_fp8,
        false_clip_rate=false_clip,
        balance_bf16=balance_bf16,
        balance_fp8=balance_fp8,
        tokens=tokens,
        lower_raw=lower_raw,
        upper_raw=upper_raw,
        balance_fp8_nominal=balance_fp8_nominal,
        skipped=False,
    )


def _all_gather_columns(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``[c, n_rank]`` tensors of different n_rank; concatenated in rank order on every rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialised; pass group=None")
    world = dist.get_world_size(group)
    n = torch.tensor([x.shape[1]], dtype=torch.long, device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    counts = [int(s) for s in sizes]
    padded = x.new_zeros((x.shape[0], max(counts)))
    padded[:, : x.shape[1]] = x
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return torch.cat([b[:, :c] for b, c in zip(bufs, counts)], dim=1)


class CalibratedClipping:
    """Controller that keeps the clip bounds in force and re-calibrates them every ``interval`` steps.

    Per calibration step (``should_calibrate(step)``), the trainer calls :meth:`observe` once per
    minibatch with the FP8 ratios r, the BF16 shadow ratios rho of the same tokens and the advantages,
    then :meth:`update` once at the end of the step. ``update`` all-gathers the kept tokens over the
    data-parallel ``group`` (every rank then computes identical bounds), runs :func:`calibrate_bounds`,
    and smooths: the first successful calibration sets the bounds, later ones blend
    ``L <- ema * L + (1 - ema) * L_new`` (same for H). Bounds apply from the next step. Before the first
    calibration the bounds are (``init_lower``, ``init_upper``), nominal (1 - eps_low, 1 + eps_high) by
    default. With ``apply=False`` everything is measured and logged but the bounds stay at the initial
    ones (how a fixed-clip FP8 run would have been calibrated).

    Token subset: at most ``max_tokens`` tokens per rank are kept, a uniform random subset of the round's
    valid tokens (bottom-k of i.i.d. uniform keys, which merges across minibatches and steps). Keys come
    from a ``torch.Generator`` seeded from (``seed``, the round's first step, observe call, rank), so runs
    and resumes are deterministic; ``seed`` is saved in :meth:`state_dict`.

    Rounds (``window`` = w, 1 <= w <= ``interval``): calibration k observes the steps
    c_k, ..., c_k + w - 1 (c_k = ``start_step`` + k ``interval``; :meth:`should_calibrate` is True on each)
    and pools their tokens; :meth:`update` computes the bounds once, at the round's last step
    (:meth:`is_round_end`), and returns ``{}`` (no collective, buffer kept) on its other steps. The bounds
    apply from step c_k + w. Each pooled token keeps the (r, rho, A) of the step that produced it, so
    alpha and L* are the same statistics over w steps' tokens. With w = 1 (the default) every call to
    :meth:`update` calibrates, as before. A round's buffer spans steps, so :meth:`state_dict` saves it
    (per rank: the trainer checkpoints each rank's state) and a resumed run pools exactly the same tokens.

    Config (the names are the Hydra keys): ``eps_low``, ``eps_high``, ``interval`` (20), ``ema`` (0.5),
    ``upper_mode`` ("balance"), ``lower_min`` (0.5), ``upper_max`` (3.0), ``min_tokens`` (64),
    ``max_tokens`` (65536), ``start_step`` (0), ``init_lower``/``init_upper`` (None = nominal),
    ``apply`` (True), ``window`` (1), ``seed`` (0).
    """

    def __init__(
        self,
        *,
        eps_low: float,
        eps_high: float,
        interval: int = 20,
        ema: float = 0.5,
        upper_mode: str = "balance",
        lower_min: float = 0.5,
        upper_max: float = 3.0,
        min_tokens: int = 64,
        max_tokens: int = 65536,
        start_step: int = 0,
        init_lower: float | None = None,
        init_upper: float | None = None,
        apply: bool = True,
        window: int = 1,
        seed: int = 0,
    ) -> None:
        self.eps_low, self.eps_high, self.lower_min, self.upper_max = _check_config(
            eps_low, eps_high, upper_mode, lower_min, upper_max, min_tokens
        )
        for name, v, lo in (
            ("interval", interval, 1),
            ("max_tokens", max_tokens, 1),
            ("start_step", start_step, 0),
            ("window", window, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if window > interval:
            raise ValueError(f"window ({window}) must be <= interval ({interval}): a round pools window "
                             "consecutive steps of each interval (calibration.window, calibration.interval)")
        if max_tokens < min_tokens:
            raise ValueError(f"max_tokens ({max_tokens}) must be >= min_tokens ({min_tokens})")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not isinstance(apply, bool):
            raise ValueError(f"apply must be a bool, got {apply!r}")
        self.interval = interval
        self.window = window
        self.ema = check_number(
            "ema", ema, low=0.0, high=1.0, hint="ema is the weight of the old bound, in [0, 1]"
        )
        self.upper_mode = upper_mode
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.start_step = start_step
        self.apply = apply
        self.seed = seed
        self.nominal = (1.0 - self.eps_low, 1.0 + self.eps_high)
        il = (
            self.nominal[0]
            if init_lower is None
            else check_number("init_lower", init_lower, low=0.0, high=1.0, low_open=True)
        )
        iu = self.nominal[1] if init_upper is None else check_number("init_upper", init_upper, low=1.0)
        if il >= iu:
            raise ValueError(f"init_lower ({il}) must be < init_upper ({iu})")
        self.init_bounds = (il, iu)
        self._lower, self._upper = il, iu
        self._calibrated = False
        self._last_step: int | None = None
        self._updates = 0
        self.last_result: CalibrationResult | None = None
        self._reset_buffer()

    # ------------------------------------------------------------------ schedule and bounds
    def should_calibrate(self, step: int) -> bool:
        """True on the steps a round observes: ``start_step`` + k ``interval`` + j, 0 <= j < ``window``."""
        return step >= self.start_step and (step - self.start_step) % self.interval < self.window

    def is_round_end(self, step: int) -> bool:
        """True where :meth:`update` calibrates: always with ``window`` 1, else on a round's last step."""
        return self.window == 1 or (
            step >= self.start_step and (step - self.start_step) % self.interval == self.window - 1
        )

    @property
    def bounds(self) -> tuple[float, float]:
        """(lower, upper) in force, as Python floats."""
        return self._lower, self._upper

    def _next_step(self) -> int:
        """First step of the next round (the round an observation without ``step`` belongs to)."""
        base = self.start_step if self._last_step is None else max(self._last_step + 1, self.start_step)
        k = -(-(base - self.start_step) // self.interval)
        return self.start_step + k * self.interval

    def _round_of(self, step: int) -> int:
        """First step of the round that observes ``step``."""
        return step - (step - self.start_step) % self.interval if step >= self.start_step else step

    # ------------------------------------------------------------------ collecting tokens
    def _reset_buffer(self) -> None:
        self._data: torch.Tensor | None = None  # [3, n]: r, rho, A
        self._keys: torch.Tensor | None = None  # [n] float64 uniform keys
        self._calls = 0
        self._round_step: int | None = None

    def observe(
        self,
        ratio: torch.Tensor,
        ref_ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        step: int | None = None,
    ) -> None:
        """Collect one minibatch of a calibration step (detached; nothing is synced to the host).

        Args:
            ratio: FP8 ratios r = exp(logp - old_logp), ``[batch, seq]`` (any shape works).
            ref_ratio: BF16 shadow ratios rho of the same tokens, same shape.
            advantages: same shape, or ``[batch]`` per sequence.
            mask: valid tokens, same shape, or None.
            step: the training step (its round's first step seeds the keys); default: the next round's
                first step.
        """
        if not isinstance(ratio, torch.Tensor) or not isinstance(ref_ratio, torch.Tensor):
            raise ValueError("ratio and ref_ratio must be torch.Tensors")
        if ref_ratio.shape != ratio.shape:
            raise ValueError(
                f"ref_ratio has shape {tuple(ref_ratio.shape)} but ratio has {tuple(ratio.shape)}"
            )
        adv = expand_advantages(advantages, ratio) if ratio.dim() == 2 else advantages
        if not isinstance(adv, torch.Tensor) or adv.shape != ratio.shape:
            raise ValueError(f"advantages must have the shape of ratio {tuple(ratio.shape)}")
        m = as_bool_mask(mask, ratio)
        if self._round_step is None:
            if step is None:
                self._round_step = self._next_step()
            else:  # window 1: the step itself (as before rounds existed, whatever step a caller passes)
                self._round_step = int(step) if self.window == 1 else self._round_of(int(step))
        wd = torch.promote_types(ratio.dtype, torch.float32)
        x = torch.stack([ratio.detach().to(wd), ref_ratio.detach().to(wd), adv.detach().to(wd)]).reshape(
            3, -1
        )
        keep = m.reshape(-1) & torch.isfinite(x).all(0) & (x[2] != 0)
        x = x[:, keep]
        gen = torch.Generator().manual_seed(self._seed_for(self._round_step, self._calls))
        keys = torch.rand(x.shape[1], generator=gen, dtype=torch.float64).to(x.device)
        self._calls += 1
        if self._data is not None:
            x = torch.cat(
                [
                    self._data.to(device=x.device, dtype=torch.promote_types(self._data.dtype, x.dtype)),
                    x.to(torch.promote_types(self._data.dtype, x.dtype)),
                ],
                dim=1,
            )
            keys = torch.cat([self._keys.to(x.device), keys])
        if keys.numel() > self.max_tokens:
            idx = torch.topk(keys, self.max_tokens, largest=False).indices.sort().values
            x, keys = x[:, idx], keys[idx]
        self._data, self._keys = x, keys

    def _seed_for(self, step: int, call: int) -> int:
        rank = 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        h = self.seed
        for v in (step, call, rank):
            h = (h * 1_000_003 + int(v) + 0x9E3779B9) % (2**63 - 1)
        return h

    # ------------------------------------------------------------------ update
    def update(self, step: int, group=None) -> dict[str, Metric]:
        """Calibrate from the observed tokens (all-gathered over ``group``), smooth, and clear the buffer.

        Every rank of ``group`` must call this. On a step that does not end its round (``window`` > 1) it
        returns ``{}`` at once: no collective, the pooled tokens stay. Otherwise it returns the ``calib/*``
        metrics of docs/design.md, "Calibrated Clipping":
        ``calib/{alpha_bf16, alpha_fp8_nominal, false_clip_rate, lower_raw, upper_raw, balance_bf16,
        balance_fp8, balance_fp8_nominal, tokens, skipped}`` (identical on every rank, reduction "mean").
        ``calib/skipped`` is 1 when too few tokens were seen (bounds kept).
        """
        if not self.is_round_end(int(step)):
            return {}
        data = self._data
        if data is None:
            device = torch.device("cpu")
            if (
                group is not None
                and torch.distributed.is_initialized()
                and torch.distributed.get_backend(group) == "nccl"
            ):
                device = torch.device("cuda", torch.cuda.current_device())
            data = torch.zeros((3, 0), dtype=torch.float32, device=device)
        if group is not None:
            data = _all_gather_columns(data, group)
        res = calibrate_bounds(
            data[0],
            data[1],
            data[2],
            None,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            upper_mode=self.upper_mode,
            lower_min=self.lower_min,
            upper_max=self.upper_max,
            min_tokens=self.min_tokens,
        )
        if not res.skipped and self.apply:
            if not self._calibrated:
                self._lower, self._upper = res.lower, res.upper
            else:
                self._lower = self.ema * self._lower + (1.0 - self.ema) * res.lower
                self._upper = self.ema * self._upper + (1.0 - self.ema) * res.upper
            self._calibrated = True
        self._last_step = int(step)
        self._updates += 1
        self._reset_buffer()
        self.last_result = res
        return {
            "calib/alpha_bf16": make_metric(res.alpha_bf16, "mean"),
            "calib/alpha_fp8_nominal": make_metric(res.alpha_fp8_nominal, "mean"),
            "calib/false_clip_rate": make_metric(res.false_clip_rate, "mean"),
            "calib/lower_raw": make_metric(res.lower_raw, "mean"),
            "calib/upper_raw": make_metric(res.upper_raw, "mean"),
            "calib/balance_bf16": make_metric(res.balance_bf16, "mean"),
            "calib/balance_fp8": make_metric(res.balance_fp8, "mean"),
            "calib/balance_fp8_nominal": make_metric(res.balance_fp8_nominal, "mean"),
            "calib/tokens": make_metric(float(res.tokens), "mean"),
            "calib/skipped": make_metric(float(res.skipped), "mean"),
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Bounds, schedule position, seed and, inside a round of ``window`` > 1 steps, this rank's pooled
        tokens (``round``: None between rounds; the buffer of a finished step of a window-1 run is empty)."""
        pooled = None
        if self._round_step is not None:
            pooled = {"step": self._round_step, "calls": self._calls,
                      "data": None if self._data is None else self._data.detach().cpu(),
                      "keys": None if self._keys is None else self._keys.detach().cpu()}
        return {
            "lower": self._lower,
            "upper": self._upper,
            "calibrated": self._calibrated,
            "last_step": self._last_step,
            "updates": self._updates,
            "seed": self.seed,
            "round": pooled,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"lower", "upper", "calibrated", "last_step", "updates", "seed"} - set(state)
        if missing:
            raise ValueError(
                f"calibration state is missing {sorted(missing)}; was it saved by CalibratedClipping?"
            )
        self._lower, self._upper = float(state["lower"]), float(state["upper"])
        self._calibrated = bool(state["calibrated"])
        self._last_step = None if state["last_step"] is None else int(state["last_step"])
        self._updates = int(state["updates"])
        self.seed = int(state["seed"])
        self._reset_buffer()
        pooled = state.get("round")  # absent in checkpoints from before calibration.window
        if pooled is not None:
            self._round_step, self._calls = int(pooled["step"]), int(pooled["calls"])
            self._data, self._keys = pooled["data"], pooled["keys"]

    @staticmethod
    def merge_rounds(states: list[dict], max_tokens: int) -> dict | None:
        """One round buffer from several ranks' :meth:`state_dict` (a resume on another data-parallel layout):
        the union of their pooled tokens, cut to the ``max_tokens`` with the smallest keys (a uniform subset,
        as :meth:`observe` keeps). Pass one state per data-parallel rank (tensor-parallel ranks hold copies).
        None when no state is inside a round."""
        rounds = [s.get("round") for s in states if s.get("round") is not None]
        if not rounds:
            return None
        if len({int(r["step"]) for r in rounds}) != 1:
            raise ValueError(f"the saved ranks are in different calibration rounds {[r['step'] for r in rounds]}; "
                             "the checkpoint is inconsistent")
        parts = [r for r in rounds if r["data"] is not None]
        merged = {"step": int(rounds[0]["step"]), "calls": max(int(r["calls"]) for r in rounds),
                  "data": None, "keys": None}
        if parts:
            data = torch.cat([r["data"] for r in parts], dim=1)
            keys = torch.cat([r["keys"] for r in parts])
            if keys.numel() > max_tokens:
                idx = torch.topk(keys, max_tokens, largest=False).indices.sort().values
                data, keys = data[:, idx], keys[idx]
            merged["data"], merged["keys"] = data, keys
        return merged
