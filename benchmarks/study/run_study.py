"""The study runner: the paper in miniature on the tiny model, the real-model groups, and issue 28's protocol.

Every run is the real CLI (``python -m nemo_fp8rl.train``), FP8 in training and rollout, old log-probs from
the rollout engine (the demo's setting, where the FP8 ratio noise is visible). Runs go to
``<out>/<group>/<name>/``. ``--jobs`` runs execute side by side (one torch thread each). Afterwards
``summarize.py`` writes ``docs/results.md``.

    python benchmarks/study/run_study.py --out runs/study --steps 100 --jobs 2            # the tiny groups
    python benchmarks/study/run_study.py --only main --recipes tensorwise --seeds 1         # a slice
    python benchmarks/study/run_study.py --list                                             # the plan

**Issue 28's protocol** (``--stage``; SmolLM2-135M on reasoning-gym, docs/results.md): find a regime where
BF16 learns, find the mildest FP8 condition under which fixed-clip FP8 falls behind on seed 1, then confirm
on fresh seeds::

    python benchmarks/study/run_study.py --stage sweep --plan                       # BF16 regime sweep, seed 1
    python benchmarks/study/run_study.py --stage sweep --chunks 1 --commit          # the next <= 2 h of it
    python benchmarks/study/run_study.py --stage explore --regime lr1e-5 --plan     # FP8 conditions, seed 1
    python benchmarks/study/run_study.py --stage explore --regime lr1e-5 --chunks 1 --commit
    python benchmarks/study/run_study.py --stage confirm --regime lr1e-5 --condition e5m2 --plan
    python benchmarks/study/run_study.py --stage confirm --regime lr1e-5 --condition e5m2 --chunks 1 --commit
    python benchmarks/study/run_study.py --stage sweep --report     # markdown tables for docs/results.md

``--report`` reads each run of the stage from ``<out>`` or its committed record and prints the stage's
table (protocol_report.py defines the columns): the sweep with issue 28's target per point, the
exploration's runs, the confirmation's runs and its paired per-seed differences with bootstrap intervals.

* ``sweep``: the BF16 arm (``fp8=off calibration=measure``: bounds nominal, BF16's own ``calib/`` metrics
  and negative push logged) at each named point of :data:`SWEEP` (learning rate, minibatches/epochs, group
  size, task and difficulty, response format and length), seed :data:`SWEEP_SEED`, ``--sweep-steps``.
* ``explore``: on the ``--regime`` sweep point, seed :data:`EXPLORE_SEED`: BF16 and fixed-clip FP8
  (``calibration=measure``) under each condition of :data:`EXPLORE` (a condition's non-FP8 overrides, e.g.
  the learning rate or the response length, apply to its BF16 reference too), ``--explore-steps``. The
  regime's own BF16 reference is the sweep's run of that point when the seeds and steps agree.
* ``confirm``: on the ``--regime`` and the exploration's ``--condition``, ``--confirm-seeds`` (never a
  sweep or exploration seed: refused), the arms of :data:`PROTOCOL_ARMS`: bf16, fp8 (fixed clip),
  fp8_calibrated (``calibration=paper``), fp8_calibrated_upper_fixed (``calibration.upper_mode=fixed``) and
  the control fp8_fixed_wide (fixed clip at [0.5, 2.0]), ``--confirm-steps``; planned primary arms seed by
  seed first, then the ablation (:data:`PROTOCOL_ABLATION_ARMS`), then the control
  (:data:`PROTOCOL_CONTROL_ARMS`).
* ``track`` (issue 41): the arms of :data:`TRACK_ARMS` on each candidate of :data:`TRACK_CANDIDATES`, seed
  :data:`EXPLORE_SEED`, with pooled calibration and the stop string; ``--report`` adds the exploration rule's
  table and its choice (``protocol_report.track_rule``).
* ``track_confirm`` (issue 41): on the one ``--candidates`` the rule chose (else refused, unless
  ``--any-candidate``), ``--confirm-seeds`` (default :data:`TRACK_CONFIRM_SEEDS`; never
  :data:`TRACK_USED_SEEDS`), the arms of :data:`TRACK_CONFIRM_ARMS` seed by seed, then
  :data:`TRACK_CONFIRM_LATE_ARMS`; ``--report`` adds the paired tables and the verdicts on questions 1 and 2.

Every protocol run calibrates (or, bf16 and fixed clip, measures) every :data:`PROTOCOL_CALIB_INTERVAL`
steps, so every arm logs ``calib/neg_push`` (nemo_fp8rl/algorithms/push.py) on the same steps.

**Surviving interruption.** Any run of any group:

* is *done* when its ``metrics.jsonl`` (in ``<out>`` or in the ``--record`` copy) holds all its steps;
* is *resumed* from its newest checkpoint when one is on disk (``resume=true``; checkpoints every
  ``--checkpoint-every`` steps of the protocol, ``trainer.keep_last=1`` always), else *restarted*;
* has its settings written to ``<run>/study_run.json`` (stage, name, seed, steps, overrides, command, and
  each attempt: start, step resumed from, code commit, machine (CPU, its AVX-512/AMX flags, torch), wall
  time, exit code); a run directory whose recorded overrides differ from the plan's is refused, not mixed;
* is *stopped at a checkpoint* when the study gets SIGTERM, SIGINT or SIGUSR1 (:class:`Stop`): the running
  trainers get SIGTERM, checkpoint and exit, no new run starts, and the study exits non-zero (exit code 7
  for those runs); the same command resumes them;
* with ``--commit``: once finished, its small files (:data:`SMALL_FILES`: metrics, samples, resolved
  config, warm-up record, study_run.json) and a per-run figure (``report/report.png``, ``summary.md``) are
  copied to ``<record>/<group>/<name>/`` (default ``benchmarks/study/records``) and committed with
  ``git add`` + ``git commit -- <those paths>``: never a checkpoint, the ``hf/`` export or the warm-up cache.

``--plan`` prints the remaining work in chunks of at most ``--chunk-hours`` (2 h) at ``--jobs`` runs side
by side, each run's state (fresh / restart / resume from step N), remaining steps and estimated minutes,
from measured step times (``timing/step`` of runs already in ``<out>`` or ``<record>`` with the same
settings, else the same arm kind scaled by the batch's tokens, else :data:`STEP_SECONDS`). ``--chunks N``
runs the next N chunks (each finishes, and is committed run by run, on its own); without it every
remaining chunk runs. ``--prune-finished`` deletes a finished run's ``checkpoints/`` and ``hf/`` after
recording it.

Disk (measured 2026-12-01 on SmolLM2-135M runs): a checkpoint is 1.62 GB (float32 weights and Adam
moments), the final ``hf/`` export 0.52 GB, a warm-up cache entry 0.62 GB per (model, task, warm-up
settings, seed); a run's record is ~0.2 MB (the figure 0.17 MB). With ``keep_last=1`` a save writes the
new checkpoint before it prunes the old one, so one running run peaks at 3.3 GB (3.8 GB when extending a
finished run, whose ``hf/`` is still there) and a finished one keeps 2.1 GB (``--prune-finished``: under
1 MB). A stage at ``--jobs 2``: 2 x 3.8 GB while running plus 2.1 GB per finished run kept plus 0.62 GB
per warm-up (sweep: ~11 GB with pruning, ~30 GB without; confirmation: 3 seeds' warm-ups, ~10 GB with
pruning, ~35 GB without).

Groups of the tiny study (``--only``):
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
* ``real``: a real pretrained LLM, SmolLM2-135M-Instruct on reasoning-gym chain_sum with the
  base settings of ``make demo-real`` (``nemo_fp8rl.demo.REAL``, without its regime: short format warm-up, 8 prompts x 4 responses x 32
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
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nemo_fp8rl import machine
from nemo_fp8rl.demo import REAL, sample_steps

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol_report  # noqa: E402 - benchmarks/study is not a package

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the default record directory lives under it)."""

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
# 0.4-0.8); SmolLM2 with REAL's 8 prompts x 4 responses (python -m nemo_fp8rl.demo --real --base-regime --steps 2,
# tensorwise, 2026-12-01: bf16 31.6 / 28.9 s, fp8 56.3 (calibration measured) / 42.5 s, fp8_calibrated
# 52.8 / 48.0 s), plus ~20 s start-up and the final export per run. REAL_WARMUP_S: the format warm-up
# (219 s measured), once per seed (cached, shared by the seed's runs).
STEP_SECONDS = {"tiny": 0.8, "real/bf16": 32.0, "real/fp8": 48.0, "real/fp8_calibrated": 50.0}
RUN_OVERHEAD_S = {"tiny": 5.0, "real": 30.0}
REAL_WARMUP_S = 220.0
REAL_RECIPE_FACTOR = {"blockwise": 1.1}
"""Step time of a recipe relative to tensorwise on SmolLM2: 2.3x with the eager quantizer (96 s vs 42 s), about
1.0x with the fused one (docs/results.md, "Trainer step": 60.8 s vs 62.6 s at equal shapes); 1.1 leaves room."""


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


