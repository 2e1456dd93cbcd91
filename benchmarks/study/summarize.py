"""Tables and figures of the study (``run_study.py``) -> ``docs/results.md`` and ``docs/figures/``.

    python benchmarks/study/summarize.py --study runs/study --doc docs/results.md

Per run: final reward and accuracy (mean of the last ``--last`` steps), final entropy (same window),
entropy surge ratio (max over the run of ``stability/entropy_ratio``; the study's runs were made with
the running-median monitor, before the lagged baseline of docs/design.md, "One training step"),
entropy max / start (max entropy over the run / mean entropy of its first 5 steps: a surge that lasts
became its own running median, this ratio still shows it), final rollout-trainer mismatch (mean
``mismatch/logp_abs_diff_mean`` over the last steps),
``clip/low_frac`` (mean over steps), ``calib/alpha_bf16``, ``calib/alpha_fp8_nominal`` and
``calib/false_clip_rate`` (means over calibration steps), invalid-output rate (mean), step time (mean).
The real-model section (group ``real``: SmolLM2-135M) adds final accuracy, ``clip/high_frac``, the
number of steps flagged as an entropy surge or garbled output (``stability/*``) and the sample
generations at the start, middle and end of each seed-1 run. Cells are mean ± std over seeds. The prose of ``benchmarks/study/observations.md`` is included as is.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from nemo_fp8rl.report import make_report, samples_markdown
from nemo_fp8rl.trainer.logger import read_metrics

COLUMNS = [
    ("reward", "final reward"),
    ("entropy", "final entropy"),
    ("surge", "max entropy ratio"),
    ("entropy_rise", "entropy max/start"),
    ("low_frac", "clip/low_frac"),
    ("alpha_bf16", "alpha bf16"),
    ("alpha_fp8", "alpha fp8 nominal"),
    ("false_clip", "false-clip rate"),
    ("upper", "final upper"),
    ("invalid", "invalid rate"),
    ("mismatch", "final mismatch"),
    ("step_s", "step s"),
]
REAL_COLUMNS = [
    ("reward", "final reward"),
    ("accuracy", "final accuracy"),
    ("entropy", "final entropy"),
    ("surge", "max entropy ratio"),
    ("surges", "entropy-surge steps"),
    ("garbled", "garbled steps"),
    ("invalid", "invalid rate"),
    ("low_frac", "clip/low_frac"),
    ("high_frac", "clip/high_frac"),
    ("alpha_bf16", "alpha bf16"),
    ("alpha_fp8", "alpha fp8 nominal"),
    ("false_clip", "false-clip rate"),
    ("mismatch", "final mismatch"),
    ("step_s", "step s"),
]


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def run_stats(run_dir: Path, last: int) -> dict | None:
    recs = read_metrics(str(run_dir))
    if not recs:
        return None
    tail = recs[-last:]
    calib = [r for r in recs if r.get("calib/alpha_bf16") is not None]
    return {
        "steps": len(recs),
        "reward": _mean([r.get("reward/mean") for r in tail]),
        "accuracy": _mean([r.get("reward/accuracy") for r in tail]),
        "entropy": _mean([r.get("policy/entropy") for r in tail]),
        "surge": max((r.get("stability/entropy_ratio") or 0.0) for r in recs),
        "entropy_rise": max(r["policy/entropy"] for r in recs) / _mean([r["policy/entropy"] for r in recs[:5]]),
        "low_frac": _mean([r.get("clip/low_frac") for r in recs]),
        "high_frac": _mean([r.get("clip/high_frac") for r in recs]),
        "surges": float(sum(1 for r in recs if (r.get("stability/entropy_surge") or 0.0) > 0)),
        "garbled": float(sum(1 for r in recs if (r.get("stability/garbled") or 0.0) > 0)),
        "alpha_bf16": _mean([r.get("calib/alpha_bf16") for r in calib]),
        "alpha_fp8": _mean([r.get("calib/alpha_fp8_nominal") for r in calib]),
        "false_clip": _mean([r.get("calib/false_clip_rate") for r in calib]),
        "upper": tail[-1].get("clip/upper"),
        "invalid": _mean([r.get("rollout/invalid_frac") for r in recs]),
        "mismatch": _mean([r.get("mismatch/logp_abs_diff_mean") for r in tail]),
        "step_s": _mean([r.get("timing/step") for r in recs]),
    }


def cell(values: list) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    m = statistics.mean(vals)
    if len(vals) == 1:
        return f"{m:.3f}"
    return f"{m:.3f} ± {statistics.stdev(vals):.3f}"


def table(rows: list[tuple[str, list[dict]]], columns: list[tuple[str, str]] = COLUMNS) -> str:
    head = "| run | seeds | " + " | ".join(label for _, label in columns) + " |"
    out = [head, "|---|---:|" + "---:|" * len(columns)]
    for name, stats in rows:
        out.append(f"| {name} | {len(stats)} | " + " | ".join(cell([s[k] for s in stats]) for k, _ in columns) + " |")
    return "\n".join(out)


def collect(study: Path, pattern: str, last: int) -> list[dict]:
    out = []
    for d in sorted(study.glob(pattern)):
        s = run_stats(d, last)
        if s is not None:
            out.append(s)
    return out


def figure(dirs: list[Path], names: list[str], target: Path) -> None:
    """Overlay ``dirs`` with :func:`make_report` and keep only its PNG, as ``target``."""
    rep = make_report([str(d) for d in dirs], str(target.with_suffix("")) + "_tmp", names=names)
    (rep / "report.png").replace(target)
    for p in rep.iterdir():
        p.unlink()
    rep.rmdir()


def _arm_dirs(study: Path, group: str, cond: str, seed: int, bf16_name: str = "") -> tuple[list[Path], list[str]]:
    """Run directories and legend names of the three arms of one condition; an FP8-only condition has no
    bf16 run of its own, so the main grid's GRPO bf16 run stands in for it."""
    dirs, names = [], []
    for arm in ("bf16", "fp8", "fp8_calibrated"):
        d = study / group / cond / arm / f"seed{seed}"
        if arm == "bf16" and not (d / "metrics.jsonl").is_file():
            d, name = study / "main" / "grpo" / "bf16" / f"seed{seed}", "bf16"
        else:
            name = bf16_name if (arm == "bf16" and bf16_name) else f"{cond} {arm}"
        dirs.append(d)
        names.append(name)
    return dirs, names


