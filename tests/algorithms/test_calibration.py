import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_fp8rl.algorithms import (
    UPPER_MODES,
    CalibratedClipping,
    balance_upper,
    calibrate_bounds,
    get_policy_loss,
    metrics_to_floats,
)

from ._dist_cases import CALIB_KW, calibration_shards, step_data

EPS_L, EPS_H = 0.2, 0.28
L0, H0 = 1 - EPS_L, 1 + EPS_H
def f32(v):
    return float(torch.tensor(v, dtype=torch.float32))



def _flat(neg_r, neg_rho, pos_r, pos_rho, neg_a=None, pos_a=None):
    r = torch.tensor(neg_r + pos_r, dtype=torch.float32)
    rho = torch.tensor(neg_rho + pos_rho, dtype=torch.float32)
    na = neg_a or [-1.0] * len(neg_r)
    pa = pos_a or [1.0] * len(pos_r)
    return r, rho, torch.tensor(na + pa, dtype=torch.float32)


def _masses(r, a, lower, upper):
    """Readable reference: M+_r(upper) and M-_r(lower)."""
    rl, al = r.tolist(), a.tolist()
    mp = sum(x * y for x, y in zip(rl, al) if y > 0 and x <= f32(upper))
    mn = sum(x * -y for x, y in zip(rl, al) if y < 0 and x >= f32(lower))
    return mp, mn


# ------------------------------------------------------------------------------------ hand cases
def test_alpha_zero_clips_nothing():
    r, rho, a = _flat([0.6, 0.7, 0.9, 1.1], [0.95, 0.9, 1.0, 1.05], [1.0, 1.2], [1.0, 1.1])
    res = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H, min_tokens=1)
    assert not res.skipped and res.tokens == 6
    assert res.alpha_bf16 == 0.0
    assert res.alpha_fp8_nominal == pytest.approx(0.5) and res.false_clip_rate == pytest.approx(0.5)
    assert res.lower_raw == f32(0.6) and res.lower == f32(0.6)  # L* = min r: nothing strictly below
    assert int((r[:4] < res.lower).sum()) == 0
    # balance: p_ref = 2.1 / 3.9 ; FP8 at H0 already has 2.2 / 3.3 >= p_ref -> H0
    assert res.balance_bf16 == pytest.approx(2.1 / 3.9, rel=1e-6)
    assert res.upper == pytest.approx(H0)
    assert res.balance_fp8 == pytest.approx(2.2 / 3.3, rel=1e-6)
    assert res.balance_fp8_nominal == pytest.approx((1.0 + 1.2) / (0.9 + 1.1), rel=1e-6)


@pytest.mark.parametrize("mode", UPPER_MODES)
def test_on_policy_gives_nominal_bounds(mode):
    ones = torch.ones(200)
    adv = torch.linspace(-1, 1, 200)
    res = calibrate_bounds(ones, ones, adv, eps_low=EPS_L, eps_high=EPS_H, upper_mode=mode)
    assert (res.lower, res.upper) == pytest.approx((L0, H0)) and res.alpha_bf16 == 0.0
    # identical FP8 and BF16 ratios (no FP8 noise) with spread: bounds stay nominal as well
    g = torch.Generator().manual_seed(1)
    r = torch.exp(0.3 * torch.randn(500, generator=g))
    a = torch.randn(500, generator=g)
    res = calibrate_bounds(r, r.clone(), a, eps_low=EPS_L, eps_high=EPS_H, upper_mode=mode)
    assert (res.lower, res.upper) == pytest.approx((L0, H0))
    assert res.false_clip_rate == 0.0 and res.alpha_bf16 == res.alpha_fp8_nominal > 0


