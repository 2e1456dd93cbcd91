"""Markers: ``gpu`` (needs CUDA), ``slurm`` (needs a running SLURM), ``slow`` (opt-in with --run-slow)."""

import os
import shutil
import subprocess

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
