"""Step-time breakdown of the tiny RL run and the cost of Calibrated Clipping, measured side by side.

Three trainers with the same configuration and seed run in one process, their steps interleaved
(A, B, C, A, B, C, ...) so machine load affects them alike: the FP8 fixed-clip arm
(``calibration=off``), the calibrated arm (``calibration=paper``, interval 20) and the measure-only arm
(``calibration=measure``: the same shadow forwards, bounds kept nominal). The table prints the mean of
each ``timing/*`` phase per arm (weight sync, generation, log-probs, shadow, train; ``PHASES``) and the overheads ``mean step(arm) / mean step(fixed) - 1`` (goal: < 3%
at interval 20; docs/design.md, Calibrated Clipping). The calibrated arm trains differently (other
bounds, other responses), so its ratio also carries trajectory differences; the measure-only arm
follows the fixed arm's trajectory exactly, so its ratio is the cost of calibration alone.

    python benchmarks/bench_step.py [--steps 60] [--interval 20] [--recipe tensorwise]

``--real`` instead measures what FP8 costs per step on the base settings of ``make demo-real`` (SmolLM2-135M,
reasoning-gym chain_sum, ``nemo_fp8rl.demo.REAL``): BF16 (``fp8=off``) against each FP8 recipe with the
fused quantizer (``fp8.compile=true``) and, for comparison, the eager one (``fp8.compile=false``), all
fixed clip, in one process, steps interleaved. Step 0 (compiles, allocator warm-up) is not counted. The
arms' trajectories differ after step 0 (other bounds, other samples), so a few steps' mean is compared,
phase by phase. Target (issue 26): an FP8 step at most 1.2x the BF16 step.

    python benchmarks/bench_step.py --real [--steps 4] [--recipes tensorwise,blockwise] [--threads 2] [--fixed-length]

``--real --correction-cost`` (issue 41) instead prices the two fixes side by side, ``blockwise`` fixed clip
in every arm: no correction pass (``calibration=off``, ``algorithm.old_logprobs=rollout``); the pooled
calibration's shadow passes on every step (``calibration=measure`` with interval 5 and window 5: the
bounds stay nominal, so it follows the first arm's trajectory and its extra time is the passes alone); and
the peers' recompute + TIS (``algorithm.old_logprobs=recompute``: one more FP8 forward over the batch per
step). Per calibration step the shadow passes cost the ``shadow`` + ``push`` seconds printed; at interval
k without pooling they cost that / k per step.

    python benchmarks/bench_step.py --real --correction-cost [--steps 4] --fixed-length

The response lengths (which set the decode steps and the trained tokens) differ between arms, so the
table also prints each arm's mean ``rollout/response_len`` and ``train/global_tokens``; ``--fixed-length``
removes that difference (every response runs to ``rollout.max_new_tokens``) to compare the cost alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from nemo_fp8rl import machine
from nemo_fp8rl.config.schema import TrainConfig
from nemo_fp8rl.trainer import RLTrainer, run_warmup

PHASES = ("rollout", "weight_sync", "logprobs", "shadow", "train", "step")
"""The trainer's ``timing/*`` keys printed per arm. ``weight_sync`` is part of ``rollout`` (the sync to the
rollout engine before it generates); the tables add ``generate`` = rollout - weight_sync, so the split of a
step reads sync | generate | log-prob | shadow | train (issue 39: the phase split on CPU)."""
SIZE_KEYS = ("rollout/response_len", "train/global_tokens")


def phase_rows(times: dict, arms, fmt: str = ">12.4f", width: int = 16) -> list[str]:
    """The phase table's rows: one per phase (mean seconds per step and arm), ``generate`` after ``weight_sync``."""
    rows = []
    for p in PHASES:
        if not any(times[n][p] and statistics.mean(times[n][p]) for n in arms) and p not in ("rollout", "step"):
            continue
        rows.append(f"{p:<{width}}" + "".join(f"{statistics.mean(times[n][p]):{fmt}}" for n in arms))
        if p == "weight_sync":
            gen = {n: statistics.mean(times[n]["rollout"]) - statistics.mean(times[n]["weight_sync"]) for n in arms}
            rows.append(f"{'  generate':<{width}}" + "".join(f"{gen[n]:{fmt}}" for n in arms))
    return rows


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