def real_section(study: Path, meta: dict, figs: Path, last: int) -> list[str]:
    """The "Real model (SmolLM2-135M)" section of docs/results.md from the runs of group ``real``."""
    steps = meta.get("real_steps", 20)
    conds = [("tensorwise", "tensorwise"), ("blockwise", "blockwise"), ("e5m2_2xlr", "e5m2_2xlr")]
    rows = [("bf16", collect(study, "real/bf16/seed*", last))]
    for cond, label in conds:
        for arm in (("bf16",) if cond == "e5m2_2xlr" else ()) + ("fp8", "fp8_calibrated"):
            rows.append((f"{label} / {arm}", collect(study, f"real/{cond}/{arm}/seed*", last)))
    parts = ["## Real model (SmolLM2-135M)", "",
             f"Command: `python benchmarks/study/run_study.py --out {study} --only real --real-steps {steps}"
             f"{_real_flags(study)} --jobs 2`. SmolLM2-135M-Instruct (`model=smollm2_135m`, the registry's Q4_1 GGUF "
             "decoded to float32) on reasoning-gym `chain_sum` (2-3 terms of 1-2 digits, prompts through the "
             "model's chat template), the base settings of `make demo-real` (`nemo_fp8rl.demo.REAL`): a short "
             "supervised warm-up that teaches the `<answer>` format (zero-shot the model never writes it, so "
             "every reward would be 0), then GRPO with 8 prompts x 4 responses x up to 32 new tokens, temperature 1, "
             "lr 3e-6, calibration every 4 steps. FP8 in training and rollout (rollout scheme vllm_w8a8), old "
             "log-probs from the rollout engine: the TIS weight exp(old - rollout) is then exactly 1, so TIS "
             "C=2 is a no-op in this setting. `e5m2_2xlr`: E5M2 activations and weights "
             "(`fp8.fp8_format=e5m2`) and 2x the learning rate (bf16: 2x the learning rate only). Final values: "
             f"means over the last {last} steps; `entropy-surge steps` / `garbled steps`: steps flagged by the "
             "stability monitor (`stability/entropy_surge`, `stability/garbled`), summed over the run.", ""]
    notes = Path(__file__).resolve().parent / "real_notes.md"  # measured by hand: sizing, zero-shot behaviour
    if notes.is_file():
        parts += [notes.read_text().strip(), ""]
    if not any(st for _, st in rows):
        return parts + ["No runs of the real group in this study directory yet.", ""]
    parts += [table(rows, REAL_COLUMNS), ""]
    for cond, _ in conds:
        dirs = [study / "real" / ("e5m2_2xlr/bf16" if cond == "e5m2_2xlr" else "bf16") / "seed1",
                study / "real" / cond / "fp8" / "seed1", study / "real" / cond / "fp8_calibrated" / "seed1"]
        names = ["bf16" + (" 2x lr" if cond == "e5m2_2xlr" else ""), f"{cond} fp8", f"{cond} fp8_calibrated"]
        if all((d / "metrics.jsonl").is_file() for d in dirs):
            target = figs / f"real_{cond}.png"
            figure(dirs, names, target)
            parts += [f"![real model, {cond}, seed 1](figures/{target.name})", ""]
            samples = samples_markdown({n: str(d) for n, d in zip(names, dirs)}, heading="###")
            if samples:
                parts += [samples.replace("### Sample generations", f"### Sample generations: {cond}, seed 1", 1), ""]
    return parts