# ------------------------------------------------------------------ issue 28's protocol (--stage)
PROTOCOL_CALIB_INTERVAL = 10
"""Calibration (fp8_calibrated) and measurement (bf16, fixed clip) every 10 steps: 10-15 points of the
negative push per run of 100-150 steps. Cost on SmolLM2 (benchmarks/study/real_notes.md): a calibration
step runs four high-precision forwards without backward (old log-probs, one per minibatch, the push);
measured 8.4 s of them in a tensorwise FP8 step (the push 2.7 s) against ~27 s for a plain step, so about
3% of the mean step time at interval 10 for the FP8 arms; in a BF16 arm, whose own step is cheaper, 106 s
against a 116 s plain step under heavy machine load, about 9%."""
PROTOCOL_BASE = ["algorithm=grpo", *REAL, f"calibration.interval={PROTOCOL_CALIB_INTERVAL}"]
"""The base settings of make demo-real (``nemo_fp8rl.demo.REAL``: SmolLM2-135M-Instruct, reasoning-gym
chain_sum 2-3 terms of 1-2 digits, a 30-step format warm-up, 8 prompts x 4 responses x 32 tokens, 2
minibatches, lr 3e-6; the demo adds the regime this protocol confirmed, ``demo.REAL_REGIME``), calibrating every
:data:`PROTOCOL_CALIB_INTERVAL` steps. The later of two overrides of one key wins (Hydra)."""
PROTOCOL_ARMS = {
    "bf16": ["fp8=off", "calibration=measure"],  # bounds nominal; BF16's own calib/ metrics and push
    "fp8": ["calibration=measure"],  # fixed clip; measures how it would have been calibrated
    "fp8_calibrated": ["calibration=paper"],
    "fp8_calibrated_upper_fixed": ["calibration=paper", "calibration.upper_mode=fixed"],  # the ablation
    # the control (added 2026-12-03, after the 12 runs above): fixed clip at the window the calibrated arm
    # settled on there, [lower_min, its mean upper bound in force] = [0.5, 2.0]; measured, not applied
    "fp8_fixed_wide": ["calibration=measure", "algorithm.eps_low=0.5", "algorithm.eps_high=1.0"],
}
"""The confirmation's arms (the FP8 recipe comes from the condition); exploration runs bf16 and fp8."""
PROTOCOL_ABLATION_ARMS = ("fp8_calibrated_upper_fixed",)
"""The confirmation's ablation arms: planned after every seed of the primary arms."""
PROTOCOL_CONTROL_ARMS = ("fp8_fixed_wide",)
"""Control arms added after the confirmation's 12 runs had finished (docs/results.md, "Control: a fixed wide
window"): planned last, after the ablation."""
SWEEP_SEED = 1
EXPLORE_SEED = 1
SWEEP = {
    "base": [],
    "lr1e-5": ["optim.lr=1e-5"],
    "lr3e-5": ["optim.lr=3e-5"],
    "lr1e-5_mb4": ["optim.lr=1e-5", "algorithm.minibatches_per_step=4"],
    "lr1e-5_epochs2": ["optim.lr=1e-5", "algorithm.epochs=2"],
    # group 8 x 4 prompts: the same 32 responses per step
    "lr1e-5_group8": ["optim.lr=1e-5", "algorithm.group_size=8", "algorithm.prompts_per_step=4"],
    "lr1e-5_easy": ["optim.lr=1e-5", "task.dataset_kwargs.max_terms=2", "task.dataset_kwargs.max_digits=1"],
    "lr1e-5_hard": ["optim.lr=1e-5", "task.dataset_kwargs.min_terms=3", "task.dataset_kwargs.max_terms=4"],
    "lr1e-5_products": ["optim.lr=1e-5", "task.dataset=products", "task.dataset_kwargs.max_terms=2"],
    "lr1e-5_len64": ["optim.lr=1e-5", "rollout.max_new_tokens=64"],
    # "reason, then answer": the warm-up still teaches the bare tag format; the prompt invites a few words
    "lr1e-5_reason64": ["optim.lr=1e-5", "rollout.max_new_tokens=64",
                        "task.system_prompt='Think in one or two short sentences, then give the final answer "
                        "in <answer></answer> tags, e.g. <answer>42</answer>.'"],
}
"""The BF16 regime sweep: named points on top of :data:`PROTOCOL_BASE` (one factor or two at a time;
add points here, a point's name is its run directory). Target (issue 28): reward +0.15 (mean of the
first 10 steps vs the last 10) within 150 steps and ``calib/alpha_bf16`` >= 0.01."""
EXPLORE = {
    "tensorwise": ["fp8=tensorwise"],
    "blockwise": ["fp8=blockwise"],
    "e5m2": ["fp8=tensorwise", "fp8.fp8_format=e5m2"],
    "fast_accum": ["fp8=tensorwise", "fp8.accumulation=fast"],
    "2xlr": ["fp8=tensorwise", "optim.lr={lr2x}"],
    "e5m2_2xlr": ["fp8=tensorwise", "fp8.fp8_format=e5m2", "optim.lr={lr2x}"],
    "len64": ["fp8=tensorwise", "rollout.max_new_tokens=64"],
    # the FP8 KV cache with vLLM's default static scales (1.0 per layer), the full FP8 rollout pipeline
    "kv_e4m3_static": ["fp8=tensorwise", "rollout.fp8.kv_cache=e4m3", "rollout.fp8.kv_scales=static"],
    "kv_e4m3_static_len64": ["fp8=tensorwise", "rollout.fp8.kv_cache=e4m3", "rollout.fp8.kv_scales=static",
                             "rollout.max_new_tokens=64"],
}
"""The exploration's FP8 conditions (``{lr2x}``: twice the regime's learning rate). Overrides of ``fp8*`` and
``rollout.fp8*`` keys (:data:`FP8_KEYS`) apply to the FP8 arms only; the others (learning rate, length) to
the condition's BF16 reference too."""
FP8_KEYS = ("fp8", "rollout.fp8")

