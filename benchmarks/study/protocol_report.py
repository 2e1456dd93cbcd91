"""Tables of issue 28's protocol stages (``run_study.py --stage ... --report``): markdown for docs/results.md.

Each run is read from ``<out>/<stage>/<name>/metrics.jsonl`` or from its committed record
(``<record>/<stage>/<name>/``), whichever holds more steps, so a clean clone reports what was committed.

Per run, over its logged steps (``reward/mean``, ``reward/accuracy`` and ``policy/entropy`` are per-step
means over the step's responses):

* ``first10`` / ``last10``: the mean over the first and the last 10 logged steps; ``gain`` = last10 - first10
  (issue 28's target for the BF16 regime: gain >= 0.15 within at most 150 steps);
* ``reward_all``: the mean reward over every logged step (the area under the learning curve over the number
  of steps; the confirmation's secondary measure: it sees an arm that learns more slowly and then catches up);
* ``alpha_bf16``: mean ``calib/alpha_bf16`` over the calibration steps that measured (``calib/skipped`` 0):
  the share of negative-advantage tokens BF16 ratios clip (target >= 0.01);
* ``neg_push``: mean ``calib/neg_push`` over those steps (the BF16 log-prob change the update gave the
  negative-advantage tokens; nemo_fp8rl/algorithms/push.py);
* ``tail gain``: mean ``calib/neg_alt_mass_gain`` over those steps (the probability mass the update moved from
  the negative-advantage tokens onto their alternatives, in high precision);
* ``low clip``: mean ``clip/low_frac`` (the share of negative-advantage tokens with ratio below the lower bound
  in force); ``high clip``: mean ``clip/high_frac`` (positive-advantage tokens above the upper bound);
  ``upper``: mean ``clip/upper``, the upper bound in force (1 + eps_high under fixed clip, the rebalanced
  bound under ``calibration=paper`` with ``upper_mode=balance``); ``step s``: mean ``timing/step``;
* ``garbled steps`` / ``entropy surges``: the number of steps with ``stability/garbled`` /
  ``stability/entropy_surge`` set (the degeneracy signals of nemo_fp8rl/algorithms/{degeneracy,mismatch}.py).
* the format of the last 10 steps (:func:`format_table`; issue 41, reported beside the reward, not a decision
  measure): ``unclosed``, the mean ``reward/unclosed_answer`` (answers read from a ``<answer>`` never closed,
  which only the task's lenient parse scores); ``trailing``, the mean ``reward/trailing_text`` (text after
  the closing tag); ``ended``, the mean ``rollout/eos_frac`` (responses that ended before the length limit: on
  EOS or, with ``rollout.stop``, on a stop string); ``garbled last 10``, the steps of those 10 with ``stability/garbled`` set. A policy can keep its
  reward while these degrade (recompute + TIS on seed 22 of the 2xlr confirmation).

The confirmation's paired comparison: per seed, the difference of two arms' ``last10`` reward (the primary
measure; ``reward_all`` the secondary one), both runs of one seed sharing its warm-up and prompt stream;
its mean over seeds with a percentile bootstrap interval over seeds (10,000 resamples, fixed generator
seed). With 3 seeds the bootstrap takes at most 10 distinct values, so the interval is coarse.
Its power: :func:`gap_seen_with_power` (the column ``gap seen w/ 80% power``).
"""

from __future__ import annotations

import os
import random
import statistics
from pathlib import Path

WINDOW = 10
GAIN_TARGET = 0.15
ALPHA_TARGET = 0.01
BOOTSTRAP = 10_000


def read_metrics(paths: list[Path]) -> list[dict]:
    """The longest ``metrics.jsonl`` among ``paths`` (run dir, record), as the trainer's logger reads it (a cut
    last line is skipped)."""
    from nemo_fp8rl.trainer.logger import read_metrics as read_jsonl

    return max((read_jsonl(str(d)) for d in paths), key=len, default=[])