def _real_flags(study: Path) -> str:
    """The ``--real-seeds/--real-recipes/--real-stress-seeds`` flags that planned the real runs present."""
    def seeds(pattern: str) -> str:
        return ",".join(sorted({p.name.removeprefix("seed") for p in study.glob(pattern)}, key=int))

    recipes = [r for r in ("tensorwise", "blockwise", "delayed", "rowwise", "mxfp8")
               if any((study / "real" / r).glob("fp8*/seed*"))]
    return (f" --real-seeds {seeds('real/bf16/seed*')} --real-recipes {','.join(recipes)}"
            f" --real-stress-seeds {seeds('real/e5m2_2xlr/fp8/seed*')}")


def _sections(text: str) -> list[tuple[str, str]]:
    """``[(header, body)]`` of a markdown document split at its ``## `` headers (the preamble has header "")."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line, []))
        out[-1][1].append(line)
    return [(h, "\n".join(body).strip("\n")) for h, body in out]


def _has_runs(body: str) -> bool:
    """A generated section holds measured runs: some table row has a non-zero ``seeds`` count, or it has no
    run table at all (prose, the H200 check); the "no runs yet" text of the real-model section counts as empty."""
    if "No runs of the real group in this study directory yet." in body:
        return False
    rows = [r for r in body.splitlines() if r.startswith("| ") and not r.startswith("| run ")]
    counts = [r.split("|")[2].strip() for r in rows if len(r.split("|")) > 3]
    counts = [c for c in counts if c.isdigit()]
    return not counts or any(int(c) > 0 for c in counts)


# Sections that describe the main grid's runs (its step count, its command): kept with the main grid.
_TIED = {"": ("## Main grid: GRPO", "## Main grid: DAPO"),
         "## How the study was run": ("## Main grid: GRPO", "## Main grid: DAPO")}


def keep_measured_sections(old: str, new: str) -> str:
    """The regenerated document ``new``, keeping from ``old`` every section the new study directory has no
    runs for: a study directory that holds only some groups (a slice, another machine) must not wipe the
    tables of the others. A kept section stays where it was relative to its neighbours in ``old``; the
    preamble and "How the study was run" follow the main grid (:data:`_TIED`)."""
    new_secs = dict(_sections(new))
    old_secs = _sections(old)
    order = [h for h, _ in _sections(new)]
    for i, (h, _) in enumerate(old_secs):  # sections only the old document has: after their old predecessor
        if h not in new_secs:
            prev = next((old_secs[j][0] for j in range(i - 1, -1, -1) if old_secs[j][0] in order), "")
            order.insert(order.index(prev) + 1, h)
    old_map = dict(old_secs)
    from_old = {h for h in order if h and h in old_map and _has_runs(old_map[h])
                and (h not in new_secs or not _has_runs(new_secs[h]))}
    from_old |= {h for h, deps in _TIED.items() if h in old_map and any(d in old_map for d in deps)
                 and all(d in from_old for d in deps if d in old_map)}
    kept = [old_map[h] if h in from_old else new_secs[h] for h in order if h in from_old or h in new_secs]
    return "\n\n".join(kept) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="runs/study")
    ap.add_argument("--doc", default="docs/results.md")
    ap.add_argument("--figures", default="docs/figures")
    ap.add_argument("--last", type=int, default=10)
    args = ap.parse_args()
    study = Path(args.study)
    meta = json.loads((study / "study.json").read_text())
    steps = meta["steps"]
    figs = Path(args.figures)
    figs.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    parts = [
        "# Results: the paper in miniature (CPU) and the GPU check",
        "",
        "Generated by `benchmarks/study/summarize.py` from the runs of `benchmarks/study/run_study.py`; "
        "every number below was measured by those runs.",
        "",
        "## How the study was run",
        "",
        "```bash",
        f"python benchmarks/study/run_study.py --out {study} --steps {steps} --jobs 2",
        f"python benchmarks/study/summarize.py --study {study} --doc {args.doc}",
        "```",
        "",
        f"Every run: tiny Megatron GPT (d=128, 3 layers), built-in 3-digit addition task, supervised warm-up "
        f"until the expected sampled accuracy reaches 0.45 (cached per seed; `warmup.json` in each run directory "
        f"records its steps), then {steps} RL steps ({meta.get('long_steps', 200)} in the `long` group) of 32 prompts x 8 responses in 4 minibatches, "
        "Adam lr 1e-4, FP8 in training *and* rollout for the FP8 arms (rollout scheme vllm_w8a8), old "
        "log-probs from the rollout engine (`algorithm.old_logprobs=rollout`, the demo's setting), TIS C=2. "
        f"Arms: `bf16` (FP8 off everywhere), `fp8` (fixed clip; the BF16 shadow only measures, "
        f"`calibration=measure`), `fp8_calibrated` (`calibration=paper`: interval 20, EMA 0.5, balance). "
        f"Final values are means over the last {args.last} steps; cells are mean ± std over seeds. "
        f"Common overrides: `{' '.join(meta['common'])}`.",
        "",
    ]
    obs = here / "observations.md"
    if obs.is_file():
        parts += [obs.read_text().strip(), ""]
    for algo in ("grpo", "dapo"):
        rows = [("bf16", collect(study, f"main/{algo}/bf16/seed*", args.last))]
        for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
            for arm in ("fp8", "fp8_calibrated"):
                rows.append((f"{recipe} / {arm}", collect(study, f"main/{algo}/{recipe}/{arm}/seed*", args.last)))
        parts += [f"## Main grid: {algo.upper()}", "",
                  f"Command: `python benchmarks/study/run_study.py --out {study} --steps {steps} --only main "
                  f"--algos {algo}`", "", table(rows), ""]
        for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
            dirs = [study / "main" / algo / "bf16" / "seed1", study / "main" / algo / recipe / "fp8" / "seed1",
                    study / "main" / algo / recipe / "fp8_calibrated" / "seed1"]
            if all((d / "metrics.jsonl").is_file() for d in dirs):
                target = figs / f"study_{algo}_{recipe}.png"
                figure(dirs, ["bf16", f"{recipe} fp8", f"{recipe} fp8_calibrated"], target)
                parts += [f"![{algo} {recipe}, seed 1](figures/{target.name})", ""]
    rows = [("default (interval 20, balance, ema 0.5, tis)",
             collect(study, "main/grpo/tensorwise/fp8_calibrated/seed*", args.last))]
    for name in ("interval5", "interval10", "interval40", "upper_quantile", "upper_proportional", "upper_fixed",
                 "ema0", "ema0.9", "recompute_tis", "recompute_none"):
        rows.append((name, collect(study, f"ablation/{name}/seed*", args.last)))
    rows.append(("(reference) fp8 fixed clip", collect(study, "main/grpo/tensorwise/fp8/seed*", args.last)))
    rows.append(("(reference) bf16", collect(study, "main/grpo/bf16/seed*", args.last)))
    parts += ["## Ablations of Calibrated Clipping (GRPO, tensorwise)", "",
              f"Command: `python benchmarks/study/run_study.py --out {study} --steps {steps} --only ablation` "
              "(one override each on the calibrated arm, three seeds; the default row is the main grid's run; `recompute_*` rows recompute old log-probs with the FP8 trainer, where rollout correction acts).", "",
              table(rows), ""]
    rows = []
    for cond in ("e5m2", "lr3e-4", "fast_accum", "lr1e-3"):
        for arm in ("bf16", "fp8", "fp8_calibrated"):
            st = collect(study, f"stress/{cond}/{arm}/seed*", args.last)
            if st:
                rows.append((f"{cond} / {arm}", st))
    if rows:
        parts += ["## Stress conditions (seed 1): looking for entropy surges", "",
                  f"Command: `python benchmarks/study/run_study.py --out {study} --steps {steps} --only stress`; "
                  "`e5m2` = E5M2 activations and weights (`fp8.fp8_format=e5m2`), `lr3e-4` / `lr1e-3` = 3x / 10x "
                  "the learning rate (`optim.lr`, also for bf16), `fast_accum` = Hopper-style un-promoted "
                  "accumulation (`fp8.accumulation=fast`).", "", table(rows), ""]
        for cond in ("e5m2", "lr3e-4", "lr1e-3"):
            dirs, names = _arm_dirs(study, "stress", cond, 1)
            if all((d / "metrics.jsonl").is_file() for d in dirs):
                target = figs / f"stress_{cond}.png"
                figure(dirs, names, target)
                parts += [f"![{cond}](figures/{target.name})", ""]
    long_steps = meta.get("long_steps", 200)
    rows = []
    for cond in ("e5m2_lr2e-4",):
        for arm in ("bf16", "fp8", "fp8_calibrated"):
            st = collect(study, f"long/{cond}/{arm}/seed*", args.last)
            if st:
                rows.append((f"{cond} / {arm}", st))
    if rows:
        parts += [f"## Longer runs where fixed-clip FP8 degrades ({long_steps} steps, 2x learning rate, E5M2)", "",
                  f"Command: `python benchmarks/study/run_study.py --out {study} --long-steps {long_steps} --only long`; "
                  "GRPO, `fp8.fp8_format=e5m2 optim.lr=2e-4` for the FP8 arms, `optim.lr=2e-4` for bf16.", "",
                  table(rows), ""]
        for seed in (1, 2, 3):
            dirs, names = _arm_dirs(study, "long", "e5m2_lr2e-4", seed, bf16_name="bf16 lr2e-4 (no E5M2)")
            if all((d / "metrics.jsonl").is_file() for d in dirs):
                target = figs / f"long_e5m2_lr2e-4_seed{seed}.png"
                figure(dirs, names, target)
                parts += [f"![e5m2 lr 2e-4, seed {seed}](figures/{target.name})", ""]
    parts += real_section(study, meta, figs, args.last)
    # measured by benchmarks/bench_rollout.py, kept in its own file so a re-summarized study keeps it
    rollout = here / "rollout_results.md"
    if rollout.is_file():
        parts += [rollout.read_text().strip(), ""]
    gpu = here / "gpu_results.md"
    # the H200 section of docs/results.md (how to run benchmarks/gpu/run.sh); gpu_results.md, when present,
    # holds its measured numbers
    parts += [(here.parent / "gpu" / "h200_check.md").read_text().strip(), "",
              gpu.read_text().strip() if gpu.is_file() else
              "No H200 numbers yet: the check has not run on a lent H200. The numbers go here when it does.", ""]
    doc = Path(args.doc)
    text = "\n".join(parts) + "\n"
    if doc.is_file():
        text = keep_measured_sections(doc.read_text(), text)
    doc.write_text(text)
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
