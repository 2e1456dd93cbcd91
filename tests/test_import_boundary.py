"""docs/design.md, "Layout": the pure-torch layers import no framework."""

import subprocess
import sys

import pytest

FRAMEWORKS = ("megatron", "transformer_engine", "hydra", "omegaconf")


@pytest.mark.parametrize("package", ["nemo_fp8rl.fp8", "nemo_fp8rl.algorithms"])
def test_pure_torch_packages_import_no_framework(package):
    code = (
        f"import sys, {package}\n"
        f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{package} imported {out.stdout.strip()}"


def test_config_is_a_leaf():
    """``nemo_fp8rl.config`` imports nothing of ours (and no torch or framework): every cross-component check
    lives with its component and is composed by ``nemo_fp8rl.validation``, so the import graph has no cycle
    through the config."""
    code = (
        "import sys, nemo_fp8rl.config.schema, nemo_fp8rl.config.model\n"
        "ours = sorted(m for m in sys.modules if m.startswith('nemo_fp8rl') and m not in "
        "('nemo_fp8rl', 'nemo_fp8rl.config', 'nemo_fp8rl.config.schema', 'nemo_fp8rl.config.model'))\n"
        f"other = sorted({{m.split('.')[0] for m in sys.modules}} & set({(*FRAMEWORKS, 'torch', 'numpy')!r}))\n"
        "print(','.join(ours + other))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"nemo_fp8rl.config imported {out.stdout.strip()}"


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
