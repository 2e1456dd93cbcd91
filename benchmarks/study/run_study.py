"""The paper in miniature: arms x FP8 recipes x algorithms x seeds, plus Calibrated Clipping ablations.

Every run is the real CLI (``python -m nemo_fp8rl.train``) on the built-in arithmetic task with the tiny
model, FP8 in training and rollout, old log-probs from the rollout engine (the demo's setting, where
the FP8 ratio noise is visible at this scale). Runs go to ``<out>/<group>/<name>/``; a run whose
``metrics.jsonl`` already has all its steps is skipped, so the study can be resumed. ``--jobs`` runs
execute side by side (one torch thread each). Afterwards ``summarize.py`` writes ``docs/results.md``.

    python benchmarks/study/run_study.py --out runs/study --steps 100 --jobs 2            # everything
    python benchmarks/study/run_study.py --only main --recipes tensorwise --seeds 1         # a slice
    python benchmarks/study/run_study.py --list                                             # the plan

Groups:
* ``main``: arms bf16 / fp8 (fixed clip, calibration measured only) / fp8_calibrated, for recipes
  tensorwise, rowwise, blockwise, mxfp8 and algorithms grpo, dapo (bf16 runs once per algorithm/seed);
* ``ablation``: fp8_calibrated with grpo + tensorwise, one override each: calibration.interval
  5/10/40, calibration.upper_mode quantile/proportional/fixed, calibration.ema 0/0.9 (the defaults
  interval 20, balance, ema 0.5 are the main runs), and rollout correction tis vs none with old
  log-probs recomputed by the trainer (with rollout old log-probs the TIS weight is exactly 1);
* ``stress``: conditions that push FP8 harder (E5M2 activations, a 3x larger learning rate, fast
  accumulation), each for the three arms, to look for entropy surges, and a 10x learning rate
  (``lr1e-3``), the one setting where the entropy surged at this scale (in every arm, BF16 included);
* ``long``: ``--long-steps`` (default 200) steps of the three arms at 2x the learning rate with E5M2
  activations and weights (bf16: the same learning rate), all seeds: the setting where the fixed-clip
  FP8 arm degrades while BF16 keeps learning (found by a search over the conditions of the ``stress``
  group, lr 2e-4/3e-4/1e-3, 2-4 epochs, 16 minibatches, at 150-200 steps; see docs/results.md);
* ``real``: a real pretrained LLM, SmolLM2-135M-Instruct on reasoning-gym chain_sum with ``make
  demo-real``'s settings (``nemo_fp8rl.demo.REAL``: short format warm-up, 8 prompts x 4 responses x 32
  tokens, lr 3e-6, calibration every 4 steps), ``--real-steps`` steps, ``--real-seeds`` (default 1,2):
  bf16 / fp8 fixed clip / fp8_calibrated for recipes tensorwise and blockwise, plus the stress setting
  ``e5m2_2xlr`` (E5M2 activations and weights, 2x lr; bf16: 2x lr only). FP8 in training and rollout,
  old log-probs from the rollout engine, so the TIS weight exp(old - rollout) is exactly 1 and TIS C=2
  is a no-op here.

Every run writes sample generations at its first, middle and last step (``logger.samples``).
``--list`` prints the plan with an estimated wall time per run (from the per-step seconds of
:data:`STEP_SECONDS`, measured on 2 shared CPU cores, one job at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nemo_fp8rl.demo import sample_steps

ARMS = {
    "bf16": ["fp8=off", "calibration=off"],
    "fp8": ["calibration=measure"],
    "fp8_calibrated": ["calibration=paper"],
}
RECIPES = ["tensorwise", "rowwise", "blockwise", "mxfp8"]
ALGOS = ["grpo", "dapo"]
COMMON = ["algorithm.old_logprobs=rollout", "logger.progress=lines", "logger.tensorboard=false"]
ABLATIONS = {
    "interval5": ["calibration.interval=5"],
    "interval10": ["calibration.interval=10"],
    "interval40": ["calibration.interval=40"],
    "upper_quantile": ["calibration.upper_mode=quantile"],
    "upper_proportional": ["calibration.upper_mode=proportional"],
    "upper_fixed": ["calibration.upper_mode=fixed"],
    "ema0": ["calibration.ema=0.0"],
    "ema0.9": ["calibration.ema=0.9"],
    # Rollout correction only acts when old log-probs come from the trainer (with old_logprobs=rollout
    # the TIS weight exp(old - rollout) is exactly 1), so it is ablated under recompute:
    "recompute_tis": ["algorithm.old_logprobs=recompute", "algorithm.rollout_correction=tis"],
    "recompute_none": ["algorithm.old_logprobs=recompute", "algorithm.rollout_correction=none"],
}
STRESS = {
    "e5m2": ["fp8.fp8_format=e5m2"],
    "lr3e-4": ["optim.lr=3e-4"],
    "fast_accum": ["fp8.accumulation=fast"],
    "lr1e-3": ["optim.lr=1e-3"],
}
# conditions that apply to the FP8 arms only (there is no E5M2 or fast accumulation in high precision)
FP8_ONLY = {"fp8.fp8_format=e5m2", "fp8.accumulation=fast"}
LONG = {"e5m2_lr2e-4": ["fp8.fp8_format=e5m2", "optim.lr=2e-4"]}
REAL_RECIPES = ["tensorwise", "blockwise"]
REAL_STRESS = {"e5m2_2xlr": ["fp8.fp8_format=e5m2", "optim.lr=6e-6"]}  # 2x REAL's optim.lr=3e-6
# Seconds per RL step for --list's estimates, measured on this project's 2 CPU cores shared with other
# jobs, one run at a time: tiny model, the study's 32 prompts x 8 responses (docs/results.md "step s":
# 0.4-0.8); SmolLM2 with REAL's 8 prompts x 4 responses (python -m nemo_fp8rl.demo --real --steps 2,
# tensorwise, 2026-12-01: bf16 31.6 / 28.9 s, fp8 56.3 (calibration measured) / 42.5 s, fp8_calibrated
# 52.8 / 48.0 s), plus ~20 s start-up and the final export per run. REAL_WARMUP_S: the format warm-up
# (219 s measured), once per seed (cached, shared by the seed's runs).
STEP_SECONDS = {"tiny": 0.8, "real/bf16": 32.0, "real/fp8": 48.0, "real/fp8_calibrated": 50.0}
RUN_OVERHEAD_S = {"tiny": 5.0, "real": 30.0}
REAL_WARMUP_S = 220.0


def _arm_overrides(arm: str, extra: list[str]) -> list[str]:
    """An arm's overrides plus a condition's; the bf16 arm keeps only the non-FP8 part of the condition."""
    if arm == "bf16":
        return [*ARMS[arm], *(o for o in extra if o not in FP8_ONLY)]
    return ["fp8=tensorwise", *ARMS[arm], *extra]


def plan(args) -> list[dict]:
    runs = []
    seeds = [int(s) for s in args.seeds.split(",")]
    recipes = args.recipes.split(",")
    algos = args.algos.split(",")
    for seed in seeds:
        for algo in algos:
            runs.append(dict(group="main", name=f"{algo}/bf16/seed{seed}", seed=seed,
                             overrides=[f"algorithm={algo}", *ARMS["bf16"]]))
            for recipe in recipes:
                for arm in ("fp8", "fp8_calibrated"):
                    runs.append(dict(group="main", name=f"{algo}/{recipe}/{arm}/seed{seed}", seed=seed,
                                     overrides=[f"algorithm={algo}", f"fp8={recipe}", *ARMS[arm]]))
        for abl, extra in ABLATIONS.items():
            runs.append(dict(group="ablation", name=f"{abl}/seed{seed}", seed=seed,
                             overrides=["algorithm=grpo", "fp8=tensorwise", *ARMS["fp8_calibrated"], *extra]))
    for cond, extra in STRESS.items():
        for arm in ARMS:
            if arm == "bf16" and not [o for o in extra if o not in FP8_ONLY]:
                continue  # E5M2 / fast accumulation do not exist in high precision: bf16 is the main run
            runs.append(dict(group="stress", name=f"{cond}/{arm}/seed1", seed=1,
                             overrides=["algorithm=grpo", *_arm_overrides(arm, extra)]))
    for seed in seeds:
        for cond, extra in LONG.items():
            for arm in ARMS:
                runs.append(dict(group="long", name=f"{cond}/{arm}/seed{seed}", seed=seed, steps=args.long_steps,
                                 overrides=["algorithm=grpo", *_arm_overrides(arm, extra)]))
    from nemo_fp8rl.demo import REAL

    for seed in [int(s) for s in args.real_seeds.split(",")]:
        runs.append(dict(group="real", name=f"bf16/seed{seed}", seed=seed, steps=args.real_steps, arm="bf16",
                         overrides=["algorithm=grpo", *REAL, *ARMS["bf16"]]))
        for recipe in [r for r in args.real_recipes.split(",") if r]:
            for arm in ("fp8", "fp8_calibrated"):
                runs.append(dict(group="real", name=f"{recipe}/{arm}/seed{seed}", seed=seed, steps=args.real_steps,
                                 arm=arm, overrides=["algorithm=grpo", *REAL, f"fp8={recipe}", *ARMS[arm]]))
        for cond, extra in REAL_STRESS.items():
            if seed not in [int(s) for s in args.real_stress_seeds.split(",") if s]:
                continue
            for arm in ARMS:
                # _arm_overrides: fp8=tensorwise for the FP8 arms, only the lr for bf16; after REAL, so they win
                runs.append(dict(group="real", name=f"{cond}/{arm}/seed{seed}", seed=seed, steps=args.real_steps,
                                 arm=arm, overrides=["algorithm=grpo", *REAL, *_arm_overrides(arm, extra)]))
    if args.only:
        runs = [r for r in runs if r["group"] in args.only.split(",")]
    return runs


def estimate_s(run: dict, steps: int) -> float:
    """Estimated wall time of ``run`` (seconds) from :data:`STEP_SECONDS`."""
    n = run.get("steps", steps)
    if run["group"] == "real":
        return RUN_OVERHEAD_S["real"] + n * STEP_SECONDS[f"real/{run['arm']}"]
    return RUN_OVERHEAD_S["tiny"] + n * STEP_SECONDS["tiny"]


def done(run_dir: Path, steps: int) -> bool:
    m = run_dir / "metrics.jsonl"
    return m.is_file() and sum(1 for _ in m.open()) >= steps


def execute(run: dict, out: Path, steps: int, log_dir: Path, extra: list[str]) -> tuple[str, int, float]:
    run_dir = out / run["group"] / run["name"]
    steps = run.get("steps", steps)
    if done(run_dir, steps):
        return run["name"], 0, 0.0
    # COMMON first: a run's own overrides (e.g. old_logprobs=recompute in an ablation) must win
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *COMMON, *run["overrides"], *extra, f"seed={run['seed']}",
           f"trainer.max_steps={steps}", f"trainer.checkpoint_interval={max(steps // 2, 1)}",
           f"output_dir={run_dir}", f"warmup.cache_dir={out / '.warmup_cache'}", "resume=true",
           sample_steps(steps)]
    log = log_dir / (run["group"] + "__" + run["name"].replace("/", "__") + ".log")
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return run["name"], rc, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--long-steps", type=int, default=200, help="RL steps of the runs of the long group")
    ap.add_argument("--real-steps", type=int, default=20, help="RL steps of the runs of the real group")
    ap.add_argument("--real-seeds", default="1,2", help="seeds of the real group")
    ap.add_argument("--real-recipes", default=",".join(REAL_RECIPES), help="FP8 recipes of the real group's main arms")
    ap.add_argument("--real-stress-seeds", default="1,2",
                    help="seeds of the real group's stress condition (E5M2, 2x lr); '' = none")
    ap.add_argument("--only", default="", help="comma-separated groups: main, ablation, stress, long, real")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Hydra overrides appended to every run's own (e.g. a smaller warm-up for a smoke test)")
    args = ap.parse_args()
    runs = plan(args)
    out = Path(args.out)
    if args.list:
        total = 0.0
        for r in runs:
            est = estimate_s(r, args.steps)
            total += est
            print(r["group"], r["name"], " ".join(r["overrides"]), f"# ~{est / 60:.0f} min")
        print(f"{len(runs)} runs, ~{total / 3600:.1f} h one at a time (estimates from STEP_SECONDS; warm-ups: "
              f"+~{REAL_WARMUP_S / 60:.0f} min per seed of the real group)")
        return
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # the record of every run ever planned into this directory: a slice (--only/--seeds) adds its runs
    meta_path = out / "study.json"
    known = json.loads(meta_path.read_text())["runs"] if meta_path.is_file() else []
    names = {(r["group"], r["name"]) for r in runs}
    merged = [r for r in known if (r["group"], r["name"]) not in names] + runs
    meta_path.write_text(json.dumps({"steps": args.steps, "long_steps": args.long_steps,
                                     "real_steps": args.real_steps, "runs": merged,
                                     "common": COMMON}, indent=1))
    # warm-ups first, one per seed (cached, shared by every run of that seed), so parallel jobs never
    # compute the same warm-up twice
    seeds = sorted({r["seed"] for r in runs})
    firsts = [next(r for r in runs if r["seed"] == s) for s in seeds]
    t0 = time.time()
    failures = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for name, rc, sec in pool.map(lambda r: execute(r, out, args.steps, log_dir, args.extra), firsts):
            print(f"[{time.time() - t0:7.0f}s] {name}: rc={rc} {sec:.0f}s", flush=True)
            failures += [name] if rc else []
        rest = [r for r in runs if r not in firsts]
        for name, rc, sec in pool.map(lambda r: execute(r, out, args.steps, log_dir, args.extra), rest):
            print(f"[{time.time() - t0:7.0f}s] {name}: rc={rc} {sec:.0f}s", flush=True)
            failures += [name] if rc else []
    print(f"study finished in {time.time() - t0:.0f}s; {len(runs) - len(failures)}/{len(runs)} runs ok")
    if failures:
        sys.exit(f"failed runs: {failures} (logs in {log_dir})")


if __name__ == "__main__":
    main()
