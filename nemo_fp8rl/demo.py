"""``make demo``: BF16 vs naive FP8 vs calibrated FP8, side by side, on a CPU in minutes.

Three runs of the real CLI (``python -m nemo_fp8rl.train``) with the same seed and configuration,
differing only in precision and clipping:

* ``bf16``: FP8 off in training and rollout (high precision end to end);
* ``fp8``: FP8 training + FP8 rollout, fixed clip bounds. It still runs the BF16 shadow forward at
  calibration steps with ``calibration.apply=false``, so it logs how it *would* have been calibrated
  (``calib/alpha_fp8_nominal`` vs ``calib/alpha_bf16`` on the same tokens);
* ``fp8_calibrated``: the same + Calibrated Clipping (``calibration=paper``).

The configuration makes the mechanism visible at tiny scale (docs/fp8-noise.md): old log-probs come
from the FP8 rollout engine (``algorithm.old_logprobs=rollout``), so the importance ratio carries the
rollout-vs-trainer FP8 mismatch, which is what pushes negative-advantage tokens below 1 - eps_low.
All arms start from the same cached supervised warm-up. Then ``nemo-fp8rl-report`` writes
``runs/demo/report/report.png`` and ``summary.md`` (with sample generations of each arm at its first,
middle and last step: ``logger.samples``).

``--real`` (``make demo-real``): the same three arms on a real pretrained LLM, SmolLM2-135M-Instruct
(``model=smollm2_135m``, fetched through the model registry on first use) with reasoning-gym's
``chain_sum`` (``task=reasoning_gym``; prompts through the model's chat template), a short format
warm-up and a small batch (:data:`REAL`), in the regime where issue 28's study found BF16 learning and
fixed-clip FP8 falling behind (:data:`REAL_REGIME`: 2 one-digit terms, lr 1e-5, calibration every 10
steps; FP8 recipe ``blockwise``), written to ``runs/demo_real``. Its arms are the study's protocol arms
(:data:`REAL_ARMS`: the bf16 arm measures BF16's own clip share and negative push): with seed 1 the
demo's bf16 and fp8 arms have the configuration of the study's seed-1 sweep and exploration runs
(docs/results.md, "The decisive experiment on SmolLM2-135M"). Measured 2026-12-03 (30 steps, one
thread): the bf16 arm repeated the study's record step for step (reward equal at all 30 steps); the fp8
arm differed from step 0, because the demo's own warm-up differed from the study's cached one in the 7th
significant digit and FP8 rounding amplifies that. 30 steps per arm by default (93 minutes
in all, warm-up included, on one thread of a 2-core Xeon beside another run).

    python -m nemo_fp8rl.demo [--steps N] [--out runs/demo] [--recipe tensorwise] [extra overrides...]
    python -m nemo_fp8rl.demo --real [--steps N] [--out runs/demo_real] [--recipe blockwise] [extra overrides...]

``--real --base-regime`` runs :data:`REAL` alone (2-3 terms of 1-2 digits, lr 3e-6, calibration every 4
steps, ``tensorwise``, a BF16 arm without measurement): ``--real`` before 2026-12-03, the setting of the
earlier real-model runs in docs/results.md, where BF16 does not learn measurably in 10 steps.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "bf16": ["fp8=off", "calibration=off"],
    "fp8": ["fp8={recipe}", "calibration=measure"],
    "fp8_calibrated": ["fp8={recipe}", "calibration=paper"],
}

# Shared by all arms: what makes the FP8 ratio noise visible on the tiny task (see module docstring).
COMMON = ["algorithm=grpo", "algorithm.old_logprobs=rollout", "logger.progress=lines"]

# --real's base (REAL_REGIME below sets the task's difficulty, the learning rate and the calibration interval
# on top; the study's runs build on REAL too): SmolLM2-135M-Instruct on reasoning-gym chain_sum, a small
# learning rate for a pretrained model, and a batch that 2 CPU cores turn around in tens of seconds per
# step; problems of 2-3 terms of 1-2 digits. Zero-shot the model never writes the <answer></answer> tags the reward parses (measured: 0 of
# 200 sampled responses at temperature 0.7, six prompt variants; benchmarks/study/real_notes.md), so
# every reward, advantage and gradient would be 0; prefilling the tag (task.response_prefix) gives the
# format but accuracy 0 (two steps of 32 responses). A short supervised warm-up on ``prompt ->
# <answer>X</answer>`` (the task's warmup_examples, high precision, cached and shared by the three arms)
# teaches the format first (measured: 30 steps, ~220 s, expected sampled accuracy 0.29 at temperature
# 0.7; then every response was well formed and rewards were 0.19-0.25 per step). Groups with mixed
# rewards are not in every step: seed 1's first step had none (gradient norm 0) at temperature 0.7 and
# at 1, its second step had some. The rollout samples at temperature 1 (the policy itself). Answers are
# then short (~9 tokens): 32 new tokens leave room for rambling. Calibration runs every 4 steps so that a
# short run calibrates several times, and needs only 16 tokens (a step has ~300 response tokens).
REAL = [
    "model=smollm2_135m", "task=reasoning_gym", "task.dataset=chain_sum",
    "+task.dataset_kwargs.min_terms=2", "+task.dataset_kwargs.max_terms=3", "+task.dataset_kwargs.min_digits=1",
    "+task.dataset_kwargs.max_digits=2",
    "warmup.steps=30", "warmup.batch_size=8", "warmup.lr=3e-5", "warmup.eval_interval=5", "warmup.eval_size=32",
    "warmup.target_accuracy=0.3", "algorithm.prompts_per_step=8", "algorithm.group_size=4", "algorithm.minibatches_per_step=2",
    "rollout.max_new_tokens=32", "rollout.temperature=1.0", "optim.lr=3e-6", "calibration.interval=4",
    "calibration.min_tokens=16", "logger.tensorboard=false",
]
# --real's regime on top of REAL (REAL stays the study's base, benchmarks/study/run_study.py PROTOCOL_BASE):
# issue 28's sweep point ``lr1e-5_easy`` (chain_sum with 2 one-digit terms at lr 1e-5; seed 1: BF16 reward
# 0.53 -> 0.75 over its first 30 steps, 0.88 by step 100) and the protocol's calibration interval. A test
# keeps these equal to the study's settings (tests/test_study_real.py).
REAL_REGIME = ["optim.lr=1e-5", "task.dataset_kwargs.max_terms=2", "task.dataset_kwargs.max_digits=1",
               "calibration.interval=10"]
REAL_RECIPE = "blockwise"
"""--real's default FP8 recipe: the study's exploration found fixed-clip FP8 visibly below BF16 in this regime
under ``blockwise`` (and E5M2), while ``tensorwise`` caught up; the confirmation ran ``blockwise``."""
REAL_ARMS = {**ARMS, "bf16": ["fp8=off", "calibration=measure"]}
"""--real's arms: the study's protocol arms (the bf16 arm keeps the nominal bounds and logs BF16's own
``calib/alpha_bf16`` and negative push at the calibration steps)."""
REAL_STEPS = 30
"""Default RL steps per arm of ``--real``."""
REAL_BASE_STEPS = 10
"""Default RL steps per arm of ``--real --base-regime``."""


def sample_steps(steps: int) -> str:
    """``logger.samples`` override: the first, middle and last step of a ``steps``-step run."""
    return "logger.samples=[" + ",".join(str(s) for s in sorted({0, (steps - 1) // 2, max(steps - 1, 0)})) + "]"


def arm_command(arm: str, out: Path, steps: int, recipe: str, seed: int, extra: list[str],
                real: bool = False, base_regime: bool = False) -> list[str]:
    """The ``nemo_fp8rl.train`` command of one arm. ``real``: SmolLM2 (:data:`REAL`) in the study's regime
    (:data:`REAL_REGIME`, :data:`REAL_ARMS`); with ``base_regime`` in :data:`REAL`'s own settings and the tiny
    demo's arms (``--real`` before 2026-12-03, which docs/results.md's earlier real-model runs used)."""
    regime = real and not base_regime
    arm_overrides = (REAL_ARMS if regime else ARMS)[arm]
    overrides = [o.format(recipe=recipe) for o in arm_overrides] + COMMON + (REAL if real else []) + (
        REAL_REGIME if regime else []) + [
        f"trainer.max_steps={steps}", f"trainer.checkpoint_interval={steps}", f"seed={seed}",
        f"output_dir={out / arm}", f"warmup.cache_dir={out / '.warmup_cache'}", sample_steps(steps),
    ] + list(extra)
    return [sys.executable, "-m", "nemo_fp8rl.train", *overrides]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nemo_fp8rl.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true",
                    help="SmolLM2-135M-Instruct on reasoning-gym chain_sum instead of the tiny model (make demo-real)")
    ap.add_argument("--base-regime", action="store_true",
                    help="with --real: REAL's base settings (2-3 terms of 1-2 digits, lr 3e-6, calibration every 4 "
                         "steps, tensorwise, BF16 arm without measurement), the --real of earlier docs/results.md runs")
    ap.add_argument("--out", default=None, help="parent directory of the three runs (runs/demo; --real: runs/demo_real)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"RL steps per arm (150; --real: {REAL_STEPS}; --real --base-regime: {REAL_BASE_STEPS})")
    ap.add_argument("--recipe", default=None, help=f"FP8 recipe of the two FP8 arms (tensorwise; --real: {REAL_RECIPE})")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every arm")
    args = ap.parse_args(argv)
    out = Path(args.out or ("runs/demo_real" if args.real else "runs/demo"))
    if args.base_regime and not args.real:
        ap.error("--base-regime applies to --real only")
    steps = args.steps if args.steps is not None else (
        (REAL_BASE_STEPS if args.base_regime else REAL_STEPS) if args.real else 150)
    recipe = args.recipe or (REAL_RECIPE if args.real and not args.base_regime else "tensorwise")
    if steps < 1:
        ap.error(f"--steps={steps} must be >= 1")
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; valid: {list(ARMS)}")
    for a in arms:
        if (out / a / "checkpoints").exists():
            ap.error(f"{out / a} already holds a run; remove it (or pass --out elsewhere) to rerun the demo")
    timings = {}
    for a in arms:
        cmd = arm_command(a, out, steps, recipe, args.seed, args.overrides, real=args.real,
                          base_regime=args.base_regime)
        print(f"\n=== {a}: {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
        t0 = time.time()
        rc = subprocess.call(cmd)
        timings[a] = time.time() - t0
        if rc != 0:
            sys.exit(f"arm {a} failed with exit code {rc}")
    from nemo_fp8rl.report import make_report

    rep = make_report([str(out / a) for a in arms], str(out / "report"))
    print("\n" + (rep / "summary.md").read_text())
    print("wall time per arm (s): " + ", ".join(f"{a} {t:.0f}" for a, t in timings.items()))
    print(f"figure: {rep / 'report.png'}")


if __name__ == "__main__":
    main()
