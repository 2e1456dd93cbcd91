"""nemo_fp8rl.algorithms.push: the negative push and the tail mass, against hand-computed values."""

import math

import pytest
import torch

from nemo_fp8rl.algorithms import metrics_to_floats
from nemo_fp8rl.algorithms.push import PUSH_STATS, push_metrics, push_stats


def _case():
    # 2 sequences x 3 tokens; sequence 0 has A = -1 (negative), sequence 1 A = +2, its last token is padding
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -9.0]])
    d = torch.tensor([[-0.3, 0.1, -0.4], [0.2, 0.1, 7.0]])
    adv = torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return old + d, old, adv, mask, d


def test_push_hand_values():
    after, old, adv, mask, d = _case()
    out = metrics_to_floats(push_metrics(push_stats(after, old, adv, mask)))
    assert out["calib/neg_push"] == pytest.approx((-0.3 + 0.1 - 0.4) / 3, rel=1e-6)
    assert out["calib/pos_push"] == pytest.approx((0.2 + 0.1) / 2, rel=1e-6)  # the padded 7.0 is left out
    p_after = [math.exp(-1.3), math.exp(-0.4), math.exp(-2.4)]
    p_old = [math.exp(-1.0), math.exp(-0.5), math.exp(-2.0)]
    assert out["calib/neg_alt_mass"] == pytest.approx(sum(1 - p for p in p_after) / 3, rel=1e-6)
    assert out["calib/neg_alt_mass_gain"] == pytest.approx(
        sum(po - pa for po, pa in zip(p_old, p_after)) / 3, rel=1e-5)
    assert out["calib/neg_push_tokens"] == 3.0


def test_stats_sum_over_ranks_like_one_batch():
    """Two ranks' vectors summed give the metrics of their tokens together (what the DP all-reduce does)."""
    after, old, adv, mask, _ = _case()
    whole = metrics_to_floats(push_metrics(push_stats(after, old, adv, mask)))
    halves = push_stats(after[:1], old[:1], adv[:1], mask[:1]) + push_stats(after[1:], old[1:], adv[1:], mask[1:])
    split = metrics_to_floats(push_metrics(halves))
    assert split == pytest.approx(whole)
    assert push_stats(after, old, adv, mask).shape == (len(PUSH_STATS),)


def test_zero_advantage_tokens_count_nowhere_and_empty_sets_are_nan():
    after, old, _, mask, _ = _case()
    out = metrics_to_floats(push_metrics(push_stats(after, old, torch.zeros_like(old), mask)))
    assert math.isnan(out["calib/neg_push"]) and math.isnan(out["calib/pos_push"])
    assert math.isnan(out["calib/neg_alt_mass"]) and out["calib/neg_push_tokens"] == 0.0


def test_unchanged_weights_push_nothing():
    lp = -torch.rand(3, 4)
    adv = torch.tensor([[-1.0], [0.5], [-2.0]]).expand(3, 4)
    out = metrics_to_floats(push_metrics(push_stats(lp, lp.clone(), adv, None)))
    assert out["calib/neg_push"] == 0.0 and out["calib/pos_push"] == 0.0 and out["calib/neg_alt_mass_gain"] == 0.0
    assert out["calib/neg_alt_mass"] == pytest.approx(float((1 - lp.exp())[[0, 2]].mean()), rel=1e-6)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="hp_old_logp has shape"):
        push_stats(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), None)
    with pytest.raises(ValueError, match="shape"):
        push_metrics(torch.zeros(3))
