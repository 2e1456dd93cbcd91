import statistics

import pytest
import torch

from nemo_fp8rl.algorithms import (
    dynamic_sampling_filter,
    get_advantage_estimator,
    list_advantage_estimators,
    overlong_reward_shaping,
    register_advantage_estimator,
)


def test_registry():
    assert {"grpo", "rloo"} <= set(list_advantage_estimators())
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'.*grpo"):
        get_advantage_estimator("gae")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda r, g: r)


def test_grpo_hand_values_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 6.0])
    adv = get_advantage_estimator("grpo")(rewards, 4)
    expected = []
    for grp in (rewards[:4].tolist(), rewards[4:].tolist()):
        mu, sd = statistics.mean(grp), statistics.stdev(grp)
        expected += [(x - mu) / (sd + 1e-6) for x in grp]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert adv[:4].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    no_std = get_advantage_estimator("grpo")(rewards, 4, norm_by_std=False)
    torch.testing.assert_close(no_std, torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, -1.0, -1.0, 3.0]))


def test_grpo_identical_group_gives_zero():
    adv = get_advantage_estimator("grpo")(torch.tensor([3.0, 3.0, 3.0]), 3)
    assert adv.abs().max().item() == 0.0


def test_rloo_leave_one_out_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 4.0, 2.0])
    adv = get_advantage_estimator("rloo")(rewards, 3)
    # group 0: [1,0,0] -> 1-0, 0-0.5, 0-0.5 ; group 1: [1,4,2] -> 1-3, 4-1.5, 2-2.5
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, -2.0, 2.5, -0.5]))
    # equals G/(G-1) (R - mean)
    g = rewards.reshape(2, 3)
    torch.testing.assert_close(adv, (1.5 * (g - g.mean(1, keepdim=True))).reshape(-1))


def test_advantage_input_errors():
    fn = get_advantage_estimator("grpo")
    with pytest.raises(ValueError, match="multiple of group_size"):
        fn(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size"):
        fn(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="1-D"):
        fn(torch.zeros(2, 4), 4)


def test_dynamic_sampling_drops_identical_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.7])
    keep, kept_frac = dynamic_sampling_filter(rewards, 3)
    # groups: [1,1,1] drop ; [0,1,0] keep ; [0,0,0] drop ; [.5,.5,.7] keep
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert kept_frac.item() == pytest.approx(0.5) and kept_frac.dim() == 0
    keep1, frac1 = dynamic_sampling_filter(torch.tensor([1.0, 2.0]), 1)
    assert keep1.tolist() == [False, False] and frac1.item() == 0.0


def test_overlong_reward_shaping_piecewise():
    lengths = torch.tensor([10, 12, 16, 18, 20, 21])
    pen = overlong_reward_shaping(lengths, max_len=20, buffer_len=8, penalty_factor=1.0)
    # soft zone starts at 12: (12 - |y|) / 8
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0, -1.0]))
    torch.testing.assert_close(overlong_reward_shaping(lengths, 20, 8, 0.5), 0.5 * pen)
    hard = overlong_reward_shaping(lengths, max_len=20, buffer_len=0, penalty_factor=1.0)
    torch.testing.assert_close(hard, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_reward_shaping(lengths, 20, 30, 1.0)
    with pytest.raises(ValueError, match="max_len"):
        overlong_reward_shaping(lengths, 0, 0, 1.0)
