"""Fused FP8 quantization: each operand quantized in one compiled kernel instead of many eager passes.

Why: the eager quantizer (``quantize.py``) is a chain of torch ops (``float``, ``abs``, ``amax``, ``* s``,
``clamp``, ``to(fp8)``, ``float``, ``* 1/s``), each one a full pass over the tensor: about 35-40 bytes
moved per element against 5 for one ``read fp32, write fp8`` cast. On a GPU that traffic costs more than
the FP8 GEMM saves; on a CPU it is the whole overhead of the emulation. ``torch.compile`` (Inductor:
Triton on GPU, C++/OpenMP on CPU; torchao's route) turns the same function into two loops: the amax
reduction, then one pointwise pass that scales, saturates, casts (and, for the emulation, reads back).

Bit-equality: the compiled function *is* the eager function (the same Python, traced), every op is
elementwise or an exact max reduction, so the result is the same bits; ``tests/fp8/test_fused.py``
checks every recipe x role x format, edge cases included.

GPU numerics (read from Inductor's sources, torch 2.13: ``config.eager_numerics`` and
``codegen/triton.py``): by default Triton lowers a float32 ``x / y`` to the approximate ``div.full`` (eager
CUDA divides exactly, round-to-nearest) and flushes denormals to zero. Either would break bit-equality on a
GPU where the CPU tests cannot see it: the scale rule ``s = M / amax``, the read-back's ``1 / s`` and the
dequantized values of tiny-amax groups. Every graph therefore compiles with
``eager_numerics.division_rounding`` and ``eager_numerics.disable_ftz`` on (:func:`compile_options`, which
keeps the ones the running torch knows; C++ on the CPU already divides exactly and keeps denormals).

Shapes: every dim of the tensor arguments is marked dynamic (``maybe_mark_dynamic``) before the first
compile, so a new token count does not recompile, while the configuration's integers (block sizes,
margin) stay compile-time constants (``dynamic=True`` would make them symbols too, and the 128x128 tile
loops then run ~2x slower than eager). Each static
configuration (format, granularity, dim, pow2, output kind ...) gets its own copy of the traced function
(:func:`_fresh_function`), so the configurations of a run never share dynamo's per-function recompile
limit and silently drop to eager.

Mode (``fp8.compile``, :func:`set_compile_mode`):

* ``auto`` (default): compiled on a GPU; on a CPU compiled for the operands of a linear whose weight
  has at least :data:`AUTO_MIN_NUMEL` elements (a real model's layer: SmolLM2-135M's smallest, its k/v
  projections, are 576 x 192 = 110,592; the tiny demo model's largest is 128 x 768 = 98,304), and for other
  tensors of at least that size. Below it the eager ops are dispatch-bound, not
  bandwidth-bound, and each configuration's first compile (1-5 s of C++ per kernel) would cost the tiny
  CPU models of the demo and the tests more than it saves. Eager where compile is unavailable.
* ``true``: compiled for every tensor (falls back to eager, with one warning, if compile fails).
* ``false``: always eager.

Compile unavailable (no C++ compiler, an unsupported Python, a failed Inductor build): the first failing
call logs one warning naming the cause, and every later call runs eager. Inductor caches compiled
kernels on disk (``TORCHINDUCTOR_CACHE_DIR``), so a second process pays tracing only.
This module imports only torch and the standard library.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from typing import Callable, Dict, Hashable, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "true", "false")

AUTO_MIN_NUMEL = 100_000
"""``auto`` on a CPU compiles a linear's operands when its weight has at least this many elements, and a lone
tensor of that size. Was 2^18 until 2026-12-04: that left SmolLM2-135M's k/v projections (576 x 192) eager,
and its blockwise forward+backward cost 1.30x the unconverted model under ``auto`` against 1.14x compiled
(benchmarks/bench_fp8_model.py, one thread). Compiled functions are keyed by configuration, not shape, so
the smaller layers add no compile of their own."""

_state = {"mode": os.environ.get("NEMO_FP8RL_COMPILE", "auto").lower(), "broken": None}
_cache: Dict[Hashable, Callable] = {}
_lock = threading.Lock()


def set_compile_mode(mode) -> str:
    """Set ``fp8.compile`` for this process: ``auto``, ``true`` or ``false`` (bools accepted); returns it."""
    m = {True: "true", False: "false"}.get(mode, mode)
    m = str(m).lower()
    if m not in COMPILE_MODES:
        raise ValueError(f"fp8.compile={mode!r}; valid: {list(COMPILE_MODES)} (auto compiles on GPU and for large CPU tensors)")
    _state["mode"] = m
    return m


def compile_mode() -> str:
    """The ``fp8.compile`` mode in force (``auto``, ``true`` or ``false``)."""
    return _state["mode"]


class compile_mode_set:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``with compile_mode_set("false"): ...`` runs the block under another mode and restores the old one."""

    def __init__(self, mode) -> None:
        self.mode = mode

    def __enter__(self):
        self.saved = _state["mode"]
        set_compile_mode(self.mode)
        return self

    def __exit__(self, *exc) -> None:
        _state["mode"] = self.saved


