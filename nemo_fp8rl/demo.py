"""``make demo``: BF16 vs naive FP8 vs calibrated FP8, side by side, on a CPU in minutes.

Three runs of the real CLI (``python -m nemo_fp8rl.train``) with the same seed and configuration,
differing only in precision and clipping:

* ``bf16``: FP8 off in training and rollout (high precision end to end);
* ``fp8``: FP8 training + FP8 rollout, fixed clip bounds. It still runs the BF16 shadow forward at
  calibration steps with ``calibration.apply=false``, so it logs how it *would* have been calibrated
  (``calib/alpha_fp8_nominal`` vs ``calib/alpha_bf16`` on the same tokens);
* ``fp8_calibrated``: the same + Calibrated Clipping (``calibration=paper``).

The configuration makes the mechanism visible at tiny scale (NOTES-prototype): old log-probs come
from the FP8 rollout engine (``algorithm.old_logprobs=rollout``), so the importance ratio carries the
rollout-vs-trainer FP8 mismatch, which is what pushes negative-advantage tokens below 1 - eps_low.
All arms start from the same cached supervised warm-up. Then ``nemo-fp8rl-report`` writes
``runs/demo/report/report.png`` and ``summary.md``.

    python -m nemo_fp8rl.demo [--steps N] [--out runs/demo] [--recipe tensorwise] [extra overrides...]
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


def arm_command(arm: str, out: Path, steps: int, recipe: str, seed: int, extra: list[str]) -> list[str]:
    overrides = [o.format(recipe=recipe) for o in ARMS[arm]] + COMMON + [
        f"trainer.max_steps={steps}", f"trainer.checkpoint_interval={steps}", f"seed={seed}",
        f"output_dir={out / arm}", f"warmup.cache_dir={out / '.warmup_cache'}",
    ] + list(extra)
    return [sys.executable, "-m", "nemo_fp8rl.train", *overrides]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nemo_fp8rl.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo", help="parent directory of the three runs")
    ap.add_argument("--steps", type=int, default=150, help="RL steps per arm")
    ap.add_argument("--recipe", default="tensorwise", help="FP8 recipe of the two FP8 arms")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every arm")
    args = ap.parse_args(argv)
    out = Path(args.out)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; valid: {list(ARMS)}")
    for a in arms:
        if (out / a / "checkpoints").exists():
            ap.error(f"{out / a} already holds a run; remove it (or pass --out elsewhere) to rerun the demo")
    timings = {}
    for a in arms:
        cmd = arm_command(a, out, args.steps, args.recipe, args.seed, args.overrides)
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
