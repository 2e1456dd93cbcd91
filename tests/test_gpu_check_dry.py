"""benchmarks/gpu/run.sh --dry-run runs every part of the GPU check on CPU tensors with tiny shapes (the
H200 run itself needs a lent GPU), as documented (no PYTHON: the checkout's .venv); the runner keeps
partial results of a part it had to kill; one budget table (runner.PARTS) gives run.sh its default and
sums to it; the throughput part survives a raising recipe and estimates per label; parity runs its new
checks first and skips the recipes it has no time for; pytest_gpu names its tests when it is cut short; grpo
gives the FP8 arm the larger share and fails when a requested CUDA graph was not captured; prepare.sh ships
nothing the H200 image has; the summary renders a GPU run's tables."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"
if str(GPU) not in sys.path:
    sys.path.insert(0, str(GPU))

import runner  # noqa: E402
import summary  # noqa: E402

RAN_ON_CPU = ["env", "parity", "throughput", "grpo", "shadow", "pytest_gpu", "distopt"]


VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def _dry_run(out: Path, **env) -> subprocess.CompletedProcess:
    """``bash benchmarks/gpu/run.sh --dry-run`` from the checkout root, as docs/results.md writes it: no
    PYTHON, so run.sh picks the checkout's .venv (a checkout without one falls back to this Python)."""
    e = dict(os.environ, OUT=str(out), **env)
    e.pop("PYTHON", None)
    e.pop("GPU_CHECK_BUDGET_S", None)
    if not VENV_PYTHON.exists():
        e["PYTHON"] = sys.executable
    # the guard is run.sh's own limit (the parts' budget and the time outside them), not a guess at this
    # machine's speed: on 2 cores shared with other jobs the dry run took over 300 s
    limit = runner.default_budget(True) + runner.OUTSIDE_PARTS_S + 60
    return subprocess.run(["bash", "benchmarks/gpu/run.sh", "--dry-run"], capture_output=True, text=True, timeout=limit,
                          env=e, cwd=ROOT, check=False)


