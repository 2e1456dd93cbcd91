"""Next-token sampling: temperature, nucleus (top-p), greedy, and the log-prob of the sampled token.

Convention (vLLM's sampled log-probs, verl): the reported log-prob is ``log_softmax(logits / T)`` at the
sampled token, computed *before* the top-p cut. Top-p only decides which tokens may be drawn. So at
``T = 1`` the reported value is the policy's log-probability, which is what importance ratios against
the trainer need, and it does not depend on ``top_p``.

Drawing: the "exponential race" (also used by vLLM's sampler). With E_i ~ Exp(1) independent,
argmax_i p_i / E_i is distributed as Categorical(p) because E_i / p_i ~ Exp(p_i) and the smallest of
independent exponentials is index i with probability p_i / sum_j p_j. One noise tensor of fixed shape
[B, V] per step, drawn from the caller's ``torch.Generator``, makes sampling deterministic given the
seed, independent of where the logits were computed.
"""

from __future__ import annotations

import torch

__all__ = ["sample_next", "top_p_filter"]


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose total probability reaches ``top_p``; renormalise.

    Sort p descending; token at sorted rank j is kept iff the mass strictly before it,
    ``sum_{i<j} p_(i)``, is below ``top_p`` (so the top token is always kept and the kept mass is
    >= top_p). Shapes: probs [B, V] (rows sum to 1) -> [B, V] with zeros outside the nucleus, rows sum to 1.
    """
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return ``(tokens [B] int64, logp [B] float32)``.

    ``logits`` [B, V] (any float dtype; computed in float32). ``temperature == 0``: greedy argmax, logp =
    log_softmax(logits). Otherwise logp_all = log_softmax(logits / T), p = top_p_filter(exp(logp_all)),
    token = argmax(p / E) with E ~ Exp(1) of shape [B, V] drawn from ``generator`` (on its device).
    """
    x = logits.float()
    if temperature == 0:
        tok = x.argmax(dim=-1)
        logp_all = torch.log_softmax(x, dim=-1)
    else:
        logp_all = torch.log_softmax(x / temperature, dim=-1)
        probs = top_p_filter(logp_all.exp(), top_p)
        noise = torch.empty(x.shape, dtype=torch.float32, device=generator.device).exponential_(generator=generator)
        # Exp(1) can return exactly 0 in float32; p / 0 would pick a zero-probability token (0/0 = nan).
        noise = noise.clamp_min_(torch.finfo(torch.float32).tiny).to(x.device)
        tok = (probs / noise).argmax(dim=-1)
    return tok, logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
