"""The study runner and its summarizer end to end, at smoke size (real CLI runs, 2 RL steps each)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    cmd = [sys.executable, str(RUN_STUDY), "--out", str(out), "--record", str(tmp_path / "records"), "--only", "long",
           "--seeds", "1", "--long-steps", "2", "--jobs", "2", "--extra", *TINY]
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

    # more steps asked of a finished run: it resumes from its last checkpoint (step 2, keep_last=1), it does
    # not start again; SIGTERM to the study (its pid only) stops that trainer at a checkpoint and the study
    # exits non-zero, leaving the run resumable
    bf16 = out / "long" / "e5m2_lr2e-4" / "bf16" / "seed1"
    assert [p.name for p in (bf16 / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_2"]
    before = (bf16 / "metrics.jsonl").read_text().splitlines()
    third = subprocess.Popen([*cmd[:cmd.index("--long-steps")], "--long-steps", "200", "--match", "bf16",
                              *cmd[cmd.index("--long-steps") + 2:]], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.time() + 300
        while len((bf16 / "metrics.jsonl").read_text().splitlines()) < 3 and third.poll() is None:
            assert time.time() < deadline, "the resumed run logged no new step"
            time.sleep(0.05)
        third.send_signal(signal.SIGTERM)
        stdout, stderr = third.communicate(timeout=300)
    finally:
        third.kill()
    assert third.returncode == 1, stdout + stderr
    assert "study stopped by signal 15" in stderr and "the same command resumes them" in stderr
    assert "start long/e5m2_lr2e-4/bf16/seed1: resume from step 2" in stdout
    assert "rc=7" in stdout and "(stopped at a checkpoint by the signal)" in stdout
    after = (bf16 / "metrics.jsonl").read_text().splitlines()
    logged = len(after)
    assert 3 <= logged < 200 and [json.loads(x)["step"] for x in after] == list(range(logged))
    assert after[:2] == before  # steps 0-1 kept as they were (a restart would have rewritten their timings)
    assert [p.name for p in (bf16 / "checkpoints").iterdir() if p.name.startswith("step_")] == [f"step_{logged}"]
    log = (out / "logs" / "long__e5m2_lr2e-4__bf16__seed1.log").read_text()
    assert "resumed from" in log and "checkpoint saved at step" in log
    attempt = json.loads((bf16 / "study_run.json").read_text())["attempts"][-1]
    assert attempt["from_step"] == 2 and attempt["rc"] == 7 and attempt["stopped_by_signal"] == signal.SIGTERM
    # each part of a run says where it ran (a resumed run may continue on another machine)
    assert attempt["machine"]["cpus"] >= 1 and attempt["machine"]["torch"] and attempt["machine"]["torch_threads"] == 1
    train_log = (bf16 / "train.log").read_text()
    assert train_log.count(" machine: ") == 2 and "resumed from" in train_log  # the first part and the resumed one


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


# ------------------------------------------------------------------ issue 28's protocol, chunks, resume, commit
def _run_study_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_study", RUN_STUDY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _study(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN_STUDY), *args], capture_output=True, text=True, cwd=ROOT,
                          check=check, timeout=120)


def _stage_args(mod, *argv: str):
    """run_study's parsed arguments for ``argv`` (its own parser, through main's argparse setup)."""
    import argparse

    ns = argparse.Namespace(stage=None, points="", regime="", conditions="", condition="", candidates="",
                            confirm_seeds="11,12,13",
                            sweep_steps=100, explore_steps=100, confirm_steps=100, checkpoint_every=10)
    for a in argv:
        k, _, v = a.partition("=")
        setattr(ns, k, type(getattr(ns, k))(v) if getattr(ns, k) is not None else v)
    return ns


def test_protocol_stages_plan_arms_and_fresh_confirmation_seeds():
    mod = _run_study_module()
    sweep = mod.stage_runs(_stage_args(mod, "stage=sweep"))
    assert [r["name"] for r in sweep] == [f"{p}/seed1" for p in mod.SWEEP] and {r["arm"] for r in sweep} == {"bf16"}
    explore = {r["name"]: r for r in mod.stage_runs(_stage_args(mod, "stage=explore", "regime=lr1e-5"))}
    assert "lr1e-5/e5m2/fp8/seed1" in explore
    # the regime's BF16 reference is the sweep's run of that point (same overrides, seed and steps)
    ref = explore["lr1e-5/seed1"]
    assert ref["group"] == "sweep" and ref["overrides"] == {r["name"]: r for r in sweep}["lr1e-5/seed1"]["overrides"]
    longer = mod.stage_runs(_stage_args(mod, "stage=explore", "regime=lr1e-5", "explore_steps=150"))
    assert [(r["group"], r["name"]) for r in longer][0] == ("explore", "lr1e-5/bf16/seed1")
    assert "lr1e-5/e5m2/bf16/seed1" not in explore  # an FP8-only condition shares the regime's BF16 run
    assert "lr1e-5/kv_e4m3_static/bf16/seed1" not in explore  # rollout.fp8.* is FP8-only too
    assert explore["lr1e-5/kv_e4m3_static_len64/bf16/seed1"]["overrides"][-3] == "rollout.max_new_tokens=64"
    assert explore["lr1e-5/2xlr/bf16/seed1"]["overrides"][-3] == "optim.lr=2e-05"  # {lr2x}: twice the regime's
    confirm = mod.stage_runs(_stage_args(mod, "stage=confirm", "regime=lr1e-5", "condition=e5m2"))
    assert len(confirm) == 3 * 5 and {r["seed"] for r in confirm} == {11, 12, 13}
    # plan order: every seed of the primary arms, then the ablation's seeds, then the later control's
    # (a session finishes ~2 runs)
    assert [(r["arm"], r["seed"]) for r in confirm] == [
        *[(a, s) for s in (11, 12, 13) for a in ("bf16", "fp8", "fp8_calibrated")],
        *[("fp8_calibrated_upper_fixed", s) for s in (11, 12, 13)],
        *[("fp8_fixed_wide", s) for s in (11, 12, 13)]]
    by_arm = {r["arm"]: r["overrides"] for r in confirm if r["seed"] == 11}
    assert set(by_arm) == {"bf16", "fp8", "fp8_calibrated", "fp8_calibrated_upper_fixed", "fp8_fixed_wide"}
    assert by_arm["bf16"][-2:] == ["fp8=off", "calibration=measure"] and "fp8.fp8_format=e5m2" not in by_arm["bf16"]
    assert by_arm["fp8_calibrated_upper_fixed"][-2:] == ["calibration=paper", "calibration.upper_mode=fixed"]
    bad = _study("--stage", "confirm", "--regime", "lr1e-5", "--condition", "e5m2", "--confirm-seeds", "1,7",
                 "--plan", check=False)
    assert bad.returncode and "[1] were used by the sweep or the exploration" in bad.stderr
    assert "needs --condition" in _study("--stage", "confirm", "--regime", "base", "--plan", check=False).stderr


def test_protocol_runs_compose_into_valid_configs(tmp_path):
    """Every run of every stage composes (Hydra, with the runner's own command-line additions) and
    validates, with the settings the protocol promises; nothing is fetched or trained."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from nemo_fp8rl.train import CONF_DIR, register_schema
    from nemo_fp8rl.validation import validate

    mod = _run_study_module()
    runs = (mod.stage_runs(_stage_args(mod, "stage=sweep"))
            + mod.stage_runs(_stage_args(mod, "stage=explore", "regime=lr1e-5"))
            + mod.stage_runs(_stage_args(mod, "stage=confirm", "regime=base", "condition=blockwise", "confirm_seeds=11")))
    register_schema()
    GlobalHydra.instance().clear()
    cfgs = {}
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for r in runs:
            cmd = mod.command(r, tmp_path, r["steps"], [])
            cfg = validate(OmegaConf.to_object(compose("config", overrides=cmd[3:])))
            cfgs[(r["group"], r["name"])] = cfg
            assert cfg.model.hf_path == "registry:smollm2-135m" and cfg.task.name == "reasoning_gym"
            assert cfg.trainer.keep_last == 1 and cfg.trainer.checkpoint_interval == 10 and cfg.resume
            assert cfg.calibration.enabled and cfg.calibration.interval == mod.PROTOCOL_CALIB_INTERVAL
            assert cfg.calibration.apply == r["arm"].startswith("fp8_calibrated")
            assert (cfg.fp8.recipe is None) == (r["arm"] == "bf16")
            assert cfg.calibration.upper_mode == ("fixed" if r["arm"].endswith("upper_fixed") else "balance")
            # the control's fixed window [0.5, 2.0]; every other arm keeps the regime's nominal [0.8, 1.2]
            wide = r["arm"] == "fp8_fixed_wide"
            assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == ((0.5, 1.0) if wide else (0.2, 0.2))
    GlobalHydra.instance().clear()
    easy = cfgs[("sweep", "lr1e-5_easy/seed1")]
    assert easy.task.dataset_kwargs["max_terms"] == 2 and easy.task.dataset_kwargs["max_digits"] == 1
    assert easy.optim.lr == 1e-5
    assert cfgs[("sweep", "base/seed1")].optim.lr == 3e-6 and cfgs[("sweep", "base/seed1")].seed == 1
    assert cfgs[("sweep", "lr1e-5_reason64/seed1")].task.system_prompt.startswith("Think in one or two")
    assert cfgs[("sweep", "lr1e-5_group8/seed1")].algorithm.group_size == 8
    assert cfgs[("explore", "lr1e-5/2xlr/bf16/seed1")].optim.lr == 2e-5
    assert cfgs[("explore", "lr1e-5/e5m2/fp8/seed1")].fp8.fp8_format == "e5m2"
    kv = cfgs[("explore", "lr1e-5/kv_e4m3_static/fp8/seed1")].rollout.fp8
    assert kv.kv_cache == "e4m3" and kv.kv_scales == "static"
    assert cfgs[("confirm", "base/blockwise/fp8_calibrated/seed11")].fp8.recipe == "blockwise"


def _fake_run(d: Path, steps: int, step_s: float, overrides: list[str], checkpoint: int | None = None):
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": 0.1, "timing/step": step_s}) + "\n"
                                             for i in range(steps)))
    (d / "study_run.json").write_text(json.dumps({"overrides": overrides, "seed": 1}))
    (d / "samples.jsonl").write_text(json.dumps({"step": 0, "prompt": "p", "question": "1+2", "answer": "3",
                                                 "response": "<answer>3</answer>", "reward": 1.0, "correct": True,
                                                 "invalid": False}) + "\n")
    (d / "config.yaml").write_text("seed: 1\n")
    if checkpoint is not None:
        ck = d / "checkpoints" / f"step_{checkpoint}"
        (ck / "dist").mkdir(parents=True)
        (ck / "meta.json").write_text("{}")
        (ck / "dist" / "__0_0.distcp").write_bytes(b"0" * 64)
        (d / "checkpoints" / "latest").write_text(f"step_{checkpoint}\n")
        (d / "hf").mkdir()
        (d / "hf" / "model.safetensors").write_bytes(b"0" * 64)


