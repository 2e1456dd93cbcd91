"""verl's ``calibrated_clip`` policy loss and the shadow-ratio hook, runnable on a CPU with the real verl.

    .venv/bin/python examples/verl_calibrated_clip.py      # needs verl importable (make install does it)

What a verl Megatron actor does per PPO step, on a toy bigram policy with emulated FP8 (``tensorwise``):
the loss is looked up in verl's registry by ``actor.policy_loss.loss_mode`` and called as verl's
``ppo_loss`` calls it; at calibration steps :class:`~nemo_fp8rl.integrations.verl.ShadowRatioHook` runs
the BF16 shadow forwards (FP8 off, same weights) and updates the controller the loss reads.
docs/integrations.md shows where these calls go in verl's ``TrainingWorker.train_mini_batch``.
"""

from __future__ import annotations

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

import nemo_fp8rl.integrations.verl as calibrated  # registers "calibrated_clip"
from nemo_fp8rl.algorithms import CalibratedClipping, grpo_advantages, metrics_to_floats
from nemo_fp8rl.fp8 import convert_to_fp8, get_recipe

VOCAB, PROMPT, RESPONSE, TARGET = 16, 4, 12, 3


def bigram_policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, VOCAB)
    )


def response_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[B, RESPONSE]`` log-probs of the response tokens (verl's ``log_prob`` layout), with the graph."""
    logp = torch.log_softmax(model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp[:, PROMPT - 1 :]


def run(steps: int = 6, interval: int = 2, seed: int = 0, verbose: bool = True) -> list[dict]:
    model = convert_to_fp8(bigram_policy(seed), get_recipe("tensorwise"))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    config = ActorConfig(  # verl's actor config: actor_rollout_ref.actor.*
        strategy="megatron",
        rollout_n=8,
        ppo_mini_batch_size=16,
        ppo_micro_batch_size_per_gpu=8,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(loss_mode="calibrated_clip"),
    )
    controller = CalibratedClipping(eps_low=0.2, eps_high=0.28, interval=interval, min_tokens=32)
    calibrated.set_calibration(controller)  # the controller this worker process's loss reads
    hook = calibrated.ShadowRatioHook(controller, model)  # verl Megatron: the actor's list of model chunks
    policy_loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)
    lp_fn = lambda ids: response_logprobs(model, ids).detach()  # noqa: E731  (verl: compute_log_prob)
    gen = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        with torch.no_grad():  # rollout (the toy samples from the trainer itself)
            ids = torch.randint(0, VOCAB, (8, PROMPT), generator=gen).repeat_interleave(8, 0)
            for _ in range(RESPONSE):
                probs = torch.softmax(model(ids[:, -1:]).float()[:, -1], -1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
        reward = (ids[:, PROMPT:] == TARGET).float().mean(-1)
        adv = grpo_advantages(reward, group_size=8)[:, None].expand(-1, RESPONSE).contiguous()
        mask = torch.ones_like(adv)
        old = lp_fn(ids)  # old_log_prob pass
        calibrating = hook.should_calibrate(step)
        hp_old = hook.old_pass(lp_fn, ids) if calibrating else None
        metrics = {}
        for rows in torch.arange(ids.shape[0]).chunk(4):  # PPO minibatches
            if calibrating:
                hook.observe_minibatch(
                    lp_fn,
                    ids[rows],
                    old_log_prob=old[rows],
                    hp_old_log_prob=hp_old[rows],
                    advantages=adv[rows],
                    response_mask=mask[rows],
                    step=step,
                )
            config.global_batch_info.update(
                dp_size=1, batch_num_tokens=int(mask[rows].sum()), global_batch_size=None
            )
            opt.zero_grad()
            loss, metrics = policy_loss_fn(
                old_log_prob=old[rows],
                log_prob=response_logprobs(model, ids[rows]),
                advantages=adv[rows],
                response_mask=mask[rows],
                loss_agg_mode=config.loss_agg_mode,
                config=config,
                rollout_is_weights=None,
            )
            loss.backward()
            opt.step()
        if calibrating:
            metrics.update(metrics_to_floats(hook.update(step)))  # group=the DP group in a real actor
        metrics["reward"] = reward.mean().item()
        history.append(metrics)
        if verbose:
            print(
                f"step {step}: reward {metrics['reward']:.3f} bounds in force "
                f"{metrics['actor/clip_lower']:.3f}/{metrics['actor/clip_upper']:.3f} "
                f"pg_clipfrac {metrics['actor/pg_clipfrac']:.3f}"
                f" low_frac {metrics['actor/clip_low_frac']:.3f}"
                + (f"  calib: tokens {metrics['calib/tokens']:.0f}" if calibrating else "")
            )
    return history


if __name__ == "__main__":
    run()