def test_fp8_noise_doubles_clipped_fraction_and_calibration_restores_bf16():
    g = torch.Generator().manual_seed(0)
    B, T = 64, 32
    hp_log_ratio = 0.15 * torch.randn(B, T, generator=g)
    fp8_log_ratio = hp_log_ratio + 0.15 * torch.randn(B, T, generator=g)  # FP8 noise on the same tokens
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.1
    zeros = torch.zeros(B, T)
    ratio = (fp8_log_ratio - zeros).clamp(-20, 20).exp()  # as the loss computes it
    rho = hp_log_ratio.exp()
    loss_fn = get_policy_loss("ppo_clip")
    bf16 = metrics_to_floats(loss_fn(hp_log_ratio, zeros, adv, mask, lower=L0, upper=H0)[1])
    fp8 = metrics_to_floats(loss_fn(fp8_log_ratio, zeros, adv, mask, lower=L0, upper=H0)[1])
    assert fp8["clip/low_frac"] >= 1.8 * bf16["clip/low_frac"] > 0  # FP8 noise doubles what is clipped

    res = calibrate_bounds(ratio, rho, adv, mask, eps_low=EPS_L, eps_high=EPS_H)
    assert 0.5 < res.lower < L0 and res.lower == res.lower_raw
    assert res.alpha_bf16 == pytest.approx(bf16["clip/low_frac"], abs=1e-6)
    assert res.alpha_fp8_nominal == pytest.approx(fp8["clip/low_frac"], abs=1e-6)
    cal = metrics_to_floats(loss_fn(fp8_log_ratio, zeros, adv, mask, lower=res.lower, upper=res.upper)[1])
    n_neg = int(((adv[:, None] < 0) & mask).sum())
    assert cal["clip/low_frac"] == pytest.approx(math.floor(res.alpha_bf16 * n_neg + 1e-9) / n_neg, abs=1e-6)
    assert cal["clip/low_frac"] == pytest.approx(bf16["clip/low_frac"], abs=1e-6)


def test_balance_hand_case_and_other_modes():
    r, rho, a = _flat([0.9, 1.0], [0.9, 1.0], [1.0, 1.4, 1.6], [1.0, 1.2, 1.5])
    res = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H, min_tokens=1)
    # p_ref = (1.0 + 1.2) / 1.9 ; FP8 M+ reaches 2.2 only at H = 1.4 (1.0 + 1.4 = 2.4)
    assert res.lower == pytest.approx(L0) and res.lower_raw == f32(0.9)
    assert res.balance_bf16 == pytest.approx(2.2 / 1.9, rel=1e-6)
    assert res.upper == f32(1.4)
    assert res.balance_fp8 == pytest.approx(2.4 / 1.9, rel=1e-6) and res.balance_fp8 >= res.balance_bf16
    assert res.balance_fp8_nominal == pytest.approx(1.0 / 1.9, rel=1e-6)
    q = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H, upper_mode="quantile", min_tokens=1)
    assert q.upper == f32(1.4)  # beta = 1/3 -> exactly one P token (1.6) strictly above
    p = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H, upper_mode="proportional", min_tokens=1)
    assert p.upper == pytest.approx(1 + (1 - L0) * EPS_H / EPS_L)
    fx = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H, upper_mode="fixed", min_tokens=1)
    assert fx.upper == pytest.approx(H0)
    # proportional follows a calibrated lower bound
    r2, rho2, a2 = _flat([0.6, 0.7, 1.0], [0.7, 0.9, 1.0], [1.0], [1.0])
    p2 = calibrate_bounds(
        r2, rho2, a2, eps_low=EPS_L, eps_high=EPS_H, upper_mode="proportional", min_tokens=1
    )
    assert p2.lower == f32(0.7) and p2.upper == pytest.approx(1 + (1 - f32(0.7)) * EPS_H / EPS_L)


def test_balance_rebalancing_reaches_p_ref_with_smallest_upper():
    g = torch.Generator().manual_seed(5)
    n = 3000
    hp = 0.1 * torch.randn(n, generator=g)
    a = torch.randn(n, generator=g)
    r = (hp + 0.25 * torch.randn(n, generator=g)).exp()
    rho = hp.exp()
    res = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H)
    mp_ref, mn_ref = _masses(rho, a, L0, H0)
    p_ref = mp_ref / mn_ref
    assert res.balance_bf16 == pytest.approx(p_ref, rel=1e-9)
    assert H0 < res.upper < 3.0  # the rebalancing moved the upper bound
    mp, mn = _masses(r, a, res.lower, res.upper)
    assert mp / mn >= p_ref * (1 - 1e-9) and res.balance_fp8 == pytest.approx(mp / mn, rel=1e-9)
    below = float(torch.nextafter(torch.tensor(res.upper, dtype=torch.float32), torch.tensor(0.0)))
    mp_below, _ = _masses(r, a, res.lower, below)
    assert mp_below / mn < p_ref  # any smaller upper bound falls short of BF16's balance