def test_run_state_resume_decision_and_plan(tmp_path):
    mod = _run_study_module()
    out, record = tmp_path / "out", tmp_path / "records"
    runs = {r["name"]: r for r in mod.stage_runs(_stage_args(mod, "stage=sweep", "sweep_steps=10"))}
    base, lr, lr3, mb4 = (runs[f"{p}/seed1"] for p in ("base", "lr1e-5", "lr3e-5", "lr1e-5_mb4"))
    _fake_run(out / "sweep" / "base/seed1", 10, 40.0, base["overrides"])  # finished
    _fake_run(out / "sweep" / "lr1e-5/seed1", 6, 20.0, lr["overrides"], checkpoint=4)  # cut after step 5
    _fake_run(out / "sweep" / "lr3e-5/seed1", 3, 20.0, lr3["overrides"])  # cut before its first checkpoint
    _fake_run(record / "sweep" / "lr1e-5_mb4/seed1", 10, 30.0, mb4["overrides"])  # committed, not on this disk
    assert mod.run_state(base, out, record, 10) == ("done", 10)
    assert mod.run_state(lr, out, record, 10) == ("resume", 4)
    assert mod.run_state(lr3, out, record, 10) == ("restart", 0)
    assert mod.run_state(mb4, out, record, 10) == ("done", 10)  # a clean clone skips what is committed
    assert mod.run_state(runs["lr1e-5_easy/seed1"], out, record, 10) == ("fresh", 0)
    assert mod.run_state(base, out, record, 12) == ("restart", 0)  # more steps asked, no checkpoint on disk

    plan = _study("--stage", "sweep", "--sweep-steps", "10", "--out", str(out), "--record", str(record),
                  "--plan", "--jobs", "2").stdout
    lines = {line.split()[1]: line for line in plan.splitlines() if line.startswith("  sweep ")}
    assert "base/seed1" not in lines and "lr1e-5_mb4/seed1" not in lines  # done: not in any chunk
    assert "resume from step 4, 6/10 steps" in lines["lr1e-5/seed1"]
    assert "20.0 s/step, measured: this run" in lines["lr1e-5/seed1"]
    assert "restart, 10/10 steps" in lines["lr3e-5/seed1"]
    # the same settings up to the learning rate (which does not change the cost): base's 40 s, lr1e-5's and
    # lr3e-5's own (cut) 20 s
    assert "26.7 s/step, measured: 3 run(s) with these settings" in lines["lr3e-5/seed1"]
    # other settings, same model and precision: scaled by the batch's tokens (epochs 2: twice the work)
    assert "s/step, measured: 4 real/bf16 run(s), scaled by tokens" in lines["lr1e-5_epochs2/seed1"]
    assert "STEP_SECONDS" not in plan
    assert plan.splitlines()[0].startswith("chunk 1: ~") and "done: 2" in plan.splitlines()[-1]
    assert f"remaining: {len(runs) - 2} of {len(runs)} runs" in plan


