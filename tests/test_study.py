"""The study runner and its summarizer end to end, at smoke size (real CLI runs, 2 RL steps each)."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "trainer"))
from _cli import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN_STUDY = ROOT / "benchmarks" / "study" / "run_study.py"
SUMMARIZE = ROOT / "benchmarks" / "study" / "summarize.py"


def _plan(*args: str) -> list[list[str]]:
    out = subprocess.run([sys.executable, str(RUN_STUDY), "--list", *args], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.splitlines()
    return [line.split("#")[0].split() for line in out[:-1]]  # "# ~N min": the run's estimated wall time


def test_plan_covers_the_grid_and_ablations():
    main = _plan("--only", "main")
    # 2 algorithms x 3 seeds x (bf16 + 4 recipes x 2 FP8 arms)
    assert len(main) == 2 * 3 * 9
    names = {r[1] for r in main}
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        for arm in ("fp8", "fp8_calibrated"):
            assert f"dapo/{recipe}/{arm}/seed3" in names
    abl = {r[1].split("/")[0]: r[2:] for r in _plan("--only", "ablation", "--seeds", "1")}
    assert "calibration.interval=5" in abl["interval5"] and "calibration.ema=0.9" in abl["ema0.9"]
    assert "calibration.upper_mode=fixed" in abl["upper_fixed"]
    # the bf16 arm of a condition keeps only its non-FP8 overrides
    long = {r[1]: r[2:] for r in _plan("--only", "long", "--seeds", "2")}
    assert long["e5m2_lr2e-4/bf16/seed2"] == ["algorithm=grpo", "fp8=off", "calibration=off", "optim.lr=2e-4"]
    assert "fp8.fp8_format=e5m2" in long["e5m2_lr2e-4/fp8/seed2"]


def test_long_group_runs_resumes_and_summarizes(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, str(RUN_STUDY), "--out", str(out), "--only", "long", "--seeds", "1", "--long-steps", "2",
           "--jobs", "2", "--extra", *TINY]
    out.mkdir()
    earlier = {"group": "main", "name": "grpo/bf16/seed9", "seed": 9, "overrides": ["algorithm=grpo"]}
    (out / "study.json").write_text(json.dumps({"steps": 60, "runs": [earlier], "common": []}))
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "3/3 runs ok" in first.stdout
    for arm in ("bf16", "fp8", "fp8_calibrated"):
        lines = (out / "long" / "e5m2_lr2e-4" / arm / "seed1" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [0, 1]
    # a finished run is skipped on the second call (the study is resumable)
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert second.returncode == 0 and second.stdout.count(": rc=0 0s") == 3, second.stdout
    # study.json records every run planned into the directory, each once (an earlier slice's runs stay)
    recorded = [r["name"] for r in json.loads((out / "study.json").read_text())["runs"]]
    assert sorted(recorded) == sorted(["grpo/bf16/seed9"] + [f"e5m2_lr2e-4/{a}/seed1" for a in
                                                               ("bf16", "fp8", "fp8_calibrated")])

    doc, figs = tmp_path / "results.md", tmp_path / "figs"
    subprocess.run([sys.executable, str(SUMMARIZE), "--study", str(out), "--doc", str(doc), "--figures", str(figs),
                    "--last", "2"], check=True, cwd=ROOT, capture_output=True, timeout=300)
    text = doc.read_text()
    assert "## Longer runs where fixed-clip FP8 degrades (2 steps" in text
    rows = [line for line in text.splitlines() if line.startswith("| e5m2_lr2e-4 / ")]
    assert [r.split("|")[1].strip() for r in rows] == [f"e5m2_lr2e-4 / {a}" for a in ("bf16", "fp8", "fp8_calibrated")]
    # the fp8 row's final reward is the mean over the --last 2 steps of that run
    rewards = [json.loads(x)["reward/mean"] for x in
               (out / "long/e5m2_lr2e-4/fp8/seed1/metrics.jsonl").read_text().splitlines()]
    assert rows[1].split("|")[3].strip() == f"{sum(rewards) / 2:.3f}"
    assert (figs / "long_e5m2_lr2e-4_seed1.png").stat().st_size > 10_000


def test_summarize_keeps_sections_whose_runs_are_not_in_the_study_dir():
    """A study directory holding one group must not wipe the others' tables from docs/results.md."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("summarize", SUMMARIZE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = "| run | seeds | final reward |\n|---|---:|---:|\n"
    old = ("# Results\n\nold preamble\n\n## How the study was run\n\n60 steps\n\n## Main grid: GRPO\n\n"
           + row + "| bf16 | 3 | 0.77 |\n\n## Stress conditions\n\n" + row + "| e5m2 / fp8 | 1 | 0.42 |\n\n"
           "## Real model (SmolLM2-135M)\n\nNo runs of the real group in this study directory yet.\n\n## H200 check\n\nold")
    new = ("# Results\n\nnew preamble\n\n## How the study was run\n\n100 steps\n\n## Main grid: GRPO\n\n"
           + row + "| bf16 | 0 | - |\n\n## Real model (SmolLM2-135M)\n\n" + row + "| bf16 | 2 | 0.19 |\n\n"
           "## H200 check\n\nnew")
    merged = mod.keep_measured_sections(old, new)
    heads = [line for line in merged.splitlines() if line.startswith("## ")]
    assert heads == ["## How the study was run", "## Main grid: GRPO", "## Stress conditions",
                     "## Real model (SmolLM2-135M)", "## H200 check"]
    assert "| bf16 | 3 | 0.77 |" in merged and "| e5m2 / fp8 | 1 | 0.42 |" in merged  # kept: no runs in new
    assert "old preamble" in merged and "60 steps" in merged  # they describe the kept main grid
    assert "| bf16 | 2 | 0.19 |" in merged and "No runs of the real group" not in merged  # measured: new wins
    assert merged.rstrip().endswith("new")  # sections without run tables are regenerated