def test_dry_run_runs_every_part(tmp_path):
    out = tmp_path / "gpu"
    proc = _dry_run(out)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"_meta", *runner.PART_NAMES}
    assert results["_meta"]["dry_run"] is True
    # run.sh's default budget is the runner's table: the caps of the parts that can run here
    assert results["_meta"]["budget_s"] == runner.default_budget(True) == runner.DRY_CAP_FACTOR * sum(
        p[1] for p in runner.PARTS if p[3] is None)
    if VENV_PYTHON.exists():  # the documented command ran the checkout's Python, not a bare python3
        assert Path(results["env"]["executable"]) == VENV_PYTHON.absolute()
    assert [results[p]["status"] for p in RAN_ON_CPU] == ["ok"] * len(RAN_ON_CPU)
    summary_md = (out / "summary.md").read_text()
    for p in runner.PART_NAMES:
        assert f"| {p} | {results[p]['status']} |" in summary_md
    assert "FAILED" not in summary_md
    # what comes back from a device machine: few files, all directly under $OUT
    assert sorted(f.name for f in out.iterdir()) == ["nvidia-smi.txt", "pytest_gpu.txt", "results.json", "run.log",
                                                     "summary.md"]

    env = results["env"]
    assert env["torch"] == __import__("torch").__version__ and env["auto_backend"] == "emulate"
    # the CPU's scaled GEMM takes per-tensor scales only
    assert set(env["torch_gemm_support"]["tensorwise"].values()) == {"torch"}
    assert all(v != "torch" for v in env["torch_gemm_support"]["blockwise"].values())

    # the rollout weight quantizers' code path (CPU against CPU here), at a shape that is and one that is not
    # a multiple of the 128-tiles
    rw = results["parity"]["rollout_weights"]
    assert rw and all(ok is True for ok in rw.values()), rw
    assert {k.split("@")[1] for k in rw} == {"768x1000", "256x384"} and "vllm_block_sync@768x1000" in rw
    assert results["parity"]["skipped_recipes"] == [] and "Rollout weight quantizers" in summary_md
    parity = results["parity"]["recipes"]
    assert list(parity) == ["delayed", "tensorwise", "rowwise", "blockwise", "blockwise_hybrid", "mxfp8"]
    for label, row in parity.items():
        assert all(row["quantized_equal"].values()), label
        for gemm in ("forward", "dgrad", "wgrad"):
            for b in ("torch", "emulate"):
                assert 0.0 < row[gemm][f"{b}_err_over_bound"] <= 1.0, (label, gemm, b)
        real = label in ("delayed", "tensorwise")
        assert row["layer_backend"] == ("torch" if real else "emulate"), label
        assert row["gemm"] == "torch._scaled_mm" if real else row["gemm"].startswith("emulated: "), label
        assert row["conversion"]["emulated_fallback"] == (0 if real else 1)
        if not real:  # a fallback runs the emulation itself: identical outputs
            assert all(row[g]["max_abs_torch_minus_emulate"] == 0.0 for g in ("forward", "dgrad", "wgrad"))

    thr = results["throughput"]
    # timed largest token count first, listed ascending (as in the records)
    assert thr["tokens"] == sorted(thr["tokens"])
    assert list(thr["ms"]) == [f"{n}@{t}" for t in thr["tokens"] for n in ("qkv", "o", "gate_up", "down")] + [
        f"layer@{t}" for t in thr["tokens"]]
    for tokens in thr["tokens"]:
        for name in ("qkv", "o", "gate_up", "down", "layer"):
            row = thr["ms"][f"{name}@{tokens}"]
            assert set(row) == {"bf16", "delayed", "tensorwise"} and all(v > 0 for v in row.values())
    assert set(thr["not_timed"]) == {"rowwise", "blockwise", "blockwise_hybrid", "mxfp8"}
    assert "| layer@" in summary_md

    grpo = results["grpo"]
    fp8, bf16 = grpo["arms"]["fp8_tensorwise_calibrated"], grpo["arms"]["bf16"]
    for arm in (fp8, bf16):
        # 3 timed steps and the profiled one (the dry run always profiles: GPU_CHECK_GRPO_PROFILE's path)
        assert arm["rc"] == 0 and arm["all_finite"] and arm["steps"] == 4
        assert arm["profile_top"][0].startswith("torch.profiler, rank 0, steps 3-3") and len(arm["profile_top"]) > 10
        assert "trainer.profile.start_step=3" in arm["cmd"] and "trainer.max_steps=4" in arm["cmd"]
    assert "Profiled step of fp8_tensorwise_calibrated" in summary_md
    assert "fp8.backend=torch" in fp8["cmd"] and "calibration=paper" in fp8["cmd"]
    assert fp8["conversion"]["backend"] == "torch" and fp8["conversion"]["torch_gemm"] > 0
    assert fp8["median_shadow_s"] > 0 and grpo["step_x_bf16"] > 0
    # where the rollout's FP8 linears ran, read from the engine's own line (on a CPU: emulated)
    assert fp8["rollout_engine"]["scheme"] == "vllm_w8a8" and fp8["rollout_engine"]["emulated"] > 0
    assert fp8["rollout_engine"]["torch_gemm"] == 0 and "rollout: scheme" in summary_md
    # the engine's decode timed eager and with rollout.cuda_graphs (no capture on a CPU: the static steps)
    assert set(grpo["decode"]["seconds"]) == {f"{s}, cuda_graphs={g}" for s in ("off", "vllm_w8a8")
                                              for g in (False, True)}
    assert "Torch engine decode in-process" in summary_md
    # every config with cuda_graphs records its static decode (on a CPU: built, nothing to capture)
    graphs = grpo["decode"]["graphs"]
    for s in ("off", "vllm_w8a8"):
        assert graphs[f"{s}, cuda_graphs=True"] == {"calls": 1, "warnings": [], "capture": False, "graphs": 0,
                                                     "fallback": None}
        assert graphs[f"{s}, cuda_graphs=False"]["calls"] == 0

    sh = results["shadow"]
    tw = sh["recipes"]["tensorwise"]
    assert tw["share_at_interval"] == pytest.approx(2 * sh["shadow_ms"] / (20 * tw["step_ms"]))
    assert "blockwise" in sh["not_timed"]

    pt = results["pytest_gpu"]
    assert pt["rc"] == 0 and pt["counts"].get("skipped", 0) > 0 and "tests/fp8/test_te_parity_gpu.py" in pt["files"]
    assert len(pt["tests"]) == pt["counts"]["skipped"] and set(pt["tests"].values()) == {"SKIPPED"}
    assert pt["in_flight"] == [] and len(pt["test_seconds"]) == len(pt["tests"])
    assert results["distopt"]["resume_max_abs_diff"] <= 1e-3

    if importlib.util.find_spec("transformer_engine") is None:
        assert "Transformer Engine is not installed" in results["te_parity"]["skipped"]
    assert "GPU_CHECK_DRY_VLLM=1" in results["vllm_rollout"]["skipped"] or "vLLM is not installed" in \
        results["vllm_rollout"]["skipped"]