def test_chunks_fit_the_budget_with_parallel_jobs():
    mod = _run_study_module()
    assert mod.lanes_wall_s([60, 60, 60], 2) == 120 and mod.lanes_wall_s([100, 10, 10, 10], 2) == 100
    rows = [{"remaining": 1, "est_s": e} for e in (3000, 3000, 3000, 3000, 9000, 100)]
    parts = mod.chunks(rows, 2, 7200)
    assert [[r["est_s"] for r in c] for c in parts] == [[3000, 3000, 3000, 3000], [9000], [100]]
    assert mod.chunks([{"remaining": 0, "est_s": 0.0}], 2, 7200) == []


def test_commit_records_small_files_and_never_checkpoints(tmp_path):
    mod = _run_study_module()
    repo = tmp_path / "repo"
    repo.mkdir()
    for cmd in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True)
    (repo / "other.txt").write_text("someone else's staged change\n")
    subprocess.run(["git", "-C", str(repo), "add", "other.txt"], check=True)
    d = tmp_path / "out" / "confirm" / "base/e5m2/fp8/seed11"
    _fake_run(d, 3, 1.0, ["fp8=tensorwise"], checkpoint=2)
    (d / "tb").mkdir()
    (d / "tb" / "events").write_text("x")
    (d / "train.log").write_text("log\n")
    assert [p.name for p in mod.small_files(d)] == ["metrics.jsonl", "samples.jsonl", "config.yaml", "study_run.json"]
    run = {"group": "confirm", "name": "base/e5m2/fp8/seed11"}
    paths = mod.record_run(run, d, repo / "records")
    assert all("checkpoints" not in p.parts and "hf" not in p.parts for p in paths)
    assert {p.relative_to(repo / "records" / "confirm" / run["name"]).as_posix() for p in paths} == {
        "metrics.jsonl", "samples.jsonl", "config.yaml", "study_run.json", "report/report.png", "report/summary.md"}
    assert mod.commit_paths(paths, "study run")
    files = subprocess.run(["git", "-C", str(repo), "show", "--name-only", "--format=", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert sorted(files) == sorted(p.relative_to(repo).as_posix() for p in paths)  # not other.txt
    staged = subprocess.run(["git", "-C", str(repo), "diff", "--cached", "--name-only"], capture_output=True,
                            text=True, check=True).stdout.split()
    assert staged == ["other.txt"]  # the other change stays staged, uncommitted
    assert not mod.commit_paths(paths, "again")  # unchanged: nothing to commit
    with pytest.raises(ValueError, match="refusing"):
        mod.commit_paths([d / "checkpoints" / "step_2" / "meta.json"], "no")


def _write_metrics(d: Path, rewards: list[float], alpha: float = 0.0, interval: int = 10) -> None:
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, r in enumerate(rewards):
        row = {"step": i, "reward/mean": r, "reward/accuracy": r, "policy/entropy": 0.5, "clip/low_frac": 0.01,
               "clip/high_frac": 0.004 if i % 2 else 0.002, "clip/upper": 1.2, "timing/step": 30.0}
        if i % interval == 0:
            row.update({"calib/alpha_bf16": alpha, "calib/skipped": 0, "calib/neg_push": -0.02})
        rows.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def test_stage_report_sweep_verdicts_and_confirmation_pairs(tmp_path):
    """--report: the sweep's target (gain >= 0.15 and alpha_bf16 >= 0.01 over a finished run), runs read from
    the run directory or the record, whichever has more steps, and the confirmation's paired differences
    with a bootstrap interval that is the same on every call and brackets the mean."""
    mod = _run_study_module()
    pr = mod.protocol_report
    out, record = tmp_path / "out", tmp_path / "record"
    _write_metrics(out / "sweep" / "lr1e-5" / "seed1", [0.2] * 10 + [0.3] * 80 + [0.4] * 10, alpha=0.02)
    _write_metrics(record / "sweep" / "lr3e-5" / "seed1", [0.2] * 90 + [0.4] * 10, alpha=0.0)  # alpha misses
    _write_metrics(out / "sweep" / "base" / "seed1", [0.2] * 40)  # unfinished (running or stopped)
    runs = mod.stage_runs(_stage_args(mod, "stage=sweep", "points=base,lr1e-5,lr3e-5"))
    md = mod.stage_report("sweep", runs, out, record, figure=tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in md.splitlines()[2:]}
    assert lines["lr1e-5"].endswith("| **met** |") and "| +0.200 |" in lines["lr1e-5"]
    assert lines["lr3e-5"].endswith("| no |") and "| 100/100 |" in lines["lr3e-5"]
    assert lines["base"].endswith("| unfinished (40/100) |")

    diffs = [0.05, -0.01, 0.03]
    lo, hi = pr.bootstrap_interval(diffs)
    assert (lo, hi) == pr.bootstrap_interval(diffs) and lo <= sum(diffs) / 3 <= hi and lo >= -0.01 - 1e-12 and hi <= 0.05 + 1e-12
    table = pr.paired_table({"fp8_calibrated": {11: 0.5, 12: 0.4, 13: 0.45}, "fp8": {11: 0.45, 12: 0.41, 13: 0.42}},
                            [("fp8_calibrated", "fp8"), ("fp8", "bf16")])
    assert "| fp8_calibrated - fp8 | 3 | 11: +0.050, 12: -0.010, 13: +0.030 | +0.023 |" in table
    assert "| fp8 - bf16 | 0 | - | - | - | - |" in table
    # power: 3 seeds, one sign for all needed: gap = sd * Phi^-1(0.8^(1/3)) = 1.464 sd (sd 0.0306 here)
    assert table.splitlines()[2].endswith("| 0.045 |")
    assert pr.gap_seen_with_power([0.1]) is None
    assert abs(pr.gap_seen_with_power([0.0, 0.1, 0.2]) - 0.1 * 1.4640) < 1e-3
    # the formula's premise: with <= 3 seeds the interval excludes 0 exactly when every difference has one sign
    assert pr.bootstrap_interval([0.01, 0.2, 0.3])[0] == 0.01 and pr.bootstrap_interval([-0.01, 0.2, 0.3])[0] < 0

    # the confirmation's report: both measures, per seed, over the seeds both arms finished
    confirm = mod.stage_runs(_stage_args(mod, "stage=confirm", "regime=lr1e-5_easy", "condition=blockwise",
                                         "confirm_seeds=11,12", "confirm_steps=20"))
    curves = {"bf16": [0.5] * 10 + [0.9] * 10, "fp8": [0.4] * 10 + [0.6] * 10}
    for r in confirm:
        if r["arm"] in curves and not (r["arm"] == "fp8" and r["seed"] == 12):  # fp8 seed 12 unfinished
            rewards = [0.5] * 10 + [0.8] * 10 if (r["arm"], r["seed"]) == ("bf16", 12) else curves[r["arm"]]
            _write_metrics(out / "confirm" / r["name"], rewards)
    md = mod.stage_report("confirm", confirm, out, record, figure=tmp_path / "confirm.png")
    assert (tmp_path / "confirm.png").stat().st_size > 10_000  # reward, accuracy, entropy, low clip, neg push
    assert "| fp8 - bf16 | 1 | 11: -0.300 | -0.300 | [-0.300, -0.300] | - |" in md  # last 10: 0.6 - 0.9
    # per arm over its finished seeds: mean [lowest, highest]; fp8 has one finished seed, so a bare value
    assert "| bf16 | 2 | 0.850 [0.800, 0.900] | 0.675 [0.650, 0.700] |" in md
    assert "| fp8 | 1 | 0.600 | 0.500 |" in md and "-0.0200 [-0.0200, -0.0200]" in md  # neg push, bf16
    # low clip, high clip (the mean of 0.002 and 0.004 over the steps), the upper bound in force
    fp8_row = next(ln for ln in md.split("Per arm")[1].splitlines() if ln.startswith("| fp8 | 1 |"))
    assert "| 0.0100 | 0.0030 | 1.20 |" in fp8_row
    assert "| fp8_calibrated_upper_fixed - fp8_calibrated | 0 |" in md  # the ablation against the full method
    assert "| fp8_calibrated - fp8_fixed_wide | 0 |" in md  # the full method against the fixed wide window
    # --samples: the seed's runs, each from its run directory or record, at the first, middle and last step
    bf16_11 = next(r for r in confirm if r["arm"] == "bf16" and r["seed"] == 11)
    rec = record / "confirm" / bf16_11["name"]
    _write_metrics(rec, [0.5] * 20)
    rows = [{"step": st, "question": f"Solve: {st} + 0 =", "answer": str(st), "response": f"<answer>{st}</answer>",
             "reward": float(st == 19), "correct": st == 19, "invalid": False} for st in (0, 7, 11, 19)]
    (rec / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fp8_11 = record / "confirm" / next(r for r in confirm if r["arm"] == "fp8" and r["seed"] == 11)["name"]
    fp8_11.mkdir(parents=True, exist_ok=True)
    fp8_rows = [{**r, "response": "x|y", "correct": False} for r in rows]
    fp8_rows[1]["question"] = "Solve: 8 + 0 ="  # a prompt the arms do not share is named in its cell
    (fp8_11 / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fp8_rows[:3]))  # no step 19
    text = mod.stage_samples(confirm, out, record, 11)
    lines = text.splitlines()
    assert lines[0] == 'Every question starts "Solve: ..."; the table shows the rest.'
    assert "| step | question | reference | bf16 | fp8 |" in text  # arms without samples have no column
    # the first, middle and last sample steps (0, 7, 19), a check mark where correct, "|" escaped in a cell
    body = lines[lines.index("|" + " --- |" * 5) + 1:]
    assert [ln.split(" | ")[0] for ln in body] == ["| 0", "| 7", "| 19"]
    assert body[1].endswith("| `x\\|y` (question: Solve: 8 + 0 =) |")
    assert lines[-1] == "| 19 | 19 + 0 = | `19` | `<answer>19</answer>` ✓ | - |"
    assert mod.stage_samples(confirm, out, record, 13) == ""
    assert "| comparison (reward over all steps) |" in md
    assert "| fp8 - bf16 | 1 | 11: -0.200 | -0.200 | [-0.200, -0.200] |" in md  # all: 0.5 - 0.7


def test_rollout_accuracy_arms_are_the_explorations_and_the_interval_is_paired():
    """benchmarks/study/rollout_accuracy.py samples the step-0 policy with exactly the exploration's bf16 and
    fp8 overrides (they differ only in FP8 keys and the arm's own), and its interval is over prompts."""
    import numpy as np

    sys.path.insert(0, str(RUN_STUDY.parent))
    import rollout_accuracy as ra
    import run_study

    bf16 = ra.arm_overrides("lr1e-5_easy", "tensorwise", "bf16")
    fp8 = ra.arm_overrides("lr1e-5_easy", "tensorwise", "fp8")
    assert "fp8=tensorwise" in fp8 and not any(o.startswith("fp8=t") for o in bf16)
    shared = [o for o in fp8 if not o.startswith(run_study.FP8_KEYS)
              and o not in run_study.PROTOCOL_ARMS["fp8"]]
    assert shared == [o for o in bf16 if o not in run_study.PROTOCOL_ARMS["bf16"]]
    assert "task.dataset_kwargs.max_digits=1" in shared
    e5m2 = ra.arm_overrides("lr1e-5_easy", "e5m2", "fp8")
    assert "fp8.fp8_format=e5m2" in e5m2
    # a condition that also changes the learning rate compares against its own BF16 reference, at that rate
    assert run_study._last(ra.arm_overrides("lr1e-5_easy", "2xlr", "bf16"), "optim.lr") == "2e-05"
    assert run_study._last(bf16, "optim.lr") == "1e-5"
    # a constant per-prompt difference has a zero-width interval at that value; otherwise the mean lies inside
    lo, hi = ra.paired_ci(np.full(50, 0.25), 2000, 0)
    assert lo == hi == 0.25
    d = np.random.default_rng(1).normal(-0.1, 0.3, 200)
    lo, hi = ra.paired_ci(d, 4000, 0)
    assert lo < d.mean() < hi and hi - lo < 0.2


def test_rollout_accuracy_variants_compose_and_first_window_reads_the_records(tmp_path):
    """Issue 41: each FP8 rollout variant is the condition's fp8 arm plus rollout-only overrides that compose
    and validate (training settings untouched), and the training first-window gap is read from the records."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from nemo_fp8rl.train import CONF_DIR, register_schema
    from nemo_fp8rl.validation import validate

    sys.path.insert(0, str(RUN_STUDY.parent))
    import rollout_accuracy as ra

    base = ra.arm_overrides("lr1e-5_easy", "blockwise", "fp8")
    assert ra.VARIANTS["fp8"] == [] and all(o.startswith("rollout.fp8.") for v in ra.VARIANTS.values() for o in v)
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfgs = {v: validate(OmegaConf.to_object(compose("config", overrides=[*base, *o, f"output_dir={tmp_path}"])))
                for v, o in ra.VARIANTS.items()}
    GlobalHydra.instance().clear()
    ref = cfgs["fp8"]
    assert ref.rollout.fp8.kv_cache == "off" and ref.fp8.recipe == "blockwise"
    assert cfgs["fp8_edges"].rollout.fp8.num_layers_at_start_in_bf16 == 1 == cfgs["fp8_edges"].rollout.fp8.num_layers_at_end_in_bf16
    assert cfgs["fp8_kv"].rollout.fp8.kv_cache == "e4m3" and cfgs["fp8_kv"].rollout.fp8.kv_scales == "calibrated"
    for cfg in cfgs.values():  # only the rollout engine's FP8 differs
        assert cfg.fp8 == ref.fp8 and cfg.algorithm == ref.algorithm and cfg.rollout.fp8.scheme == "vllm_w8a8"

    for arm, rewards in (("bf16", [0.5] * 10 + [0.9]), ("fp8", [0.25] + [0.4] * 9 + [0.0])):
        d = tmp_path / "rec" / arm / "seed11"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": r}) + "\n"
                                                 for i, r in enumerate(rewards)))
    gap = ra.first_window_gap(tmp_path / "rec", 11)
    assert gap["gap_step0"] == pytest.approx(-0.25)
    assert gap["gap_first_window"] == pytest.approx((0.25 + 9 * 0.4) / 10 - 0.5)
    assert ra.first_window_gap(tmp_path / "rec", 12) is None


def test_track_stage_arms_compose_with_pooled_calibration_stop_string_and_recompute_tis(tmp_path, monkeypatch):
    """Issue 41's exploration (``--stage track``): per candidate on seed 1, the arms compose and validate with
    the pooled calibration (every step observed, rounds of 5), the stop string, recompute + TIS for its arm,
    and the fixed-wide arm only once its window is known (then at that window)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from nemo_fp8rl.train import CONF_DIR, register_schema
    from nemo_fp8rl.validation import validate

    mod = _run_study_module()
    monkeypatch.setattr(mod, "TRACK_WIDE", {})  # before any calibrated run has set a window
    runs = mod.stage_runs(_stage_args(mod, "stage=track"))
    assert {r["arm"] for r in runs} == {"bf16", "fp8", "fp8_calibrated", "fp8_recompute_tis", "fp8_calibrated_low"}
    assert {r["seed"] for r in runs} == {mod.EXPLORE_SEED}
    monkeypatch.setitem(mod.TRACK_WIDE, "2xlr", (0.55, 1.9))
    runs = mod.stage_runs(_stage_args(mod, "stage=track", "candidates=2xlr"))
    assert [r["arm"] for r in runs] == list(mod.TRACK_ARM_ORDER)
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfgs = {r["arm"]: validate(OmegaConf.to_object(compose("config", overrides=mod.command(r, tmp_path, r["steps"], [])[3:])))
                for r in runs}
    GlobalHydra.instance().clear()
    for arm, cfg in cfgs.items():
        assert cfg.calibration.enabled and cfg.calibration.interval == 5 and cfg.calibration.window == 5
        assert cfg.calibration.apply == arm.startswith("fp8_calibrated")
        assert cfg.calibration.lower_min == (0.01 if arm == "fp8_calibrated_low" else 0.5)
        assert list(cfg.rollout.stop) == ["</answer>"]
        assert cfg.optim.lr == 2e-5 and cfg.seed == 1
        assert (cfg.fp8.recipe is None) == (arm == "bf16")
        assert cfg.algorithm.old_logprobs == ("recompute" if arm == "fp8_recompute_tis" else "rollout")
    assert cfgs["fp8_recompute_tis"].algorithm.rollout_correction == "tis"
    assert cfgs["fp8_recompute_tis"].algorithm.tis_cap == 2.0
    wide = cfgs["fp8_fixed_wide"].algorithm
    assert (1 - wide.eps_low, 1 + wide.eps_high) == pytest.approx((0.55, 1.9))


def test_calibration_batch_stats_and_seeds_for_gap():
    """Issue 41 items 3 and 7: the calibration-batch statistics of one run, and the number of seeds the
    bootstrap rule needs for a gap (monotone in the spread; the sign rule at 3 seeds)."""
    sys.path.insert(0, str(RUN_STUDY.parent))
    import protocol_report as pr

    recs = [{"step": 0, "clip/lower": 0.8, "clip/upper": 1.2, "calib/tokens": 40, "calib/alpha_bf16": 0.0,
             "calib/lower_raw": 0.1},
            {"step": 1, "clip/lower": 0.5, "clip/upper": 2.0},
            {"step": 2, "clip/lower": 0.5, "clip/upper": 2.2, "calib/tokens": 10, "calib/skipped": 1.0},
            {"step": 3, "clip/lower": 0.6, "clip/upper": 1.8, "calib/tokens": 200, "calib/alpha_bf16": 0.02,
             "calib/lower_raw": 0.6}]
    s = pr.calibration_batch_stats(recs)
    assert (s["calibrations"], s["skipped"], s["tokens_median"]) == (3, 1, 120)
    assert s["alpha_zero"] == 0.5 and s["raw_below_guard"] == 0.5 and (s["raw_min"], s["raw_max"]) == (0.1, 0.6)
    assert s["lower_at_guard"] == 2 / 3 and s["lower_median"] == 0.5 and s["upper_median"] == 2.0
    assert "| r | 3 (1) | 120 [40, 200] |" in pr.calibration_batch_table([("r", s)])
    # 3 seeds: the sign rule; Phi(gap / sd)^3 >= 0.8 needs gap >= 1.46 sd
    assert pr.seeds_for_gap(0.05, 0.08) == 3
    few, many = pr.seeds_for_gap(0.06, 0.08), pr.seeds_for_gap(0.12, 0.08)
    assert 3 <= few < many <= 60
    assert pr.seeds_for_gap(1.0, 0.01, max_seeds=5, sims=200, boot=200) is None


def test_format_of_the_last_10_steps():
    """Issue 41: run_stats' format of the last 10 steps (unclosed answers, text after the answer, the share
    ended before the length limit, garbled steps) reads only those steps, and format_table prints them, '-'
    for a run with no steps."""
    sys.path.insert(0, str(RUN_STUDY.parent))
    import protocol_report as pr

    # 12 steps: the first two (outside the last 10) carry values that would change every mean if read
    recs = [{"step": i, "reward/mean": 0.5, "reward/unclosed_answer": 1.0 if i < 2 else 0.1 * (i % 2),
             "reward/trailing_text": 0.9 if i < 2 else 0.0, "rollout/eos_frac": 0.0 if i < 2 else 1.0 - 0.05 * (i % 2),
             "stability/garbled": 1.0 if i < 2 or i == 11 else 0.0} for i in range(12)]
    s = pr.run_stats(recs)
    assert s["unclosed_last10"] == pytest.approx(0.05) and s["trailing_last10"] == 0.0
    assert s["eos_last10"] == pytest.approx(0.975) and s["garbled_last10"] == 1 and s["garbled_steps"] == 3
    table = pr.format_table([("a/seed1", s, 12), ("b/seed1", pr.run_stats([]), 12)])
    assert "| a/seed1 | 12/12 | 0.500 | 0.050 | 0.000 | 0.975 | 1 |" in table
    assert "| b/seed1 | 0/12 | - | - | - | - | - |" in table


def test_tis_weights_token_stats_against_hand_values():
    """Issue 41: tis_weights.token_stats on four tokens worked by hand (C = 2, eps 0.2): rho, the capped and
    low shares, the TIS and fixed-clip gradient mass per advantage sign, and the weight check."""
    import math

    import torch

    sys.path.insert(0, str(RUN_STUDY.parent))
    import tis_weights as tw

    rho = torch.tensor([[3.0, 0.5, 1.0, 1.1, 7.0]])  # the last token is padding
    rollout = torch.zeros(1, 5)
    old = rho.log()
    adv = torch.tensor([[1.0, 1.0, -2.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    weights = rho.clamp(max=2.0) * mask
    s = tw.token_stats(old, rollout, adv, mask, weights, cap=2.0, eps_low=0.2, eps_high=0.2)
    assert (s["tokens"], s["tokens_pos"], s["tokens_neg"]) == (4, 2, 2)
    assert s["capped"] == 0.25 and s["low"] == 0.25 and s["weight_check"] < 1e-6
    # sum |A| = 6; TIS: positive 1*2 + 1*0.5, negative 2*1 + 2*1.1
    assert math.isclose(s["push_tis_pos"], 2.5 / 6, rel_tol=1e-6)
    assert math.isclose(s["push_tis_neg"], 4.2 / 6, rel_tol=1e-6)
    # fixed clip against the rollout zeroes the positive token at rho 3 (> 1.2); no negative token is < 0.8
    assert (s["zeroed_pos"], s["zeroed_neg"]) == (0.5, 0.0)
    assert math.isclose(s["push_fixed_pos"], 0.5 / 6, rel_tol=1e-6)
    assert math.isclose(s["push_fixed_neg"], 4.2 / 6, rel_tol=1e-6)
    assert math.isclose(s["mean_w_pos"], 1.25, rel_tol=1e-6) and math.isclose(s["mean_w_neg"], 1.05, rel_tol=1e-6)


def _rule_stats(last10: float, every: float, gain: float = 0.3) -> dict:
    return {"reward_last10": last10, "reward_all": every, "gain": gain}


def test_track_rule_chooses_the_largest_usable_separation_and_waits_for_every_candidate():
    """Issue 41's exploration rule (docs/results.md, written before the runs): separation is |difference| >=
    0.06 of fp8_calibrated - fp8_fixed_wide in the last-10 or all-steps mean, usable is BF16 gain >= 0.15,
    the largest usable separation wins, ties go to fewer departures; nothing is chosen while a candidate is
    unfinished; the questions' verdicts follow the bootstrap interval's side."""
    sys.path.insert(0, str(RUN_STUDY.parent))
    import protocol_report as pr

    def cand(cal, wide, gain=0.3, low=None):
        return {"bf16": _rule_stats(0.8, 0.7, gain), "fp8_calibrated": _rule_stats(*cal),
                "fp8_fixed_wide": _rule_stats(*wide), "fp8_calibrated_low": low and _rule_stats(*low)}

    dep = {"a": 1, "b": 1, "c": 2}
    rule = pr.track_rule({"a": cand((0.70, 0.60), (0.75, 0.61)),            # -0.05, -0.01: no
                          "b": cand((0.70, 0.60), (0.62, 0.60)),            # +0.08: separates
                          "c": cand((0.50, 0.60), (0.70, 0.60), gain=0.1)},  # -0.20, but BF16 does not learn
                         dep)
    rows = {r["candidate"]: r for r in rule["rows"]}
    assert [rows[c]["separates"] for c in "abc"] == [False, True, True]
    assert [rows[c]["usable"] for c in "abc"] == [True, True, False]
    assert rule["choice"] == "b" and rows["a"]["d_last10"] == pytest.approx(-0.05)
    # exactly at the threshold separates (0.66 - 0.60 in float is 0.0600...01 or 0.0599...9)
    assert pr.track_rule({"a": cand((0.66, 0.5), (0.60, 0.5))}, dep)["choice"] == "a"
    # a tie at 3 decimals goes to the fewer departures, whatever the order
    tie = pr.track_rule({"c": cand((0.80, 0.6), (0.70, 0.6)), "a": cand((0.60, 0.6), (0.70, 0.6))}, dep)
    assert tie["choice"] == "a"
    # the lowered-guard arm is reported, not chosen on
    low = pr.track_rule({"a": cand((0.70, 0.6), (0.70, 0.6), low=(0.90, 0.6))}, dep)
    assert low["choice"] is None and low["rows"][0]["low_separates"] and "no usable candidate" in low["finding"]
    waiting = pr.track_rule({"a": cand((0.9, 0.9), (0.5, 0.5)), "b": {"bf16": None, "fp8_calibrated": None}}, dep)
    assert waiting["choice"] is None and waiting["pending"] == ["b"] and "| b | - | - |" in pr.track_rule_table(waiting)
    # the confirmation's verdicts: all seeds on one side (3 seeds: the interval's ends are the extremes)
    text = pr.track_verdicts({"fp8_calibrated": {21: 0.8, 22: 0.7, 23: 0.75},
                              "fp8_fixed_wide": {21: 0.7, 22: 0.6, 23: 0.70},
                              "fp8_recompute_tis": {21: 0.7, 22: 0.8}})
    q1, q2 = text.splitlines()
    assert "3 seeds): +0.083 [+0.050, +0.100]: tracking adds" in q1
    assert "pending, 2 of 3 paired seeds" in q2
    mixed = pr.track_verdicts({"fp8_calibrated": {21: 0.8, 22: 0.6, 23: 0.7},
                               "fp8_fixed_wide": {21: 0.7, 22: 0.7, 23: 0.7}}).splitlines()[0]
    assert "not shown (a true gap of" in mixed


def test_track_confirm_plans_the_chosen_candidate_on_fresh_seeds(tmp_path, monkeypatch):
    """Issue 41's confirmation (``--stage track_confirm``): the plan's five arms seed by seed on fresh seeds
    (never 1 or 11-13), the lowered-guard arm after them, the candidate's own steps and window; refused for a
    candidate the exploration's rule (read from the runs or records) did not choose."""
    mod = _run_study_module()
    args = _stage_args(mod, "stage=track_confirm", "candidates=2xlr")
    args.confirm_seeds, args.out, args.record, args.any_candidate = None, str(tmp_path / "out"), str(tmp_path / "rec"), False
    with pytest.raises(SystemExit, match="does not choose it; its outcome: not chosen yet"):
        mod.stage_runs(args)
    # the exploration's records: 2xlr separates (-0.1 on the last 10), e5m2 and long200 do not
    monkeypatch.setitem(mod.TRACK_WIDE, "long200", (0.5, 2.0))  # until its window is known, nothing is chosen
    rewards = {"bf16": 0.9, "fp8_calibrated": 0.6, "fp8_fixed_wide": 0.7}
    for r in mod.stage_runs(_stage_args(mod, "stage=track")):
        cand, arm = r["name"].split("/")[:2]
        value = rewards.get(arm, 0.5) - (0.1 if cand == "2xlr" and arm == "fp8_calibrated" else 0.0)
        d = tmp_path / "rec" / r["group"] / r["name"]
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "reward/mean": 0.4 if arm == "bf16" and i < 10 else value}) + "\n"
            for i in range(r["steps"])))
    assert mod.track_rule(tmp_path / "out", tmp_path / "rec")["choice"] == "2xlr"
    runs = mod.stage_runs(args)
    assert [(r["arm"], r["seed"]) for r in runs] == [
        *[(a, s) for s in (21, 22, 23) for a in mod.TRACK_CONFIRM_ARMS],
        *[("fp8_calibrated_low", s) for s in (21, 22, 23)]]
    assert {r["group"] for r in runs} == {"track_confirm"} and {r["steps"] for r in runs} == {100}
    by_arm = {r["arm"]: r["overrides"] for r in runs if r["seed"] == 21}
    explored = {r["arm"]: r["overrides"] for r in mod.stage_runs(_stage_args(mod, "stage=track", "candidates=2xlr"))}
    assert by_arm == explored  # the same arms as on seed 1, the fixed window included
    # its report: the verdicts on the reward, and the accuracy beside it (partial credit shows as the gap)
    for r in runs:
        if r["arm"] in ("fp8_calibrated", "fp8_recompute_tis"):
            _write_metrics(tmp_path / "out" / r["group"] / r["name"], [0.8 if r["arm"] == "fp8_calibrated" else 0.7]
                           * r["steps"])
    md = mod.stage_report("track_confirm", runs, tmp_path / "out", tmp_path / "rec")
    assert "| fp8_calibrated - fp8_recompute_tis | 3 | 21: +0.100, 22: +0.100, 23: +0.100 | +0.100 |" in md
    acc = md.split("Accuracy beside the reward")[1].split("Verdicts")[0]
    assert "| comparison (accuracy last 10) |" in acc and "| fp8_calibrated - fp8_recompute_tis | 3 |" in acc
    assert "| fp8_calibrated - fp8_fixed_wide | 0 | - |" in acc
    assert "| fp8_calibrated - bf16 | 0 | - |" in acc and "Where each run ran" not in md  # no machine recorded
    # attempts that recorded their machine (run_study does since 2026-12-08): a run that moved shows both
    first = runs[0]
    cpu = {"cpu": "AMD EPYC (family 23 model 49)", "cpu_flags": ["avx2"], "cpus": 2, "torch": "2.13.0+cpu"}
    (tmp_path / "out" / first["group"] / first["name"] / "study_run.json").write_text(json.dumps({"attempts": [
        {"from_step": 0}, {"from_step": 5, "machine": cpu},
        {"from_step": 9, "machine": dict(cpu, cpu="AMD EPYC (family 25 model 17)", cpu_flags=["avx2", "avx512f"])}]}))
    md = mod.stage_report("track_confirm", runs, tmp_path / "out", tmp_path / "rec")
    assert md.split("Where each run ran")[1].splitlines()[-1] == (
        f"| {first['name']} | 3 | AMD EPYC (family 23 model 49), 2 CPUs, avx2, torch 2.13.0+cpu / "
        "AMD EPYC (family 25 model 17), 2 CPUs, avx2 avx512f, torch 2.13.0+cpu |")
    args.candidates = "e5m2"
    with pytest.raises(SystemExit, match="does not choose it"):
        mod.stage_runs(args)
    args.any_candidate = True
    assert len(mod.stage_runs(args)) == 18
    args.confirm_seeds = "21,12"
    with pytest.raises(SystemExit, match=r"\[12\] were used"):
        mod.stage_runs(args)