def _mean(xs: list[float]) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def run_stats(recs: list[dict]) -> dict:
    """The per-run numbers of the module docstring (None where a run has no such step)."""
    def series(key):
        return [r.get(key) for r in recs]

    calib = [r for r in recs if "calib/alpha_bf16" in r and not r.get("calib/skipped", 0)]
    reward, acc, ent = series("reward/mean"), series("reward/accuracy"), series("policy/entropy")
    first, last = _mean(reward[:WINDOW]), _mean(reward[-WINDOW:])
    return {
        "steps": len(recs),
        "reward_first10": first, "reward_last10": last, "reward_all": _mean(reward),
        "gain": None if first is None or last is None else last - first,
        "acc_first10": _mean(acc[:WINDOW]), "acc_last10": _mean(acc[-WINDOW:]),
        "entropy_first10": _mean(ent[:WINDOW]), "entropy_last10": _mean(ent[-WINDOW:]),
        "alpha_bf16": _mean([r["calib/alpha_bf16"] for r in calib]),
        "neg_push": _mean([r.get("calib/neg_push") for r in calib]),
        "tail_gain": _mean([r.get("calib/neg_alt_mass_gain") for r in calib]),
        "calib_steps": len(calib),
        "low_clip": _mean(series("clip/low_frac")),
        "high_clip": _mean(series("clip/high_frac")),
        "upper": _mean(series("clip/upper")),
        "garbled_steps": sum(1 for r in recs if r.get("stability/garbled")),
        "entropy_surges": sum(1 for r in recs if r.get("stability/entropy_surge")),
        "unclosed_last10": _mean(series("reward/unclosed_answer")[-WINDOW:]),
        "trailing_last10": _mean(series("reward/trailing_text")[-WINDOW:]),
        "eos_last10": _mean(series("rollout/eos_frac")[-WINDOW:]),
        "garbled_last10": sum(1 for r in recs[-WINDOW:] if r.get("stability/garbled")),
        "step_s": _mean(series("timing/step")),
    }


def _f(v, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def bootstrap_interval(diffs: list[float], n: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """Percentile interval (2.5%, 97.5%) of the mean of ``diffs`` resampled with replacement ``n`` times."""
    rng = random.Random(seed)
    k = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(k)) / k for _ in range(n))
    return means[int(0.025 * n)], means[min(n - 1, int(0.975 * n))]


def gap_seen_with_power(diffs: list[float], power: float = 0.8) -> float | None:
    """The smallest true mean gap the paired comparison detects with probability ``power``, at the spread the
    seeds showed.

    ``diffs`` [k]: the per-seed differences a - b. With k <= 3 seeds the 95% percentile bootstrap interval of
    their mean excludes 0 exactly when all k differences have one sign (the resample made only of the
    smallest difference has probability (1/k)^k >= 1/27 > 2.5%, so the interval's ends are the extreme
    differences). Modelling each seed's difference as Normal(gap, sd^2), independent across seeds, the
    chance all k lie on the gap's side is Phi(gap / sd)^k, so the gap detected with probability ``power`` is

        gap = sd * Phi^-1(power^(1/k)),   sd = the sample standard deviation of ``diffs`` (k - 1 dof)

    (k = 3, power 0.8: 1.46 sd). A true gap smaller than this would more often than 1 - power be reported
    as not shown. For k >= 4 the bootstrap rule is less strict than one sign for all, so the value is an upper
    bound. ``None`` for fewer than 2 seeds (no spread to measure). With 3 seeds the sd itself is uncertain
    (2 degrees of freedom): read the value as an order of magnitude."""
    if len(diffs) < 2:
        return None
    z = statistics.NormalDist().inv_cdf(power ** (1 / len(diffs)))
    return statistics.stdev(diffs) * z