# A part's timeout counts from the child's start, so a test's must leave room for the child's Python to start
# and install its SIGTERM handler: under load that took more than 3 s (two test workers beside two training
# runs on 2 cores), and a SIGTERM before the handler ends the child with rc -15 and no record. The parts
# below sleep far past it.
TIMEOUT_S = 15.0

_TIMED_OUT_PARTS = {
    "sleeps": ("import time\n"
               "def run(ctx):\n"
               "    time.sleep(120)\n"),
    # CI once saw the runner's SIGTERM raise inside native import code, which turned the exception into
    # std::terminate (rc -6) before the child's except could record it: this part aborts on the raise
    "abort_on_raise": ("import os, time\n"
                       "def run(ctx):\n"
                       "    ctx.res['partial'] = 1\n"
                       "    ctx.save()\n"
                       "    try:\n"
                       "        time.sleep(120)\n"
                       "    except BaseException:\n"
                       "        os.abort()\n"),
}


@pytest.fixture(scope="module")
def timed_out_parts(tmp_path_factory):
    """The parts of ``_TIMED_OUT_PARTS`` run by the runner past their TIMEOUT_S, side by side (each waits on
    its own child; together they cost one timeout of test time): ``(folder, {name: result})``."""
    from concurrent.futures import ThreadPoolExecutor

    d = tmp_path_factory.mktemp("timed_out_parts")
    for name, code in _TIMED_OUT_PARTS.items():
        (d / f"part_{name}.py").write_text(code)
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(len(_TIMED_OUT_PARTS)) as pool:
        mp.setenv("PYTHONPATH", str(d))
        futures = {n: pool.submit(runner._run_part, n, TIMEOUT_S, True, d, d) for n in _TIMED_OUT_PARTS}
        return d, {n: f.result() for n, f in futures.items()}


def test_a_part_past_its_timeout_is_recorded_and_the_summary_written(timed_out_parts):
    d, results = timed_out_parts
    res = results["sleeps"]
    assert runner.status_of(res) == "FAILED"
    assert res["failed"].startswith("timed out after 15s")
    assert "_Terminated" in res.get("error", "")  # the child saved what it had when the runner's SIGTERM came
    out = d / "summary"
    out.mkdir()
    summary.write(out, "# t", [("sleeps", "FAILED", res)], ["grpo"], {"dry_run": True})
    md = (out / "summary.md").read_text()
    assert "| sleeps | FAILED |" in md and "| grpo | not run | | |" in md
    assert "timed out" in json.loads((out / "results.json").read_text())["sleeps"]["failed"]
    assert (out / "tracebacks.txt").is_file()


def test_a_timeout_is_recorded_even_when_the_child_then_aborts(timed_out_parts):
    """CI once saw the runner's SIGTERM raise inside native import code, which turned the exception into
    std::terminate (rc -6) before the child's except could record it. The handler now saves the timeout
    first: a part that aborts on the raise (what such a native frame does) still leaves the record."""
    res = timed_out_parts[1]["abort_on_raise"]
    assert res["child_rc"] == -6 and res["failed"].startswith("timed out after 15s")
    assert res["error"].startswith("_Terminated: signal 15") and "time.sleep(120)" in res["traceback"]
    assert res["partial"] == 1  # what the part had saved is kept


