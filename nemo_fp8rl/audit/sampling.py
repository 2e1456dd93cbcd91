"""Responses sampled at high precision, reaching the lengths the audit measures (``audit.eos``).

``ignore``: the engine's sampling with ``stop_on_eos=False`` (vLLM's ``ignore_eos``). ``suppress``: the
EOS ids get probability 0 until a response has ``min_new_tokens`` tokens (vLLM's ``min_tokens``,
:attr:`~nemo_fp8rl.rollout.SamplingParams.min_tokens`), so the model has to go on with its answer (every
configuration scores those tokens alike; the teacher-forced log-probs keep EOS in the softmax). ``stop``:
the engine's own sampling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from nemo_fp8rl.rollout import RolloutBatch, SamplingParams

__all__ = ["sample_responses"]


def sample_responses(engine, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator,
                     *, min_new_tokens: int = 0) -> RolloutBatch:
    """One response per prompt from ``engine`` (the audit's high-precision engine), EOS suppressed for the
    first ``min_new_tokens`` tokens: ``engine.generate`` with ``params.min_tokens = min_new_tokens``."""
    return engine.generate(prompts, dataclasses.replace(params, min_tokens=max(int(min_new_tokens), 0)), generator)
