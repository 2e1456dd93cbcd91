"""Run megatron-core's CUDA-only code paths on CPU (gloo) - a test backend; the GPU path is untouched.

This is the one module of the project that bends megatron-core 0.16 to run on a CPU. megatron's
pipeline schedules, ``DistributedDataParallel``, distributed optimizer and ``dist_checkpointing`` are
device-agnostic except for a handful of hard-coded CUDA calls:

- tensor factories with ``device="cuda"`` or ``device=torch.cuda.current_device()``;
- ``torch.cuda.synchronize()``, ``torch.cuda.current_stream()`` / ``default_stream()`` /
  ``stream(...)`` / ``Stream(...)`` / ``Event(...)``, ``torch.cuda.empty_cache()``;
- dtype checks by type *name*: ``param.type() == 'torch.cuda.FloatTensor'`` (the distributed
  optimizer's parameter sorting and ``clip_grads``), which a CPU tensor answers with
  ``'torch.FloatTensor'``.

:func:`cpu_megatron` rebinds the global name ``torch`` *inside the megatron modules of the requested
scopes only* (:data:`SCOPES`), *only while the block runs*, to :class:`_CpuTorch`: a view of the real
``torch`` module whose tensor factories map ``device="cuda"`` to the CPU and whose ``torch.cuda`` is
:class:`_CpuCuda` (``current_device()`` is the CPU, streams/events are no-ops). The ``optimizer`` and
``checkpoint`` scopes also make ``Tensor.type()`` (no argument) answer ``'torch.cuda.<X>Tensor'`` for a
CPU tensor for the duration: megatron accepts a float32 CPU parameter as the float32 CUDA parameter
its code checks for. Nothing else in torch or megatron changes. The shim is inert for a CUDA model
(``device`` is not the CPU) and refuses to activate in a process whose default process group is NCCL
or that has put a model on CUDA through it (``RuntimeError``): a CUDA run executes megatron's code
verbatim. docs/megatron.md lists every patched name.

Why not a ``TorchFunctionMode`` that rewrites devices globally: it would also intercept our own
model code and user code, and ``torch.cuda.current_device()`` raises before any tensor function is
called on a CPU-only build. Why not copy megatron's code: we want megatron's own 1F1B order, grad
buckets, optimizer sharding and checkpoint layout under test.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Iterator

import torch

_FACTORIES = ("zeros", "empty", "ones", "full", "tensor", "arange", "zeros_like", "empty_like", "ones_like",
              "randn", "rand")

# Scope -> megatron modules whose global ``torch`` is rebound while the scope is active.
SCOPES: dict[str, tuple[str, ...]] = {
    # get_forward_backward_func(): token counters and p2p shape/activation buffers on "cuda".
    "schedules": (
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.pipeline_parallel.p2p_communication",
    ),
    # DistributedDataParallel + get_megatron_optimizer(use_distributed_optimizer=True): grad/param
    # buffers on current_device(), communication streams, found-inf/overflow/scale tensors, the grad
    # norm and clipping (apex-free fallbacks in megatron.core.utils).
    "optimizer": (
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.distributed.distributed_data_parallel",
        "megatron.core.distributed.finalize_model_grads",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.utils",
    ),
    # dist_checkpointing save/load: verification flags and failure all-reduces on current_device(),
    # torch.cuda.synchronize() before writing. The asynchronous save (trainer.async_save) uses the same
    # names: preload_tensors' and TemporalAsyncCaller.schedule_async_call's torch.cuda.synchronize()
    # before the writer is forked, and the int tensors on torch.cuda.current_device() that
    # AsyncCallsQueue all-reduces (is a writer alive; the finalized call index) and that the finalize
    # broadcasts (did any rank's write fail). The forked writer itself makes no CUDA call.
    "checkpoint": (
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        "megatron.core.dist_checkpointing.strategies.async_utils",
        "megatron.core.dist_checkpointing.strategies.fully_parallel",
        "megatron.core.dist_checkpointing.exchange_utils",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.optimizer",
        "megatron.core.utils",
    ),
}
# Scopes whose megatron code checks dtypes through ``Tensor.type()`` names.
_TYPE_NAME_SCOPES = ("optimizer", "checkpoint")


def _cpu_device(device):
    if device is None:
        return None
    d = torch.device(device) if isinstance(device, (str, int)) and not isinstance(device, bool) else device
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return device


class _NoStream:
    """A CUDA stream/event stand-in: every method is a no-op; usable as a context manager."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        return lambda *a, **k: None