def test_sigterm_to_the_runner_stops_its_part_and_writes_the_summary(tmp_path):
    """run.sh's outer `timeout` (the backstop of the runner's deadline) sends SIGTERM to the runner only: the
    part, in its own session, used to run on (on the GPU) while the runner died without its record. Now the
    runner stops the part (which saves what it has), records it, marks the later parts not run, writes the
    summary and exits 143."""
    (tmp_path / "part_sleeps.py").write_text(
        "import os, time\n"
        "def run(ctx):\n"
        "    ctx.res['partial'] = 1\n"
        "    ctx.save()\n"
        f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(120)\n")
    out = tmp_path / "out"
    script = (f"import sys; sys.path.insert(0, {str(GPU)!r}); import runner\n"
              "runner.PARTS.insert(0, ('sleeps', 100, 1, None)); runner.PART_NAMES.insert(0, 'sleeps')\n"
              f"sys.argv = ['runner.py', '--dry-run', '--parts', 'sleeps,env', '--out', {str(out)!r}]\n"
              "runner.main()\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)
    try:
        pid_file = tmp_path / "pid"
        deadline = time.time() + 240  # the part's start: imports on a loaded 2-core machine
        while not (pid_file.is_file() and pid_file.read_text()) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert pid_file.is_file(), proc.communicate(timeout=30)[0] if proc.poll() is not None else "no part start"
        part_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, text[-3000:]
    with pytest.raises(ProcessLookupError):  # the part's process is gone, not orphaned
        os.kill(part_pid, 0)
    res = json.loads((out / "results.json").read_text())
    assert res["sleeps"]["failed"].startswith("stopped by signal 15 to the runner"), res["sleeps"]
    assert res["sleeps"]["partial"] == 1  # what the part had saved comes back
    md = (out / "summary.md").read_text()
    assert "| sleeps | FAILED |" in md and "| env | not run | | |" in md
    assert "runner: stopped by signal 15; not run: ['env']" in text


def test_budget_table_sums_to_the_default_and_fits_the_device_command():
    """One table: the parts the H200 runs (no TE, no vLLM) have caps summing to the runner's default budget,
    which run.sh takes (runner.py --print-budget, no number of its own), and with the time outside the
    parts it fits in the device machine's limit for one command."""
    h200 = [p for p in runner.PARTS if p[3] is None]
    total = sum(p[1] for p in h200)
    assert runner.part_table(False) == [tuple(p) for p in runner.PARTS]  # a GPU run: the table's caps
    assert runner.default_budget(True) == runner.DRY_CAP_FACTOR * total  # a CPU's caps (runner.part_table)
    assert total + runner.OUTSIDE_PARTS_S <= runner.COMMAND_LIMIT_S
    assert all(least <= cap for _, cap, least, _ in runner.PARTS)
    proc = subprocess.run([sys.executable, str(GPU / "runner.py"), "--print-budget", "--dry-run"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert int(proc.stdout.strip()) == runner.DRY_CAP_FACTOR * total
    proc = subprocess.run([sys.executable, str(GPU / "runner.py"), "--print-budget", "--dry-run", "--parts", "env,grpo"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert int(proc.stdout.strip()) == runner.DRY_CAP_FACTOR * (dict((p[0], p[1]) for p in h200)["env"]
                                                                + dict((p[0], p[1]) for p in h200)["grpo"])
    code = [line for line in (GPU / "run.sh").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert any("--print-budget" in line for line in code)
    assert not any(re.search(rf"\b{total}\b", line) for line in code), "run.sh must not hard-code the budget"


def test_part_timeouts_give_every_part_its_cap_and_pass_on_what_is_left():
    """Parts that use their whole timeout get exactly their caps (and end at the budget); one that ends early
    leaves its seconds to the next; a part never takes the least a later one needs."""
    parts = [(cap, least) for _, cap, least, req in runner.PARTS if req is None]
    left = float(sum(c for c, _ in parts))
    for i, (cap, _) in enumerate(parts):
        got = runner.part_timeout(cap, left, parts[i + 1:])
        assert got == cap
        left -= got
    assert left == 0
    (c0, _), (c1, _) = parts[0], parts[1]
    left = float(sum(c for c, _ in parts)) - (c0 - 10)  # the first part ended 10 s before its cap
    assert runner.part_timeout(c1, left, parts[2:]) == c1 + 10
    late = parts[1:3]  # little time left: a part keeps every later part's least
    assert runner.part_timeout(500, 100.0, late) == 100 - sum(lst for _, lst in late)


def test_throughput_survives_a_raising_recipe(tmp_path, monkeypatch):
    """One recipe raising (as blockwise + hybrid did before its GEMMs fell back) is recorded with its error and
    not timed again; every other recipe is still timed and the part returns its results."""
    import nemo_fp8rl.fp8 as fp8
    import part_throughput
    from common import Ctx

    orig = fp8.fp8_linear

    def flaky(x, w, b, rec, state, backend="emulate"):
        if rec.name == "tensorwise":
            raise RuntimeError("Invalid scaling configuration (injected)")
        return orig(x, w, b, rec, state, backend=backend)

    monkeypatch.setattr(fp8, "fp8_linear", flaky)
    ctx = Ctx(dry=True, device="cpu", out=tmp_path, deadline=time.time() + 300, result_path=tmp_path / "r.json")
    res = part_throughput.run(ctx)
    assert set(res["errors"]) == {"tensorwise"} and "Invalid scaling configuration" in res["errors"]["tensorwise"]
    assert "tensorwise" in res["failed"]
    for key, row in res["ms"].items():
        assert "tensorwise" not in row and row.get("bf16", 0) > 0 and row.get("delayed", 0) > 0, key
    assert any("raised, not timed further" in line for line in part_throughput.tables(res))


def test_throughput_estimates_each_label_from_its_own_last_config():
    """A configuration's expected time is its label's last one (its first carried the compiles), else the
    slowest first configuration of any label: one slow compile no longer makes every later label look slow."""
    import part_throughput

    est = part_throughput._estimate
    seconds = {"bf16": [0.4, 0.2], "torchao_tensorwise": [28.0, 1.5]}
    assert est("bf16", seconds) == 0.2 and est("torchao_tensorwise", seconds) == 1.5
    assert est("tensorwise", seconds) == 28.0  # never timed: as slow as the slowest first configuration
    assert est("tensorwise", {}) == part_throughput.FIRST_CONFIG_S


def test_parity_runs_its_new_checks_first_and_skips_recipes_without_time(tmp_path, monkeypatch):
    """The checks that never ran on a GPU come before the recipes; a recipe that does not fit the time left is
    recorded as skipped with the reason (the part is not failed), and the results are saved as they come."""
    import part_parity
    from common import Ctx

    monkeypatch.setattr(part_parity, "RECIPE_DEFAULT_S", 1e6)  # no recipe fits
    monkeypatch.setattr(part_parity, "RECIPE_LEAST_S", {})
    ctx = Ctx(dry=True, device="cpu", out=tmp_path, deadline=time.time() + 600,
              result_path=tmp_path / "r.json")
    res = part_parity.run(ctx)
    assert runner.status_of(res) == "ok" and res["problems"] == []
    assert res["skipped_recipes"] == [r[0] for r in part_parity.RECIPES]
    assert all(row["skipped"].startswith("out of time") for row in res["recipes"].values())
    assert all(ok is True for ok in res["rollout_weights"].values())
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["rollout_weights"] == res["rollout_weights"] and "mxfp8" in saved["recipes"]
    assert "| mxfp8 | skipped: out of time" in "\n".join(part_parity.tables(res))
    # the planted amax makes a division through a float32 reciprocal give another per-tensor scale
    import torch

    a = torch.tensor(part_parity._reciprocal_sensitive_amax())
    assert a / torch.tensor(448.0) != a * torch.tensor(1.0 / 448.0) and a >= 0.125


def test_pytest_gpu_cut_short_names_its_tests(tmp_path, monkeypatch):
    """pytest gets SIGINT before the part's deadline: the tests that ended and the one running are named, from
    pytest's verbose output, and the part is failed as timed out.

    The part's clock runs real time until the slow test has started, then jumps to the interrupt point: the
    interrupt lands inside that test however long pytest took to start on a loaded machine (a fixed deadline
    hit pytest's start-up once, with two other jobs on the two cores), and pytest still has the part's real
    grace to stop."""
    from types import SimpleNamespace

    import part_pytest_gpu
    from common import Ctx

    started = tmp_path / "slow_started"
    tests = tmp_path / "test_sleepy.py"
    tests.write_text("import time\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_fast():\n    pass\n\n\n"
                     f"@pytest.mark.gpu\ndef test_slow():\n    open({str(started)!r}, 'w').close()\n"
                     "    time.sleep(300)\n")
    monkeypatch.setattr(part_pytest_gpu, "gpu_test_files", lambda: [str(tests)])
    monkeypatch.setattr(part_pytest_gpu, "INTERRUPT_GRACE_S", 15)
    deadline = time.time() + 600
    offset = []

    def part_clock() -> float:
        now = time.time()
        if not offset and started.exists():
            offset.append(deadline - part_pytest_gpu.INTERRUPT_GRACE_S - now)
        return now + (offset[0] if offset else 0.0)

    monkeypatch.setattr(part_pytest_gpu, "time", SimpleNamespace(time=part_clock))
    ctx = Ctx(dry=True, device="cpu", out=tmp_path, deadline=deadline, result_path=tmp_path / "r.json")
    # as in the background of a non-interactive shell (or an xdist worker): SIGINT ignored, which a child
    # inherits; the part's pytest must still take the interrupt
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        res = part_pytest_gpu.run(ctx)
    finally:
        signal.signal(signal.SIGINT, before)
    assert offset, "the slow test never started"
    assert res["failed"].startswith("pytest timed out") and res["rc"] == 2  # pytest's "interrupted"
    assert [v for k, v in res["tests"].items() if k.endswith("::test_fast")] == ["PASSED"]
    assert [t.split("::")[1] for t in res["in_flight"]] == ["test_slow"]
    assert "running when stopped" in part_pytest_gpu.headline(res)
    assert "test_fast" in (tmp_path / "pytest_gpu.txt").read_text()


def test_grpo_gives_the_fp8_arm_the_larger_share_and_fails_on_a_graph_fallback(tmp_path, monkeypatch):
    """The FP8 arm gets ARM_SHARE of the arms' time, the BF16 arm what is left; a cuda_graphs config on CUDA
    whose timed call captured nothing fails the part (its ratio would read as measured)."""
    import part_grpo
    from common import Ctx

    timeouts = {}

    def fake_arm(name, overrides, timeout, tmp, *timed_and_profiled):
        timeouts[name] = timeout
        return {"rc": 0, "steps": 5, "all_finite": True, "median_step_s": 1.0}

    def fake_decode(ctx):
        ctx.res["decode"] = {"seconds": {"off, cuda_graphs=False": 1.0, "off, cuda_graphs=True": 1.0},
                             "graphs": {"off, cuda_graphs=False": {"calls": 0, "warnings": []},
                                        "off, cuda_graphs=True": {"calls": 1, "capture": True, "graphs": 0,
                                                                  "fallback": "RuntimeError: capture failed",
                                                                  "warnings": []}}}
        return ctx.res["decode"]

    monkeypatch.setattr(part_grpo, "_arm", fake_arm)
    monkeypatch.setattr(part_grpo, "_decode_times", fake_decode)
    ctx = Ctx(dry=True, device="cuda", out=tmp_path, deadline=time.time() + 300,
              result_path=tmp_path / "r.json")
    res = part_grpo.run(ctx)
    left = 300 - 5 - part_grpo.DECODE_RESERVE_S
    assert timeouts["fp8_tensorwise_calibrated"] == pytest.approx(0.6 * left, abs=3)
    assert timeouts["bf16"] == pytest.approx(left, abs=3)  # all that is left (the fake FP8 arm took none)
    assert "no CUDA graph captured (RuntimeError: capture failed)" in res["failed"]
    assert part_grpo._decode_problems(res["decode"], "cpu") == []  # no capture to expect without CUDA


def test_grpo_arm_cut_in_its_profiled_step_keeps_its_timed_steps(tmp_path, monkeypatch):
    """With GPU_CHECK_GRPO_PROFILE the profiled step comes after the timed ones: a timeout there costs the
    profile (said why), not the arm's measurement; a timeout before the timed steps end still fails it."""
    import part_grpo

    def run_cut_after(n):
        def fake_run(cmd, **kw):
            run = Path(next(a for a in cmd if a.startswith("output_dir=")).split("=", 1)[1])
            run.mkdir(parents=True, exist_ok=True)
            rec = {k: 1.0 for k in part_grpo.FINITE_KEYS} | {f"timing/{p}": 1.0 for p in part_grpo.PHASES}
            (run / "metrics.jsonl").write_text("".join(json.dumps(rec | {"step": i}) + "\n" for i in range(n)))
            raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=b"", stderr=b"")
        return fake_run

    monkeypatch.setattr(part_grpo.subprocess, "run", run_cut_after(5))
    arm = part_grpo._arm("fp8", [], 30.0, tmp_path / "a", 5, True)
    assert "failed" not in arm and arm["rc"] == 0 and arm["median_step_s"] == 1.0
    assert arm["profile_error"] == "timed out after 30s in the profiled step"
    monkeypatch.setattr(part_grpo.subprocess, "run", run_cut_after(3))
    arm = part_grpo._arm("fp8", [], 30.0, tmp_path / "b", 5, True)
    assert arm["failed"] == "timed out after 30s" and "no profile table" in arm["profile_error"]


# what the H200 image already has (benchmarks/gpu/h200_check.md): prepare.sh must not ship any of it, since a
# carried copy comes first on PYTHONPATH and shadows the image's own
H200_IMAGE = {"torch", "numpy", "transformers", "safetensors", "tokenizers", "pyyaml", "psutil", "matplotlib",
              "tensorboard", "pytest", "hypothesis", "triton", "packaging"}


def test_prepare_ships_nothing_the_image_has():
    text = (GPU / "prepare.sh").read_text()
    binary = re.search(r"^BINARY=\((.*?)\)", text, re.S | re.M).group(1)
    shipped = {spec.split("==")[0].lower().replace("_", "-") for spec in binary.split()}
    assert "megatron-core" in shipped and "hydra-core" in shipped
    assert not shipped & H200_IMAGE, shipped & H200_IMAGE
    assert 'rm -f "$W"/packaging-*.whl' in text  # an old .whl/ loses the copy that shadowed the image's


def test_unknown_part_is_refused_with_the_valid_names(tmp_path):
    proc = subprocess.run([sys.executable, str(GPU / "runner.py"), "--out", str(tmp_path), "--parts", "env,nope"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "unknown part(s) ['nope']" in proc.stderr and "throughput" in proc.stderr


def test_summary_tables_of_a_gpu_run(tmp_path):
    """A lent machine's results (torch GEMMs for blockwise, mxfp8 emulated, vLLM arms, a raising
    scheme) render without a GPU: the summary must not fail after the measurements."""
    g = {"torch_err_over_bound": 0.3, "emulate_err_over_bound": 0.25, "torch_finite": True, "emulate_finite": True,
         "max_abs_torch_minus_emulate": 0.01, "max_abs_output": 3.0}
    parity = {"device": "NVIDIA H200", "shapes": {"x": [1000, 1024], "weight": [768, 1024]}, "dtype": "torch.bfloat16",
              "recipes": {"blockwise": {"quantized_equal": {"x_fwd": True, "w_fwd": True}, "layer_backend": "torch",
                                        "gemm": "torch._scaled_mm", "forward": g, "dgrad": g, "wgrad": g},
                          "mxfp8": {"quantized_equal": {"x_fwd": True}, "layer_backend": "emulate",
                                    "gemm": "emulated: no Hopper kernel (mxfp8: needs sm100)", "forward": g,
                                    "dgrad": g, "wgrad": g}}}
    thr = {"tokens": [4096], "warmup": 3, "repeats": 10, "what": "ms",
           "ms": {"qkv@4096": {"bf16": 2.0, "tensorwise": 1.0, "blockwise": 1.6}},
           "not_timed": {"mxfp8": "mxfp8: needs sm100"},
           "targets": {"tensorwise layer@16384 >= 1.45x BF16": 1.8, "blockwise layer@16384 >= 1.25x BF16": None},
           "profile": {"shape": "gate_up@8192", "calls": 3, "recipes": {
               "tensorwise": {"total_ms": 4.2, "launches_per_call": 9, "kernels": [["nvjet_gemm", 3.3, 3], ["_tensor_cast_kernel", 0.5, 2]]}}}}
    arm = {"build_s": 12.0, "decode_tokens_per_s": 4000.0, "prefill_tokens_per_s": 90000.0,
           "quant_methods": ["UnquantizedLinearMethod"]}
    fp8 = dict(arm, decode_tokens_per_s=5000.0, prefill_tokens_per_s=150000.0, quant_methods=["Fp8LinearMethod"],
               fp8_kernels=["CutlassFP8ScaledMMLinearKernel"])
    rollout = {"vllm": "0.33.0", "shape": {"num_layers": 4, "hidden_size": 4096}, "dtype": "bfloat16",
               "decode": {"batch": 256, "new": 128}, "prefill": {"batch": 32, "prompt": 2048}, "repeats": 2,
               "arms": {"bf16": arm, "fp8_block": fp8}, "errors": {"fp8_w8a8": "RuntimeError: no kernel"},
               "failed": "arm(s) ['fp8_w8a8'] failed",
               "vs_high_precision": {"bf16": {"decode": 1.0, "prefill": 1.0}, "fp8_block": {"decode": 1.25, "prefill": 1.67}}}
    row = {"tokens": 256, "max_abs_diff": 0.05, "mean_abs_diff": 0.004, "argmax_agree": 0.99}
    vparity = {"reference": "torch engine", "prompts": 8, "new_tokens": 32,
               "schemes": {"vllm_block": dict(row, fp8_effect_mean=0.02, fp8_kernels=["K"]),
                           "vllm_w8a8": {"error": "ValueError: no FP8 here"}}, "failed": "scheme(s) ['vllm_w8a8'] raised"}
    done = [("parity", "ok", parity), ("throughput", "ok", thr), ("vllm_rollout", "FAILED", rollout),
            ("vllm_parity", "FAILED", vparity)]
    summary.write(tmp_path, "# GPU check", done, [], {})
    md = (tmp_path / "summary.md").read_text()
    assert "| blockwise | torch._scaled_mm | 2/2 | 0.3 | 0.25 |" in md
    assert "| mxfp8 | emulated: no Hopper kernel (mxfp8: needs sm100) |" in md
    assert "| qkv@4096 | 2.00 | 1.00 | 2.00 | 1.60 | 1.25 |" in md
    assert "- tensorwise layer@16384 >= 1.45x BF16: 1.80" in md and "- blockwise layer@16384 >= 1.25x BF16: -" in md
    assert "| tensorwise | 4.200 | 9 | nvjet_gemm 3.300 x3; _tensor_cast_kernel 0.500 x2 |" in md
    assert "| fp8_block | 5000 | 1.25 | 150000 | 1.67 | Fp8LinearMethod (CutlassFP8ScaledMMLinearKernel) |" in md
    assert "| vllm_w8a8 | ValueError: no FP8 here |" in md
    assert "arm(s) ['fp8_w8a8'] failed" in summary.headline("vllm_rollout", rollout)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_dry_run_vllm_parts(tmp_path):
    """The two vLLM parts on a tiny float32 model with FP8 off (vLLM's FP8 needs a GPU); minutes on CPU."""
    out = tmp_path / "gpu"
    proc = _dry_run(out, GPU_CHECK_DRY_VLLM="1", GPU_CHECK_PARTS="vllm_rollout,vllm_parity", GPU_CHECK_BUDGET_S="900")
    assert proc.returncode == 0, proc.stdout[-5000:]
    results = json.loads((out / "results.json").read_text())
    rollout, vparity = results["vllm_rollout"], results["vllm_parity"]
    assert rollout["status"] == "ok", rollout
    assert rollout["arms"]["float32"]["decode_tokens_per_s"] > 0
    assert set(rollout["skipped"]) == {"fp8_w8a8", "fp8_block"}
    off = vparity["schemes"]["off"]
    assert vparity["status"] == "ok" and off["max_abs_diff"] < 1e-4 and off["argmax_agree"] == 1.0