# ------------------------------------------------------------------ issue 41: tracking vs a fixed window
TRACK_CALIB = ["calibration.interval=5", "calibration.window=5"]
"""Calibration of issue 41's arms: every step is observed (shadow forwards on each), and the bounds are
recomputed every 5 steps from the 5 steps' pooled tokens (``calibration.window``): about 5x the 32-213
non-zero-advantage tokens of one step of this batch, so alpha is measured rather than 0 (docs/design.md,
"Rounds"). The same interval for the measuring arms, so every arm logs ``calib/*`` on the same steps."""
TRACK_STOP = ['rollout.stop=["</answer>"]']
"""Issue 41 item 6: responses end at the closing answer tag (no text after the answer to score)."""
TRACK_ARMS = {
    "bf16": ["fp8=off", "calibration=measure", *TRACK_CALIB],
    "fp8": ["calibration=measure", *TRACK_CALIB],
    "fp8_calibrated": ["calibration=paper", *TRACK_CALIB],
    # fixed clip at calibration's own median bounds on the exploration seed (TRACK_WIDE); planned once known
    "fp8_fixed_wide": ["calibration=measure", *TRACK_CALIB, "algorithm.eps_low={wide_eps_low}",
                       "algorithm.eps_high={wide_eps_high}"],
    # added 2026-12-04 20:30 after the pooled seed-1 run (docs/results.md): the measured L* lies at 0.006-0.075,
    # so with lower_min 0.5 the guard, not the match, sets the bound; this arm lets the match set it
    "fp8_calibrated_low": ["calibration=paper", *TRACK_CALIB, "calibration.lower_min=0.01"],
    # what verl / NeMo RL users switch on today: the trainer's own FP8 forward as pi_old before the update, and
    # token-level TIS (C = 2) on pi_old / pi_rollout; fixed clip
    "fp8_recompute_tis": ["calibration=measure", *TRACK_CALIB, "algorithm.old_logprobs=recompute",
                          "algorithm.rollout_correction=tis", "algorithm.tis_cap=2.0"],
}
"""Issue 41's arms (the FP8 recipe comes from the candidate); docs/results.md, "Tracking vs a fixed window"."""
TRACK_CANDIDATES = {
    # lr1e-5_easy (the confirmed regime) run twice as long: the entropy falls towards 0.02 by step 100
    "long200": {"regime": "lr1e-5_easy", "extra": ["fp8=blockwise"], "steps": 200, "departures": 1},
    # a higher learning rate: a wide fixed window lets through updates BF16's quantile would clip
    "2xlr": {"regime": "lr1e-5_easy", "extra": ["fp8=blockwise", "optim.lr=2e-05"], "steps": 100, "departures": 1},
    # larger FP8 noise (E5M2 forward), the exploration's noisiest qualifying condition
    "e5m2": {"regime": "lr1e-5_easy", "extra": ["fp8=tensorwise", "fp8.fp8_format=e5m2"], "steps": 100,
             "departures": 2},
}
"""Issue 41's candidate regimes, explored on seed 1 (:data:`EXPLORE_SEED`): a candidate's non-FP8 overrides
apply to its BF16 reference too (as :data:`EXPLORE`'s). ``departures``: how many settings it changes from the
confirmed regime (lr1e-5_easy, blockwise, 100 steps): the rule's tie-break (e5m2 changes the recipe and the
format)."""
TRACK_WIDE: dict[str, tuple[float, float]] = {
    # 2026-12-05 from the seed-1 fp8_calibrated records (steps 6-99): lower 0.500 [0.500, 0.519], upper 2.289
    "2xlr": (0.5, 2.29),
    # lower 0.500 [0.500, 0.590], upper 2.372
    "e5m2": (0.5, 2.37),
    # 2026-12-06 from the seed-1 long200 fp8_calibrated record (steps 6-199): lower 0.500 [0.500, 0.589], upper 2.095
    "long200": (0.5, 2.10),
}
"""Per candidate, the fixed window (lower, upper) of its ``fp8_fixed_wide`` arm: the medians over steps of
``clip/lower`` and ``clip/upper`` in force in its seed-1 ``fp8_calibrated`` run (after the first round), filled
in by hand once that run has finished (``--stage track --report`` prints them). Until then the arm is not
planned."""
TRACK_ARM_ORDER = ("fp8_calibrated", "fp8_fixed_wide", "bf16", "fp8", "fp8_recompute_tis", "fp8_calibrated_low")
"""The plan's order (docs/results.md): the calibrated run first (its bounds set the fixed window), then that window,
then the references."""
TRACK_CONFIRM_ARMS = ("fp8_calibrated", "fp8_fixed_wide", "fp8_recompute_tis", "bf16", "fp8")
"""The confirmation's arms as the plan wrote them before any track run (docs/results.md, 2026-12-04 19:10), in
the order each seed runs them: the two arms of question 1 first, then question 2's, then the references."""
TRACK_CONFIRM_LATE_ARMS = ("fp8_calibrated_low",)
"""Added to the exploration before any track run and judged by the same rule; not in the plan's list of
confirmation arms, so planned after every seed of :data:`TRACK_CONFIRM_ARMS`: it delays none of them."""
TRACK_USED_SEEDS = (SWEEP_SEED, EXPLORE_SEED, 11, 12, 13)
"""Seeds the confirmation of issue 41 never uses: the sweep's and the exploration's (1), and the first
confirmation's (11-13, whose results motivated the questions)."""
TRACK_CONFIRM_SEEDS = "21,22,23"
"""``--confirm-seeds``' default for ``--stage track_confirm`` (3 first, then chunks up to 11, the plan's power)."""


def _track_overrides(cand: str, arm: str) -> list[str]:
    """The overrides of ``arm`` on the track candidate ``cand`` (its regime, the stop string, its FP8 recipe for
    the FP8 arms and only its non-FP8 settings for bf16, the arm's calibration; fp8_fixed_wide at
    :data:`TRACK_WIDE`, which must be known)."""
    c = TRACK_CANDIDATES[cand]
    regime = [*PROTOCOL_BASE, *SWEEP[c["regime"]], *TRACK_STOP]
    extra = list(c["extra"])
    shared = [o for o in extra if not o.startswith(FP8_KEYS)]
    ov = list(TRACK_ARMS[arm])
    if arm == "fp8_fixed_wide":
        lo, hi = TRACK_WIDE[cand]
        ov = [o.format(wide_eps_low=f"{1 - lo:g}", wide_eps_high=f"{hi - 1:g}") for o in ov]
    return [*regime, *(shared if arm == "bf16" else extra), *ov]


def track_rule(out: Path, record: Path) -> dict:
    """:func:`protocol_report.track_rule` on the seed-1 exploration runs (``--stage track``) in ``out`` or
    their records; a run counts once it has all its steps."""
    runs = stage_runs(argparse.Namespace(stage="track", candidates="", checkpoint_every=10))
    by_cand: dict[str, dict[str, dict | None]] = {c: {} for c in TRACK_CANDIDATES}
    for r in runs:
        s = protocol_report.run_stats(protocol_report.read_metrics([run_dir(out, r), record / r["group"] / r["name"]]))
        by_cand[r["name"].split("/")[0]][r["arm"]] = s if s["steps"] >= r["steps"] else None
    return protocol_report.track_rule(by_cand, {c: v["departures"] for c, v in TRACK_CANDIDATES.items()})


def _last(overrides: list[str], key: str, default: str | None = None) -> str | None:
    """The value the last override of ``key`` sets (Hydra: the later override wins), else ``default``."""
    for o in reversed(overrides):
        k, _, v = o.lstrip("+").partition("=")
        if k == key:
            return v
    return default


def _select(names: str, table: dict) -> list[str]:
    chosen = [n for n in names.split(",") if n] if names else list(table)
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise SystemExit(f"unknown name(s) {unknown}; valid: {list(table)}")
    return chosen


