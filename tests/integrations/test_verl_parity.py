"""Where nemo_fp8rl.algorithms and verl 0.9.1 share a semantic, they give the same numbers.

PPO clip with dual clip and rollout weights in every shared aggregation mode with global counts, the KL
estimators, GRPO / Dr. GRPO advantages; checked against the real verl functions.
"""

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn, kl_penalty
from verl.workers.config import ActorConfig

from nemo_fp8rl.algorithms import grpo_advantages, ppo_clip_loss
from nemo_fp8rl.algorithms import kl_penalty as our_kl_penalty

SHARED_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _inputs(seed=0, B=6, T=10):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[0, :4], logp[0, :4] = -3.0, old[0, :4] + 1.4  # dual clip binds (ratio 4 > c = 3, A < 0)
    mask = (torch.arange(T)[None] < torch.tensor([10, 8, 1, 6, 10, 3])[:, None]).to(torch.float64)
    mask[2] = 0
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return old, logp.requires_grad_(True), adv, mask, w


@pytest.mark.parametrize("mode", SHARED_MODES)
def test_ppo_clip_loss_equals_verl_vanilla(mode):
    old, logp, adv, mask, w = _inputs()
    toks, seqs, horizon = 50, 9, 16  # global counts of a larger minibatch, constant horizon T
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
    )
    cfg.global_batch_info.update(
        dp_size=1, batch_num_tokens=toks, global_batch_size=seqs, loss_scale_factor=horizon
    )
    ref, _ = get_policy_loss_fn("vanilla")(old, logp, adv, mask, mode, cfg, w)
    ours, _ = ppo_clip_loss(
        logp,
        old,
        adv,
        mask,
        lower=0.8,
        upper=1.28,
        dual_clip=3.0,
        weights=w,
        agg_mode=mode,
        global_tokens=toks,
        global_seqs=seqs,
        norm_len=horizon,
    )
    (g_ref,) = torch.autograd.grad(ref, logp)
    (g_ours,) = torch.autograd.grad(ours, logp)
    torch.testing.assert_close(ours, ref, rtol=1e-7, atol=0)  # verl adds 1e-8 to per-sequence lengths
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize(("ours", "theirs"), [("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")])
def test_kl_estimators_equal_verl(ours, theirs):
    _, logp, _, _, _ = _inputs(1)
    ref_logp = logp.detach() + 0.5 * torch.randn(
        logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    clamp = {"input_clamp": 20.0, "output_clamp": 10.0} if ours == "k3" else {}
    torch.testing.assert_close(
        our_kl_penalty(logp, ref_logp, ours, **clamp),
        kl_penalty(logp, ref_logp, theirs),
        rtol=1e-12,
        atol=1e-15,
    )


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_equal_verl(norm_by_std):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (12,), generator=g).float()
    mask = torch.ones(12, 5)
    theirs, _ = compute_grpo_outcome_advantage(
        rewards[:, None] * torch.eye(5)[-1],
        mask,
        np.repeat(np.arange(3), 4),
        norm_adv_by_std_in_grpo=norm_by_std,
    )
    ours = grpo_advantages(rewards, group_size=4, norm_by_std=norm_by_std)
    torch.testing.assert_close(ours[:, None].expand(-1, 5), theirs, rtol=1e-6, atol=1e-6)
