"""Accuracy of the RL starting policy sampled with BF16 vs FP8 rollout (issue 28: inference vs training).

The exploration's fixed-clip FP8 runs start below BF16 in their first steps already. Part of that gap can
be the FP8 rollout's sampling quality (the same weights, sampled through FP8 linears / KV cache) rather
than what FP8 does to training. This script separates the two at step 0: it builds the protocol's run of
``--regime`` / ``--condition`` at ``--seed`` exactly as ``run_study.py`` would (same overrides, same cached
warm-up), loads the warmed-up policy into its rollout engine, and samples ``--prompts`` held-out prompts x
``--samples`` responses per prompt twice: once with the BF16 arm's rollout (FP8 off) and once with the FP8
arm's. Both arms draw the same prompts and the same sampling generator seeds (common random numbers), so
the per-prompt difference is paired.

    python benchmarks/study/rollout_accuracy.py --regime lr1e-5_easy --condition tensorwise --prompts 128

Output: per arm the accuracy (mean reward), the well-formed share and the mean response length; the paired
difference FP8 - BF16 with a 95% bootstrap interval over prompts. ``--json`` writes the numbers too.

    acc_arm = (1 / (P S)) sum_p sum_s correct[p, s]
    diff_p = mean_s correct_fp8[p, s] - mean_s correct_bf16[p, s],   diff = mean_p diff_p
    CI: 2.5 / 97.5 percentiles of the mean of P prompts resampled with replacement (``--boot`` times)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_study  # (after the sys.path insert) the protocol's tables: PROTOCOL_BASE, SWEEP, EXPLORE, PROTOCOL_ARMS)

HELD_OUT_SEED_OFFSET = 1_000_003
"""Prompts come from a generator seeded ``seed + this``, not from the task's training stream."""


def arm_overrides(regime: str, condition: str, arm: str) -> list[str]:
    """The Hydra overrides ``run_study.py --stage explore`` gives ``arm`` (bf16 | fp8) of ``condition``: for
    bf16 the condition's own BF16 reference where it has one (a condition that also changes the learning rate
    or the length), else the regime's."""
    args = argparse.Namespace(stage="explore", regime=regime, conditions=condition, checkpoint_every=10,
                              explore_steps=100, sweep_steps=100)
    runs = [r for r in run_study.stage_runs(args) if r["arm"] == arm]
    own = [r for r in runs if f"/{condition}/" in r["name"]]
    if own or (arm == "bf16" and runs):
        return list((own or runs)[0]["overrides"])
    raise SystemExit(f"no {arm} run for --regime {regime} --condition {condition}")


def held_out_batch(trainer, prompts: list, samples: int, gen_seed: int):
    """``(expanded prompts, RolloutBatch)``: ``samples`` responses per prompt from the trainer's rollout engine,
    drawn with a generator seeded ``gen_seed`` (the same draws for every arm given the same seed)."""
    expanded = [p for p in prompts for _ in range(samples)]
    batch = trainer.engine.generate([p.ids for p in expanded], trainer.sampling, torch.Generator().manual_seed(gen_seed))
    return expanded, batch


def held_out_prompts(trainer, n: int, seed: int) -> list:
    """``n`` prompts from a generator seeded ``seed + HELD_OUT_SEED_OFFSET`` (the training stream is untouched)."""
    return trainer.task.prompts(n, generator=torch.Generator().manual_seed(seed + HELD_OUT_SEED_OFFSET))


def build(overrides: list[str], seed: int, out: Path, cache_dir: Path):
    """The trainer of a run with ``overrides`` (warm-up from ``cache_dir``), as ``nemo_fp8rl.train`` builds it."""
    from hydra import compose, initialize_config_dir

    from nemo_fp8rl.train import CONF_DIR, prepare, register_schema, to_train_config

    register_schema()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        dict_cfg = compose("config", overrides=[*run_study.COMMON, *overrides, f"seed={seed}",
                                                f"output_dir={out}", f"warmup.cache_dir={cache_dir}",
                                                "resume=false", "trainer.cpu_threads=1"])
    return prepare(to_train_config(dict_cfg))


