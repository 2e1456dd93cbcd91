"""DESIGN.md section 2: the pure-torch layers import no framework."""

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