def test_guards_bind():
    # huge FP8 noise: L* would be far below lower_min
    r, rho, a = _flat([0.1, 0.2, 0.3, 1.0], [0.7, 0.9, 0.95, 1.0], [1.0, 5.0], [1.0, 1.1])
    res = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H, min_tokens=1, upper_mode="quantile")
    assert res.lower_raw == f32(0.2) and res.lower == 0.5  # alpha = 1/4 -> r_(1) = 0.2 -> lower_min
    # quantile with beta = 0 gives max r = 5.0 -> capped at upper_max
    assert res.upper_raw == f32(5.0) and res.upper == 3.0
    res2 = calibrate_bounds(
        r,
        rho,
        a,
        eps_low=EPS_L,
        eps_high=EPS_H,
        min_tokens=1,
        lower_min=0.1,
        upper_max=6.0,
        upper_mode="quantile",
    )
    assert res2.lower == f32(0.2) and res2.upper == f32(5.0)
    # balance unreachable (FP8 has no positive mass at all) -> upper_max
    r3, rho3, a3 = _flat([0.9, 1.0], [0.9, 1.0], [4.0], [1.0])
    res3 = calibrate_bounds(r3, rho3, a3, eps_low=EPS_L, eps_high=EPS_H, min_tokens=1, upper_max=3.0)
    assert res3.upper == 3.0
    # every N token clipped in BF16: L* just above max r, then the 1 - eps_low guard
    r4, rho4, a4 = _flat([0.5, 0.6], [0.1, 0.2], [1.0], [1.0])
    res4 = calibrate_bounds(r4, rho4, a4, eps_low=EPS_L, eps_high=EPS_H, min_tokens=1)
    assert (
        res4.alpha_bf16 == 1.0 and res4.lower_raw > f32(0.6) and res4.lower == pytest.approx(res4.lower_raw)
    )
    assert int((r4[:2] < res4.lower).sum()) == 2 and res4.upper == pytest.approx(H0)


def test_too_few_tokens_and_no_negatives_are_skipped():
    r, rho, a = _flat([0.5, 0.9], [0.9, 0.9], [1.0], [1.0])
    res = calibrate_bounds(r, rho, a, eps_low=EPS_L, eps_high=EPS_H, min_tokens=4)
    assert res.skipped and res.tokens == 3 and (res.lower, res.upper) == pytest.approx((L0, H0))
    assert math.isnan(res.lower_raw) and res.alpha_fp8_nominal == pytest.approx(0.5)
    res = calibrate_bounds(torch.ones(100), torch.ones(100), torch.ones(100), eps_low=EPS_L, eps_high=EPS_H)
    assert res.skipped and math.isnan(res.alpha_bf16)


