"""Next-token sampling: temperature, nucleus (top-p), greedy, and the log-prob of the sampled token.

Convention (:class:`~nemo_fp8rl.rollout.base.SamplingParams`; vLLM's ``processed_logprobs``): the reported
log-prob is that of the sampled token under the distribution it was drawn from, after temperature and
the top-p cut, renormalised over the nucleus K: ``log_softmax(logits / T)[tok] - log sum_{j in K} q_j``
with ``q = softmax(logits / T)``. That distribution is the behaviour policy which TIS / IcePop correct
for. With ``top_p = 1`` it is ``log_softmax(logits / T)``, at ``T = 1`` the policy's log-probability.

Drawing: the "exponential race" (also used by vLLM's sampler). With E_i ~ Exp(1) independent,
argmax_i p_i / E_i is distributed as Categorical(p) because E_i / p_i ~ Exp(p_i) and the smallest of
independent exponentials is index i with probability p_i / sum_j p_j. One noise tensor of fixed shape
[B, V] per step, drawn from the caller's ``torch.Generator``, makes sampling deterministic given the
seed, independent of where the logits were computed.
"""

from __future__ import annotations

import torch

__all__ = ["sample_next", "top_p_filter", "top_p_mask"]


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus: the smallest set of most probable tokens whose total probability reaches ``top_p``.

    Sort p descending; token at sorted rank j is kept iff the mass strictly before it,
    ``sum_{i<j} p_(i)``, is below ``top_p`` (so the top token is always kept and the kept mass is
    >= top_p; vLLM's rule). Shapes: probs [B, V] (rows sum to 1) -> bool [B, V].
    """
    if top_p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the probabilities outside the nucleus (:func:`top_p_mask`) and renormalise.

    Shapes: probs [B, V] (rows sum to 1) -> [B, V] with zeros outside the nucleus, rows sum to 1.
    """
    if top_p >= 1.0:
        return probs
    kept = probs * top_p_mask(probs, top_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return ``(tokens [B] int64, logp [B] float32)``.

    ``logits`` [B, V] (any float dtype; computed in float32). ``temperature == 0``: greedy argmax, logp =
    log_softmax(logits). Otherwise logp_all = log_softmax(logits / T), K = top_p_mask(exp(logp_all)),
    p = exp(logp_all) on K renormalised, token = argmax(p / E) with E ~ Exp(1) of shape [B, V] drawn from
    ``generator`` (on its device), logp = logp_all[token] - log sum_{j in K} exp(logp_all_j) (the log of
    p[token], computed without the rounding of the renormalised p).
    """
    x = logits.float()
    if temperature == 0:
        tok = x.argmax(dim=-1)
        logp_all = torch.log_softmax(x, dim=-1)
    else:
        logp_all = torch.log_softmax(x / temperature, dim=-1)
        probs = logp_all.exp()
        if top_p < 1.0:
            keep = top_p_mask(probs, top_p)
            kept = probs * keep
            probs = kept / kept.sum(dim=-1, keepdim=True)
            # renormalise the log-probs over the nucleus (the distribution the token is drawn from)
            logp_all = logp_all - torch.logsumexp(logp_all.masked_fill(~keep, float("-inf")), dim=-1, keepdim=True)
        noise = torch.empty(x.shape, dtype=torch.float32, device=generator.device).exponential_(generator=generator)
        # Exp(1) can return exactly 0 in float32; p / 0 would pick a zero-probability token (0/0 = nan).
        noise = noise.clamp_min_(torch.finfo(torch.float32).tiny).to(x.device)
        tok = (probs / noise).argmax(dim=-1)
    return tok, logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
