"""Supervised warm-up: stops at the target accuracy, records what it did, caches by content."""

import json

import torch

from nemo_fp8rl.config.schema import TrainConfig
from nemo_fp8rl.trainer import RLTrainer, run_warmup
from nemo_fp8rl.trainer.warmup import expected_sampled_accuracy


def _cfg(out, cache, **warmup):
    cfg = TrainConfig(output_dir=str(out), seed=5)
    cfg.warmup.cache_dir = str(cache)
    cfg.warmup.batch_size = 16
    for k, v in warmup.items():
        setattr(cfg.warmup, k, v)
    return cfg


def test_stops_at_target_and_caches(tmp_path):
    cfg = _cfg(tmp_path / "a", tmp_path / "cache", steps=40, eval_interval=4, eval_size=32, target_accuracy=1e-9)
    tr = RLTrainer(cfg)
    w = run_warmup(cfg, tr.model_cfg, tr.task)
    info = json.loads((tmp_path / "a" / "warmup.json").read_text())
    assert info["steps"] == 4 and info["cached"] is False and info["expected_sampled_accuracy"] >= 1e-9
    # same content -> the cache; a different target -> a different cache entry
    again = run_warmup(cfg, tr.model_cfg, tr.task)
    assert json.loads((tmp_path / "a" / "warmup.json").read_text())["cached"] is True
    assert all(torch.equal(w[k], again[k]) for k in w)
    cfg2 = _cfg(tmp_path / "b", tmp_path / "cache", steps=6, eval_interval=4, eval_size=32, target_accuracy=None)
    run_warmup(cfg2, tr.model_cfg, tr.task)
    info2 = json.loads((tmp_path / "b" / "warmup.json").read_text())
    assert info2["steps"] == 6 and info2["cached"] is False  # no target: all steps, checked at the end
    tr.close()  # the engine, the reward worker and the signal handlers


def test_expected_sampled_accuracy_is_the_probability_of_the_demonstration(tmp_path):
    cfg = _cfg(tmp_path / "c", tmp_path / "cache")
    tr = RLTrainer(cfg)
    tokens, mask = tr.task.warmup_examples(8, torch.Generator().manual_seed(0))
    logits_p = []
    logp, _ = tr.actor.get_logprobs(tokens)
    for b in range(8):  # product over the answer tokens of p(token), one sequence at a time
        p = 1.0
        for t in range(tokens.shape[1]):
            if mask[b, t]:
                p *= float(logp[b, t].exp())
        logits_p.append(p)
    assert abs(expected_sampled_accuracy(tr.actor, tokens, mask.float()) - sum(logits_p) / 8) < 1e-9
    tr.close()