def test_masked_nonfinite_and_zero_advantage_tokens_are_ignored():
    r = torch.tensor([[0.5, 0.9, float("inf")], [1.0, 0.1, 1.2]])
    rho = torch.tensor([[0.9, 0.9, 1.0], [1.0, 0.1, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    res = calibrate_bounds(r, rho, adv, mask, eps_low=EPS_L, eps_high=EPS_H, min_tokens=1)
    assert res.tokens == 3 and res.alpha_fp8_nominal == pytest.approx(0.5)


def test_calibrate_bounds_errors():
    x = torch.ones(10)
    with pytest.raises(ValueError, match="upper_mode"):
        calibrate_bounds(x, x, x, eps_low=0.2, eps_high=0.2, upper_mode="median")
    with pytest.raises(ValueError, match="lower_min"):
        calibrate_bounds(x, x, x, eps_low=0.2, eps_high=0.2, lower_min=0.9)
    with pytest.raises(ValueError, match="upper_max"):
        calibrate_bounds(x, x, x, eps_low=0.2, eps_high=0.28, upper_max=1.1)
    with pytest.raises(ValueError, match="eps_low"):
        calibrate_bounds(x, x, x, eps_low=0.0, eps_high=0.2)
    with pytest.raises(ValueError, match="ref_ratio"):
        calibrate_bounds(x, x[:5], x, eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match="min_tokens"):
        calibrate_bounds(x, x, x, eps_low=0.2, eps_high=0.2, min_tokens=0)


# ------------------------------------------------------------------------------------ properties
_ratio32 = st.floats(0.25, 2.5, width=32)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    neg_r=st.lists(_ratio32, min_size=1, max_size=40, unique=True),
    data=st.data(),
    eps_low=st.sampled_from([0.1, 0.2, 0.3]),
)
def test_property_lower_quantile_matches_bf16_count(neg_r, data, eps_low):
    n = len(neg_r)
    neg_rho = data.draw(st.lists(_ratio32, min_size=n, max_size=n))
    pos_r = data.draw(st.lists(_ratio32, max_size=10))
    pos_rho = data.draw(st.lists(_ratio32, min_size=len(pos_r), max_size=len(pos_r)))
    r, rho, a = _flat(neg_r, neg_rho, pos_r, pos_rho)
    res = calibrate_bounds(r, rho, a, eps_low=eps_low, eps_high=0.2, lower_min=0.05, min_tokens=1)
    l0 = torch.tensor(1 - eps_low, dtype=torch.float32)
    k = int((rho[:n] < l0).sum())
    assert res.alpha_bf16 == k / n
    def below(bound):
        return int((r[:n] < torch.tensor(bound, dtype=torch.float32)).sum())

    assert below(res.lower_raw) == math.floor(res.alpha_bf16 * n + 1e-9) == k
    if 0.05 < res.lower_raw <= 1 - eps_low:  # guards do not bind
        assert (
            res.lower == res.lower_raw and below(res.lower) / n == math.floor(res.alpha_bf16 * n + 1e-9) / n
        )
    assert 0.05 <= res.lower <= 1 - eps_low and 1.2 - 1e-12 <= res.upper <= 3.0


@settings(max_examples=100, deadline=None)
@given(
    neg=st.lists(st.tuples(_ratio32, _ratio32, st.floats(0.1, 3.0)), min_size=1, max_size=30),
    pos=st.lists(
        st.tuples(_ratio32, st.floats(1.375, 2.5, width=32), st.floats(0.1, 3.0)), min_size=1, max_size=30
    ),
    moved=st.data(),
)
def test_property_upper_is_monotone_in_p_ref(neg, pos, moved):
    # moving BF16 ratios of positive tokens from above 1 + eps_high to below it raises p_ref only
    idx = moved.draw(st.sets(st.integers(0, len(pos) - 1)))
    r = torch.tensor([x[0] for x in neg] + [x[0] for x in pos])
    a = torch.tensor([-x[2] for x in neg] + [x[2] for x in pos])
    rho1 = torch.tensor([x[1] for x in neg] + [x[1] for x in pos])
    rho2 = rho1.clone()
    for i in idx:
        rho2[len(neg) + i] = 1.0
    kw = {"eps_low": EPS_L, "eps_high": EPS_H, "min_tokens": 1}
    res1 = calibrate_bounds(r, rho1, a, **kw)
    res2 = calibrate_bounds(r, rho2, a, **kw)
    assert res2.balance_bf16 >= res1.balance_bf16 or math.isnan(res1.balance_bf16)
    assert res1.lower == res2.lower
    assert res2.upper >= res1.upper


@settings(max_examples=100, deadline=None)
@given(
    pos=st.lists(st.tuples(_ratio32, st.floats(0.1, 3.0)), min_size=1, max_size=30),
    mass_neg=st.floats(0.1, 10.0),
    p1=st.floats(0.0, 5.0),
    p2=st.floats(0.0, 5.0),
)
def test_property_balance_upper_monotone_and_minimal(pos, mass_neg, p1, p2):
    r = torch.tensor([x[0] for x in pos])
    a = torch.tensor([x[1] for x in pos])
    kw = {"mass_neg": mass_neg, "mass_neg_ref": 1.0, "upper_min": H0, "upper_cap": 3.0}
    h1 = balance_upper(r, a, mass_pos_ref=min(p1, p2), **kw)
    h2 = balance_upper(r, a, mass_pos_ref=max(p1, p2), **kw)
    assert H0 <= h1 <= h2 <= 3.0
    target = max(p1, p2) * mass_neg
    def mp(h):
        return sum(x * y for x, y in zip(r.tolist(), a.tolist()) if x <= f32(h))

    if h2 < 3.0:
        assert mp(h2) >= target * (1 - 1e-9)
    if h2 > H0:
        below = float(torch.nextafter(torch.tensor(h2, dtype=torch.float32), torch.tensor(0.0)))
        assert mp(below) < target * (1 + 1e-9)


# ------------------------------------------------------------------------------------ controller
def _flat_concat(shards):
    rs, rhos, advs = [], [], []
    for r, rho, adv, mask in shards:
        a = adv[:, None].expand_as(r)
        rs.append(r[mask]), rhos.append(rho[mask]), advs.append(a[mask])
    return torch.cat(rs), torch.cat(rhos), torch.cat(advs)


def test_schedule_and_initial_bounds():
    c = CalibratedClipping(eps_low=EPS_L, eps_high=EPS_H)
    assert [s for s in range(65) if c.should_calibrate(s)] == [0, 20, 40, 60]
    assert c.bounds == pytest.approx((L0, H0))
    c = CalibratedClipping(
        eps_low=EPS_L, eps_high=EPS_H, interval=10, start_step=5, init_lower=0.7, init_upper=1.5
    )
    assert [s for s in range(30) if c.should_calibrate(s)] == [5, 15, 25]
    assert c.bounds == (0.7, 1.5)


def test_first_calibration_sets_then_ema_blends():
    kw = {"eps_low": EPS_L, "eps_high": EPS_H, "min_tokens": 16}
    c = CalibratedClipping(ema=0.25, **kw)
    results = []
    for step, seed in ((0, 1), (20, 2)):
        data = step_data(seed)
        for mb in data:
            c.observe(*mb)
        m = metrics_to_floats(c.update(step))
        results.append(calibrate_bounds(*_flat_concat(data), **kw))
        assert m["calib/skipped"] == 0 and m["calib/tokens"] == results[-1].tokens
        assert m["calib/lower_raw"] == pytest.approx(results[-1].lower_raw)
        assert m["calib/alpha_bf16"] == pytest.approx(results[-1].alpha_bf16)
        if step == 0:
            assert c.bounds == pytest.approx((results[0].lower, results[0].upper))
    r0, r1 = results
    assert c.bounds == pytest.approx((0.25 * r0.lower + 0.75 * r1.lower, 0.25 * r0.upper + 0.75 * r1.upper))
    assert c.bounds[0] < L0  # the noise really moved the bound


def test_apply_false_measures_but_keeps_nominal_bounds():
    data = step_data(3)
    on = CalibratedClipping(eps_low=EPS_L, eps_high=EPS_H)
    off = CalibratedClipping(eps_low=EPS_L, eps_high=EPS_H, apply=False)
    for c in (on, off):
        for mb in data:
            c.observe(*mb)
    m_on, m_off = metrics_to_floats(on.update(0)), metrics_to_floats(off.update(0))
    assert m_on == m_off
    assert off.bounds == pytest.approx((L0, H0)) and on.bounds != off.bounds


def test_skipped_calibration_keeps_previous_bounds():
    c = CalibratedClipping(eps_low=EPS_L, eps_high=EPS_H, min_tokens=64)
    for mb in step_data(4):
        c.observe(*mb)
    c.update(0)
    before = c.bounds
    r, rho, adv, mask = step_data(5, n_mb=1, B=2, T=8)[0]
    c.observe(r, rho, adv, mask)
    m = metrics_to_floats(c.update(20))
    assert m["calib/skipped"] == 1.0 and m["calib/tokens"] < 64 and c.bounds == before
    m = metrics_to_floats(c.update(40))  # nothing observed at all
    assert m["calib/skipped"] == 1.0 and m["calib/tokens"] == 0 and c.bounds == before


def test_max_tokens_keeps_a_deterministic_subset_from_all_minibatches():
    data = step_data(6, n_mb=3, B=4, T=10)  # ~32 valid tokens each

    def run(seed):
        c = CalibratedClipping(eps_low=EPS_L, eps_high=EPS_H, min_tokens=8, max_tokens=40, seed=seed)
        for mb in data:
            c.observe(*mb)
        kept = c._data.clone()
        return kept, metrics_to_floats(c.update(0)), c.bounds

    k1, m1, b1 = run(0)
    k2, m2, b2 = run(0)
    k3, _, _ = run(1)
    assert k1.shape[1] == 40 and m1["calib/tokens"] == 40
    assert torch.equal(k1, k2) and m1 == m2 and b1 == b2
    assert not torch.equal(k1, k3)
    full = torch.cat(
        [torch.stack([r[m], rho[m], adv[:, None].expand_as(r)[m]]) for r, rho, adv, m in data], 1
    )
    # kept tokens are a subset of the observed ones, in observation order, from every minibatch
    sizes = [int(m.sum()) for *_, m in data]
    pos = [int((full.T == col).all(1).nonzero()[0]) for col in k1.T]
    assert pos == sorted(pos) and len(set(pos)) == 40
    assert all(any(sum(sizes[:i]) <= p < sum(sizes[: i + 1]) for p in pos) for i in range(3))


def test_state_dict_resume_is_exact():
    kw = {"eps_low": EPS_L, "eps_high": EPS_H, "interval": 2, "max_tokens": 50, "min_tokens": 8, "seed": 3}
    steps = [(s, step_data(100 + s)) for s in range(0, 8, 2)]

    def go(c, items):
        out = []
        for s, data in items:
            for mb in data:
                c.observe(*mb)
            c.update(s)
            out.append(c.bounds)
        return out

    full = go(CalibratedClipping(**kw), steps)
    a = CalibratedClipping(**kw)
    first = go(a, steps[:2])
    b = CalibratedClipping(**kw)
    b.load_state_dict(a.state_dict())
    assert first + go(b, steps[2:]) == full
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"lower": 0.8})


