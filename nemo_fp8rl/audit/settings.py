"""The audit's own keys (``audit.*``) next to the trainer's whole config.

``nemo-fp8rl-audit`` composes the trainer's Hydra config (``nemo_fp8rl/conf/config.yaml``, the same groups
and overrides as ``nemo-fp8rl-train``) with one more section, ``audit``, whose keys and defaults live here
(:class:`AuditConfig`). Everything else comes from the trainer's keys: the model (``model=...``,
``model.hf_path``), the prompts (``task=...``), the training recipe (``fp8=...``, ``fp8.backend``), the
rollout's FP8 (``rollout.fp8.*``), the clip range (``algorithm.eps_low`` / ``eps_high``), the sampling
temperature and top-p (``rollout.*``), the guards of Calibrated Clipping (``calibration.lower_min``), the seed
and ``trainer.cpu_threads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from nemo_fp8rl.config.schema import ConfigError, TrainConfig

__all__ = ["AuditConfig", "AuditRunConfig", "check_audit_config"]


@dataclass
class AuditConfig:
    """``audit.*``: what the audit samples, compares and reports (docs/audit.md)."""

    configs: Optional[List[str]] = None
    """FP8 configurations to compare against high precision (names in nemo_fp8rl/audit/configs.py, e.g.
    [linear,kv_static,kv_calibrated,kv_calibrated+edge,train:blockwise]); null = that rollout ladder, plus
    `train` (the fp8= recipe through the trainer's model) when fp8 is not off."""
    prompts: int = 6
    """Prompts drawn from the task (or the first N lines of audit.prompts_file); 6 x 512 tokens keep
    model=smollm2_135m under 10 minutes on 2 CPU cores shared with other work."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt."""
    prompts_file: Optional[str] = None
    """JSONL file of prompts (one object per line with audit.prompt_key) instead of the task's prompts."""
    prompt_key: str = "prompt"
    """Field of each audit.prompts_file line that holds the prompt text."""
    chat_template: bool = True
    """audit.prompts_file: wrap each prompt in the tokenizer's chat template (when it has one)."""
    response_len: int = 512
    """Most response tokens sampled per prompt (model.seq_length is raised to fit the prompt + this)."""
    eos: str = "ignore"
    """What the end-of-turn token does while sampling: ignore (sampled like any token, the response goes on:
    vLLM's ignore_eos, how benchmarks get long responses; a chat model then writes new turns, text it finds
    likely) | suppress (never sampled before audit.response_len: vLLM's min_tokens; a small model at
    temperature 1 drifts into improbable text) | stop (the model's own stopping and rollout.stop's strings, response
    lengths as in training)."""
    position_buckets: List[int] = field(default_factory=lambda: [0, 32, 64, 128, 256, 512])
    """Response-position bucket starts for mismatch against length (the last bucket is open-ended)."""
    rank_config: Optional[str] = None
    """Configuration whose layers are ranked (one layer at a time in high precision); null = the rollout
    configuration with the most in FP8 and no edge layers (the last of ties, e.g. kv_calibrated)."""
    rank_layers: Optional[List[int]] = None
    """Decoder layers to rank; null = all; [] = no ranking."""
    rank_sequences: int = 2
    """Sequences the layer ranking scores (the first ones sampled)."""
    rank_response_len: int = 128
    """Response tokens per sequence the layer ranking scores."""
    calib_alphas: List[float] = field(default_factory=lambda: [0.001, 0.01, 0.05])
    """BF16 clip rates for which the Calibrated Clipping lower bound is reported (audit docs: lower_at_alpha)."""
    max_extra_clip: float = 0.005
    """Recommendation: a configuration with more in FP8 is preferred while its pure-noise clip share is at
    most this much above the lowest one audited."""
    calibrate_above: float = 0.001
    """Recommendation: calibration=paper when the chosen rollout's pure-noise share below 1 - eps_low exceeds this."""
    score_batch: int = 4
    """Sequences per scoring forward (bounds the [rows, T, vocab] logits held at once)."""
    kv_kernel: str = "cuda"
    """Which vLLM FP8 KV-cache writer the torch engine emulates: cuda (vLLM on GPUs) | cpu (vLLM-CPU)."""
    out: Optional[str] = None
    """Report directory; null = <output_dir>/audit."""


@dataclass
class AuditRunConfig(TrainConfig):
    """The trainer's config plus ``audit`` (Hydra registers it as the trainer's schema for this CLI)."""

    audit: AuditConfig = field(default_factory=AuditConfig)


def check_audit_config(a: AuditConfig) -> AuditConfig:
    """Reject ``audit.*`` values that cannot work, naming the key and the fix."""

    def pos_int(key: str, v, low: int = 1) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"audit.{key}={v!r} must be an integer >= {low}")

    pos_int("prompts", a.prompts)
    pos_int("samples_per_prompt", a.samples_per_prompt)
    pos_int("response_len", a.response_len)
    pos_int("rank_sequences", a.rank_sequences)
    pos_int("rank_response_len", a.rank_response_len)
    pos_int("score_batch", a.score_batch)
    if a.eos not in ("ignore", "suppress", "stop"):
        raise ConfigError(f"audit.eos={a.eos!r} is not valid; choose one of ['ignore', 'suppress', 'stop']")
    b = list(a.position_buckets)
    if not b or b[0] != 0 or any(not isinstance(x, int) or isinstance(x, bool) for x in b) or b != sorted(set(b)):
        raise ConfigError(f"audit.position_buckets={b} must be increasing integers starting at 0, e.g. [0,64,128,256]")
    if any(not (isinstance(x, (int, float)) and 0.0 < x < 1.0) for x in a.calib_alphas):
        raise ConfigError(f"audit.calib_alphas={list(a.calib_alphas)} must be fractions in (0, 1), e.g. [0.01,0.05]")
    for key in ("max_extra_clip", "calibrate_above"):
        v = getattr(a, key)
        if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
            raise ConfigError(f"audit.{key}={v!r} must be a fraction in [0, 1)")
    if a.kv_kernel not in ("cuda", "cpu"):
        raise ConfigError(f"audit.kv_kernel={a.kv_kernel!r} is not valid; choose one of ['cuda', 'cpu']")
    if a.rank_layers is not None and any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                                         for x in a.rank_layers):
        raise ConfigError(f"audit.rank_layers={list(a.rank_layers)} must be decoder layer indices >= 0 "
                          "(null = all layers, [] = no ranking)")
    if a.configs is not None and (not isinstance(list(a.configs), list) or not list(a.configs)):
        raise ConfigError("audit.configs=[] names no configuration; give at least one, e.g. audit.configs=[linear], "
                          "or null for the default ladder")
    return a