def seeds_for_gap(sd: float, gap: float, power: float = 0.8, max_seeds: int = 60, sims: int = 2000,
                  boot: int = 1000, seed: int = 0) -> int | None:
    """Issue 41 item 7: the fewest seeds k with which the paired comparison's 95% percentile bootstrap
    interval (over seeds) lies on the gap's side of 0 with probability >= ``power`` when the true gap is
    ``gap``, each seed's difference Normal(gap, sd^2), independent. Estimated by simulation (``sims``
    experiments of k seeds, ``boot`` resamples each, one numpy generator seeded ``seed``):

        power(k) = P( percentile_2.5( mean of k draws resampled from d_1..d_k ) > 0 ),  d_i ~ N(gap, sd^2)

    The search starts at 3 seeds (the protocol's least). For k = 3 this is the sign rule of
    :func:`gap_seen_with_power` (Phi(gap / sd)^3). ``None`` when even ``max_seeds`` seeds fall short. sd is itself estimated from a few seeds: read k as an order of magnitude."""
    import numpy as np

    if sd <= 0:
        return 3
    rng = np.random.default_rng(seed)
    for k in range(3, max_seeds + 1):
        d = rng.normal(gap, sd, size=(sims, k)).astype(np.float32)
        idx = rng.integers(0, k, size=(boot, k))
        lo = np.empty(sims, dtype=np.float32)
        for start in range(0, sims, 250):  # [250, boot, k] at a time: bounded memory
            means = d[start:start + 250][:, idx].mean(axis=2)
            lo[start:start + 250] = np.percentile(means, 2.5, axis=1)
        if float((lo > 0).mean()) >= power:
            return k
    return None


def calibration_batch_stats(recs: list[dict], lower_min: float = 0.5, nominal_lower: float = 0.8) -> dict:
    """Issue 41 item 3: how well one run's calibrations measured BF16's clip share, and where its lower
    bound sat. Over its calibrations (steps with ``calib/tokens``, skipped ones counted apart):

    * ``tokens``: median and range of ``calib/tokens`` (non-zero-advantage tokens per calibration);
    * ``alpha_zero``: the share of calibrations where BF16 clipped no negative token (``calib/alpha_bf16`` 0:
      then L* is the lowest FP8 ratio, a guess, not a measurement);
    * ``raw_below_guard``: the share with ``calib/lower_raw`` < ``lower_min`` (the guard, not the match,
      sets the bound); ``raw`` median and range of ``calib/lower_raw``;
    * ``lower_at_guard``: the share of steps whose ``clip/lower`` in force equals ``lower_min`` (after the
      first calibration), its median and range; the same medians of ``clip/upper`` (issue 41's fixed window
      of ``fp8_fixed_wide`` is (median lower, median upper) of the exploration seed's calibrated run)."""
    import numpy as np

    cal = [r for r in recs if "calib/tokens" in r]
    done = [r for r in cal if not r.get("calib/skipped", 0)]
    raw = [r["calib/lower_raw"] for r in done if r.get("calib/lower_raw") is not None]
    first = min((r["step"] for r in done), default=None)
    after = [r for r in recs if first is not None and r["step"] > first and "clip/lower" in r]
    lows = [r["clip/lower"] for r in after]
    ups = [r["clip/upper"] for r in after]

    def med(xs):
        return None if not xs else float(np.median(xs))

    return {
        "calibrations": len(cal), "skipped": len(cal) - len(done),
        "tokens_median": med([r["calib/tokens"] for r in done]),
        "tokens_min": min((r["calib/tokens"] for r in done), default=None),
        "tokens_max": max((r["calib/tokens"] for r in done), default=None),
        "alpha_zero": None if not done else sum(1 for r in done if r.get("calib/alpha_bf16") == 0) / len(done),
        "alpha_median": med([r["calib/alpha_bf16"] for r in done if r.get("calib/alpha_bf16") is not None]),
        "raw_below_guard": None if not raw else sum(1 for x in raw if x < lower_min) / len(raw),
        "raw_median": med(raw), "raw_min": min(raw, default=None), "raw_max": max(raw, default=None),
        "lower_at_guard": None if not lows else sum(1 for x in lows if abs(x - lower_min) < 1e-9) / len(lows),
        "lower_median": med(lows), "lower_min": min(lows, default=None), "lower_max": max(lows, default=None),
        "upper_median": med(ups),
    }


