"""Hand-written kernels of the FP8 backends (Triton), kept beside the readable reference they match.

``quantize.py`` stays the definition; the kernels here produce the same bits faster on a GPU
(``cast_transpose.py``: every FP8 layout of a GEMM operand from one read; ``vllm_quant.py``: the rollout's
per-token and per-group activation quantizers in one launch; ``block_gemm.py``: a 1x128 / 128x128
block-scaled GEMM that takes E5M2 operands, which torch's does not; ``kv_attention.py``: decode attention reading
the FP8 KV cache's codes, equal to the reference within float32 rounding rather than bit for bit). They need Triton and a CUDA
device; on a CPU they run only in Triton's interpreter (``TRITON_INTERPRET=1``), which the tests use to
check them bit for bit against the reference. Everything else (a CPU-only install, an old GPU, no Triton)
keeps the eager/compiled quantizer: :func:`kernel_unavailable` says why, once per reason.

``NEMO_FP8RL_KERNELS``: ``1`` (default) runs them on CUDA tensors; ``0`` turns them off (the torch backend
then runs the compiled quantizer and transposed copies, the path before the kernels existed);
``interpret`` also runs them on CPU tensors, in Triton's interpreter (set ``TRITON_INTERPRET=1`` before
Triton is imported; tests only: the interpreter is far too slow to train with).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Optional

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _import_error() -> Optional[str]:
    try:
        importlib.import_module("nemo_fp8rl.fp8.kernels.cast_transpose")
    except Exception as e:  # noqa: BLE001 - ImportError, or a Triton that fails to initialise
        return f"triton kernels unavailable ({type(e).__name__}: {str(e).strip()[:200]})"
    return None


def kernel_unavailable(device) -> Optional[str]:
    """Why the Triton kernels do not run for tensors on ``device`` (None: they do).

    They run on CUDA devices with Triton installed, and on the CPU only under
    ``NEMO_FP8RL_KERNELS=interpret`` with ``TRITON_INTERPRET=1`` (tests). ``NEMO_FP8RL_KERNELS=0`` turns them off.
    """
    mode = os.environ.get("NEMO_FP8RL_KERNELS", "1")
    if mode == "0":
        return "NEMO_FP8RL_KERNELS=0"
    dev = torch.device(device)
    if dev.type == "cpu" and not (mode == "interpret" and interpreting()):
        return "CPU: the kernels are Triton (GPU); on a CPU the eager/compiled quantizer runs"
    if dev.type not in ("cpu", "cuda"):
        return f"device {dev.type}: no kernels"
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        # Triton launches on the current device: pointers of another GPU would fault there
        return _other_device(dev.index, torch.cuda.current_device())
    return _import_error()


@functools.lru_cache(maxsize=None)
def _other_device(index: int, current: int) -> str:
    why = (f"tensors on cuda:{index} while the current device is cuda:{current} (Triton launches on the current "
           f"device); call torch.cuda.set_device({index}) in the process that owns cuda:{index}, as Megatron's "
           "initialisation does, to run the kernels there")
    logging.getLogger(__name__).warning("FP8 kernels off for these tensors: %s; the eager/compiled quantizer runs", why)
    return why


def ops():
    """The kernel launchers module (``cast_transpose``); call only after :func:`kernel_unavailable` said None."""
    return importlib.import_module("nemo_fp8rl.fp8.kernels.cast_transpose")


def vllm_ops():
    """The rollout's activation quantizers (``vllm_quant``: vLLM's per-token and 1x128-group FP8); call only
    after :func:`kernel_unavailable` said None."""
    return importlib.import_module("nemo_fp8rl.fp8.kernels.vllm_quant")


def block_gemm_ops():
    """The block-scaled FP8 GEMM that takes E5M2 operands (``block_gemm``: ``blockwise`` + ``hybrid``'s dgrad and
    wgrad); call only after :func:`kernel_unavailable` said None."""
    return importlib.import_module("nemo_fp8rl.fp8.kernels.block_gemm")


def kv_ops():
    """Decode attention over an FP8 KV cache (``kv_attention``: the codes dequantized per block inside the
    kernel); call only after :func:`kernel_unavailable` said None."""
    return importlib.import_module("nemo_fp8rl.fp8.kernels.kv_attention")


__all__ = ["block_gemm_ops", "interpreting", "kernel_unavailable", "kv_ops", "ops", "vllm_ops"]
