"""Outcome-reward advantage estimators (registry), DAPO dynamic sampling and overlong reward shaping.

Layout: ``rewards`` is a 1-D tensor ``[n_prompts * group_size]`` ordered prompt-major, i.e. the
``group_size`` responses of prompt 0 first, then those of prompt 1, ... Every estimator has the
signature ``(rewards, group_size, **kw) -> advantages [n]`` (one advantage per sequence; broadcast it
over the response tokens, the losses accept ``[batch]`` advantages directly).
"""

from __future__ import annotations

from typing import Protocol

import torch

from nemo_fp8rl.algorithms._common import check_number
from nemo_fp8rl.registry import Registry


class AdvantageEstimator(Protocol):
    def __call__(self, rewards: torch.Tensor, group_size: int, **kwargs: object) -> torch.Tensor: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.adv_estimator")


# the public functions of this registry: register (a decorator: ``@register_advantage_estimator("name")``), look up, list
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get
list_advantage_estimators = ADVANTAGE_ESTIMATORS.names


def group_rewards(rewards: torch.Tensor, group_size: int, *, min_group_size: int = 1) -> torch.Tensor:
    """Validate and reshape ``rewards [n_prompts * group_size]`` to ``[n_prompts, group_size]`` (float)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_group_size:
        raise ValueError(f"group_size must be an int >= {min_group_size}, got {group_size!r}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor [n_prompts * group_size], got {shape}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}; "
            f"pass all group_size responses of every prompt, prompt-major"
        )
    return rewards.float().reshape(-1, group_size)


@register_advantage_estimator("grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantage (Shao et al., DeepSeekMath, arXiv 2402.03300, section 4.1.2).

    A_i = (R_i - mean_g(R)) / (std_g(R) + eps) over the ``group_size`` responses of the same prompt,
    std with Bessel's correction (as TRL and verl). ``norm_by_std=False`` gives A_i = R_i - mean_g(R)
    (Dr. GRPO, arXiv 2503.20783). Shapes: ``[n_prompts * group_size]`` -> same. group_size >= 2.
    """
    g = group_rewards(rewards, group_size, min_group_size=2)
    centered = g - g.mean(dim=1, keepdim=True)
    if norm_by_std:
        centered = centered / (g.std(dim=1, keepdim=True) + check_number("eps", eps, low=0.0))
    return centered.reshape(-1)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740).

    A_i = R_i - (1/(G-1)) sum_{j != i} R_j = G/(G-1) (R_i - mean_g(R)), G = group_size >= 2.
    Shapes: ``[n_prompts * group_size]`` -> same.
    """
    g = group_rewards(rewards, group_size, min_group_size=2)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def dynamic_sampling_filter(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal (Yu et al., arXiv 2503.14476).

    A group with identical rewards has zero group-relative advantage and gives no gradient; DAPO
    over-samples and keeps only groups with 0 < accuracy < 1 (generalised here to: max_g R > min_g R).
    Refilling up to a batch cap (generate more, concatenate, truncate) is the trainer's loop.

    Args:
        rewards: ``[n_prompts * group_size]`` prompt-major.
        group_size: responses per prompt (>= 1).

    Returns:
        ``(keep_mask [n] bool per sequence, kept_frac 0-dim float)`` where kept_frac is the fraction of
        groups (= of sequences) kept.
    """
    g = group_rewards(rewards, group_size)
    keep_group = g.amax(dim=1) > g.amin(dim=1)
    keep = keep_group.repeat_interleave(group_size)
    kept_frac = keep_group.float().mean() if keep_group.numel() else torch.zeros((), device=g.device)
    return keep, kept_frac


def overlong_reward_shaping(
    response_lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al., arXiv 2503.14476, eq. 13), to ADD to the rewards.

    With L_max = ``max_len``, L_cache = ``buffer_len`` and |y| the response length::

        R_len(y) = 0                                  if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                                 if |y| > L_max

    and the returned penalty is ``penalty_factor * R_len`` (verl's ``overlong_penalty_factor``).
    ``buffer_len = 0`` keeps only the hard -1 beyond ``max_len``. Shapes: ``[n]`` -> ``[n]`` float.
    """
    if not isinstance(response_lengths, torch.Tensor) or response_lengths.dim() != 1:
        raise ValueError("response_lengths must be a 1-D tensor [n] of token counts")
    lmax = check_number("max_len", max_len, low=0, low_open=True)
    cache = check_number(
        "buffer_len", buffer_len, low=0, high=lmax, hint="buffer_len must lie in [0, max_len]"
    )
    factor = check_number("penalty_factor", penalty_factor, low=0.0)
    length = response_lengths.float()
    soft_start = lmax - cache
    if cache > 0:
        soft = (soft_start - length) / cache
    else:
        soft = torch.zeros_like(length)
    penalty = torch.where(length <= soft_start, torch.zeros_like(length), soft)
    penalty = torch.where(length > lmax, torch.full_like(length, -1.0), penalty)
    return factor * penalty
