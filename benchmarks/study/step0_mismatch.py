"""FP8 forward error of the RL starting policy, per exploration condition (issue 28).

For each ``--conditions`` entry this builds the exploration's FP8 run at ``--seed`` exactly as
``run_study.py`` does (same overrides, same cached warm-up; ``--extra`` Hydra overrides on top, e.g.
``fp8.pow2_scales=false``), samples one batch of held-out prompts with its rollout engine, and scores the
sampled tokens three ways on the same weights: the trainer's FP8 forward (``logp_fp8``), its high-precision
shadow forward (``logp_hp``, FP8 off) and the rollout engine's own log-probs (``logp_rollout``).

    err(a, b) = sum_{b,t} m[b,t] |a[b,t] - b[b,t]| / sum_{b,t} m[b,t]        (mean over response tokens)
    train_vs_hp = err(logp_fp8, logp_hp), rollout_vs_hp = err(logp_rollout, logp_hp),
    train_vs_rollout = err(logp_fp8, logp_rollout)   (the noise in log r at step 0 with old_logprobs=rollout)
    m [B, T]: 1 on response tokens; B = prompts x samples.

Every condition samples the same prompts with the same generator seeds; conditions that share a rollout
scheme (all FP8 arms here use ``vllm_w8a8``) therefore score the same tokens.

    python benchmarks/study/step0_mismatch.py --regime lr1e-5_easy --conditions tensorwise,blockwise,e5m2
    python benchmarks/study/step0_mismatch.py --regime lr1e-5_easy --conditions blockwise --extra fp8.pow2_scales=false
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import rollout_accuracy as ra  # (its directory is on sys.path when run as a script) build() and the arms
import run_study
import torch


def masked_mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """sum(mask |a - b|) / sum(mask) over [B, T] tensors (float32)."""
    return float(((a - b).abs() * mask).sum() / mask.sum().clamp(min=1.0))


def measure(condition: str, regime: str, seed: int, extra: list[str], prompts: int, samples: int,
            out: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"step0_{condition}_") as tmp:
        trainer = ra.build([*ra.arm_overrides(regime, condition, "fp8"), *extra], seed, Path(tmp),
                           out / ".warmup_cache")
        try:
            trainer.kv_sync.sync(trainer.engine, trainer.actor.iter_weights())
            _, batch = ra.held_out_batch(trainer, ra.held_out_prompts(trainer, prompts, seed), samples, seed * 7_919)
            t = trainer.cfg.rollout.temperature
            mask = batch.mask.float()
            lp_fp8 = trainer.actor.get_logprobs(batch.tokens, temperature=t)[0]
            lp_hp = trainer.actor.get_shadow_logprobs(batch.tokens, temperature=t)[0]
            lp_ro = batch.rollout_logp.float()
            return {"condition": condition, "extra": extra, "tokens": int(mask.sum()),
                    "train_vs_hp": masked_mean_abs(lp_fp8, lp_hp, mask),
                    "rollout_vs_hp": masked_mean_abs(lp_ro, lp_hp, mask),
                    "train_vs_rollout": masked_mean_abs(lp_fp8, lp_ro, mask)}
        finally:
            trainer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", required=True, help="a sweep point of run_study.SWEEP")
    ap.add_argument("--conditions", default="tensorwise,blockwise,e5m2", help="exploration conditions (EXPLORE)")
    ap.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="Hydra overrides on top")
    ap.add_argument("--seed", type=int, default=run_study.EXPLORE_SEED)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--out", default="runs/study", help="the study's output root (its .warmup_cache is reused)")
    ap.add_argument("--json", default="", help="also append the rows here (JSON lines)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| condition | extra | response tokens | FP8 train vs HP | rollout vs HP | train vs rollout |\n"
          "|---|---|---:|---:|---:|---:|", flush=True)
    for cond in [c for c in args.conditions.split(",") if c]:
        row = measure(cond, args.regime, args.seed, args.extra, args.prompts, args.samples, Path(args.out))
        print(f"| {cond} | {' '.join(args.extra) or '-'} | {row['tokens']} | {row['train_vs_hp']:.4f} | "
              f"{row['rollout_vs_hp']:.4f} | {row['train_vs_rollout']:.4f} |", flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "a") as f:
                f.write(json.dumps({"regime": args.regime, "seed": args.seed, **row}) + "\n")


if __name__ == "__main__":
    main()
