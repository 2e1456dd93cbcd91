"""docs/design.md, "Layout": the pure-torch layers import no framework."""

import subprocess
import sys

import pytest

FRAMEWORKS = ("megatron", "transformer_engine", "hydra", "omegaconf")


def _modules_loaded_by(imports: str) -> set:
    """The modules a fresh interpreter holds after ``import <imports>``: top-level package names, plus
    every ``nemo_fp8rl.*`` module by its full name."""
    code = (f"import sys, {imports}\n"
            "print(' '.join(m if m.startswith('nemo_fp8rl') else m.split('.')[0] for m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize("package", ["nemo_fp8rl.fp8", "nemo_fp8rl.algorithms"])
def test_pure_torch_packages_import_no_framework(package):
    bad = sorted(_modules_loaded_by(package) & set(FRAMEWORKS))
    assert not bad, f"{package} imported {bad}"


def test_config_is_a_leaf():
    """``nemo_fp8rl.config`` imports nothing of ours (and no torch or framework): every cross-component check
    lives with its component and is composed by ``nemo_fp8rl.validation``, so the import graph has no cycle
    through the config."""
    config = {"nemo_fp8rl", "nemo_fp8rl.config", "nemo_fp8rl.config.schema", "nemo_fp8rl.config.model"}
    loaded = _modules_loaded_by("nemo_fp8rl.config.schema, nemo_fp8rl.config.model")
    bad = sorted(m for m in loaded if (m.startswith("nemo_fp8rl") and m not in config)
                 or m in (*FRAMEWORKS, "torch", "numpy"))
    assert not bad, f"nemo_fp8rl.config imported {bad}"


def test_validation_checks_the_component_options():
    """The checks moved out of the config still run through ``validate``: a bad value of each is refused
    with its key named."""
    from nemo_fp8rl.config.schema import ConfigError, TrainConfig
    from nemo_fp8rl.validation import validate

    for key, value in [("algorithm.rollout_correction", "tiss"), ("calibration.upper_mode", "balanced"),
                       ("fp8.recipe", "fp4"), ("rollout.fp8.scheme", "w4a4"), ("rollout.engine", "sglang")]:
        cfg = TrainConfig()
        group, _, name = key.rpartition(".")
        obj = cfg
        for part in group.split("."):
            obj = getattr(obj, part)
        setattr(obj, name, value)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(cfg)
    cfg = TrainConfig()
    cfg.algorithm.rollout_correction = "is"  # accepted by algorithms/rollout_correction.py, so by the config too
    validate(cfg)