def _seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def stage_runs(args) -> list[dict]:
    """The runs of ``--stage`` (sweep | explore | confirm), each ``{group, name, seed, steps, arm, overrides,
    checkpoint_interval}``; the group is the stage."""
    ckpt = args.checkpoint_every

    def run(name, seed, steps, arm, overrides):
        return dict(group=args.stage, name=f"{name}/seed{seed}", seed=seed, steps=steps, arm=arm,
                    checkpoint_interval=ckpt, overrides=overrides)

    if args.stage == "track":
        return [run(f"{cand}/{arm}", EXPLORE_SEED, TRACK_CANDIDATES[cand]["steps"], arm, _track_overrides(cand, arm))
                for cand in _select(args.candidates, TRACK_CANDIDATES) for arm in TRACK_ARM_ORDER
                if arm != "fp8_fixed_wide" or cand in TRACK_WIDE]
    if args.stage == "track_confirm":
        cand = _select(args.candidates, TRACK_CANDIDATES) if args.candidates else []
        if len(cand) != 1:
            raise SystemExit("--stage track_confirm needs --candidates with one candidate: the exploration's "
                             "choice (--stage track --report prints the rule's outcome)")
        cand = cand[0]
        seeds = _seeds(args.confirm_seeds or TRACK_CONFIRM_SEEDS)
        used = sorted(set(seeds) & set(TRACK_USED_SEEDS))
        if used:
            raise SystemExit(f"--confirm-seeds {used} were used by the sweep, the exploration or the first "
                             f"confirmation ({sorted(set(TRACK_USED_SEEDS))}); issue 41's confirmation needs fresh "
                             f"seeds, e.g. the default {TRACK_CONFIRM_SEEDS}")
        if cand not in TRACK_WIDE:
            raise SystemExit(f"candidate {cand!r} has no fixed window in TRACK_WIDE yet: fill it from its seed-1 "
                             "fp8_calibrated run (--stage track --report) first")
        if not getattr(args, "any_candidate", False):
            rule = track_rule(Path(args.out), Path(args.record))
            if rule["choice"] != cand:
                raise SystemExit(f"--candidates {cand}: the exploration's rule (docs/results.md) does not choose it; "
                                 f"its outcome: {rule['finding']}. Run --stage track --report for the table, or pass "
                                 "--any-candidate to run it outside the plan (then say so beside its numbers)")
        steps = TRACK_CANDIDATES[cand]["steps"]
        order = [(seed, arm) for seed in seeds for arm in TRACK_CONFIRM_ARMS]
        order += [(seed, arm) for arm in TRACK_CONFIRM_LATE_ARMS for seed in seeds]
        return [run(f"{cand}/{arm}", seed, steps, arm, _track_overrides(cand, arm)) for seed, arm in order]
    if args.stage == "sweep":
        return [run(p, SWEEP_SEED, args.sweep_steps, "bf16", [*PROTOCOL_BASE, *SWEEP[p], *PROTOCOL_ARMS["bf16"]])
                for p in _select(args.points, SWEEP)]
    if args.regime not in SWEEP:
        raise SystemExit(f"--regime {args.regime!r} is not a sweep point; valid: {list(SWEEP)}")
    regime = [*PROTOCOL_BASE, *SWEEP[args.regime]]
    lr2x = f"{2 * float(_last(regime, 'optim.lr')):g}"

    def condition(cond):
        extra = [o.format(lr2x=lr2x) for o in EXPLORE[cond]]
        return extra, [o for o in extra if not o.startswith(FP8_KEYS)]  # (FP8 arms', BF16 reference's)

    if args.stage == "explore":
        ref = run(f"{args.regime}/bf16", EXPLORE_SEED, args.explore_steps, "bf16", [*regime, *PROTOCOL_ARMS["bf16"]])
        if EXPLORE_SEED == SWEEP_SEED and args.explore_steps == args.sweep_steps:
            # the sweep's run of this point has the same overrides, seed and steps, and a run is deterministic
            # on CPU: it is the reference (a second run would repeat it step for step, ~1.7 h)
            ref = dict(ref, group="sweep", name=f"{args.regime}/seed{SWEEP_SEED}")
        runs = [ref]
        for cond in _select(args.conditions, EXPLORE):
            extra, shared = condition(cond)
            if shared:  # a condition that changes more than FP8 has its own BF16 reference
                runs.append(run(f"{args.regime}/{cond}/bf16", EXPLORE_SEED, args.explore_steps, "bf16",
                                [*regime, *shared, *PROTOCOL_ARMS["bf16"]]))
            runs.append(run(f"{args.regime}/{cond}/fp8", EXPLORE_SEED, args.explore_steps, "fp8",
                            [*regime, *extra, *PROTOCOL_ARMS["fp8"]]))
        return runs
    if args.stage == "confirm":
        if not args.condition:
            raise SystemExit("--stage confirm needs --condition: the exploration's outcome (one of "
                             f"{list(EXPLORE)}), fixed and written into docs/results.md before the runs")
        cond = _select(args.condition, EXPLORE)
        if len(cond) != 1:
            raise SystemExit("--condition takes one exploration condition")
        confirm_seeds = _seeds(args.confirm_seeds or "11,12,13")
        used = sorted(set(confirm_seeds) & {SWEEP_SEED, EXPLORE_SEED})
        if used:
            raise SystemExit(f"--confirm-seeds {used} were used by the sweep or the exploration; the "
                             "confirmation needs fresh seeds")
        extra, shared = condition(cond[0])
        # Plan order: the primary arms (bf16, fp8, fp8_calibrated) seed by seed, then the ablation's seeds.
        # A session's machine is fresh (checkpoints do not outlive it), so the confirmation advances by
        # the runs that finish within one session; this order completes the failure-and-repair comparison
        # before the ablation. The order is fixed before any confirmation result exists; it selects nothing.
        # The control arm came after all of that, so it is planned last.
        primary = [a for a in PROTOCOL_ARMS if a not in PROTOCOL_ABLATION_ARMS + PROTOCOL_CONTROL_ARMS]
        order = [(seed, arm) for seed in confirm_seeds for arm in primary]
        order += [(seed, arm) for arm in PROTOCOL_ABLATION_ARMS + PROTOCOL_CONTROL_ARMS for seed in confirm_seeds]
        return [run(f"{args.regime}/{cond[0]}/{arm}", seed, args.confirm_steps, arm,
                    [*regime, *(shared if arm == "bf16" else extra), *PROTOCOL_ARMS[arm]])
                for seed, arm in order]
    raise SystemExit(f"--stage {args.stage!r}: choose sweep, explore, confirm, track or track_confirm")


# ------------------------------------------------------------------ run state: done / resume / restart
SMALL_FILES = ("metrics.jsonl", "samples.jsonl", "config.yaml", "warmup.json", "study_run.json")
"""A run's files that are recorded and committed (a few hundred kB); never ``checkpoints/``, ``hf/``,
``tb/`` or the warm-up cache."""
REPORT_FILES = ("report/report.png", "report/summary.md")
"""The per-run figure and table written into the record by ``nemo_fp8rl.report.make_report``."""


def run_dir(out: Path, run: dict) -> Path:
    return out / run["group"] / run["name"]


def steps_logged(d: Path) -> int:
    """Steps in ``d/metrics.jsonl`` (a cut last line, from a killed run, is not counted)."""
    return len(protocol_report.read_metrics([d]))


def latest_checkpoint(d: Path) -> int | None:
    """The step of the newest complete checkpoint under ``d/checkpoints`` (what ``resume=true`` loads)."""
    from nemo_fp8rl.trainer.atomic_publish import latest_step

    return latest_step(d / "checkpoints")


def run_state(run: dict, out: Path, record: Path | None, steps: int) -> tuple[str, int]:
    """What running ``run`` now means: ``("done", n)`` (its metrics hold all ``steps``, in ``out`` or in the
    record), ``("resume", k)`` (a checkpoint of step k is on disk: the trainer continues from it),
    ``("restart", 0)`` (a partial run without a checkpoint: it starts again from step 0) or ``("fresh", 0)``."""
    d = run_dir(out, run)
    for where in (d, record / run["group"] / run["name"] if record else None):
        if where is not None and steps_logged(where) >= steps:
            return "done", steps_logged(where)
    k = latest_checkpoint(d) if d.is_dir() else None
    if k is not None:
        return "resume", k
    return ("restart", 0) if (d / "metrics.jsonl").exists() else ("fresh", 0)


def done(run_dir: Path, steps: int) -> bool:
    return steps_logged(run_dir) >= steps


# ------------------------------------------------------------------ estimates from measured step times
COST_FREE = ("optim.lr=", "calibration=", "calibration.upper_mode=", "calibration.ema=", "calibration.apply=",
             "fp8.fp8_format=", "seed=")