def compile_unavailable() -> Optional[str]:
    """Why compiled quantization is off for this process (None while it works or was never tried)."""
    return _state["broken"]


def wants_compile(x: torch.Tensor, size_hint: Optional[int] = None) -> bool:
    """Whether a quantization of ``x`` runs compiled under the current mode (module docstring).

    ``size_hint``: the element count ``auto`` judges on a CPU (a linear passes its weight's, so all three
    operands of one layer decide alike); default ``x.numel()``.
    """
    mode = _state["mode"]
    if mode == "false" or _state["broken"] is not None:
        return False
    if _get_current_dispatch_mode() is not None:
        # a TorchDispatchMode (FlopCounterMode, a byte counter, fake tensors) sees the eager ops; dynamo
        # skips such frames, and that error must not read as "compile unavailable" for the whole process
        return False
    if mode == "true" or x.is_cuda:
        return True
    return (x.numel() if size_hint is None else size_hint) >= AUTO_MIN_NUMEL


def _fresh_function(fn: Callable, tag: str) -> Callable:
    """A copy of ``fn`` with its own code object, so dynamo keeps a separate cache (and recompile limit) for it."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


EXACT_NUMERICS = ("eager_numerics.division_rounding", "eager_numerics.disable_ftz")
"""Inductor options every quantizer graph compiles with (module docstring, "GPU numerics")."""


def compile_options() -> Dict[str, bool]:
    """The options of :data:`EXACT_NUMERICS` this torch's Inductor has, all set to True (``torch.compile``
    rejects an unknown option, and older releases lack some of them)."""
    try:
        from torch._inductor import config as inductor_config
    except ImportError:  # pragma: no cover - torch without Inductor: compile fails and run() goes eager
        return {}
    known = inductor_config.get_config_copy()
    return {k: True for k in EXACT_NUMERICS if k in known}


def run(key: Hashable, make: Callable[[], Callable], *args, size_hint: Optional[int] = None):
    """``make()(*args)``, compiled once per ``key`` when :func:`wants_compile` says so, else eager.

    ``make`` returns the function of the tensors ``args`` alone (its static configuration closed over);
    ``key`` names that configuration. The first tensor argument (and ``size_hint``) decides the mode. If
    compiling or running the compiled function raises, the error is logged once and this process runs eager.
    """
    fn = make()
    if not wants_compile(args[0], size_hint):
        return fn(*args)
    compiled = _cache.get(key)
    if compiled is None:
        with _lock:
            compiled = _cache.get(key)
            if compiled is None:
                compiled = torch.compile(_fresh_function(fn, f"k{len(_cache)}"), dynamic=None, fullgraph=True,
                                         options=compile_options())
                _cache[key] = compiled
    for a in args:  # every tensor dim symbolic from the first compile; the closed-over ints (block sizes,
        for i in range(a.dim()):  # margin) stay constants, which dynamic=True would turn into symbols too
            torch._dynamo.maybe_mark_dynamic(a, i)
    try:
        return compiled(*args)
    except Exception as err:  # noqa: BLE001 - any compile failure: fall back, say so once
        _state["broken"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        logger.warning(
            "fp8.compile: torch.compile of the FP8 quantizer failed (%s); quantizing eagerly from now on "
            "(correct, slower). Set fp8.compile=false to silence this.", _state["broken"],
        )
        return fn(*args)


def reset() -> None:
    """Forget compiled functions and a recorded failure (tests)."""
    with _lock:
        _cache.clear()
        _state["broken"] = None


__all__ = [
    "AUTO_MIN_NUMEL", "COMPILE_MODES", "compile_mode", "compile_mode_set", "compile_unavailable", "reset", "run",
    "set_compile_mode", "wants_compile",
]
