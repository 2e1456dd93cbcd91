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

Issue 41 (how much of FP8's first-window gap is inference): ``--seeds`` samples several seeds' warm-up
policies, and ``--variants`` adds FP8 rollout arms beside the condition's own (``fp8``): BF16 edge layers
(``fp8_edges``: the first and the last decoder layer's linears and KV cache in BF16), the FP8 KV cache
(``fp8_kv``: E4M3 with per-step calibrated scales, NeMo RL's recipe) and both (``fp8_kv_edges``). With
``--first-window RECORD_DIR`` (the confirmation's record directory of the condition) each seed's table also
shows the training runs' own first-window reward gap (fp8 - bf16, steps 0-9), the gap this measurement is
compared with::

    python benchmarks/study/rollout_accuracy.py --regime lr1e-5_easy --condition blockwise --seeds 11,12,13 \
        --variants fp8,fp8_edges,fp8_kv,fp8_kv_edges --prompts 192 \
        --first-window benchmarks/study/records/confirm/lr1e-5_easy/blockwise --json out.json

Output: per arm the accuracy, the mean reward (accuracy plus any format reward), the well-formed share and
the mean response length; per FP8 arm the paired difference arm - BF16 with a 95% bootstrap interval over
prompts. ``--json`` writes the numbers too.

    acc_arm = (1 / (P S)) sum_p sum_s correct[p, s]
    diff_p = mean_s correct_fp8[p, s] - mean_s correct_bf16[p, s],   diff = mean_p diff_p
    (correct [P, S]: P prompts x S samples; the same for the reward)
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


VARIANTS = {
    "fp8": [],
    "fp8_edges": ["rollout.fp8.num_layers_at_start_in_bf16=1", "rollout.fp8.num_layers_at_end_in_bf16=1"],
    "fp8_kv": ["rollout.fp8.kv_cache=e4m3", "rollout.fp8.kv_scales=calibrated"],
    "fp8_kv_edges": ["rollout.fp8.kv_cache=e4m3", "rollout.fp8.kv_scales=calibrated",
                     "rollout.fp8.num_layers_at_start_in_bf16=1", "rollout.fp8.num_layers_at_end_in_bf16=1"],
}
"""FP8 rollout arms: Hydra overrides on top of the condition's fp8 arm (training settings are untouched; only
the rollout engine's FP8 changes, and every arm samples the same warmed-up weights)."""


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
    correct, reward, valid, lens = [], [], [], []
    for start in range(0, n_prompts, batch_prompts):
        expanded, batch = held_out_batch(trainer, prompts[start:start + batch_prompts], samples, seed * 7_919 + start)
        texts = [trainer.task.response_text(r) for r in batch.responses()]
        scores = trainer.task.score(expanded, texts)
        correct.append(scores.correct.float().view(-1, samples))
        reward.append(scores.rewards.float().view(-1, samples))
        valid.append((~scores.invalid).float().view(-1, samples))
        lens.append(batch.response_lens.float().view(-1, samples))
    return {"correct": torch.cat(correct).numpy(), "reward": torch.cat(reward).numpy(),
            "valid": torch.cat(valid).numpy(), "len": torch.cat(lens).numpy()}


def paired_ci(diff_p: np.ndarray, boot: int, seed: int) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(diff_p), diff_p [P], resampling prompts."""
    rng = np.random.default_rng(seed)
    means = diff_p[rng.integers(0, len(diff_p), size=(boot, len(diff_p)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def first_window_gap(record: Path, seed: int, window: int = 10) -> dict | None:
    """The training runs' own step-0 and first-window rewards: ``reward/mean`` of the ``bf16`` and ``fp8`` arms
    of ``record/<arm>/seed<seed>/metrics.jsonl`` at step 0 and averaged over steps 0..window-1, and fp8 - bf16.
    None when either record is missing."""
    out = {}
    for arm in ("bf16", "fp8"):
        path = record / arm / f"seed{seed}" / "metrics.jsonl"
        if not path.exists():
            return None
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        by_step = {int(r["step"]): float(r["reward/mean"]) for r in rows if "reward/mean" in r}
        if not all(s in by_step for s in range(window)):
            return None
        out[arm] = {"step0": by_step[0], "first_window": float(np.mean([by_step[s] for s in range(window)]))}
    out["gap_step0"] = out["fp8"]["step0"] - out["bf16"]["step0"]
    out["gap_first_window"] = out["fp8"]["first_window"] - out["bf16"]["first_window"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", required=True, help="a sweep point of run_study.SWEEP")
    ap.add_argument("--condition", default="tensorwise", help="an exploration condition of run_study.EXPLORE")
    ap.add_argument("--seed", type=int, default=None, help="one seed (same as --seeds N)")
    ap.add_argument("--seeds", default=None, help=f"comma-separated seeds (default {run_study.EXPLORE_SEED})")
    ap.add_argument("--variants", default="fp8", help=f"FP8 rollout arms, comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--first-window", default="", help="the condition's confirmation record directory: print "
                    "each seed's training first-window gap beside the measurement")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--batch-prompts", type=int, default=16, help="prompts per engine call")
    ap.add_argument("--boot", type=int, default=10_000)
    ap.add_argument("--out", default="runs/study", help="the study's output root (its .warmup_cache is reused)")
    ap.add_argument("--json", default="", help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.seed is not None and args.seeds is not None:
        raise SystemExit("give --seed or --seeds, not both")
    seeds = [args.seed] if args.seed is not None else [int(x) for x in (args.seeds or str(run_study.EXPLORE_SEED)).split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SystemExit(f"--variants {args.variants!r}: unknown {unknown}; choose from {sorted(VARIANTS)}")
    summaries = [measure_seed(args, seed, variants) for seed in seeds]
    if len(summaries) > 1:
        print("\nall seeds: mean over seeds of arm - bf16 (accuracy)")
        for v in variants:
            print(f"  {v}: {np.mean([s['diff'][v]['mean'] for s in summaries]):+.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = summaries[0] if len(summaries) == 1 else {"seeds": summaries}
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")


def measure_seed(args, seed: int, variants: list[str]) -> dict:
    """Sample the warm-up policy of ``seed`` with the BF16 arm's rollout and each FP8 variant's; print the table
    and return the numbers (JSON-ready)."""
    res, t0 = {}, time.time()
    for arm in ("bf16", *variants):
        base = arm_overrides(args.regime, args.condition, "bf16" if arm == "bf16" else "fp8")
        overrides = base if arm == "bf16" else [*base, *VARIANTS[arm]]
        with tempfile.TemporaryDirectory(prefix=f"rollout_acc_{arm}_") as tmp:
            trainer = build(overrides, seed, Path(tmp), Path(args.out) / ".warmup_cache")
            temperature = trainer.cfg.rollout.temperature
            try:
                res[arm] = sample_arm(trainer, args.prompts, args.samples, seed, args.batch_prompts)
            finally:
                trainer.close()
        print(f"seed {seed}, {arm}: sampled in {time.time() - t0:.0f} s", flush=True)

    rows = {arm: {"accuracy": float(r["correct"].mean()), "reward": float(r["reward"].mean()),
                  "valid": float(r["valid"].mean()), "response_len": float(r["len"].mean())}
            for arm, r in res.items()}
    diff = {}
    for arm in variants:
        diff_p = res[arm]["correct"].mean(1) - res["bf16"]["correct"].mean(1)
        rdiff_p = res[arm]["reward"].mean(1) - res["bf16"]["reward"].mean(1)
        lo, hi = paired_ci(diff_p, args.boot, seed)
        rlo, rhi = paired_ci(rdiff_p, args.boot, seed)
        diff[arm] = {"mean": float(diff_p.mean()), "ci95": [lo, hi],
                     "reward_mean": float(rdiff_p.mean()), "reward_ci95": [rlo, rhi],
                     "same_correctness_frac": float((res[arm]["correct"] == res["bf16"]["correct"]).mean())}
    summary = {"regime": args.regime, "condition": args.condition, "seed": seed, "prompts": args.prompts,
               "samples": args.samples, "temperature": temperature, "arms": rows,
               "overrides": {v: VARIANTS[v] for v in variants}, "diff": diff}
    if "fp8" in diff:  # the keys of the single-arm record (issue 28)
        summary["diff_fp8_minus_bf16"] = {"mean": diff["fp8"]["mean"], "ci95": diff["fp8"]["ci95"]}
        summary["same_correctness_frac"] = diff["fp8"]["same_correctness_frac"]
    if args.first_window:
        summary["training"] = first_window_gap(Path(args.first_window), seed)
    print(f"\nstep-0 policy of {args.regime} (seed {seed}, warm-up only), {args.prompts} held-out prompts "
          f"x {args.samples} samples, temperature {temperature:g}")
    print("| rollout | accuracy | reward | well-formed | response tokens | arm - bf16 (accuracy, 95% CI) |\n"
          "|---|---|---|---|---|---|")
    for arm, r in rows.items():
        d = "" if arm == "bf16" else f"{diff[arm]['mean']:+.3f} [{diff[arm]['ci95'][0]:+.3f}, {diff[arm]['ci95'][1]:+.3f}]"
        print(f"| {arm} | {r['accuracy']:.3f} | {r['reward']:.3f} | {r['valid']:.3f} | {r['response_len']:.1f} | {d} |")
    tr = summary.get("training")
    if tr:
        print(f"training runs (fp8 - bf16 reward/mean): step 0 {tr['gap_step0']:+.3f}, "
              f"steps 0-9 {tr['gap_first_window']:+.3f}")
    return summary


if __name__ == "__main__":
    main()