"""Overrides that do not change a step's cost (same work, other numbers)."""


def cost_key(overrides: list[str]) -> tuple:
    return tuple(sorted({o for o in overrides if not o.startswith(COST_FREE)}))


def arm_kind(overrides: list[str]) -> tuple[str, str]:
    """(model, precision): ('real' | 'tiny', 'bf16' | the FP8 recipe)."""
    model = "real" if any(o.startswith("model=smollm2") for o in overrides) else "tiny"
    recipe = _last(overrides, "fp8", "tensorwise")
    return model, "bf16" if recipe == "off" else recipe


def work(overrides: list[str]) -> float:
    """Response tokens trained per step, relative units: prompts x group x max_new_tokens x epochs."""
    keys = {"algorithm.prompts_per_step": "1", "algorithm.group_size": "1", "rollout.max_new_tokens": "8",
            "algorithm.epochs": "1"}
    w = 1.0
    for key, default in keys.items():
        w *= float(_last(overrides, key, default))
    return w


def mean_step_s(d: Path) -> float | None:
    m = d / "metrics.jsonl"
    if not m.is_file():
        return None
    xs = []
    for line in m.read_text().splitlines():
        try:
            x = json.loads(line).get("timing/step")
        except json.JSONDecodeError:
            break
        if isinstance(x, (int, float)):
            xs.append(float(x))
    return sum(xs) / len(xs) if xs else None


def measured_runs(roots: list[Path]) -> list[tuple[list[str], float]]:
    """``(overrides, mean timing/step)`` of every run under ``roots`` that has a ``study_run.json`` and steps."""
    found = {}
    for root in roots:  # a run in both <out> and the record counts once (<out>'s copy is the newer)
        if not root.is_dir():
            continue
        for meta in root.glob("**/study_run.json"):
            s = mean_step_s(meta.parent)
            key = meta.parent.relative_to(root).as_posix()
            if s is not None and key not in found:
                found[key] = (json.loads(meta.read_text())["overrides"], s)
    return list(found.values())


def step_estimate(run: dict, measured: list[tuple[list[str], float]], own: float | None) -> tuple[float, str]:
    """Seconds per step of ``run`` and where the number comes from."""
    if own is not None:
        return own, "measured: this run"
    ov = run["overrides"]
    same = [s for o, s in measured if cost_key(o) == cost_key(ov)]
    if same:
        return sum(same) / len(same), f"measured: {len(same)} run(s) with these settings"
    kind = [s * work(ov) / work(o) for o, s in measured if arm_kind(o) == arm_kind(ov)]
    if kind:
        return sum(kind) / len(kind), f"measured: {len(kind)} {'/'.join(arm_kind(ov))} run(s), scaled by tokens"
    model, precision = arm_kind(ov)
    if model == "real":
        base = STEP_SECONDS["real/bf16" if precision == "bf16" else "real/fp8_calibrated"]
        if precision not in ("bf16", "tensorwise"):
            base *= REAL_RECIPE_FACTOR.get(precision, 1.0)
        ref = work(["algorithm.prompts_per_step=8", "algorithm.group_size=4", "rollout.max_new_tokens=32"])
        return base * work(ov) / ref, "STEP_SECONDS (not measured yet), scaled by tokens"
    return STEP_SECONDS["tiny"], "STEP_SECONDS (not measured yet)"


def warmup_key(run: dict) -> tuple:
    """What the cached warm-up depends on, as far as the overrides tell: seed, model, task, warm-up."""
    return run["seed"], tuple(o for o in run["overrides"] if o.lstrip("+").startswith(("model", "task", "warmup")))


def annotate(runs: list[dict], out: Path, record: Path | None, default_steps: int) -> list[dict]:
    """Each run with its state, remaining steps and estimated seconds (``est_s``, incl. start-up and, for
    the first run of a warm-up no run in ``out`` has started, the warm-up)."""
    measured = measured_runs([out] + ([record] if record else []))
    warmed = {warmup_key(r) for r in runs if (run_dir(out, r) / "config.yaml").exists()}
    rows = []
    for r in runs:
        steps = r.get("steps", default_steps)
        state, k = run_state(r, out, record, steps)
        remaining = 0 if state == "done" else steps - k
        own = mean_step_s(run_dir(out, r)) if state == "resume" else None
        per_step, source = step_estimate(r, measured, own)
        model = arm_kind(r["overrides"])[0]
        est = 0.0
        if remaining:
            est = RUN_OVERHEAD_S[model] + remaining * per_step
            if state != "resume" and warmup_key(r) not in warmed and model == "real":
                est += REAL_WARMUP_S
                warmed.add(warmup_key(r))
        rows.append(dict(r, steps=steps, state=state, at_step=k, remaining=remaining, step_s=per_step,
                         source=source, est_s=est))
    return rows


def lanes_wall_s(estimates: list[float], jobs: int) -> float:
    """Wall time of running ``estimates`` in order on ``jobs`` lanes (each run takes the first free lane)."""
    lanes = [0.0] * max(jobs, 1)
    for e in estimates:
        i = lanes.index(min(lanes))
        lanes[i] += e
    return max(lanes)


def chunks(rows: list[dict], jobs: int, budget_s: float) -> list[list[dict]]:
    """The remaining runs, in plan order, cut into chunks whose wall time at ``jobs`` runs side by side is at
    most ``budget_s`` (a run longer than that is a chunk of its own; its checkpoints carry it over a cut)."""
    out: list[list[dict]] = []
    cur: list[dict] = []
    for r in (r for r in rows if r["remaining"]):
        if cur and lanes_wall_s([x["est_s"] for x in cur + [r]], jobs) > budget_s:
            out.append(cur)
            cur = []
        cur.append(r)
    return out + ([cur] if cur else [])


def print_plan(rows: list[dict], jobs: int, budget_s: float) -> None:
    parts = chunks(rows, jobs, budget_s)
    for i, c in enumerate(parts, 1):
        print(f"chunk {i}: ~{lanes_wall_s([r['est_s'] for r in c], jobs) / 3600:.1f} h with --jobs {jobs}")
        for r in c:
            state = f"resume from step {r['at_step']}" if r["state"] == "resume" else r["state"]
            print(f"  {r['group']} {r['name']}  {state}, {r['remaining']}/{r['steps']} steps, "
                  f"~{r['est_s'] / 60:.0f} min ({r['step_s']:.1f} s/step, {r['source']})")
    left = [r for r in rows if r["remaining"]]
    total = sum(r["est_s"] for r in left)
    wall = sum(lanes_wall_s([r["est_s"] for r in c], jobs) for c in parts)
    print(f"remaining: {len(left)} of {len(rows)} runs, {sum(r['remaining'] for r in left)} steps, "
          f"~{wall / 3600:.1f} h in {len(parts)} chunk(s) of <= {budget_s / 3600:g} h with --jobs {jobs} "
          f"(~{total / 3600:.1f} h one at a time); done: {len(rows) - len(left)}")


# ------------------------------------------------------------------ record and commit
def small_files(d: Path) -> list[Path]:
    """The files of run directory ``d`` that are recorded (:data:`SMALL_FILES` that exist); nothing under
    ``checkpoints/``, ``hf/`` or ``tb/``."""
    return [d / f for f in SMALL_FILES if (d / f).is_file()]


def record_run(run: dict, d: Path, record: Path, figure: bool = True) -> list[Path]:
    """Copy the run's small files to ``<record>/<group>/<name>/`` and write its figure there
    (``report/``); returns the recorded paths."""
    dest = record / run["group"] / run["name"]
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in small_files(d):
        shutil.copy2(f, dest / f.name)
        paths.append(dest / f.name)
    if figure:
        from nemo_fp8rl.report import make_report

        make_report([str(dest)], str(dest / "report"), names=[run["name"]])
        paths += [dest / f for f in REPORT_FILES if (dest / f).is_file()]
    return paths


