"""Step-time breakdown of the tiny RL run and the cost of Calibrated Clipping, measured side by side.

Three trainers with the same configuration and seed run in one process, their steps interleaved
(A, B, C, A, B, C, ...) so machine load affects them alike: the FP8 fixed-clip arm
(``calibration=off``), the calibrated arm (``calibration=paper``, interval 20) and the measure-only arm
(``calibration=measure``: the same shadow forwards, bounds kept nominal). The table prints the mean of
each ``timing/*`` phase per arm and the overheads ``mean step(arm) / mean step(fixed) - 1`` (goal: < 3%
at interval 20; docs/design.md, Calibrated Clipping). The calibrated arm trains differently (other
bounds, other responses), so its ratio also carries trajectory differences; the measure-only arm
follows the fixed arm's trajectory exactly, so its ratio is the cost of calibration alone.

    python benchmarks/bench_step.py [--steps 60] [--interval 20] [--recipe tensorwise]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from nemo_fp8rl.config.schema import TrainConfig
from nemo_fp8rl.trainer import RLTrainer, run_warmup

PHASES = ("rollout", "logprobs", "shadow", "train", "step")


def make_cfg(out: str, recipe: str, mode: str, interval: int, steps: int, cache_dir: str) -> TrainConfig:
    cfg = TrainConfig(output_dir=out, seed=1)
    cfg.fp8.recipe = recipe
    cfg.calibration.enabled = mode != "off"
    cfg.calibration.apply = mode == "paper"
    cfg.calibration.interval = interval
    cfg.algorithm.old_logprobs = "rollout"
    cfg.trainer.max_steps = steps
    cfg.warmup.cache_dir = cache_dir  # the standard warm-up (to 0.45 expected accuracy), shared/cached
    cfg.logger.tensorboard = False
    cfg.logger.progress = "none"
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--recipe", default="tensorwise")
    ap.add_argument("--warmup-cache", default="runs/.warmup_cache",
                    help="warm-up cache directory (the warm-up is the trainer's default, computed once)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench_step_")
    arms = {}
    for name, mode in (("fixed", "off"), ("calibrated", "paper"), ("measured", "measure")):
        cfg = make_cfg(f"{tmp}/{name}", args.recipe, mode, args.interval, args.steps, args.warmup_cache)
        tr = RLTrainer(cfg)
        tr.setup(warm_start=run_warmup(cfg, tr.model_cfg, tr.task))
        arms[name] = tr
    times = {name: {p: [] for p in PHASES} for name in arms}
    t0 = time.time()
    for _ in range(args.steps):
        for name, tr in arms.items():
            m = tr.step()
            for p in PHASES:
                times[name][p].append(m.get(f"timing/{p}", 0.0))
    for tr in arms.values():
        tr.task.close()
    print(f"tiny GRPO step, fp8={args.recipe}, {args.steps} steps per arm interleaved, calibration interval "
          f"{args.interval}, torch threads {torch.get_num_threads()}, total {time.time() - t0:.0f}s")
    print(f"{'phase (mean s)':<16}" + "".join(f"{n:>12}" for n in arms))
    for p in PHASES:
        print(f"{p:<16}" + "".join(f"{statistics.mean(times[n][p]):>12.4f}" for n in arms))
    fixed = statistics.mean(times["fixed"]["step"])
    for arm in ("calibrated", "measured"):
        ratio = statistics.mean(times[arm]["step"]) / fixed - 1
        print(f"overhead of the {arm} arm (mean step / fixed - 1): {100 * ratio:+.2f}%")
    cal_steps = [s for i, s in enumerate(times["calibrated"]["shadow"]) if i % args.interval == 0]
    print(f"shadow forwards per calibration step: {statistics.mean(cal_steps):.3f}s "
          f"= {100 * statistics.mean(cal_steps) / fixed:.1f}% of a fixed-clip step, amortised over "
          f"{args.interval} steps = {100 * statistics.mean(cal_steps) / fixed / args.interval:.2f}%")


if __name__ == "__main__":
    main()
