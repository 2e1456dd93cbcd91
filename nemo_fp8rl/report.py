"""``nemo-fp8rl-report RUN_DIR... [--out DIR]``: figures and a table comparing runs.

Reads each run's ``metrics.jsonl`` and writes to ``--out`` (default ``<first run's parent>/report``):

* ``report.png``: entropy, reward/accuracy, clip fractions by advantage sign, clip bounds in force,
  ``calib/alpha_fp8_nominal`` vs ``calib/alpha_bf16`` and the false-clip rate, rollout/trainer mismatch,
  the garbled-output signals (invalid and repetitive responses, bad characters, BF16-unlikely tokens);
* ``summary.md``: final metrics (mean of the last ``--last`` steps) per run and, for runs that logged
  sample generations (``logger.samples``, ``samples.jsonl``), the generations of the first, middle and
  last sample steps, so garbled text can be read next to the metrics.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from nemo_fp8rl.trainer.logger import read_metrics

SUMMARY_KEYS = [
    ("reward/mean", "reward"),
    ("reward/accuracy", "accuracy"),
    ("policy/entropy", "entropy"),
    ("clip/low_frac", "clip low (A<0)"),
    ("clip/high_frac", "clip high (A>0)"),
    ("clip/lower", "lower bound"),
    ("clip/upper", "upper bound"),
    ("calib/alpha_bf16", "alpha bf16"),
    ("calib/alpha_fp8_nominal", "alpha fp8 nominal"),
    ("calib/false_clip_rate", "false clip rate"),
    ("rollout/invalid_frac", "invalid frac"),
    ("mismatch/logp_abs_diff_mean", "rollout-trainer mean abs dlogp"),
    ("timing/step", "step s"),
]

PANELS = [
    ("Entropy", ["policy/entropy"]),
    ("Reward / accuracy", ["reward/mean", "reward/accuracy"]),
    ("Clipped fraction by advantage sign", ["clip/low_frac", "clip/high_frac"]),
    ("Clip bounds in force", ["clip/lower", "clip/upper"]),
    ("A<0 fraction below 1-eps_low (calibration steps)", ["calib/alpha_fp8_nominal", "calib/alpha_bf16"]),
    ("False-clip rate (calibration steps)", ["calib/false_clip_rate"]),
    ("Rollout vs trainer mismatch", ["mismatch/logp_abs_diff_mean"]),
    ("Garbled responses: invalid (task parser), repetitive", ["rollout/invalid_frac", "stability/repetitive_frac"]),
    ("Garbled characters; tokens BF16 finds unlikely (calibration steps)",
     ["stability/nonprintable_frac", "stability/replacement_frac", "stability/unlikely_frac"]),
]


def series(records: List[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def final_value(records: List[dict], key: str, last: int) -> Optional[float]:
    """Mean of ``key`` over the last ``last`` steps that logged it (calibration metrics: their last values)."""
    _, ys = series(records, key)
    if not ys:
        return None
    tail = ys[-last:]
    return sum(tail) / len(tail)


def summary_table(runs: Dict[str, List[dict]], last: int) -> str:
    present = [(k, label) for k, label in SUMMARY_KEYS if any(series(r, k)[1] for r in runs.values())]
    head = "| run | steps | " + " | ".join(label for _, label in present) + " |"
    sep = "|---|---:|" + "---:|" * len(present)
    rows = [head, sep]
    for name, recs in runs.items():
        cells = []
        for k, _ in present:
            v = final_value(recs, k, last)
            cells.append("-" if v is None else f"{v:.3f}")
        rows.append(f"| {name} | {len(recs)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def pick_sample_steps(steps: Sequence[int]) -> list[int]:
    """The first, middle and last of the distinct ``steps`` (fewer when fewer were logged)."""
    steps = sorted(set(steps))
    if not steps:
        return []
    return sorted({steps[0], steps[(len(steps) - 1) // 2], steps[-1]})


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def samples_markdown(run_dirs: Dict[str, str], per_step: int = 3, limit: int = 400, heading: str = "##") -> str:
    """Markdown of the sample generations (``samples.jsonl``) of each run at its first, middle and last
    sample step: question, reference answer, reward and the response as the model wrote it (in a code
    block, cut at ``limit`` characters). Empty when no run logged samples."""
    parts = []
    for name, d in run_dirs.items():
        recs = read_metrics(d, "samples.jsonl")
        if not recs:
            continue
        parts.append(f"{heading}# {name}\n")
        for step in pick_sample_steps([r["step"] for r in recs]):
            parts.append(f"Step {step}:\n")
            for r in [r for r in recs if r["step"] == step][:per_step]:
                verdict = "correct" if r.get("correct") else ("invalid: no answer tag" if r.get("invalid") else "wrong")
                resp = r.get("response", "")
                resp = (resp if len(resp) <= limit else resp[:limit] + " [...]").replace("`", "'")
                body = "".join(f"  {ln}\n" for ln in (resp.splitlines() or [""]))
                parts.append(f"- reward {r.get('reward', float('nan')):.2f} ({verdict}); reference "
                             f"`{r.get('answer', '')}`; question: {_one_line(r.get('question', ''), 200)}\n\n"
                             f"  ```text\n{body}  ```\n")
    if not parts:
        return ""
    return (f"{heading} Sample generations\n\nDecoded rollouts (`samples.jsonl`, `logger.samples`) at the first, "
            "middle and last sample step of each run.\n\n" + "\n".join(parts))


def plot(runs: Dict[str, List[dict]], path: Path, smooth: int = 5) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.0 * rows), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for ci, (name, recs) in enumerate(runs.items()):
            for ki, key in enumerate(keys):
                xs, ys = series(recs, key)
                if not xs:
                    continue
                if smooth > 1 and not key.startswith("calib/") and len(ys) > smooth:
                    ys = [sum(ys[max(0, i - smooth + 1): i + 1]) / (i + 1 - max(0, i - smooth + 1)) for i in range(len(ys))]
                marker = "o" if key.startswith("calib/") else None
                ax.plot(xs, ys, styles[ki % len(styles)], color=f"C{ci}", marker=marker, markersize=3,
                        label=f"{name}: {key}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.lines:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_report(run_dirs: Sequence[str], out_dir: Optional[str] = None, last: int = 10,
                names: Optional[Sequence[str]] = None) -> Path:
    """Write ``report.png`` and ``summary.md`` for ``run_dirs``; returns the output directory."""
    runs: Dict[str, List[dict]] = {}
    dirs: Dict[str, str] = {}
    for i, d in enumerate(run_dirs):
        if not (Path(d) / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{d}/metrics.jsonl not found: is {d} a run directory (output_dir)?")
        name = names[i] if names else Path(d).name
        runs[name], dirs[name] = read_metrics(d), str(d)
    out = Path(out_dir) if out_dir else Path(run_dirs[0]).resolve().parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / "report.png")
    table = summary_table(runs, last)
    (out / "summary.md").write_text(
        f"# Run comparison\n\nFinal metrics: mean over the last {last} logged steps "
        "(calibration metrics: over the last calibration steps).\n\n" + table + "\n\n![report](report.png)\n"
        + ("\n" + samples if (samples := samples_markdown(dirs)) else "")
    )
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="nemo-fp8rl-report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--out", default=None, help="output directory (default: <parent of first run>/report)")
    ap.add_argument("--last", type=int, default=10, help="steps averaged for the final-metrics table")
    args = ap.parse_args(argv)
    try:
        out = make_report(args.runs, args.out, args.last)
    except FileNotFoundError as e:
        ap.error(str(e))
    print(f"report written to {out}/report.png and {out}/summary.md")
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    main()