def test_window_pools_consecutive_steps_and_calibrates_at_the_round_end():
    """calibration.window: the round c..c+w-1 is observed (shadow passes on each step), update() is a no-op
    ({} and the tokens kept) until its last step, which calibrates on the pooled tokens exactly as one step
    holding them all would; the bounds apply from c + w."""
    kw = {"eps_low": EPS_L, "eps_high": EPS_H, "min_tokens": 16}
    c = CalibratedClipping(interval=5, window=3, **kw)
    assert [s for s in range(12) if c.should_calibrate(s)] == [0, 1, 2, 5, 6, 7, 10, 11]
    assert [s for s in range(12) if c.is_round_end(s)] == [2, 7]
    pooled = []
    for step in (0, 1):
        data = step_data(200 + step)
        pooled += data
        for mb in data:
            c.observe(*mb, step=step)
        assert c.update(step) == {} and c.bounds == pytest.approx((L0, H0))
    data = step_data(202)
    pooled += data
    for mb in data:
        c.observe(*mb, step=2)
    m = metrics_to_floats(c.update(2))
    ref = calibrate_bounds(*_flat_concat(pooled), **kw)
    assert m["calib/tokens"] == ref.tokens > metrics_to_floats(_one_step(202, kw))["calib/tokens"]
    assert m["calib/alpha_bf16"] == pytest.approx(ref.alpha_bf16)
    assert c.bounds == pytest.approx((ref.lower, ref.upper))
    assert c.state_dict()["round"] is None  # the buffer was spent
    # window 1 is the controller without rounds: every update() calibrates, whatever the step
    one = CalibratedClipping(**kw)
    assert all(one.is_round_end(s) for s in range(7))


