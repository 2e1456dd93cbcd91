"""Part (b), ``pytest -m gpu`` over every test file that has ``gpu`` tests (found by their marker), in
one pytest run; tests that need Transformer Engine or vLLM skip with their reason (``-rfEs``). The full
output goes to ``pytest_gpu.txt`` under the output folder. Exit codes 0 (all passed or skipped) and 5
(nothing selected) are fine; anything else fails the part.

A run cut short still names its tests: pytest runs verbose (``-v``: a test's id when it starts, its outcome
when it ends) into ``pytest_gpu.txt`` while it runs, and the part parses that file into ``tests`` (node id ->
outcome) and ``in_flight`` (started, no outcome yet) and saves them every few seconds. Before the part's own
deadline pytest gets SIGINT, on which it stops in the running test and still writes its summary, its slowest
tests (``--durations``) and its JUnit XML, whose per-test seconds go into ``test_seconds`` (the numbers the
part's cap is sized from). The JUnit file goes to a temporary folder: what comes back from a device machine is
the output folder's few files.

``NEMO_FP8RL_KERNEL_TUNE=0`` in pytest's environment: the cast kernels and the block GEMM then use their
default launch configuration instead of timing every candidate in the pytest process (the throughput part
tunes, in its own process); every configuration writes the same bits (tests/fp8/_kernel_checks.py), and no
gpu test checks the tuning itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INTERRUPT_GRACE_S = 15
"""Seconds between pytest's SIGINT and the part's deadline: pytest finishes the running test's teardown and
writes its summary and JUnit XML (a test inside a long CUDA call sees the interrupt when the call returns)."""
POLL_S = 5
"""How often the part reads pytest's output and saves the tests named so far."""
_PYTEST_MAIN = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "import pytest; sys.exit(pytest.main(sys.argv[1:]))")
"""``python -c`` body: pytest's main with Python's KeyboardInterrupt handler on SIGINT."""
_RESULT = re.compile(r"^(\S+\.py::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", re.M)


def gpu_test_files() -> list[str]:
    """Test files that mark tests ``gpu`` (``pytest.mark.gpu`` / ``pytestmark = pytest.mark.gpu``)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


def _parse(text: str, res: dict) -> None:
    """Outcome line, counts, skip reasons and per-test outcomes of pytest's output so far, into ``res``."""
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected|error)", ln)]
    res["outcome"] = last[-1].strip("= ") if last else None
    res["counts"] = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)",
                                                     res["outcome"] or "")}
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", text, re.M)
    res["skip_reasons"] = sorted({m.strip() for m in reasons})[:20]
    res["tests"] = dict(_RESULT.findall(text))
    # -v writes a test's id when it starts and its outcome when it ends: an id without one was running
    res["in_flight"] = [t for t in re.findall(r"^(\S+\.py::\S+)", text, re.M) if t not in res["tests"]]


def _junit_seconds(path: Path) -> dict:
    """``{"<classname>::<test>": seconds}`` of a JUnit XML file, slowest first ({} when pytest wrote none)."""
    if not path.is_file():
        return {}
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except ET.ParseError:
        return {}
    secs = {f"{c.get('classname')}::{c.get('name')}": round(float(c.get("time", 0)), 2) for c in cases
            if c.get("name")}  # an interrupted run ends with an empty testcase
    return dict(sorted(secs.items(), key=lambda kv: -kv[1]))


def run(ctx) -> dict:
    files = gpu_test_files()
    junit = Path(tempfile.mkdtemp(prefix="gpu_check_pytest_")) / "junit.xml"
    # pytest through a -c that takes SIGINT as KeyboardInterrupt whatever this process inherited: a process
    # started in the background of a non-interactive shell (or by pytest-xdist) has SIGINT ignored, and Python
    # keeps an ignored SIGINT ignored, so the interrupt below would do nothing and pytest would be killed
    cmd = [sys.executable, "-c", _PYTEST_MAIN, "-v", "-p", "no:cacheprovider", "-m", "gpu", "-rfEs",
           "--durations=15", f"--junitxml={junit}", *files]
    res = ctx.res
    res.update(files=files, cmd="-m pytest " + " ".join(cmd[3:]))
    log = ctx.out / "pytest_gpu.txt"
    env = dict(os.environ, NEMO_FP8RL_KERNEL_TUNE="0")
    stop_at = ctx.deadline - INTERRUPT_GRACE_S
    rc = None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        interrupted = False
        while True:
            try:
                rc = proc.wait(timeout=max(min(POLL_S, stop_at - time.time()), 0.1))
                break
            except subprocess.TimeoutExpired:
                pass
            _parse(log.read_text(errors="replace"), res)
            ctx.save()
            if time.time() >= stop_at and not interrupted:
                interrupted = True
                res["failed"] = "pytest timed out (interrupted; the tests it named are in 'tests')"
                proc.send_signal(signal.SIGINT)  # pytest stops and still writes its summary and JUnit XML
                stop_at = ctx.deadline - 2
            elif time.time() >= stop_at:
                proc.kill()
                rc = proc.wait()
                break
    text = log.read_text(errors="replace")
    with open(log, "a") as f:
        f.write(f"\nexit code {rc}\n")
    res["rc"] = rc
    _parse(text, res)
    res["test_seconds"] = _junit_seconds(junit)
    shutil.rmtree(junit.parent, ignore_errors=True)
    if rc not in (0, 5) and "failed" not in res:
        res["failed"] = f"pytest exit code {rc}: {res['outcome']}"
    return res


def headline(res: dict) -> str:
    reasons = "; ".join(r[:70] for r in res.get("skip_reasons", [])[:3])
    text = f"{res.get('outcome')} (pytest_gpu.txt); skip reasons: {reasons}"
    if res.get("in_flight"):
        text += f"; running when stopped: {', '.join(res['in_flight'][:2])}"
    return text
