"""Run megatron's pipeline schedules on CPU (gloo) - a test backend; the GPU path is untouched.

megatron-core 0.16's schedules are device-agnostic except for a handful of hard-coded CUDA calls:

- ``schedules.py``: ``torch.zeros([], dtype=torch.int, device="cuda")`` (token counter, 3 places);
- ``p2p_communication.py``: ``device=torch.cuda.current_device()`` for received activations and
  shape messages, and ``torch.cuda.synchronize()`` after batched send/recv.

Everything else (the 1F1B order, send/recv through ``torch.distributed``, which gloo implements) works
on CPU. :func:`cpu_pipeline_schedules` rebinds the global name ``torch`` *inside those two megatron
modules only*, *only while the block runs*, and *only for a model on the CPU*, to
:class:`_CpuTorch`: a view of the real ``torch`` module whose tensor factories map ``device="cuda"``
to the CPU and whose ``cuda.current_device()`` / ``cuda.synchronize()`` are CPU no-ops. Nothing in
torch or elsewhere in megatron is modified, and for a CUDA model the context manager does nothing,
so GPU runs execute megatron's schedule code verbatim.

Why not a ``TorchFunctionMode`` that rewrites devices globally: it would also intercept our own
model code and user code, and ``torch.cuda.current_device()`` raises before any tensor function is
called on a CPU-only build. Why not copy the schedule: we want megatron's own 1F1B order under test.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_FACTORIES = ("zeros", "empty", "ones", "full", "tensor", "arange", "zeros_like", "empty_like", "ones_like")


def _cpu_device(device):
    if device is None:
        return None
    d = torch.device(device) if isinstance(device, (str, int)) and not isinstance(device, bool) else device
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda:
    """``torch.cuda`` as the schedule modules see it on a CPU-only machine."""

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def is_available():
        return False

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """The ``torch`` module, except that tensor factories place ``cuda`` tensors on the CPU."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, device=None, **kwargs):
                return attr(*args, device=_cpu_device(device), **kwargs)

            return factory
        return attr


_lock = threading.RLock()
_depth = 0
_saved: list = []


def _patched_modules():
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    return [schedules, p2p_communication]


@contextlib.contextmanager
def cpu_pipeline_schedules(enabled: bool = True) -> Iterator[None]:
    """Make megatron's ``get_forward_backward_func()`` schedules run on CPU inside the block.

    ``enabled`` is True for a model on the CPU (the actor passes ``model device == cpu``); with
    ``enabled=False`` (a CUDA model) it does nothing. Re-entrant; restores the modules' ``torch`` on
    exit, even on error.
    """
    global _depth
    if not enabled:
        yield
        return
    with _lock:
        if _depth == 0:
            proxy = _CpuTorch()
            _saved.clear()
            for mod in _patched_modules():
                _saved.append((mod, mod.torch))
                mod.torch = proxy
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for mod, orig in _saved:
                    mod.torch = orig
                _saved.clear()


__all__ = ["cpu_pipeline_schedules"]