def _one_step(seed, kw):
    c = CalibratedClipping(**kw)
    for mb in step_data(seed):
        c.observe(*mb)
    return c.update(0)


def test_window_resume_inside_a_round_is_exact_and_merges_on_another_layout():
    """A round's pooled tokens are part of state_dict: a controller restored at any step of a round ends it
    with the bounds of the uninterrupted one. merge_rounds joins several ranks' buffers (another DP size)
    into the subset one rank holding all their tokens would have kept."""
    kw = {"eps_low": EPS_L, "eps_high": EPS_H, "interval": 4, "window": 3, "max_tokens": 120, "min_tokens": 8,
          "seed": 5}
    steps = [(s, step_data(300 + s)) for s in range(12) if s % 4 < 3]

    def go(c, items):
        out = []
        for s, data in items:
            for mb in data:
                c.observe(*mb, step=s)
            out.append((dict(metrics_to_floats(c.update(s))), c.bounds))
        return out

    full = go(CalibratedClipping(**kw), steps)
    for cut in range(1, len(steps)):
        a = CalibratedClipping(**kw)
        first = go(a, steps[:cut])
        b = CalibratedClipping(**kw)
        b.load_state_dict(a.state_dict())
        assert first + go(b, steps[cut:]) == full, cut
    old = {k: v for k, v in CalibratedClipping(**kw).state_dict().items() if k != "round"}
    CalibratedClipping(**kw).load_state_dict(old)  # a checkpoint from before rounds existed

    ranks = [CalibratedClipping(**kw) for _ in range(2)]
    for i, c in enumerate(ranks):
        for mb in step_data(400 + i, n_mb=3):
            c.observe(*mb, step=1)
    merged = CalibratedClipping.merge_rounds([c.state_dict() for c in ranks], max_tokens=kw["max_tokens"])
    union = torch.cat([c._data for c in ranks], 1)
    keys = torch.cat([c._keys for c in ranks])
    keep = torch.topk(keys, kw["max_tokens"], largest=False).indices.sort().values
    assert merged["step"] == 0 and torch.equal(merged["data"], union[:, keep])
    assert CalibratedClipping.merge_rounds([CalibratedClipping(**kw).state_dict()], 10) is None
    late = CalibratedClipping(**kw)
    late.observe(*step_data(401)[0], step=5)
    with pytest.raises(ValueError, match="different calibration rounds"):
        CalibratedClipping.merge_rounds([ranks[0].state_dict(), late.state_dict()], 100)