def _git(repo: Path, *args: str, wait_s: float = 600.0) -> subprocess.CompletedProcess:
    """``git -C repo args``, retried while another process holds the index lock."""
    git_dir = Path(subprocess.run(["git", "-C", str(repo), "rev-parse", "--absolute-git-dir"], capture_output=True,
                                  text=True, check=True).stdout.strip())
    t0 = time.time()
    while True:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        if proc.returncode == 0 or not (git_dir / "index.lock").exists() or time.time() - t0 > wait_s:
            return proc
        time.sleep(2.0)


def commit_paths(paths: list[Path], message: str) -> bool:
    """``git add`` + ``git commit -- <paths>``: only these paths, whatever else the index holds. False when
    they are unchanged (nothing to commit). Refuses a path under a ``checkpoints/`` or ``hf/`` directory."""
    bad = [p for p in paths if {"checkpoints", "hf", ".warmup_cache"} & set(p.parts)]
    if bad:
        raise ValueError(f"refusing to commit checkpoint or export files: {bad}")
    repo = Path(subprocess.run(["git", "-C", str(paths[0].parent), "rev-parse", "--show-toplevel"],
                               capture_output=True, text=True, check=True).stdout.strip())
    rel = [str(p.resolve().relative_to(repo)) for p in paths]
    for proc in (_git(repo, "add", "--", *rel),):
        if proc.returncode:
            raise RuntimeError(f"git add failed: {proc.stderr.strip()}")
    if _git(repo, "diff", "--cached", "--quiet", "--", *rel).returncode == 0:
        return False
    proc = _git(repo, "commit", "-q", "-m", message, "--", *rel)
    if proc.returncode:
        raise RuntimeError(f"git commit failed: {proc.stderr.strip()}")
    return True


def _summary(d: Path, steps: int) -> str:
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()[:steps]]
    first = [r.get("reward/mean", 0.0) for r in recs[:10]]
    last = [r.get("reward/mean", 0.0) for r in recs[-10:]]
    return (f"{len(recs)} steps, reward {sum(first) / len(first):.3f} (first 10) -> {sum(last) / len(last):.3f} "
            f"(last 10)")


