"""Responses sampled at high precision, reaching the lengths the audit measures (``audit.eos``).

``ignore`` is the engine's own sampling with ``stop_on_eos=False`` (vLLM's ``ignore_eos``). ``suppress``
is the torch rollout engine's ``generate`` loop (prefill, then one token per step with its KV cache) with
one addition, vLLM's ``min_tokens``: the EOS ids get probability 0 until a response has ``min_new_tokens``
tokens, so the model has to go on with its answer (the tokens are then drawn from its distribution
conditioned on "not yet the end"; every configuration scores them alike, the teacher-forced log-probs keep
EOS in the softmax). ``stop``: ``min_new_tokens=0``, the engine's own sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_fp8rl.rollout import RolloutBatch, SamplingParams
from nemo_fp8rl.rollout.base import check_generate_inputs
from nemo_fp8rl.rollout.model import KVCache, forward_decode, forward_prefill
from nemo_fp8rl.rollout.sampling import sample_next

__all__ = ["sample_responses"]


@torch.no_grad()
def sample_responses(engine, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator,
                     *, min_new_tokens: int = 0) -> RolloutBatch:
    """Sample one response per prompt with a :class:`~nemo_fp8rl.rollout.torch_engine.TorchRolloutEngine`
    (the audit's high-precision engine), EOS suppressed for the first ``min_new_tokens`` tokens.

    ``min_new_tokens=0`` returns exactly ``engine.generate(prompts, params, generator)``.
    """
    if min_new_tokens <= 0:
        return engine.generate(prompts, params, generator)
    w = engine._w()
    shape, scheme, dev = engine.shape, engine.scheme, engine.device
    B, P, N, lens_list = check_generate_inputs(prompts, params, generator, shape.seq_length)
    lens = torch.tensor(lens_list, dtype=torch.long)
    tokens = torch.full((B, P + N), engine.pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    engine._check_ids(tokens[:, :P], "prompts")
    logp = torch.zeros((B, P + N), dtype=torch.float32)
    resp = torch.zeros(B, dtype=torch.long)
    eos = torch.tensor(engine.eos_ids, dtype=torch.long)
    eos_dev = eos.to(dev)
    cache = KVCache.empty(shape, B, P + N, dev, engine.dtype, kv=engine.kv)
    logits = forward_prefill(shape, w, scheme, tokens[:, :P].to(dev), lens.to(dev), cache)
    rows = torch.arange(B)
    for step in range(N):
        if step < min_new_tokens:
            logits = logits.float().index_fill(-1, eos_dev, float("-inf"))
        tok, lp = sample_next(logits, params.temperature, params.top_p, generator)
        tok_cpu = tok.cpu()
        pos = lens[rows] + step
        tokens[rows, pos] = tok_cpu
        logp[rows, pos] = lp.float().cpu()
        resp[rows] += 1
        if step == N - 1:
            break
        if params.stop_on_eos:
            done = torch.isin(tok_cpu, eos)
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                rows, pos = rows[keep], pos[keep]
                keep_dev = keep.to(dev)
                cache.select_rows(keep_dev)
                tok = tok[keep_dev]
        logits = forward_decode(shape, w, scheme, tok, pos.to(dev), cache)
    finished = torch.isin(tokens[torch.arange(B), lens + resp - 1], eos) if params.stop_on_eos else torch.zeros(B, dtype=torch.bool)
    return RolloutBatch.from_padded(tokens, lens, resp, logp, finished)
