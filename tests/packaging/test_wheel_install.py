"""The wheel works without a checkout: built from this checkout, installed into a fresh venv, and its
console scripts run from a directory outside any checkout.

The fresh venv reuses this test venv's installed dependencies (torch, megatron-core, hydra, ...) through
a ``.pth`` file holding the test venv's site-packages directory as a plain path line: that adds the
directory to ``sys.path`` without running the ``.pth`` files inside it, so the editable install of
``nemo_fp8rl`` there (``__editable__.nemo_fp8rl-*.pth``) stays inactive and ``import nemo_fp8rl``
finds the wheel's copy only (checked). The wheel is built from a copy of the package sources, so the
build's ``build/`` and ``*.egg-info`` land in the temporary directory, not in the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nemo_fp8rl"
# Shipped config trees (nemo_fp8rl/resources.py): every YAML below them must be in the wheel.
CONF_TREES = ("nemo_fp8rl/conf", "nemo_fp8rl/launcher/conf")
# The smallest one-step RL run of the tiny CPU model (cf. tests/trainer/_cli.py), no supervised warm-up.
TRAIN_ONE_STEP = [
    "algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.minibatches_per_step=1",
    "parallel.micro_batch_size=16", "rollout.max_new_tokens=6", "warmup.steps=0", "trainer.max_steps=1",
    "logger.tensorboard=false", "logger.progress=lines",
]


def _run(cmd: list, *, cwd: Path, env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("wheel")
    assert not root.resolve().is_relative_to(REPO.resolve()), "the temporary directory must be outside the checkout"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(HYDRA_FULL_ERROR="0", PIP_DISABLE_PIP_VERSION_CHECK="1")

    src = root / "src"
    shutil.copytree(PACKAGE, src / "nemo_fp8rl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    dist = root / "dist"
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
              "-w", dist, src], cwd=root, env=env))
    (wheel,) = dist.glob("nemo_fp8rl-*.whl")

    venv = root / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root, env=env))
    py = venv / "bin" / "python"
    site = Path(_ok(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root,
                         env=env)).stdout.strip())
    # this venv's site-packages (and any system/user site directories it sees), in sys.path order, no dupes
    reuse = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
                           *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))])
    (site / "_nemo_fp8rl_test_deps.pth").write_text("".join(f"{p}\n" for p in reuse))
    # pip itself comes from the test venv; --ignore-installed: never touch the test venv's editable install
    _ok(_run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel], cwd=root,
             env=env))
    work = root / "work"  # the users' directory: outside the checkout and the venv
    work.mkdir()
    return SimpleNamespace(root=root, wheel=wheel, venv=venv, py=py, bin=venv / "bin", site=site,
                           package=site / "nemo_fp8rl", work=work, env=env)


def test_the_wheel_holds_every_shipped_yaml_and_module(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for tree in CONF_TREES:
        yamls = sorted(p.relative_to(REPO).as_posix() for p in (REPO / tree).rglob("*.yaml"))
        assert yamls, f"no YAML under {tree}"
        missing = [y for y in yamls if y not in names]
        assert not missing, f"YAMLs of the checkout missing from {installed.wheel.name}: {missing}"
    modules = [p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    assert [m for m in modules if m not in names] == []
    entry_points = zipfile.ZipFile(installed.wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for script in ("nemo-fp8rl-train", "nemo-fp8rl-launch", "nemo-fp8rl-plan"):
        assert f"{script} = " in entry_points


def test_the_console_scripts_run_outside_a_checkout(installed):
    ins = installed
    before = _tree(ins.package)
    assert before, f"nothing installed at {ins.package}"

    probe = _ok(_run([ins.py, "-c", "import nemo_fp8rl, nemo_fp8rl.resources as r; print(nemo_fp8rl.__file__); "
                      "print(r.checkout_dir()); print(r.default_launcher_scripts_dir())"], cwd=ins.work, env=ins.env))
    file, checkout, scripts_dir = probe.stdout.split("\n")[:3]
    assert Path(file) == ins.package / "__init__.py"  # the wheel's copy, not the editable checkout
    assert checkout == "None" and Path(scripts_dir) == ins.work

    # nemo-fp8rl-train: one RL step, run directory relative to the current directory
    _ok(_run([ins.bin / "nemo-fp8rl-train", *TRAIN_ONE_STEP, "output_dir=run"], cwd=ins.work, env=ins.env))
    run = ins.work / "run"
    assert (run / "config.yaml").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1, steps

    # nemo-fp8rl-launch dry run: results under launcher_scripts_path = the current directory
    proc = _ok(_run([ins.bin / "nemo-fp8rl-launch", "rl=tiny_grpo_blockwise", "launcher.dry_run=true"], cwd=ins.work,
                    env=ins.env))
    lines = {k.strip(): v.strip() for k, _, v in (ln.partition(": ") for ln in proc.stdout.splitlines())}
    script = Path(lines["submission script"])
    assert script.is_file() and script.is_relative_to(ins.work / "results"), proc.stdout
    assert Path(lines["results dir"]) == ins.work / "results" / "tiny_grpo_blockwise"
    assert str(ins.py) in script.read_text()  # the job runs the interpreter the wheel is installed in

    # a stage that does not exist: the message names where the shipped stage YAMLs really are
    proc = _run([ins.bin / "nemo-fp8rl-launch", "rl=tiny_fp4"], cwd=ins.work, env=ins.env)
    assert proc.returncode == 2, proc.stderr
    missing = ins.package / "launcher" / "conf" / "rl" / "tiny_fp4.yaml"
    assert (f"rl=tiny_fp4: there is no nemo_fp8rl/launcher/conf/rl/tiny_fp4.yaml (in the installed package: "
            f"{missing}); choose one of [") in proc.stderr
    assert missing.parent.is_dir()

    # nemo-fp8rl-plan: a training config and a launcher stage, both composed from the installed YAMLs
    _ok(_run([ins.bin / "nemo-fp8rl-plan", "model=tiny", "--device", "cpu"], cwd=ins.work, env=ins.env))
    proc = _ok(_run([ins.bin / "nemo-fp8rl-plan", "rl=qwen3_8b_grpo_blockwise", "--gpu", "h200"], cwd=ins.work,
                    env=ins.env))
    assert "fits" in proc.stdout

    assert _tree(ins.package) == before, "a CLI wrote into the installed package"
    assert not any(p.name in ("results", "runs", "run", "outputs") for p in ins.site.iterdir())
