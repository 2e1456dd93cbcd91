"""``fp8=auto`` (nemo_fp8rl/fp8/recipes.py, auto_recipe_name / resolve_auto_recipe): the recipe is picked by
hardware when the trainer starts, logged with the reason, and recorded in config.yaml. The GPUs are faked
(compute capability), so the decision is tested on the CPU."""

import logging

import pytest
import torch

from nemo_fp8rl.config.schema import ConfigError, TrainConfig
from nemo_fp8rl.fp8.recipes import AUTO_CANDIDATES, auto_recipe_name, build_fp8_recipe, resolve_auto_recipe
from nemo_fp8rl.validation import validate


@pytest.mark.parametrize("capability,recipe,says", [
    ((12, 0), "mxfp8", "Blackwell"),
    ((10, 0), "mxfp8", "sm100"),
    ((9, 0), "blockwise", "Hopper"),
    ((8, 9), "tensorwise", "Ada"),
    ((8, 0), "tensorwise", "no FP8 tensor cores"),
    ((7, 0), "tensorwise", "emulated"),
])
def test_the_pick_by_compute_capability(capability, recipe, says):
    name, why = auto_recipe_name("cuda", capability=capability)
    assert name == recipe and says in why, why
    assert name in AUTO_CANDIDATES


def test_cpu_gets_emulated_tensorwise():
    assert auto_recipe_name("cpu") == ("tensorwise", "no CUDA device (cpu): tensorwise (per-tensor current scaling), "
                                                     "emulated")


def test_the_torch_backend_gets_what_torch_runs(monkeypatch):
    assert auto_recipe_name("cuda", capability=(10, 0), backend="torch")[0] == "tensorwise"  # no MX GEMM in torch
    assert auto_recipe_name("cuda", capability=(10, 0), backend="te")[0] == "mxfp8"
    assert auto_recipe_name("cuda", capability=(9, 0), backend="torch")[0] == "blockwise"  # this torch has scaled_mm
    monkeypatch.delattr(torch.nn.functional, "scaled_mm", raising=False)
    name, why = auto_recipe_name("cuda", capability=(9, 0), backend="torch")
    assert name == "tensorwise" and "torch >= 2.10" in why


def _fake_gpu(monkeypatch, capability):
    """This CPU machine looks like one CUDA device of ``capability`` to torch.cuda."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("capability,recipe", [((9, 0), "blockwise"), ((10, 0), "mxfp8"), ((8, 9), "tensorwise")])
def test_the_trainer_resolution_reads_the_device_and_logs_why(monkeypatch, caplog, capability, recipe):
    _fake_gpu(monkeypatch, capability)
    assert auto_recipe_name()[0] == recipe  # the default device is the (fake) GPU
    cfg = TrainConfig()
    cfg.fp8.recipe, cfg.fp8.backend = "auto", "emulate"
    with caplog.at_level(logging.INFO, logger="nemo_fp8rl.fp8.recipes"):
        assert resolve_auto_recipe(cfg) == recipe
    assert cfg.fp8.recipe == recipe and f"fp8=auto: sm{capability[0]}{capability[1]}" in caplog.text
    assert f"-> fp8.recipe={recipe}" in caplog.text
    assert resolve_auto_recipe(cfg) is None and cfg.fp8.recipe == recipe  # resolved once; a named recipe stays


def test_validation_and_the_launcher_keep_auto():
    """A login node is not the GPU the job runs on: validate() leaves ``auto`` for the trainer; building the
    recipe there (the launcher's memory plan) gives this machine's pick without changing the config."""
    cfg = TrainConfig()
    cfg.fp8.recipe = "auto"
    validate(cfg)
    assert cfg.fp8.recipe == "auto"
    recipe = build_fp8_recipe(cfg)
    assert recipe.name == auto_recipe_name()[0] and cfg.fp8.recipe == "auto"
    cfg.fp8.fp8_format = "fp4"
    with pytest.raises(ConfigError, match="fp8=auto picks blockwise on some hardware .*fp8_format='fp4'"):
        validate(cfg)


def test_the_config_group_composes():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from nemo_fp8rl.train import CONF_DIR, register_schema

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = validate(OmegaConf.to_object(compose("config", overrides=["fp8=auto"])))
    finally:
        GlobalHydra.instance().clear()
    assert cfg.fp8.recipe == "auto"


def test_config_yaml_and_checkpoints_record_the_recipe_picked(tmp_path, close_trainer):
    """The trainer resolves ``auto`` before it builds the model: the model, config.yaml (written by
    nemo_fp8rl.train.prepare from the same config) and the checkpoint fingerprint name the recipe picked
    (here the CPU's tensorwise), so a resume on the same hardware is the same run."""
    from nemo_fp8rl.train import write_resolved_config
    from nemo_fp8rl.trainer import RLTrainer, model_fingerprint

    cfg = TrainConfig(output_dir=str(tmp_path / "run"))
    cfg.fp8.recipe = "auto"
    cfg.warmup.steps = 0
    cfg.logger.tensorboard, cfg.logger.progress = False, "none"
    tr = RLTrainer(cfg)
    try:
        assert tr.recipe.name == "tensorwise" and tr.cfg.fp8.recipe == "tensorwise"
        assert model_fingerprint(tr.cfg)["fp8.recipe"] == "tensorwise"
        write_resolved_config(tr.cfg, tr.cfg.output_dir)
        import yaml

        assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["fp8"]["recipe"] == "tensorwise"
    finally:
        close_trainer(tr)
