"""Run reward functions so that one that raises, hangs or crashes can never stop training.

Why a subprocess: Python cannot interrupt a thread that is stuck in C code (a sympy simplification, a
regex with catastrophic backtracking, an ``input()``), and a timed-out thread keeps running and holding
the GIL. A child process can be killed. So reward functions run in one long-lived worker process that
evaluates the items of a batch one after the other and sends each result back as soon as it has it.
The parent waits for each result with a per-call deadline; on a timeout it kills the worker (SIGKILL),
records reward 0 for that item, starts a fresh worker and continues with the next item. A function that
raises gets reward 0 too, and so does a result that is not a finite number; all are counted as errors.

What a reward function needs before its first call (importing its checker: ``reasoning_gym`` pulls in
matplotlib, ``math_verify`` sympy; measured 1-19 s and 1-23 s on the 2-core CI machine under load, more from a
cold network file system) is not a reward call and must not count against the per-call deadline, or the
first item of every fresh worker times out, the worker is killed, and the next fresh worker starts over.
So a task may give a ``prepare`` callable: each worker runs it once, right after loading the function and
before its first call, under the start-up deadline (``_STARTUP_TIMEOUT_S``).

The worker is a plain ``python -c`` child (not ``multiprocessing``): it imports only this module, the
standard library and whatever the reward function's module imports when unpickled, so it neither
re-imports the training entry point (as multiprocessing's spawn/forkserver would) nor inherits the
trainer's CUDA/NCCL state (as fork would). It exits when the parent dies (a watchdog thread polls the
parent pid) or when its pipe closes.

This module deliberately imports only the standard library.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["RewardResult", "RewardRunner"]

_STARTUP_TIMEOUT_S = 120.0


@dataclass
class RewardResult:
    """Outcome of one reward call: ``reward`` (0.0 on error), ``correct``, and ``error`` (None when fine)."""

    reward: float
    correct: bool
    error: str | None = None


def _coerce(value: Any) -> tuple[float, bool]:
    """Accept ``float`` (correct = reward > 0) or ``(float, bool)``; raise TypeError/ValueError otherwise."""
    if isinstance(value, tuple) and len(value) == 2:
        r, c = value
    else:
        r, c = value, None
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise TypeError(f"reward function returned {type(r).__name__}; it must return a float or (float, bool)")
    r = float(r)
    if not math.isfinite(r):
        raise ValueError(f"reward function returned a non-finite reward {r}")
    return r, (r > 0) if c is None else bool(c)


def _import_roots(fn: Any) -> list[str]:
    """Directories from which the worker can import the module(s) that define ``fn`` as the parent did.

    The worker gets the parent's ``sys.path`` anyway; this adds the root of each defining module's
    top-level package, for modules that were imported without a ``sys.path`` entry (e.g. by pytest's
    rootdir-based import of test packages).
    """
    roots = []
    for f in (fn, getattr(fn, "func", None)):
        mod = sys.modules.get(getattr(f, "__module__", None) or "")
        if mod is None:
            continue
        top = sys.modules.get(mod.__name__.split(".")[0])
        file = getattr(top, "__file__", None)
        if not file:
            continue
        d = os.path.dirname(os.path.abspath(file))
        roots.append(os.path.dirname(d) if os.path.basename(file) == "__init__.py" else d)
    return roots


def _worker_main(read_fd: int, write_fd: int) -> None:
    """Child process loop: ``("fn", (fn_bytes, prepare_bytes))`` loads a function and runs its ``prepare``
    (None: nothing to run), ``("run", items)`` evaluates and streams results.

    Each item is a tuple of positional arguments; for item i the child sends ``("ok", i, value)`` or
    ``("err", i, message)``.
    """
    os.dup2(2, 1)  # anything the reward function prints goes to stderr, never into the result pipe
    # The parent owns this process's lifetime (pipe EOF, watchdog, kill on timeout). Signals meant for the
    # trainer reach every process of a job - SLURM's --signal/scancel --signal and preemption SIGTERM go to
    # all processes of a step, Ctrl-C to the terminal's process group - and must not kill the worker while
    # the trainer finishes its step and checkpoints.
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()

    def watchdog() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    rx, tx = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    fn: Callable[..., Any] | None = None
    tx.send(("ready", -1, None))
    while True:
        try:
            kind, payload = rx.recv()
        except (EOFError, OSError):
            return
        if kind == "fn":
            fn_bytes, prepare_bytes = payload
            try:
                fn = pickle.loads(fn_bytes)
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
                tx.send(("load_err", -1, f"{type(e).__name__}: {e}"))
                continue
            try:
                if prepare_bytes is not None:
                    pickle.loads(prepare_bytes)()
                tx.send(("loaded", -1, None))
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
                tx.send(("prepare_err", -1, f"{type(e).__name__}: {e}"))
        elif kind == "run":
            for i, args in enumerate(payload):
                try:
                    value = fn(*args)  # type: ignore[misc]
                    tx.send(("ok", i, value))
                except BaseException as e:  # noqa: BLE001 - any failure is a reward error, counted
                    try:
                        tx.send(("err", i, f"{type(e).__name__}: {e}"))
                    except Exception:  # unpicklable exception text: send its type only
                        tx.send(("err", i, type(e).__name__))


class RewardRunner:
    """Evaluate a picklable reward function on many argument tuples with a per-call timeout.

    Args:
        timeout_s: seconds each call may take (measured from the previous result); past it the worker is
            killed and the call scores 0 with an error.

    Use :meth:`run`; call :meth:`close` (or use as a context manager) to stop the worker. The function
    must be picklable by reference (a module-level function or a ``functools.partial`` of one).
    """

    def __init__(self, timeout_s: float = 5.0) -> None:
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"reward timeout {timeout_s!r} must be a positive number of seconds (task.reward_timeout_s)")
        self.timeout_s = float(timeout_s)
        self._proc: subprocess.Popen | None = None
        self._tx: Connection | None = None
        self._rx: Connection | None = None
        self._loaded: tuple[bytes, bytes | None] | None = None
        """The (function, prepare) the current worker has loaded."""
        self._extra_paths: list[str] = []
        self.restarts = 0
        """Workers started after the first (each timeout or crash costs one)."""

    # ------------------------------------------------------------------ process management
    def _start(self) -> None:
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        env = dict(os.environ)
        paths = [p for p in sys.path if isinstance(p, str) and p] + self._extra_paths
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        code = (
            "import sys; from nemo_fp8rl.tasks.reward_runner import _worker_main; "
            "_worker_main(int(sys.argv[1]), int(sys.argv[2]))"
        )
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, str(p2c_r), str(c2p_w)],
                pass_fds=(p2c_r, c2p_w),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
        self._tx = Connection(p2c_w, readable=False)
        self._rx = Connection(c2p_r, writable=False)
        self._loaded = None
        if not self._rx.poll(_STARTUP_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, _, _ = self._rx.recv()
        except EOFError:
            self._kill()
            raise RuntimeError(
                f"reward worker exited at start-up ({sys.executable} could not import nemo_fp8rl.tasks.reward_runner)"
            ) from None
        assert kind == "ready", kind

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        for c in (self._tx, self._rx):
            if c is not None:
                c.close()
        self._proc = self._tx = self._rx = None
        self._loaded = None

    def close(self) -> None:
        """Stop the worker process (idempotent)."""
        self._kill()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; explicit close() is preferred
        try:
            self._kill()
        except Exception:
            pass

    @property
    def worker_pid(self) -> int | None:
        """Process id of the current worker (None when none runs)."""
        return None if self._proc is None else self._proc.pid

    def _load(self, fn: Any, fn_bytes: bytes, prepare: Any, prepare_bytes: bytes | None) -> None:
        roots = [r for f in (fn, prepare) if f is not None for r in _import_roots(f)]
        roots = [r for r in dict.fromkeys(roots) if r not in self._extra_paths]
        if roots:  # the worker must be able to import fn's module: (re)start it with those roots
            self._extra_paths += roots
            self._kill()
        if self._proc is None:
            self._start()
        if self._loaded == (fn_bytes, prepare_bytes):
            return
        self._tx.send(("fn", (fn_bytes, prepare_bytes)))
        ok = self._rx.poll(_STARTUP_TIMEOUT_S)
        kind, _, msg = (self._rx.recv() if ok else
                        ("load_err", -1, f"timed out after {_STARTUP_TIMEOUT_S:.0f} s while importing the function "
                                         "or running its prepare"))
        if kind == "prepare_err":
            self._kill()
            raise RuntimeError(f"the reward worker could not prepare the reward function: {msg} (the task's "
                               "reward_prepare, run once per worker before its first call)")
        if kind != "loaded":
            self._kill()
            raise RuntimeError(
                f"the reward worker could not load the reward function: {msg}. It must be importable by "
                "reference (a module-level function or functools.partial of one) from the worker's sys.path"
            )
        self._loaded = (fn_bytes, prepare_bytes)

    # ------------------------------------------------------------------ evaluation
    def run(self, fn: Callable[..., Any], items: Sequence[tuple],
            prepare: Callable[[], Any] | None = None) -> list[RewardResult]:
        """Evaluate ``fn(*args)`` for every ``args`` in ``items``; one :class:`RewardResult` per item, in order.

        The function returns a reward ``float`` or ``(reward, correct)``. Exceptions, timeouts
        (> ``timeout_s`` per call), worker crashes and invalid return values give reward 0 and an error
        message; they never raise. Raises only when ``fn`` or ``prepare`` cannot be pickled, loaded or
        run in the worker (a programming error that would otherwise silently zero every reward).

        ``prepare``: a picklable callable without arguments that each worker runs once, after loading
        ``fn`` and before its first call, under the start-up deadline rather than ``timeout_s`` (imports and
        set-up the function needs; see the module docstring). Its return value is ignored.
        """
        blobs = []
        for what, f in (("reward function", fn), ("reward prepare", prepare)):
            try:
                blobs.append(None if f is None else pickle.dumps(f))
            except Exception as e:
                raise TypeError(
                    f"{what} {f!r} is not picklable ({e}); use a module-level function or a functools.partial of one"
                ) from e
        fn_bytes, prepare_bytes = blobs
        results: list[RewardResult | None] = [None] * len(items)
        start = 0
        while start < len(items):
            pending = list(items[start:])
            for attempt in range(2):
                try:
                    self._load(fn, fn_bytes, prepare, prepare_bytes)
                    self._tx.send(("run", pending))
                    break
                except (BrokenPipeError, EOFError, OSError):
                    # the idle worker died since the last batch (e.g. killed by a signal): start a new one
                    self._kill()
                    self.restarts += 1
                    if attempt:
                        raise
            base = start
            for j in range(len(pending)):
                i = base + j
                if not self._rx.poll(self.timeout_s):
                    results[i] = RewardResult(0.0, False, f"timed out after {self.timeout_s:g} s")
                    self._kill()
                    self.restarts += 1
                    start = i + 1
                    break
                try:
                    kind, k, value = self._rx.recv()
                except (EOFError, OSError):
                    try:  # EOF comes a moment before the exit status can be collected
                        code = self._proc.wait(timeout=5.0)
                    except subprocess.TimeoutExpired:
                        code = None
                    results[i] = RewardResult(0.0, False, f"reward worker died (exit code {code})")
                    self._kill()
                    self.restarts += 1
                    start = i + 1
                    break
                assert k == j, (k, j)
                if kind == "ok":
                    try:
                        r, c = _coerce(value)
                        results[i] = RewardResult(r, c, None)
                    except (TypeError, ValueError) as e:
                        results[i] = RewardResult(0.0, False, str(e))
                else:
                    results[i] = RewardResult(0.0, False, str(value))
            else:
                start = len(items)
        return results  # type: ignore[return-value]
