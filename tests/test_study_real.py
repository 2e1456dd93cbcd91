"""The study's ``real`` group (SmolLM2-135M + chain_sum): its plan, per-run estimates and overrides."""

import copy
import subprocess
import sys
from pathlib import Path

from nemo_fp8rl.demo import REAL, sample_steps

ROOT = Path(__file__).resolve().parents[1]
RUN_STUDY = ROOT / "benchmarks" / "study" / "run_study.py"


def _list(*args: str) -> list[str]:
    return subprocess.run([sys.executable, str(RUN_STUDY), "--list", *args], capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout.splitlines()


def test_real_plan_arms_recipes_stress_and_estimates():
    lines = _list("--only", "real", "--real-seeds", "1,2", "--real-steps", "30")
    runs = {}
    for line in lines[:-1]:
        body, est = line.split("#")
        group, name, *overrides = body.split()
        assert group == "real" and est.strip().startswith("~") and est.strip().endswith(" min")
        runs[name] = overrides
    names = {f"{c}/seed{s}" for s in (1, 2) for c in
             ["bf16", "tensorwise/fp8", "tensorwise/fp8_calibrated", "blockwise/fp8", "blockwise/fp8_calibrated",
              "e5m2_2xlr/bf16", "e5m2_2xlr/fp8", "e5m2_2xlr/fp8_calibrated"]}
    assert set(runs) == names and lines[-1].startswith("16 runs")
    for name, ov in runs.items():
        assert ov[: 1 + len(REAL)] == ["algorithm=grpo", *REAL], name  # the demo-real settings, then the arm's
        assert "model=smollm2_135m" in ov and "task.dataset=chain_sum" in ov
    assert runs["blockwise/fp8_calibrated/seed2"][-2:] == ["fp8=blockwise", "calibration=paper"]
    assert runs["tensorwise/fp8/seed1"][-2:] == ["fp8=tensorwise", "calibration=measure"]
    # stress: E5M2 + 2x lr for the FP8 arms; the bf16 arm has no E5M2, only the lr; the last lr wins in Hydra
    assert runs["e5m2_2xlr/bf16/seed1"][-3:] == ["fp8=off", "calibration=off", "optim.lr=6e-6"]
    assert runs["e5m2_2xlr/fp8/seed1"][-2:] == ["fp8.fp8_format=e5m2", "optim.lr=6e-6"]
    assert "optim.lr=3e-6" in REAL
    # the estimate scales with --real-steps
    short = _list("--only", "real", "--real-seeds", "1", "--real-steps", "2")
    assert short[-1].startswith("8 runs")


def test_sample_steps_start_middle_end():
    assert sample_steps(1) == "logger.samples=[0]"
    assert sample_steps(2) == "logger.samples=[0,1]"
    assert sample_steps(12) == "logger.samples=[0,5,11]"


def _run_study_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_study", RUN_STUDY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# what differs between two runs of one trajectory: where they write, how long they run, when they checkpoint
# and sample, and whether they resume
RUN_KEYS = {("trainer", "max_steps"), ("trainer", "checkpoint_interval"), ("trainer", "keep_last"),
            ("logger", "samples"), ("output_dir",), ("resume",), ("warmup", "cache_dir")}


def _trajectory(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    for path in RUN_KEYS:
        node = cfg
        for k in path[:-1]:
            node = node[k]
        node.pop(path[-1], None)
    return cfg


def test_demo_real_arms_are_the_studys_protocol_arms(tmp_path):
    """Every ``python -m nemo_fp8rl.demo --real`` arm command composes (Hydra) and validates, with the
    settings the demo promises, and equals the study's run of that arm on seed 1 in everything but where
    it writes, its length, checkpoints and samples: the bf16 arm is the sweep's ``lr1e-5_easy`` run, fp8 the
    exploration's ``blockwise`` fixed-clip run, fp8_calibrated the confirmation's arm (which runs on other
    seeds). Nothing is fetched or trained."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from nemo_fp8rl.demo import ARMS, REAL_RECIPE, REAL_STEPS, arm_command
    from nemo_fp8rl.train import CONF_DIR, register_schema
    from nemo_fp8rl.validation import validate

    study = _run_study_module()
    regime = [*study.PROTOCOL_BASE, *study.SWEEP["lr1e-5_easy"]]
    study_runs = {
        "bf16": dict(group="sweep", name="lr1e-5_easy/seed1", seed=1, overrides=[*regime, *study.PROTOCOL_ARMS["bf16"]]),
        **{arm: dict(group="explore", name=f"x/{arm}/seed1", seed=1,
                     overrides=[*regime, *study.EXPLORE["blockwise"], *study.PROTOCOL_ARMS[arm]])
           for arm in ("fp8", "fp8_calibrated")},
    }
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        def config(cmd):
            assert cmd[1:3] == ["-m", "nemo_fp8rl.train"]
            return OmegaConf.to_container(compose("config", overrides=cmd[3:]), resolve=True)

        for arm in ARMS:
            cmd = arm_command(arm, tmp_path, REAL_STEPS, REAL_RECIPE, 1, [], real=True)
            demo = config(cmd)
            cfg = validate(OmegaConf.to_object(compose("config", overrides=cmd[3:])))
            assert cfg.model.hf_path == "registry:smollm2-135m" and cfg.task.name == "reasoning_gym"
            assert cfg.task.dataset == "chain_sum" and cfg.task.chat_template
            assert cfg.task.dataset_kwargs == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
            assert cfg.algorithm.old_logprobs == "rollout" and cfg.optim.lr == 1e-5 and cfg.calibration.interval == 10
            assert cfg.logger.samples == [0, (REAL_STEPS - 1) // 2, REAL_STEPS - 1]
            assert cfg.fp8.recipe == (None if arm == "bf16" else "blockwise")  # fp8=off: no recipe
            assert cfg.calibration.enabled  # every arm measures; only fp8_calibrated applies the bounds
            assert cfg.calibration.apply == (arm == "fp8_calibrated")
            ref = config(study.command(study_runs[arm], tmp_path / "study", 100, []))
            assert _trajectory(demo) == _trajectory(ref), arm
            assert demo["trainer"]["max_steps"] == REAL_STEPS and ref["trainer"]["max_steps"] == 100
            # --base-regime: REAL alone, the tiny demo's arms (the study's ``real`` group's settings)
            base = validate(OmegaConf.to_object(compose("config", overrides=arm_command(
                arm, tmp_path, 10, "tensorwise", 1, [], real=True, base_regime=True)[3:])))
            assert base.optim.lr == 3e-6 and base.calibration.interval == 4
            assert base.task.dataset_kwargs == {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
            assert base.calibration.enabled == (arm != "bf16")
    GlobalHydra.instance().clear()
