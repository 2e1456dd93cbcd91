"""The audit's statistics on hand-made tensors: each value checked against arithmetic done by hand."""

import math

import pytest
import torch

from nemo_fp8rl.audit import stats

EPS = dict(eps_low=0.2, eps_high=0.28)


def _one_row(ref, cfg, mask=None):
    ref = torch.tensor([ref], dtype=torch.float32)
    cfg = torch.tensor([cfg], dtype=torch.float32)
    mask = torch.ones_like(ref) if mask is None else torch.tensor([mask], dtype=torch.float32)
    return ref, cfg, mask


def test_token_mult_prob_error_is_nemo_rls_rule():
    """NeMo RL: masked_mean(exp(|gen - prev| * mask), mask) = sum(exp(|d| m) m) / (sum(m) + 1e-8): masked
    tokens (here |d| = 5) do not count; 1 means no mismatch."""
    gen, prev, mask = _one_row([-1.0, -2.0, -3.0], [-1.1, -1.8, 2.0], [1, 1, 0])
    want = (math.exp(0.1) + math.exp(0.2)) / (2 + 1e-8)
    assert stats.token_mult_prob_error(gen, prev, mask) == pytest.approx(want, rel=1e-6)
    assert stats.token_mult_prob_error(gen, gen, mask) == pytest.approx(1.0 / (1 + 5e-9), rel=1e-12)


def test_kl_k3_by_hand():
    """k3 = mean(exp(lr) - 1 - lr), lr = other - sampler."""
    ref, cfg, mask = _one_row([-0.5, -1.0], [-0.5 + 0.3, -1.0 - 0.1])
    want = ((math.exp(0.3) - 1 - 0.3) + (math.exp(-0.1) - 1 + 0.1)) / 2
    assert stats.kl_k3(ref, cfg, mask) == pytest.approx(want, rel=1e-6)