def real_trainer(out: str, overrides: list, cache_dir: str):
    """An RLTrainer for the demo-real settings plus ``overrides``, composed by Hydra as the CLI does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_fp8rl.demo import REAL
    from nemo_fp8rl.train import CONF_DIR, register_schema, to_train_config

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        dict_cfg = compose("config", overrides=[*REAL, "algorithm=grpo", f"output_dir={out}", "seed=1",
                                                f"warmup.cache_dir={cache_dir}", "logger.progress=none",
                                                "trainer.cpu_threads=0", *overrides])
    GlobalHydra.instance().clear()
    cfg = to_train_config(dict_cfg)
    tr = RLTrainer(cfg)
    tr.setup(warm_start=run_warmup(cfg, tr.model_cfg, tr.task))
    return tr


def main_real(args) -> None:
    from nemo_fp8rl.fp8 import fused

    tmp = tempfile.mkdtemp(prefix="bench_step_real_")
    fixed = ["rollout.stop_on_eos=false"] if args.fixed_length else []
    if args.correction_cost:
        base = ["fp8=blockwise", "fp8.compile=true", *fixed]
        rollout_old = "algorithm.old_logprobs=rollout"  # the study's setting (the trainer default is recompute)
        arms = {"fixed": ([*base, "calibration=off", rollout_old], "true"),
                "pooled shadow": ([*base, "calibration=measure", "calibration.interval=5", "calibration.window=5",
                                   rollout_old], "true"),
                "recompute+tis": ([*base, "calibration=off", "algorithm.old_logprobs=recompute",
                                   "algorithm.rollout_correction=tis", "algorithm.tis_cap=2.0"], "true")}
    else:
        arms = {"bf16": (["fp8=off", "calibration=off", *fixed], "false")}
        for recipe in args.recipes.split(","):
            arms[f"{recipe} fused"] = ([f"fp8={recipe}", "calibration=off", "fp8.compile=true", *fixed], "true")
            arms[f"{recipe} eager"] = ([f"fp8={recipe}", "calibration=off", "fp8.compile=false", *fixed], "false")
    trainers = {name: real_trainer(f"{tmp}/{name.replace(' ', '_')}", ov, args.warmup_cache)
                for name, (ov, _) in arms.items()}
    phases = PHASES
    times = {name: {p: [] for p in phases} for name in arms}
    sizes = {name: {k: [] for k in SIZE_KEYS} for name in arms}
    t0 = time.time()
    for i in range(args.steps + 1):
        for name, tr in trainers.items():
            with fused.compile_mode_set(arms[name][1]):
                m = tr.step()
            if i == 0:
                continue  # compiles and first-touch allocations
            for p in phases:
                times[name][p].append(m.get(f"timing/{p}", 0.0))
            times[name].setdefault("push", []).append(m.get("timing/push_forward", 0.0))
            for k in SIZE_KEYS:
                sizes[name][k].append(m.get(k, 0.0))
    for tr in trainers.values():
        tr.close()
    print(f"demo-real GRPO step (SmolLM2-135M, chain_sum), {args.steps} steps per arm after step 0, interleaved, "
          f"total {time.time() - t0:.0f}s; {machine.describe_line(torch.get_num_threads())}")
    print(f"{'phase (mean s)':<16}" + "".join(f"{n:>18}" for n in arms))
    print("\n".join(phase_rows(times, arms, fmt=">18.2f")))
    for k in SIZE_KEYS:  # the work each arm's steps did: differing sizes confound the time ratios
        print(f"{k:<16}" + "".join(f"{statistics.mean(sizes[n][k]):>18.1f}" for n in arms))
    print(f"{'push (calib)':<16}" + "".join(f"{statistics.mean(times[n]['push']):>18.2f}" for n in arms))
    ref_arm = "fixed" if args.correction_cost else "bf16"
    ref = statistics.mean(times[ref_arm]["step"])
    print(f"{'x ' + ref_arm + ' step':<16}" + "".join(f"{statistics.mean(times[n]['step']) / ref:>18.2f}" for n in arms))
    if args.correction_cost:
        cal = statistics.mean(times["pooled shadow"]["shadow"]) + statistics.mean(times["pooled shadow"]["push"])
        extra = statistics.mean(times["recompute+tis"]["logprobs"]) - statistics.mean(times["fixed"]["logprobs"])
        print(f"calibration passes per calibration step: {cal:.2f}s = {100 * cal / ref:.1f}% of a fixed-clip step "
              f"(every step with window 5 / interval 5; {100 * cal / ref / 10:.1f}% at interval 10, "
              f"{100 * cal / ref / 20:.1f}% at interval 20); recompute: {extra:.2f}s more log-prob time per "
              f"step = {100 * extra / ref:.1f}%")
    if fused.compile_unavailable():
        print(f"note: compile unavailable ({fused.compile_unavailable()}): the fused arms ran eager")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--recipe", default="tensorwise")
    ap.add_argument("--warmup-cache", default="runs/.warmup_cache",
                    help="warm-up cache directory (the warm-up is the trainer's default, computed once)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--real", action="store_true", help="BF16 vs FP8 step on the make demo-real settings")
    ap.add_argument("--recipes", default="tensorwise,blockwise", help="--real: FP8 recipes to compare")
    ap.add_argument("--correction-cost", action="store_true",
                    help="--real: price calibration's shadow passes against recompute + TIS (issue 41)")
    ap.add_argument("--fixed-length", action="store_true",
                    help="--real: rollout.stop_on_eos=false in every arm, so every response has "
                         "rollout.max_new_tokens tokens and every arm's steps process the same shapes (the "
                         "demo's responses end at EOS, and their lengths differ between arms)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.real:
        if args.steps == 60:
            args.steps = 4
        return main_real(args)
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
          f"{args.interval}, total {time.time() - t0:.0f}s; {machine.describe_line(torch.get_num_threads())}")
    print(f"{'phase (mean s)':<16}" + "".join(f"{n:>12}" for n in arms))
    print("\n".join(phase_rows(times, arms)))
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
