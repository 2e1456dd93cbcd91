"""Token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

With tensor parallelism each rank holds the logits of a contiguous vocabulary slice
[start, start + V_r) (megatron's ``VocabParallelEmbedding``/``ColumnParallelLinear`` layout). For
logits z [..., V] split that way, the target token y and the true (unpadded) vocabulary size V*:

    m       = max_j z_j                                  (all-reduce MAX)
    S       = sum_j exp(z_j - m)                         (all-reduce SUM)
    lse     = m + log S
    logp_y  = z_y - lse                                  (z_y: all-reduce SUM of the owning rank's value)
    H       = lse - sum_j p_j z_j,  p_j = exp(z_j - lse)  (all-reduce SUM)

Columns j >= V* (megatron's vocabulary padding) are excluded (p_j = 0). The two SUM reductions are
fused into one collective, so a call costs two all-reduces of [..., 3] floats, not a gather of
[..., V]. Backward is local to each rank's slice (no communication):

    d logp_y / d z_j = 1[j = y] - p_j
    d H / d z_j      = p_j (E_p[z] - z_j)

Everything runs in float32 regardless of the logits' dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, with_entropy):
        # logits [N, Vr] float32, target [N] long
        n, vr = logits.shape
        cols = torch.arange(vr, device=logits.device) + vocab_start
        valid = cols < vocab_size  # [Vr]
        z = logits.masked_fill(~valid, float("-inf"))
        m = z.max(dim=-1).values if vr > 0 else logits.new_full((n,), float("-inf"))
        if _size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - m[:, None])  # padded columns -> 0
        local_t = target - vocab_start
        owns = (local_t >= 0) & (local_t < vr)
        idx = local_t.clamp(0, max(vr - 1, 0))
        z_t = torch.where(owns, z.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(m)) if vr > 0 \
            else torch.zeros_like(m)
        z_valid = torch.where(valid, z, torch.zeros_like(z))
        parts = [e.sum(-1), z_t]
        if with_entropy:
            parts.append((e * z_valid).sum(-1))  # sum_j exp(z_j - m) z_j; divided by S below
        sums = torch.stack(parts, dim=-1)
        if _size(group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        s = sums[:, 0]
        lse = m + torch.log(s)
        logp = sums[:, 1] - lse
        p = e / s[:, None]
        if with_entropy:
            ez = sums[:, 2] / s  # E_p[z]
            entropy = lse - ez
            ctx.save_for_backward(p, idx, owns, z_valid, ez)
        else:
            entropy = torch.zeros_like(logp)
            ctx.save_for_backward(p, idx, owns)
        ctx.with_entropy = with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        if ctx.with_entropy:
            p, idx, owns, z_valid, ez = ctx.saved_tensors
        else:
            p, idx, owns = ctx.saved_tensors
        grad = -p * g_logp[:, None]
        if p.shape[1] > 0:
            onehot_g = torch.where(owns, g_logp, torch.zeros_like(g_logp))
            grad.scatter_add_(1, idx[:, None], onehot_g[:, None])
        if ctx.with_entropy and g_ent is not None:
            grad = grad + g_ent[:, None] * p * (ez[:, None] - z_valid)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    group: "dist.ProcessGroup | None" = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of ``target`` and (optionally) the entropy, from this rank's vocabulary slice.

    Args:
        logits: [..., V_r] logits of vocabulary columns [vocab_start, vocab_start + V_r) (any float
            dtype; computed in float32). Divide by the sampling temperature before calling.
        target: [...] token ids in the full vocabulary.
        vocab_start: first global column held by this rank.
        vocab_size: true vocabulary size V*; columns >= V* are padding and excluded (None = no padding).
        group: the tensor-parallel group the vocabulary is split over (None = not split).
        with_entropy: also return H = -sum_j p_j log p_j.

    Returns:
        ``(logp [...], entropy [...] or None)`` in float32, differentiable w.r.t. ``logits``.
    """
    lead = target.shape
    z = logits.reshape(-1, logits.shape[-1]).float()
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1] if _size(group) == 1 else None
        if vocab_size is None:
            raise ValueError("vocab_size is required when the vocabulary is split over a group")
    logp, ent = _VocabParallelLogprobEntropy.apply(
        z, target.reshape(-1), int(vocab_start), int(vocab_size), group, bool(with_entropy)
    )
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)


def token_logprobs_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    group=None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-position log-probs aligned to ``tokens`` (our batch convention).

    logits: [B, T, V_r] where position t predicts token t + 1; tokens: [B, T].
    Returns logprobs [B, T] with ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])`` for t >= 1
    and column 0 set to 0, and the entropy [B, T] of the distribution that predicts token t (column 0
    = 0), both float32. ``temperature`` divides the logits first (verl convention).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    z = logits[:, :-1].float()
    if temperature != 1.0:
        z = z / temperature
    lp, ent = vocab_parallel_logprobs(
        z, tokens[:, 1:], vocab_start=vocab_start, vocab_size=vocab_size, group=group, with_entropy=with_entropy
    )
    pad = lp.new_zeros(lp.shape[0], 1)
    lp = torch.cat([pad, lp], dim=1)
    if ent is not None:
        ent = torch.cat([pad, ent], dim=1)
    return lp, ent


__all__ = ["vocab_parallel_logprobs", "token_logprobs_from_logits"]
