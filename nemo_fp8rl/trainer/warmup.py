"""Supervised warm-up: teach the task's format (and some of its answers) before RL.

RL on a verifiable task needs a policy that is right part of the time; a randomly initialised tiny
model never is. The warm-up trains with token-level cross-entropy on the task's demonstrations in
high precision (FP8 off, a fresh AdamW), exactly as every arm of a comparison would start from the
same SFT checkpoint, and stops when the policy reaches ``warmup.target_accuracy`` (so every seed
starts RL from a comparable policy). The result is cached by a hash of everything that shapes it, so
the bf16, fp8 and fp8_calibrated arms of one seed start from the same weights and pay for it once.

    loss = - sum_t m_t log p(x_t | x_<t) / sum_t m_t      (m = 1 on the response tokens)
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import time
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.algorithms import make_metric, metrics_to_floats
from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.config.schema import TrainConfig
from nemo_fp8rl.trainer.atomic_publish import atomic_write_bytes

logger = logging.getLogger(__name__)


def sft_loss(mb, logprobs, entropy, *, global_tokens, global_seqs):
    """Token-mean negative log-likelihood over the minibatch (normalised by its global token count)."""
    m = mb["mask"]
    loss = -(logprobs * m).sum() / global_tokens.clamp(min=1)
    return loss, {"warmup/nll": make_metric(loss.detach(), "sum"),
                  "warmup/entropy": make_metric((entropy.detach() * m).sum() / global_tokens.clamp(min=1), "sum")}


def expected_sampled_accuracy(actor, tokens: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> float:
    """Probability that sampling reproduces the demonstrations, averaged over them.

        acc = mean_b exp( sum_t m_bt log p_T(x_bt | x_b,<t) )

    tokens [B, T] (prompt + demonstrated response), mask [B, T] (1 on the response, EOS included).
    For a task whose correct response is unique (the arithmetic task's zero-padded answer) this is
    exactly the expected exact-match accuracy of sampling at temperature T; otherwise a lower bound.
    One teacher-forced forward, no generation.
    """
    logp, _ = actor.get_logprobs(tokens, temperature=temperature)
    return float(torch.exp((logp * mask).sum(-1)).mean())


def warmup_key(cfg: TrainConfig, model_cfg: ModelConfig) -> str:
    """Hash of what determines the warmed-up weights (layout included: TP changes float summation)."""
    blob = json.dumps({
        "model": dataclasses.asdict(model_cfg), "task": dataclasses.asdict(cfg.task),
        "warmup": {k: v for k, v in dataclasses.asdict(cfg.warmup).items() if k not in ("cache", "cache_dir")},
        "parallel": dataclasses.asdict(cfg.parallel), "seed": cfg.seed, "temperature": cfg.rollout.temperature,
        "version": 2,
    }, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_warmup(cfg: TrainConfig, model_cfg: ModelConfig, task) -> Optional[Dict[str, torch.Tensor]]:
    """Warmed-up weights (Hugging Face naming, full tensors) or None when ``warmup.steps == 0``.

    Writes ``<output_dir>/warmup.json`` (steps run, expected sampled accuracy, seconds, cache file).
    """
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.models.hf_load import load_hf_policy

    w = cfg.warmup
    if w.steps == 0:
        return None
    path = Path(w.cache_dir) / f"warmup-{warmup_key(cfg, model_cfg)}.pt"
    if w.cache and path.is_file():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            logger.info("warm-up: reusing %s (%s)", path, blob["info"])
            _write_info(cfg, dict(blob["info"], cached=True))
            return blob["weights"]
        except Exception as e:  # noqa: BLE001  (a corrupt cache entry is recomputed, not fatal)
            logger.warning("warm-up cache %s unreadable (%s); recomputing", path, e)
    t0 = time.time()
    build = load_hf_policy if model_cfg.hf_path else build_actor  # SFT starts from the checkpoint
    actor = build(model_cfg, cfg.parallel, fp8_recipe=None, seed=cfg.seed, lr=w.lr,
                  grad_clip=cfg.optim.grad_clip, fp8_backend=cfg.fp8.backend)
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + 1 + actor.dp_rank)
    # the same held-out demonstrations on every rank (the check's decision must agree across ranks)
    eval_tokens, eval_mask = task.warmup_examples(w.eval_size, torch.Generator().manual_seed(cfg.seed * 7919 + 2))
    eval_mask = eval_mask.float()
    steps, acc = 0, None
    for s in range(w.steps):
        tokens, mask = task.warmup_examples(w.batch_size, gen)
        m = actor.train_step({"tokens": tokens, "mask": mask.float()}, sft_loss)
        steps = s + 1
        if steps % w.eval_interval == 0 or steps == w.steps:
            acc = expected_sampled_accuracy(actor, eval_tokens, eval_mask, cfg.rollout.temperature)
            f = metrics_to_floats(m)
            logger.info("warm-up %d/%d nll %.4f entropy %.4f expected sampled accuracy %.3f", steps, w.steps,
                        f["warmup/nll"], f["warmup/entropy"], acc)
            if w.target_accuracy is not None and acc >= w.target_accuracy:
                break
    if w.target_accuracy is not None and (acc is None or acc < w.target_accuracy):
        logger.warning("warm-up: %d steps reached accuracy %.3f < warmup.target_accuracy=%s; RL starts from it",
                       steps, acc if acc is not None else float("nan"), w.target_accuracy)
    info = {"steps": steps, "expected_sampled_accuracy": acc, "seconds": round(time.time() - t0, 1),
            "cache_file": str(path)}
    weights = actor.export_weights()
    rank = dist.get_rank() if dist.is_initialized() else 0
    _write_info(cfg, dict(info, cached=False))
    if w.cache and rank == 0:
        buf = io.BytesIO()
        torch.save({"weights": weights, "info": info}, buf)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, buf.getvalue())
        except OSError as e:  # a cache is an optimisation: the run goes on without it
            logger.warning("warm-up cache not written to %s (%s); the run continues", path, e)
    logger.info("warm-up: %s", info)
    del actor
    return weights


def _write_info(cfg: TrainConfig, info: dict) -> None:
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(cfg.output_dir) / "warmup.json", json.dumps(info, indent=1).encode())