# ------------------------------------------------------------------ running
def _code_commit() -> str:
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def command(run: dict, out: Path, steps: int, extra: list[str]) -> list[str]:
    d = run_dir(out, run)
    ckpt = run.get("checkpoint_interval") or max(steps // 2, 1)
    # COMMON first: a run's own overrides (e.g. old_logprobs=recompute in an ablation) must win
    return [sys.executable, "-m", "nemo_fp8rl.train", *COMMON, *run["overrides"], *extra, f"seed={run['seed']}",
            f"trainer.max_steps={steps}", f"trainer.checkpoint_interval={ckpt}", "trainer.keep_last=1",
            f"output_dir={d}", f"warmup.cache_dir={out / '.warmup_cache'}", "resume=true", sample_steps(steps)]


def check_settings(run: dict, d: Path) -> None:
    """Refuse a run directory that holds a run with other overrides (resuming it would mix two runs)."""
    meta = d / "study_run.json"
    if meta.is_file():
        old = json.loads(meta.read_text())
        if old.get("overrides") != run["overrides"] or old.get("seed") != run["seed"]:
            raise RuntimeError(f"{d} holds a run with other settings ({meta}: {old.get('overrides')}); move it "
                               "away or rename the sweep point / condition")


class Stop:
    """SIGTERM, SIGINT or SIGUSR1 to the study (``kill PID``, Ctrl-C, SLURM): its running trainers are sent
    SIGTERM (each finishes its step, checkpoints and exits: the next call resumes them), no new run starts,
    and the study exits non-zero once they are done. SIGTERM, whatever came: a trainer that already got a
    Ctrl-C from its terminal's group would take a second SIGINT as "stop now, without the checkpoint"."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._children: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def install(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        first = self.signum is None
        self.signum = signum
        if first:
            sys.stderr.write(f"run_study: signal {signum}: stopping the running trainers at a checkpoint, "
                             "starting no new run\n")
        for proc in list(self._children.values()):  # the handler runs in the main thread: no lock
            self._terminate(proc)

    @staticmethod
    def _terminate(proc: subprocess.Popen) -> None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def call(self, cmd: list[str], **kwargs) -> int:
        """``subprocess.call`` that the handler can reach; a run that would start after the signal does not."""
        with self._lock:
            if self.signum is not None:
                return -signal.SIGTERM
            proc = subprocess.Popen(cmd, **kwargs)
            self._children = {**self._children, proc.pid: proc}
        if self.signum is not None:  # came between the check and the registration
            self._terminate(proc)
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._children = {k: v for k, v in self._children.items() if k != proc.pid}


STOP = Stop()


def execute(run: dict, out: Path, steps: int, log_dir: Path, extra: list[str],
            gate=None) -> tuple[str, int | None, float]:
    """Run (or resume, or restart) one run to ``steps``; ``gate()`` waits for a shared warm-up first.
    Returns (name, rc, seconds): rc None when the study was stopped before the run started, 7 when it
    stopped the run (:class:`Stop`)."""
    d = run_dir(out, run)
    steps = run.get("steps", steps)
    if done(d, steps):
        return run["name"], 0, 0.0
    check_settings(run, d)
    if gate is not None:
        gate()
    if STOP.signum is not None:
        return run["name"], None, 0.0
    cmd = command(run, out, steps, extra)
    d.mkdir(parents=True, exist_ok=True)
    meta_path = d / "study_run.json"
    attempts = json.loads(meta_path.read_text()).get("attempts", []) if meta_path.is_file() else []
    attempt = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "from_step": latest_checkpoint(d) or 0,
               "code_commit": _code_commit(), "machine": machine.describe(torch_threads=1)}  # OMP_NUM_THREADS=1 below

    def write_meta():
        meta_path.write_text(json.dumps(
            {"group": run["group"], "name": run["name"], "seed": run["seed"], "steps": steps, "arm": run.get("arm"),
             "overrides": run["overrides"], "extra": extra, "common": COMMON, "command": cmd[1:],
             "attempts": attempts + [attempt]}, indent=1))

    write_meta()
    log = log_dir / (run["group"] + "__" + run["name"].replace("/", "__") + ".log")
    t0 = time.time()
    with open(log, "a") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = STOP.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if STOP.signum is not None and (rc == 0 and not done(d, steps) or rc == -signal.SIGTERM):
        rc = 7  # stopped by the signal: at a checkpoint, or before its handler was installed (no new step)
    elif rc == 0 and not done(d, steps):
        rc = 4  # the trainer exited cleanly without all steps (stopped by the stability monitor?)
    attempt.update(wall_s=round(time.time() - t0, 1), rc=rc)
    if STOP.signum is not None:
        attempt["stopped_by_signal"] = STOP.signum
    write_meta()
    return run["name"], rc, time.time() - t0


class WarmupGate:
    """Runs that share a warm-up (:func:`warmup_key`) start after the first of them has finished it (its
    ``config.yaml``, written after the warm-up, is new) or has ended, so side-by-side jobs never compute the
    same warm-up twice."""

    def __init__(self, runs: list[dict], out: Path):
        self.out, self.t0 = out, time.time()
        self.leader: dict[tuple, dict] = {}
        for r in runs:
            self.leader.setdefault(warmup_key(r), r)
        self.ended = {(r["group"], r["name"]): threading.Event() for r in self.leader.values()}

    def for_run(self, run: dict):
        lead = self.leader[warmup_key(run)]
        if lead is run:
            return None
        cfg = run_dir(self.out, lead) / "config.yaml"

        def wait():
            while not self.ended[(lead["group"], lead["name"])].is_set():
                if cfg.is_file() and cfg.stat().st_mtime >= self.t0:
                    return
                time.sleep(2.0)

        return wait

    def finished(self, run: dict) -> None:
        if self.leader[warmup_key(run)] is run:
            self.ended[(run["group"], run["name"])].set()


def stage_report(stage: str, runs: list[dict], out: Path, record: Path, figure: Path | None = None) -> str:
    """The markdown of ``--report`` for ``runs`` of ``stage`` (protocol_report.py defines every column);
    with ``figure``, also the stage's curves there: one line per sweep point, or per arm (the mean over its
    finished seeds with a min-max band) for the exploration and the confirmation."""
    recs = [protocol_report.read_metrics([run_dir(out, r), record / r["group"] / r["name"]]) for r in runs]
    stats = [protocol_report.run_stats(m) for m in recs]

    if figure is not None:
        # one line per arm (the name without /seedN), over its finished runs; a sweep point is one run, drawn
        # however far it got
        names = [r["name"].rsplit("/", 1)[0] for r in runs]
        prefix = os.path.commonprefix(names)
        prefix = prefix[: prefix.rfind("/") + 1] if len(set(names)) > 1 else ""
        groups: dict[str, list[list[dict]]] = {}
        for r, m, s, name in zip(runs, recs, stats, names):
            if stage == "sweep" or s["steps"] >= r["steps"]:
                groups.setdefault(name[len(prefix):], []).append(m)
        protocol_report.curves_figure(groups, figure)

    if stage == "sweep":
        rows = [(p, SWEEP[p], s, r["steps"]) for r, s in zip(runs, stats) for p in [r["name"].rsplit("/", 1)[0]]]
        return protocol_report.sweep_table(rows)
    table = protocol_report.arms_table([(r["name"], s, r["steps"]) for r, s in zip(runs, stats)])
    if stage in ("track", "track_confirm"):  # issue 41: a reward kept while the format degrades shows here
        table += ("\n\nFormat of the last 10 steps (protocol_report.format_table; reported, not a decision "
                  "measure):\n\n" + protocol_report.format_table([(r["name"], s, r["steps"])
                                                                   for r, s in zip(runs, stats)]))
    if stage == "explore":
        return table
    # issue 41 item 3: how each calibrated run's calibrations measured, and where its bounds sat
    calibrated = [(r["name"], protocol_report.calibration_batch_stats(m)) for r, m in zip(runs, recs)
                  if r["arm"].startswith("fp8_calibrated") and m]
    if calibrated:
        table += ("\n\nCalibration batches of the calibrated runs (protocol_report.calibration_batch_stats):\n\n"
                  + protocol_report.calibration_batch_table(calibrated))
    if stage == "track":
        return (table + "\n\nIssue 41's rule on seed 1 (protocol_report.track_rule; d = arm - fp8_fixed_wide):\n\n"
                + protocol_report.track_rule_table(track_rule(out, record)))
    last10: dict[str, dict[int, float]] = {}
    every: dict[str, dict[int, float]] = {}
    acc10: dict[str, dict[int, float]] = {}
    by_arm: dict[str, list[dict]] = {}
    for r, s in zip(runs, stats):
        if s["steps"] >= r["steps"]:
            last10.setdefault(r["arm"], {})[r["seed"]] = s["reward_last10"]
            every.setdefault(r["arm"], {})[r["seed"]] = s["reward_all"]
            if s["acc_last10"] is not None:
                acc10.setdefault(r["arm"], {})[r["seed"]] = s["acc_last10"]
            by_arm.setdefault(r["arm"], []).append(s)
    table += "\n\nPer arm over its finished seeds (mean [lowest, highest]):\n\n" + protocol_report.arm_means_table(by_arm)
    if stage == "track_confirm":  # issue 41: questions 1 and 2 first, then what each arm does against fixed clip
        pairs = [("fp8_calibrated", "fp8_fixed_wide"), ("fp8_calibrated", "fp8_recompute_tis"),
                 ("fp8_calibrated_low", "fp8_fixed_wide"), ("fp8_calibrated", "fp8"), ("fp8_fixed_wide", "fp8"),
                 ("fp8_recompute_tis", "fp8"), ("fp8", "bf16"), ("fp8_calibrated", "bf16")]
    else:
        pairs = [("fp8_calibrated", "fp8"), ("fp8", "bf16"), ("fp8_calibrated", "bf16"),
                 ("fp8_calibrated_upper_fixed", "fp8"), ("fp8_calibrated_upper_fixed", "fp8_calibrated"),
                 ("fp8_calibrated", "fp8_fixed_wide"), ("fp8_fixed_wide", "fp8")]
    # primary: the last-10 mean; secondary: the mean over all steps (docs/results.md, the confirmation plan)
    table += ("\n\n" + protocol_report.paired_table(last10, pairs) + "\n\n"
              + protocol_report.paired_table(every, pairs, measure="over all steps"))
    if stage == "track_confirm":
        # beside, not a decision measure: reasoning-gym's partial credit made recompute + TIS's reward overstate
        # its accuracy on seed 1 more than any other arm's (docs/results.md, the exploration)
        table += ("\n\nAccuracy beside the reward (reported, not a decision measure; reward - accuracy is partial "
                  "credit):\n\n" + protocol_report.paired_table(acc10, pairs, quantity="accuracy"))
        table += "\n\nVerdicts (primary measure, last 10):\n\n" + protocol_report.track_verdicts(last10)
    machines = machines_table(runs, out, record)
    if machines:
        table += "\n\nWhere each run ran (study_run.json's attempts that recorded their machine):\n\n" + machines
    return table


def run_machines(meta_paths: list[Path]) -> tuple[int, list[str]]:
    """``(attempts, distinct machines in order)`` of a run, from the first of ``meta_paths`` (its
    ``study_run.json`` in the output or the record directory) that exists; each machine on one line
    (:func:`nemo_fp8rl.machine.as_line`). Attempts recorded before machines were (2026-12-08) count in
    ``attempts`` but name none."""
    for meta in meta_paths:
        if meta.is_file():
            attempts = json.loads(meta.read_text()).get("attempts", [])
            names = [machine.as_line(a["machine"]) for a in attempts if a.get("machine")]
            return len(attempts), list(dict.fromkeys(names))
    return 0, []


def machines_table(runs: list[dict], out: Path, record: Path) -> str:
    """A markdown table of the runs whose attempts recorded a machine: parts (attempts) and machines; ``""``
    when none did (every run before 2026-12-08)."""
    rows = []
    for r in runs:
        n, seen = run_machines([run_dir(out, r) / "study_run.json", record / r["group"] / r["name"] / "study_run.json"])
        if seen:
            rows.append(f"| {r['name']} | {n} | {' / '.join(seen)} |")
    if not rows:
        return ""
    return "\n".join(["| run | parts | machine(s) |", "| --- | ---: | --- |", *rows])


def stage_samples(runs: list[dict], out: Path, record: Path, seed: int) -> str:
    """The sample generations of ``seed``'s runs of a stage at the first, middle and last sample step, one
    table with a column per arm (the arms of a seed share their prompts; protocol_report.samples_table). Each
    run is read from its run directory or its record: one with samples, and of those the one that logged
    more steps."""
    from nemo_fp8rl.trainer.logger import read_metrics as read_jsonl

    samples = {}
    for r in runs:
        if r["seed"] != seed:
            continue
        cands = [run_dir(out, r), record / r["group"] / r["name"]]
        d = max(cands, key=lambda c: ((c / "samples.jsonl").is_file(), len(protocol_report.read_metrics([c]))))
        samples[r.get("arm") or r["name"].rsplit("/", 1)[0]] = read_jsonl(str(d), "samples.jsonl")
    return protocol_report.samples_table(samples)


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
    p = ap.add_argument_group("issue 28's protocol")
    p.add_argument("--stage", choices=["sweep", "explore", "confirm", "track", "track_confirm"],
                   help="a stage of the protocol instead of --only's groups")
    p.add_argument("--points", default="", help="sweep: comma-separated points of SWEEP (default: all)")
    p.add_argument("--regime", default="", help="explore, confirm: the sweep point the FP8 arms run in")
    p.add_argument("--conditions", default="", help="explore: comma-separated conditions of EXPLORE (default: all)")
    p.add_argument("--condition", default="", help="confirm: the exploration's chosen condition")
    p.add_argument("--candidates", default="", help="track (issue 41): comma-separated TRACK_CANDIDATES (default: "
                   "all); track_confirm: the one candidate the exploration's rule chose")
    p.add_argument("--any-candidate", action="store_true",
                   help="track_confirm: run --candidates even where the exploration's rule chose another or none")
    p.add_argument("--confirm-seeds", default=None,
                   help="confirm: fresh seeds (never the sweep's or the exploration's; default 11,12,13); "
                        f"track_confirm: never {sorted(set(TRACK_USED_SEEDS))} (default {TRACK_CONFIRM_SEEDS})")
    p.add_argument("--sweep-steps", type=int, default=100)
    p.add_argument("--explore-steps", type=int, default=100)
    p.add_argument("--confirm-steps", type=int, default=100)
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="protocol runs checkpoint every N steps (keep_last=1)")
    r = ap.add_argument_group("chunks, resume and records")
    r.add_argument("--report", action="store_true",
                   help="--stage: print the stage's markdown tables (protocol_report.py) from the runs in --out "
                        "or their records; run nothing")
    r.add_argument("--figure", default="", help="--report: also write the stage's curves to this PNG")
    r.add_argument("--samples", type=int, default=None, metavar="SEED",
                   help="--report: also print the sample generations of this seed's runs (start, middle, end)")
    r.add_argument("--plan", action="store_true",
                   help="print the remaining work in chunks with time estimates; run nothing")
    r.add_argument("--chunk-hours", type=float, default=2.0, help="largest estimated wall time of a chunk")
    r.add_argument("--chunks", type=int, default=0, help="run only the next N chunks (0 = all remaining)")
    r.add_argument("--match", default="", help="only runs whose group/name contains this text")
    r.add_argument("--record", default=str(ROOT / "benchmarks" / "study" / "records"),
                   help="the committed records: --commit copies finished runs' small files here; a run whose "
                        "record holds all its steps is done (a clean clone skips it)")
    r.add_argument("--commit", action="store_true",
                   help="copy each finished run's small files and figure to --record and git commit them")
    r.add_argument("--no-figures", action="store_true", help="record without the per-run report figure")
    r.add_argument("--prune-finished", action="store_true",
                   help="delete a finished run's checkpoints/ and hf/ once it is recorded")
    args = ap.parse_args()
    runs = stage_runs(args) if args.stage else plan(args)
    if args.match:
        runs = [x for x in runs if args.match in f"{x['group']}/{x['name']}"]
    out = Path(args.out)
    record = Path(args.record)
    if args.list:
        total = 0.0
        for x in runs:
            est = estimate_s(x, args.steps)
            total += est
            print(x["group"], x["name"], " ".join(x["overrides"]), f"# ~{est / 60:.0f} min")
        print(f"{len(runs)} runs, ~{total / 3600:.1f} h one at a time (estimates from STEP_SECONDS; warm-ups: "
              f"+~{REAL_WARMUP_S / 60:.0f} min per seed of the real group)")
        return
    if args.report:
        if not args.stage:
            raise SystemExit("--report needs --stage (sweep, explore, confirm, track or track_confirm)")
        print(stage_report(args.stage, runs, out, record, Path(args.figure) if args.figure else None))
        if args.samples is not None:
            print("\n" + stage_samples(runs, out, record, args.samples))
        return
    rows = annotate(runs, out, record, args.steps)
    budget = args.chunk_hours * 3600
    if args.plan:
        print_plan(rows, args.jobs, budget)
        return
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # the record of every run ever planned into this directory: a slice (--only/--seeds/--stage) adds its runs
    meta_path = out / "study.json"
    known = json.loads(meta_path.read_text())["runs"] if meta_path.is_file() else []
    names = {(x["group"], x["name"]) for x in runs}
    merged = [x for x in known if (x["group"], x["name"]) not in names] + runs
    meta_path.write_text(json.dumps({"steps": args.steps, "long_steps": args.long_steps,
                                     "real_steps": args.real_steps, "runs": merged,
                                     "common": COMMON}, indent=1))
    STOP.install()
    t0 = time.time()
    failures: list[str] = []
    lock = threading.Lock()
    say_lock = threading.Lock()

    def say(msg: str) -> None:
        """One whole line at a time: ``print`` writes the text and its newline separately, so two jobs
        starting together could run their lines into one."""
        with say_lock:
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()

    def finish(row: dict) -> None:
        """With --commit, record and commit a finished run (unless its record is complete already); with
        --prune-finished, delete its checkpoints and export."""
        d = run_dir(out, row)
        if not done(d, row["steps"]):
            return
        with lock:  # one record/commit at a time (matplotlib and the git index are shared)
            dest = record / row["group"] / row["name"]
            if args.commit and steps_logged(dest) < row["steps"]:
                paths = record_run(row, d, record, figure=not args.no_figures)
                msg = f"study {row['group']}/{row['name']}: {_summary(d, row['steps'])} (run_study.py --commit)"
                if commit_paths(paths, msg):
                    say(f"committed {dest}")
            if args.prune_finished:
                for sub in ("checkpoints", "hf"):
                    shutil.rmtree(d / sub, ignore_errors=True)

    for row in rows:  # finished before: say so (the study is resumable), commit what is not recorded yet
        if row["state"] == "done":
            print(f"[{0:7.0f}s] {row['name']}: rc=0 0s", flush=True)
            finish(row)
    parts = chunks(rows, args.jobs, budget)
    if args.chunks:
        parts = parts[: args.chunks]
    for i, part in enumerate(parts, 1):
        est = lanes_wall_s([x["est_s"] for x in part], args.jobs)
        print(f"chunk {i}/{len(parts)}: {len(part)} run(s), ~{est / 3600:.1f} h", flush=True)
        gate = WarmupGate(part, out)

        def one(row):
            if STOP.signum is not None:
                return row["name"], None, 0.0
            state = f"resume from step {row['at_step']}" if row["state"] == "resume" else row["state"]
            say(f"start {row['group']}/{row['name']}: {state}")
            try:
                res = execute(row, out, args.steps, log_dir, args.extra, gate=gate.for_run(row))
            except Exception as e:  # noqa: BLE001  (one bad run must not stop the chunk)
                res = (row["name"], 5, 0.0)
                say(f"{row['name']}: {e}")
            finally:
                gate.finished(row)
            if res[1] == 0:
                try:
                    finish(row)
                except Exception as e:  # noqa: BLE001
                    res = (row["name"], 6, res[2])
                    say(f"{row['name']}: finished but not recorded: {e}")
            return res

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for name, rc, sec in pool.map(one, part):
                if rc is None:
                    continue  # not started: the study was stopped
                say(f"[{time.time() - t0:7.0f}s] {name}: rc={rc} {sec:.0f}s"
                    + (" (stopped at a checkpoint by the signal)" if rc == 7 else ""))
                failures += [name] if rc and rc != 7 else []
        if STOP.signum is not None:
            break
    if STOP.signum is not None:
        sys.exit(f"study stopped by signal {STOP.signum} after {time.time() - t0:.0f}s: its running trainers "
                 "checkpointed and exited; the same command resumes them"
                 + (f"; failed runs: {failures} (logs in {log_dir})" if failures else ""))
    ran = sum(len(c) for c in parts)
    skipped = len([x for x in rows if x["remaining"]]) - ran
    print(f"study finished in {time.time() - t0:.0f}s; {len(runs) - len(failures) - skipped}/{len(runs)} runs ok"
          + (f" ({skipped} left for later chunks)" if skipped else ""))
    if failures:
        sys.exit(f"failed runs: {failures} (logs in {log_dir})")


if __name__ == "__main__":
    main()