def test_controller_config_errors():
    with pytest.raises(ValueError, match="interval"):
        CalibratedClipping(eps_low=0.2, eps_high=0.2, interval=0)
    with pytest.raises(ValueError, match="ema"):
        CalibratedClipping(eps_low=0.2, eps_high=0.2, ema=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        CalibratedClipping(eps_low=0.2, eps_high=0.2, min_tokens=100, max_tokens=10)
    with pytest.raises(ValueError, match="init_lower"):
        CalibratedClipping(eps_low=0.2, eps_high=0.2, init_lower=1.2)
    with pytest.raises(ValueError, match="upper_mode"):
        CalibratedClipping(eps_low=0.2, eps_high=0.2, upper_mode="nope")
    with pytest.raises(ValueError, match=r"window \(6\) must be <= interval \(5\)"):
        CalibratedClipping(eps_low=0.2, eps_high=0.2, interval=5, window=6)
    with pytest.raises(ValueError, match="window"):
        CalibratedClipping(eps_low=0.2, eps_high=0.2, window=0)
    c = CalibratedClipping(eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match="advantages"):
        c.observe(torch.ones(2, 3), torch.ones(2, 3), torch.ones(3))


def test_two_gloo_ranks_get_identical_bounds_equal_to_single_process(gloo_results):
    (b0, m0), (b1, m1) = (r["calibration"] for r in gloo_results)
    shards = calibration_shards()
    assert b0 == b1 and m0 == m1
    kw = {k: v for k, v in CALIB_KW.items() if k != "max_tokens"}
    single = calibrate_bounds(*_flat_concat(shards[0] + shards[1]), **kw)
    assert b0 == (single.lower, single.upper)
    assert m0["calib/tokens"] == single.tokens
    assert m0["calib/lower_raw"] == pytest.approx(single.lower_raw)
    local = CalibratedClipping(**CALIB_KW)
    for mb in shards[0]:
        local.observe(*mb)
    local.update(0)
    assert local.bounds != b0  # one rank alone would have calibrated differently


def test_library_defaults_are_the_config_defaults():
    """``CalibratedClipping`` and ``calibrate_bounds`` (usable without our config) default to the values of
    the ``calibration`` config group, so a plug-in user and a CLI user get the same controller."""
    import dataclasses
    import inspect

    from nemo_fp8rl.algorithms.calibration import CalibratedClipping, calibrate_bounds
    from nemo_fp8rl.config.schema import AlgorithmConfig, CalibrationConfig

    config = {f.name: f.default for f in dataclasses.fields(CalibrationConfig)}
    config.update({f.name: f.default for f in dataclasses.fields(AlgorithmConfig) if f.name in ("eps_low", "eps_high")})
    checked = 0
    for fn in (CalibratedClipping.__init__, calibrate_bounds):
        for name, p in inspect.signature(fn).parameters.items():
            if name in config and p.default is not inspect.Parameter.empty:
                assert p.default == config[name], f"{fn.__qualname__}({name}={p.default!r}) but the config says {config[name]!r}"
                checked += 1
    assert checked >= 8, checked