def test_identical_configurations_give_zero_mismatch_and_no_noise_clips():
    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(3, 20, generator=g) * 4
    mask = (torch.rand(3, 20, generator=g) > 0.3).float()
    pos = torch.arange(20).expand(3, 20) - 5
    for side in ("rollout", "train"):
        r = stats.config_stats(ref.clone(), ref, mask, side=side, response_pos=pos, position_buckets=[0, 4, 8], **EPS)
        assert r["tokens"] == int(mask.sum())
        assert r["mean_abs_dlogp"] == 0 and r["max_abs_dlogp"] == 0 and r["kl"] == 0
        assert r["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-7)
        assert r["noise_clip"] == r["noise_clip_low"] == r["noise_clip_high"] == 0
        assert all(b.get("noise_clip", 0) == 0 for b in r["by_prob_decile"] + r["by_position"])
        cal = stats.calibration_bounds(torch.zeros_like(ref), mask, alphas=[0.1], lower_min=0.5, upper_max=3.0, **EPS)
        assert cal["lower_onpolicy_raw"] == 1.0 and cal["lower_onpolicy"] == pytest.approx(0.8)


def test_noise_clips_side_and_bounds_by_hand():
    """d = logp_cfg - logp_ref. Rollout side: r = exp(-d); train side: r = exp(d). Bounds [0.8, 1.28]."""
    d = [math.log(0.7), math.log(0.9), math.log(1.3), math.log(1.24), 0.0]
    ref, cfg, mask = _one_row([-1.0] * 5, [-1.0 + x for x in d])
    pos = torch.arange(5).unsqueeze(0)
    tr = stats.config_stats(cfg, ref, mask, side="train", response_pos=pos, position_buckets=[0], **EPS)
    assert (tr["noise_clip_low"], tr["noise_clip_high"], tr["noise_clip"]) == pytest.approx((1 / 5, 1 / 5, 2 / 5))
    ro = stats.config_stats(cfg, ref, mask, side="rollout", response_pos=pos, position_buckets=[0], **EPS)
    # r = 1/0.7 = 1.43 (high), 1/0.9, 1/1.3 = 0.77 (low), 1/1.24 = 0.81, 1
    assert (ro["noise_clip_low"], ro["noise_clip_high"]) == pytest.approx((1 / 5, 1 / 5))
    assert tr["mean_abs_dlogp"] == pytest.approx(sum(abs(x) for x in d) / 5, rel=1e-6)


def test_probability_deciles_and_position_buckets_split_tokens_by_hand():
    # p_ref = 0.05, 0.15, 0.95, 0.95 -> bins 0, 1, 9, 9; positions 0, 1, 2, 40 -> buckets 0-1, 0-1, 2-31, 32+
    ref = torch.log(torch.tensor([[0.05, 0.15, 0.95, 0.95]]))
    cfg = ref + torch.tensor([[math.log(1.5), 0.0, 0.0, math.log(0.5)]])
    mask = torch.ones_like(ref)
    pos = torch.tensor([[0, 1, 2, 40]])
    r = stats.config_stats(cfg, ref, mask, side="train", response_pos=pos, position_buckets=[0, 2, 32], **EPS)
    dec = {b["p_ref"]: b for b in r["by_prob_decile"]}
    assert dec["0.0-0.1"]["tokens"] == 1 and dec["0.0-0.1"]["noise_clip"] == 1.0
    assert dec["0.1-0.2"]["tokens"] == 1 and dec["0.1-0.2"]["noise_clip"] == 0.0
    assert dec["0.9-1.0"]["tokens"] == 2 and dec["0.9-1.0"]["noise_clip_low"] == 0.5
    assert sum(b["tokens"] for b in r["by_prob_decile"]) == 4
    pb = {b["positions"]: b for b in r["by_position"]}
    assert list(pb) == ["0-1", "2-31", "32+"]
    assert pb["0-1"]["tokens"] == 2 and pb["0-1"]["noise_clip"] == 0.5
    assert pb["2-31"]["tokens"] == 1 and pb["2-31"]["noise_clip"] == 0.0
    assert pb["32+"]["tokens"] == 1 and pb["32+"]["noise_clip"] == 1.0
    assert pb["32+"]["mean_abs_dlogp"] == pytest.approx(math.log(2), rel=1e-6)


def test_calibration_bounds_by_hand():
    """On-policy (rho = 1): L* = min r, clamped to [lower_min, 1 - eps_low]. At alpha: exactly
    floor(alpha N) ratios lie below L* = the k-th smallest r."""
    r = torch.tensor([[0.6, 0.7, 0.9, 1.0, 1.1, 0.95, 0.85, 1.05, 1.2, 0.99]])
    lr, mask = torch.log(r), torch.ones_like(r)
    out = stats.calibration_bounds(lr, mask, alphas=[0.1, 0.25], lower_min=0.5, upper_max=3.0, **EPS)
    assert out["lower_onpolicy_raw"] == pytest.approx(0.6) and out["lower_onpolicy"] == pytest.approx(0.6)
    a1 = out["lower_at_alpha"]["0.1"]
    assert a1["alpha_bf16"] == pytest.approx(0.1) and a1["lower_raw"] == pytest.approx(0.7)  # 1 token (0.6) below
    a2 = out["lower_at_alpha"]["0.25"]  # floor(2.5) = 2 below: 0.6, 0.7 -> L* = 0.85 (clamped to 0.8)
    assert a2["lower_raw"] == pytest.approx(0.85) and a2["lower"] == pytest.approx(0.8)
    low = stats.calibration_bounds(torch.log(torch.tensor([[0.3, 0.9]])), torch.ones(1, 2), alphas=[], lower_min=0.5,
                                   upper_max=3.0, **EPS)
    assert low["lower_onpolicy_raw"] == pytest.approx(0.3) and low["lower_onpolicy"] == 0.5  # guard lower_min


def test_layer_ranking_orders_by_drop():
    rows = stats.layer_ranking(0.2, {0: 0.15, 1: 0.19, 2: 0.05, 3: 0.15})
    assert [r["layer"] for r in rows] == [2, 0, 3, 1]
    assert rows[0]["drop"] == pytest.approx(0.15) and rows[0]["drop_share"] == pytest.approx(0.75)


def test_shapes_must_match():
    with pytest.raises(ValueError, match="same shape"):
        stats.token_mult_prob_error(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))
