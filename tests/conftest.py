"""Markers: ``gpu`` (needs CUDA), ``slurm`` (needs a running SLURM), ``slow`` (opt-in with --run-slow)."""

import importlib.util
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch


def _test_threads() -> int:
    """Intra-op threads of the test process: OMP_NUM_THREADS when set (so `OMP_NUM_THREADS=1 make test`
    really runs single-threaded), else at most 2 of the CPUs this process may run on (taskset/cgroups)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


# Tests run on 2 cores next to their own worker processes: keep intra-op threads modest and fixed
# so runs are deterministic and do not oversubscribe. No test may depend on this number: the suite is
# run with OMP_NUM_THREADS=1, the default and under `taskset -c 0` (tests/_fp8_bounds.py says why FP8
# comparisons are written as they are).
torch.set_num_threads(_test_threads())

try:  # property tests: the same examples on every run (CI stays reproducible); explore new ones with
    # `pytest --hypothesis-profile=explore` (a random search, as a fuzzing session would run it)
    from hypothesis import settings

    settings.register_profile("default", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:
    pass


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_across_modules():
    """A module that builds trainers in this process leaves torch.distributed initialised (kept on
    purpose between its own tests); the next module must start without it, whatever the order."""
    yield
    from nemo_fp8rl.models.parallel import destroy_distributed

    destroy_distributed()


def _trainer_cli():
    """tests/trainer/_cli.py (the real training CLI in a subprocess with tiny sizes), loaded by path."""
    spec = importlib.util.spec_from_file_location("_trainer_cli", Path(__file__).parent / "trainer" / "_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class DemoRuns:
    """The demo's three arms trained once each through the real CLI, on first use (``demo_runs[arm]`` is
    the run directory ``<root>/<arm>``; ``demo_runs.stderr(arm)`` what the CLI printed). The settings are
    ``tests/trainer/_cli.py``'s :func:`demo_overrides`. The runs are shared: read them, or copy one
    (``shutil.copytree``) before resuming, extending or otherwise writing to it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.warmup_cache = root / ".warmup_cache"
        """The arms' warm-up cache (``warmup.cache_dir=``): a run of the same model and task reuses it."""
        self._stderr: dict[str, str] = {}

    def __getitem__(self, arm: str) -> Path:
        if arm not in self._stderr:
            cli = _trainer_cli()
            self._stderr[arm] = cli.run_cli(self.root / arm, *cli.demo_overrides(arm)).stderr
        return self.root / arm

    def stderr(self, arm: str) -> str:
        self[arm]
        return self._stderr[arm]


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory) -> DemoRuns:
    """bf16, fp8 and fp8_calibrated on the tiny model (``make demo``'s arms at test size), each trained by
    the CLI at most once per session and only if a test asks for it; the arms share one warm-up cache."""
    return DemoRuns(tmp_path_factory.mktemp("demo"))


TRAINER_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class TrainerCloser:
    """``close_trainer(trainer)`` tears down an ``RLTrainer`` that was built but never ran ``fit`` (``fit``
    closes it on every exit): ``trainer.close()``, then checks that the signal handlers the trainer installed
    are gone. ``close_trainer.check()`` asserts that no trainer is open (the handlers are the starting ones)."""

    def __init__(self) -> None:
        self.saved = {s: signal.getsignal(s) for s in TRAINER_SIGNALS}

    def __call__(self, trainer) -> None:
        trainer.close()
        self.check()

    def left_installed(self) -> dict:
        return {s: h for s, h in ((s, signal.getsignal(s)) for s in TRAINER_SIGNALS) if h != self.saved[s]}

    def check(self) -> None:
        left = self.left_installed()
        assert not left, f"signal handlers left installed by a trainer that was not closed: {left}"

    def restore(self) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)


@pytest.fixture
def close_trainer():
    """A :class:`TrainerCloser`; at the end of the test the signal handlers must be the starting ones (a
    trainer left open fails the test; ``signal.signal`` puts the starting handlers back either way)."""
    closer = TrainerCloser()
    yield closer
    left = closer.left_installed()
    closer.restore()
    assert not left, f"signal handlers left installed by a trainer that was not closed: {left}"


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")


def _slurm_up() -> str:
    if shutil.which("sinfo") is None:
        return "SLURM is not installed (scripts/slurm_local.sh installs and starts a one-node cluster)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except Exception as e:  # noqa: BLE001
        return f"sinfo failed: {e}"
    if out.returncode != 0 or not out.stdout.strip():
        return f"no SLURM controller answering ({out.stderr.strip()[:200]})"
    return ""


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or os.environ.get("NEMO_FP8RL_RUN_SLOW") == "1"
    slurm_reason = None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: run with --run-slow or NEMO_FP8RL_RUN_SLOW=1"))
        if "slurm" in item.keywords:
            if slurm_reason is None:
                slurm_reason = _slurm_up()
            if slurm_reason:
                item.add_marker(pytest.mark.skip(reason=slurm_reason))