def sample_arm(trainer, n_prompts: int, samples: int, seed: int, batch_prompts: int) -> dict:
    """``samples`` responses for each of ``n_prompts`` held-out prompts; correct / valid [P, S], lengths."""
    trainer.kv_sync.sync(trainer.engine, trainer.actor.iter_weights())  # the warmed-up weights, as step 0
    prompts = held_out_prompts(trainer, n_prompts, seed)
    correct, valid, lens = [], [], []
    for start in range(0, n_prompts, batch_prompts):
        expanded, batch = held_out_batch(trainer, prompts[start:start + batch_prompts], samples, seed * 7_919 + start)
        texts = [trainer.task.response_text(r) for r in batch.responses()]
        scores = trainer.task.score(expanded, texts)
        correct.append(scores.correct.float().view(-1, samples))
        valid.append((~scores.invalid).float().view(-1, samples))
        lens.append(batch.response_lens.float().view(-1, samples))
    return {"correct": torch.cat(correct).numpy(), "valid": torch.cat(valid).numpy(),
            "len": torch.cat(lens).numpy()}


def paired_ci(diff_p: np.ndarray, boot: int, seed: int) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(diff_p), diff_p [P], resampling prompts."""
    rng = np.random.default_rng(seed)
    means = diff_p[rng.integers(0, len(diff_p), size=(boot, len(diff_p)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", required=True, help="a sweep point of run_study.SWEEP")
    ap.add_argument("--condition", default="tensorwise", help="an exploration condition of run_study.EXPLORE")
    ap.add_argument("--seed", type=int, default=run_study.EXPLORE_SEED)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--batch-prompts", type=int, default=16, help="prompts per engine call")
    ap.add_argument("--boot", type=int, default=10_000)
    ap.add_argument("--out", default="runs/study", help="the study's output root (its .warmup_cache is reused)")
    ap.add_argument("--json", default="", help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    res, t0 = {}, time.time()
    for arm in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory(prefix=f"rollout_acc_{arm}_") as tmp:
            trainer = build(arm_overrides(args.regime, args.condition, arm), args.seed, Path(tmp),
                            Path(args.out) / ".warmup_cache")
            temperature = trainer.cfg.rollout.temperature
            try:
                res[arm] = sample_arm(trainer, args.prompts, args.samples, args.seed, args.batch_prompts)
            finally:
                trainer.close()
        print(f"{arm}: sampled in {time.time() - t0:.0f} s", flush=True)

    diff_p = res["fp8"]["correct"].mean(1) - res["bf16"]["correct"].mean(1)
    lo, hi = paired_ci(diff_p, args.boot, args.seed)
    rows = {arm: {"accuracy": float(r["correct"].mean()), "valid": float(r["valid"].mean()),
                  "response_len": float(r["len"].mean())} for arm, r in res.items()}
    summary = {"regime": args.regime, "condition": args.condition, "seed": args.seed, "prompts": args.prompts,
               "samples": args.samples, "arms": rows,
               "diff_fp8_minus_bf16": {"mean": float(diff_p.mean()), "ci95": [lo, hi]},
               "same_correctness_frac": float((res["fp8"]["correct"] == res["bf16"]["correct"]).mean())}
    print(f"\nstep-0 policy of {args.regime} (seed {args.seed}, warm-up only), {args.prompts} held-out prompts "
          f"x {args.samples} samples, temperature {temperature:g}")
    print("| rollout | accuracy | well-formed | response tokens |\n|---|---|---|---|")
    for arm, r in rows.items():
        print(f"| {arm if arm == 'bf16' else 'fp8 (' + args.condition + ' arm)'} | {r['accuracy']:.3f} | "
              f"{r['valid']:.3f} | {r['response_len']:.1f} |")
    print(f"paired FP8 - BF16: {diff_p.mean():+.3f} (95% bootstrap CI {lo:+.3f} .. {hi:+.3f} over prompts)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