def calibration_batch_table(rows: list[tuple[str, dict]]) -> str:
    """``rows``: (run name, :func:`calibration_batch_stats`)."""
    out = ["| run | calibrations (skipped) | tokens per calibration, median [range] | alpha_bf16 = 0 | "
           "alpha_bf16 median | lower_raw < guard | lower_raw median [range] | lower in force at guard | "
           "lower in force median [range] | upper in force median |",
           "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    for name, s in rows:
        out.append(
            f"| {name} | {s['calibrations']} ({s['skipped']}) | {_f(s['tokens_median'], '.0f')} "
            f"[{_f(s['tokens_min'], '.0f')}, {_f(s['tokens_max'], '.0f')}] | {_f(s['alpha_zero'], '.2f')} | "
            f"{_f(s['alpha_median'])} | {_f(s['raw_below_guard'], '.2f')} | {_f(s['raw_median'])} "
            f"[{_f(s['raw_min'])}, {_f(s['raw_max'])}] | {_f(s['lower_at_guard'], '.2f')} | "
            f"{_f(s['lower_median'])} [{_f(s['lower_min'])}, {_f(s['lower_max'])}] | {_f(s['upper_median'])} |")
    return "\n".join(out)


SEPARATION = 0.06
"""Issue 41's exploration rule: two arms of one seed *separate* when their reward differs by at least this in
the last-10 mean or in the mean over all steps (two standard errors of a 10-step window, the first
exploration's rule)."""


def track_rule(candidates: dict[str, dict[str, dict | None]], departures: dict[str, int],
               separation: float = SEPARATION, gain_target: float = GAIN_TARGET) -> dict:
    """Issue 41's choice of the confirmation's candidate, the rule docs/results.md wrote before any run of
    ``--stage track`` (2026-12-04 19:10).

    ``candidates[cand][arm]``: the :func:`run_stats` of the candidate's finished seed-1 run of ``arm``, or
    ``None`` while it has not finished. Per candidate, with d = fp8_calibrated - fp8_fixed_wide:

    * *separates*: max(|d last 10|, |d over all steps|) >= ``separation``, in either direction;
    * *usable*: the bf16 run's gain (first 10 to last 10 steps) >= ``gain_target``;
    * the same d for ``fp8_calibrated_low`` (added to the exploration before any run and judged by the same
      rule), reported beside; the choice reads ``fp8_calibrated``, the plan's arm.

    The choice: the usable candidate that separates with the largest max(|d|); ties (equal to 3 decimals)
    go to the fewest ``departures`` from the confirmed regime, then to the name. While any candidate lacks
    one of bf16, fp8_calibrated, fp8_fixed_wide, nothing is chosen (``pending`` names them). If every
    candidate is finished and none is usable and separating, ``choice`` is None and ``finding`` says so:
    the best fixed window does what tracking does there, and the plan runs no confirmation for question 1.

    Returns ``{"rows": [{candidate, bf16_gain, usable, d_last10, d_all, separates, low_d_last10, low_d_all,
    low_separates}], "pending": [cand], "choice": cand | None, "finding": str}``."""
    def diff(a, b, key):
        return None if a is None or b is None or a[key] is None or b[key] is None else a[key] - b[key]

    def sep(d1, d2):
        return None if d1 is None or d2 is None else max(abs(d1), abs(d2)) >= separation - 1e-12

    rows, pending = [], []
    for cand, arms in candidates.items():
        bf16, cal, wide, low = (arms.get(a) for a in ("bf16", "fp8_calibrated", "fp8_fixed_wide",
                                                      "fp8_calibrated_low"))
        if bf16 is None or cal is None or wide is None:
            pending.append(cand)
        gain = None if bf16 is None else bf16["gain"]
        row = {"candidate": cand, "bf16_gain": gain, "usable": None if gain is None else gain >= gain_target,
               "d_last10": diff(cal, wide, "reward_last10"), "d_all": diff(cal, wide, "reward_all"),
               "low_d_last10": diff(low, wide, "reward_last10"), "low_d_all": diff(low, wide, "reward_all")}
        row["separates"] = sep(row["d_last10"], row["d_all"])
        row["low_separates"] = sep(row["low_d_last10"], row["low_d_all"])
        rows.append(row)
    if pending:
        return {"rows": rows, "pending": pending, "choice": None,
                "finding": f"not chosen yet, no finished bf16, fp8_calibrated and fp8_fixed_wide runs for "
                           f"{', '.join(pending)}"}
    eligible = [r for r in rows if r["usable"] and r["separates"]]
    if not eligible:
        return {"rows": rows, "pending": [], "choice": None,
                "finding": "no usable candidate separates fp8_calibrated from its fixed window on seed 1: the "
                           "best fixed window does what tracking does in these regimes (no confirmation for "
                           "question 1)"}
    best = min(eligible, key=lambda r: (-round(max(abs(r["d_last10"]), abs(r["d_all"])), 3),
                                        departures.get(r["candidate"], 0), r["candidate"]))
    return {"rows": rows, "pending": [], "choice": best["candidate"],
            "finding": f"{best['candidate']} (usable; fp8_calibrated - fp8_fixed_wide {best['d_last10']:+.3f} "
                       f"last 10, {best['d_all']:+.3f} over all steps)"}


def track_rule_table(rule: dict) -> str:
    """:func:`track_rule`'s rows as markdown, and its outcome."""
    def yn(v):
        return "-" if v is None else ("yes" if v else "no")

    out = ["| candidate | bf16 gain | usable | calibrated - fixed window, last 10 | over all steps | separates | "
           "calibrated_low - fixed window, last 10 | over all steps | separates |", "|" + " --- |" * 9]
    for r in rule["rows"]:
        out.append(f"| {r['candidate']} | {_f(r['bf16_gain'], '+.3f')} | {yn(r['usable'])} | "
                   f"{_f(r['d_last10'], '+.3f')} | {_f(r['d_all'], '+.3f')} | {yn(r['separates'])} | "
                   f"{_f(r['low_d_last10'], '+.3f')} | {_f(r['low_d_all'], '+.3f')} | {yn(r['low_separates'])} |")
    return "\n".join(out) + f"\n\nThe rule's choice for the confirmation: {rule['finding']}."


def track_verdicts(last10: dict[str, dict[int, float]], min_seeds: int = 3) -> str:
    """Issue 41's confirmation verdicts from the primary measure (``last10[arm][seed]``: a finished run's
    last-10 mean reward), by the plan's rule: a question is answered where the 95% bootstrap interval of the
    per-seed difference lies on one side of 0, and is *not shown* otherwise, stated with the gap the seeds
    could have seen (:func:`gap_seen_with_power`). Fewer than ``min_seeds`` paired seeds: pending.

    * question 1: fp8_calibrated - fp8_fixed_wide (above 0: tracking adds; below: the fixed window does
      better);
    * question 2: fp8_calibrated - fp8_recompute_tis (above 0: calibration does better than recompute + TIS;
      below: recompute + TIS does better)."""
    questions = (("question 1", "fp8_calibrated", "fp8_fixed_wide", "tracking adds", "the fixed window does better"),
                 ("question 2", "fp8_calibrated", "fp8_recompute_tis", "calibration does better than recompute + TIS",
                  "recompute + TIS does better than calibration"))
    lines = []
    for q, a, b, above, below in questions:
        _, diffs = paired_diffs(last10, a, b)
        if len(diffs) < min_seeds:
            lines.append(f"- {q} ({a} - {b}): pending, {len(diffs)} of {min_seeds} paired seeds finished.")
            continue
        lo, hi = bootstrap_interval(diffs)
        mean = sum(diffs) / len(diffs)
        if lo > 0:
            verdict = above
        elif hi < 0:
            verdict = below
        else:
            gap = gap_seen_with_power(diffs)
            verdict = f"not shown (a true gap of {gap:.3f} would be seen 4 times in 5 at this spread)"
        lines.append(f"- {q} ({a} - {b}, {len(diffs)} seeds): {mean:+.3f} [{lo:+.3f}, {hi:+.3f}]: {verdict}.")
    return "\n".join(lines)


def sweep_table(rows: list[tuple[str, list[str], dict, int]]) -> str:
    """``rows``: (point, its overrides, run_stats, planned steps)."""
    out = [("| point | overrides | steps | reward first 10 | last 10 | gain | accuracy first 10 | last 10 | "
            "alpha_bf16 | neg push | low clip | entropy first 10 | last 10 | step s | target |"),
           "|" + " --- |" * 15]
    for name, overrides, s, planned in rows:
        if s["steps"] == 0:
            verdict = "not run"
        elif s["steps"] < planned:
            verdict = f"unfinished ({s['steps']}/{planned})"
        else:
            ok = (s["gain"] or 0) >= GAIN_TARGET and (s["alpha_bf16"] or 0) >= ALPHA_TARGET
            verdict = "**met**" if ok else "no"
        out.append(f"| {name} | {' '.join(overrides) or '(base)'} | {s['steps']}/{planned} | "
                   f"{_f(s['reward_first10'])} | {_f(s['reward_last10'])} | {_f(s['gain'], '+.3f')} | "
                   f"{_f(s['acc_first10'])} | {_f(s['acc_last10'])} | {_f(s['alpha_bf16'], '.4f')} | "
                   f"{_f(s['neg_push'], '+.4f')} | {_f(s['low_clip'], '.4f')} | {_f(s['entropy_first10'])} | "
                   f"{_f(s['entropy_last10'])} | {_f(s['step_s'], '.1f')} | {verdict} |")
    return "\n".join(out)


def arms_table(rows: list[tuple[str, dict, int]]) -> str:
    """``rows``: (run name, run_stats, planned steps), for exploration and confirmation runs."""
    out = [("| run | steps | reward last 10 | gain | mean over all steps | accuracy last 10 | alpha_bf16 | neg push | "
            "tail gain | low clip | high clip | upper | entropy last 10 | garbled steps | entropy surges |"),
           "|" + " --- |" * 15]
    for name, s, planned in rows:
        out.append(f"| {name} | {s['steps']}/{planned} | {_f(s['reward_last10'])} | {_f(s['gain'], '+.3f')} | "
                   f"{_f(s['reward_all'])} | {_f(s['acc_last10'])} | {_f(s['alpha_bf16'], '.4f')} | "
                   f"{_f(s['neg_push'], '+.4f')} | {_f(s['tail_gain'], '+.4f')} | {_f(s['low_clip'], '.4f')} | "
                   f"{_f(s['high_clip'], '.4f')} | {_f(s['upper'], '.2f')} | {_f(s['entropy_last10'])} | {s['garbled_steps']} | {s['entropy_surges']} |")
    return "\n".join(out)


def format_table(rows: list[tuple[str, dict, int]]) -> str:
    """``rows``: (run name, run_stats, planned steps). The format of each run's last 10 steps (module
    docstring): shares of unclosed answers, text after the answer, responses ended before the length limit, and garbled
    steps."""
    out = ["| run | steps | reward last 10 | unclosed answer last 10 | text after answer last 10 | "
           "ended (EOS or stop string) last 10 | garbled steps of the last 10 |", "|" + " --- |" * 7]
    for name, s, planned in rows:
        out.append(f"| {name} | {s['steps']}/{planned} | {_f(s['reward_last10'])} | {_f(s['unclosed_last10'])} | "
                   f"{_f(s['trailing_last10'])} | {_f(s['eos_last10'])} | "
                   f"{s['garbled_last10'] if s['steps'] else '-'} |")
    return "\n".join(out)


ARM_COLUMNS = (("reward_last10", "reward last 10", ".3f"), ("reward_all", "mean over all steps", ".3f"),
               ("acc_last10", "accuracy last 10", ".3f"), ("low_clip", "low clip", ".4f"),
               ("high_clip", "high clip", ".4f"), ("upper", "upper", ".2f"),
               ("alpha_bf16", "alpha_bf16", ".4f"), ("neg_push", "neg push", "+.4f"),
               ("tail_gain", "tail gain", "+.4f"), ("entropy_last10", "entropy last 10", ".3f"))


def arm_means_table(by_arm: dict[str, list[dict]]) -> str:
    """``by_arm[arm]``: the run_stats of its finished runs (one per seed). Per arm, the mean over seeds of each
    column of :data:`ARM_COLUMNS` with the lowest and highest seed in brackets, and the garbled steps and
    entropy surges summed over its runs."""
    out = ["| arm | seeds | " + " | ".join(h for _, h, _ in ARM_COLUMNS) + " | garbled steps | entropy surges |",
           "|" + " --- |" * (len(ARM_COLUMNS) + 4)]
    for arm, stats in by_arm.items():
        cells = []
        for key, _, fmt in ARM_COLUMNS:
            xs = [s[key] for s in stats if s[key] is not None]
            if not xs:
                cells.append("-")
            elif len(xs) == 1:
                cells.append(format(xs[0], fmt))
            else:
                cells.append(f"{format(sum(xs) / len(xs), fmt)} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]")
        out.append(f"| {arm} | {len(stats)} | " + " | ".join(cells) + f" | {sum(s['garbled_steps'] for s in stats)} | "
                   f"{sum(s['entropy_surges'] for s in stats)} |")
    return "\n".join(out)


def paired_diffs(by_seed: dict[str, dict[int, float]], a: str, b: str) -> tuple[list[int], list[float]]:
    """The seeds both arms finished (sorted) and a - b on each: ``by_seed[arm][seed]`` a run's measure."""
    seeds = sorted(set(by_seed.get(a, {})) & set(by_seed.get(b, {})))
    return seeds, [by_seed[a][s] - by_seed[b][s] for s in seeds]


def paired_table(by_seed: dict[str, dict[int, float]], pairs: list[tuple[str, str]], measure: str = "last 10",
                 quantity: str = "reward") -> str:
    """``by_seed[arm][seed]``: a finished run's ``quantity`` (reward, or accuracy), ``measure`` naming how it is
    taken in the header (the last-10 mean, or the mean over all steps). Per pair (a, b): a - b per seed, the
    mean and its bootstrap interval over the seeds both arms finished, and :func:`gap_seen_with_power` of
    those differences."""
    out = [f"| comparison ({quantity} {measure}) | seeds | per seed (a - b) | mean | 95% bootstrap interval "
           "| gap seen w/ 80% power |", "|" + " --- |" * 6]
    for a, b in pairs:
        seeds, diffs = paired_diffs(by_seed, a, b)
        if not diffs:
            out.append(f"| {a} - {b} | 0 | - | - | - | - |")
            continue
        lo, hi = bootstrap_interval(diffs)
        per = ", ".join(f"{s}: {d:+.3f}" for s, d in zip(seeds, diffs))
        gap = gap_seen_with_power(diffs)
        out.append(f"| {a} - {b} | {len(seeds)} | {per} | {sum(diffs) / len(diffs):+.3f} | "
                   f"[{lo:+.3f}, {hi:+.3f}] | {'-' if gap is None else f'{gap:.3f}'} |")
    return "\n".join(out)


def samples_table(samples: dict[str, list[dict]], limit: int = 60) -> str:
    """One markdown table of the sample generations of one seed's arms, which share their prompt stream:
    ``samples[arm]``: that run's ``samples.jsonl`` records (step, question, answer, response, correct). A row
    per (step, i-th sample of the step) at the first, middle and last sample step, with each arm's response
    (cut at ``limit`` characters; a check mark where it is correct). Where the arms' questions differ at a
    row, the row shows the first arm's question and marks the others' cells with theirs."""
    from nemo_fp8rl.report import _one_line, pick_sample_steps

    arms = [a for a, recs in samples.items() if recs]
    if not arms:
        return ""
    steps = pick_sample_steps([r["step"] for r in samples[arms[0]]])

    def cell(r: dict, question: str) -> str:
        text = _one_line(str(r.get("response", "")), limit).replace("|", "\\|").replace("`", "'")
        mark = " ✓" if r.get("correct") else ""
        other = "" if r.get("question") == question else f" (question: {r.get('question', '')})"
        return f"`{text}`{mark}{other}"

    questions = [" ".join(str(r.get("question", "")).split()) for r in samples[arms[0]] if r["step"] in steps]
    prefix = os.path.commonprefix(questions) if len(questions) > 1 else ""
    prefix = prefix[: prefix.rfind(" ") + 1]  # whole words
    out = [f"Every question starts \"{prefix.strip()} ...\"; the table shows the rest.\n" if prefix else "",
           "| step | question | reference | " + " | ".join(arms) + " |", "|" + " --- |" * (3 + len(arms))]
    for st in steps:
        per_arm = {a: [r for r in samples[a] if r["step"] == st] for a in arms}
        for i, first in enumerate(per_arm[arms[0]]):
            q = first.get("question", "")
            rest = " ".join(q.split())[len(prefix):]
            cells = [cell(per_arm[a][i], q) if i < len(per_arm[a]) else "-" for a in arms]
            out.append(f"| {st} | {rest} | `{first.get('answer', '')}` | " + " | ".join(cells) + " |")
    return "\n".join(x for x in out if x)


def _smooth(xs: list[float], k: int = WINDOW) -> list[float]:
    """Trailing mean over the last ``k`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _series(recs: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that logged it (a calibration metric only on its steps)."""
    pts = [(int(r.get("step", i)), float(r[key])) for i, r in enumerate(recs) if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def curves_figure(groups: dict[str, list[list[dict]]], target: Path,
                  keys: tuple[str, ...] = ("reward/mean", "reward/accuracy", "policy/entropy", "clip/low_frac",
                                           "calib/neg_push")) -> None:
    """One panel per metric in ``keys``; per group (an arm, or a sweep point) the mean over its runs (seeds),
    with the band from the lowest to the highest run where there are several. A metric every step logs is
    drawn as its trailing 10-step mean over the steps every run of the group reached; one logged on some steps
    only (``calib/*``, on calibration steps) as its raw values, at each step over the runs that logged it there.
    ``groups[name]``: each run's metrics records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.6))
    for ax, key in zip(axes, keys):
        sparse = False
        for name, runs in groups.items():
            logged = [(_series(recs, key), len(recs)) for recs in runs if recs]
            xs_ys = [xy for xy, _ in logged if xy[0]]
            if not xs_ys:
                continue
            if any(len(x) < n for (x, _), n in logged if x):
                # sparse: at each step some run logged, over the runs that logged it
                sparse = True
                values = [dict(zip(x, y)) for x, y in xs_ys]
                steps = sorted(set().union(*values))
                cols = [[v[st] for v in values if st in v] for st in steps]
            else:
                smoothed = [_smooth(y) for _, y in xs_ys]
                steps = list(range(min(len(s) for s in smoothed)))
                cols = [[s[i] for s in smoothed] for i in steps]
            line, = ax.plot(steps, [sum(c) / len(c) for c in cols], marker="o" if sparse else None, markersize=3,
                            label=f"{name} ({len(xs_ys)})")
            if len(xs_ys) > 1:
                ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(),
                                alpha=0.2)
        ax.set_title(f"{key} (calibration steps)" if sparse else f"{key} (trailing {WINDOW}-step mean)",
                     fontsize=9)
        ax.set_xlabel("RL step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