class _CpuCuda:
    """``torch.cuda`` as the patched megatron modules see it while a CPU model runs."""

    Stream = _NoStream
    Event = _NoStream

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def current_stream(device=None):
        return _NoStream()

    @staticmethod
    def default_stream(device=None):
        return _NoStream()

    @staticmethod
    def stream(s=None):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """The ``torch`` module, except that tensor factories place ``cuda`` tensors on the CPU."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, device=None, **kwargs):
                kwargs.pop("pin_memory", None)
                return attr(*args, device=_cpu_device(device), **kwargs)

            return factory
        return attr


_real_tensor_type = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()`` that names a CPU tensor's type as megatron's CUDA checks expect
    (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``); conversions (``dtype`` given) and CUDA
    tensors are answered by torch unchanged."""
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _real_tensor_type(self)
        return name.replace("torch.", "torch.cuda.", 1)
    return _real_tensor_type(self, dtype, non_blocking, **kwargs)


_lock = threading.RLock()
_module_depth: dict[str, int] = {}
_module_saved: dict[str, object] = {}
_type_depth = 0


def _refuse_on_cuda_run() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        raise RuntimeError(
            "nemo_fp8rl.models.cpu_schedules.cpu_megatron was asked to patch megatron in a process whose "
            "default process group is NCCL: the CPU shims must never run on a CUDA run (a CPU model on a "
            "GPU machine needs parallel.backend=gloo)"
        )


def _enter(scopes: tuple[str, ...]) -> None:
    global _type_depth
    proxy = None
    for scope in scopes:
        for name in SCOPES[scope]:
            if _module_depth.get(name, 0) == 0:
                mod = importlib.import_module(name)
                _module_saved[name] = mod.torch
                proxy = proxy or _CpuTorch()
                mod.torch = proxy
            _module_depth[name] = _module_depth.get(name, 0) + 1
    if any(s in _TYPE_NAME_SCOPES for s in scopes):
        if _type_depth == 0:
            torch.Tensor.type = _cuda_named_type
        _type_depth += 1


def _exit(scopes: tuple[str, ...]) -> None:
    global _type_depth
    if any(s in _TYPE_NAME_SCOPES for s in scopes):
        _type_depth -= 1
        if _type_depth == 0:
            torch.Tensor.type = _real_tensor_type
    for scope in reversed(scopes):
        for name in SCOPES[scope]:
            _module_depth[name] -= 1
            if _module_depth[name] == 0:
                importlib.import_module(name).torch = _module_saved.pop(name)
                del _module_depth[name]


@contextlib.contextmanager
def cpu_megatron(*scopes: str, device: "torch.device | str") -> Iterator[None]:
    """Make megatron's code of ``scopes`` (keys of :data:`SCOPES`) run on CPU inside the block.

    ``device`` is the model's device: the CPU activates the shims; any other device makes the block
    run megatron's code untouched. Re-entrant (nested and overlapping scopes share one patch);
    restores every patched name on exit, even on error.

    Raises:
        KeyError: an unknown scope.
        RuntimeError: activation in a process whose default process group is NCCL.
    """
    for s in scopes:
        if s not in SCOPES:
            raise KeyError(f"unknown cpu_megatron scope {s!r}; valid: {sorted(SCOPES)}")
    if torch.device(device).type != "cpu":
        yield
        return
    _refuse_on_cuda_run()
    with _lock:
        _enter(scopes)
    try:
        yield
    finally:
        with _lock:
            _exit(scopes)


@contextlib.contextmanager
def cpu_pipeline_schedules(enabled: bool = True) -> Iterator[None]:
    """``cpu_megatron("schedules")`` for a CPU model (``enabled``) or nothing (a CUDA model)."""
    with cpu_megatron("schedules", device="cpu" if enabled else "meta"):
        yield


def patched_names() -> dict[str, list[str]]:
    """Every name the shims rebind, by scope (what docs/megatron.md lists)."""
    out = {s: [f"{m}.torch" for m in mods] for s, mods in SCOPES.items()}
    for s in _TYPE_NAME_SCOPES:
        out[s].append("torch.Tensor.type (no-argument call on a CPU tensor)")
    return out


__all__ = ["cpu_megatron", "cpu_pipeline_schedules", "patched_names", "SCOPES"]
