"""What machine a run or a benchmark ran on, in the words that decide its speed and its FP8 roundings.

Two runs of the same config on CPUs with and without AVX-512 take different times and may round one FP8
value differently (different GEMM kernels), and a run resumed on another machine continues there. So the
trainer writes :func:`describe_line` into each ``train.log`` it opens, the study records :func:`describe`
per attempt in ``study_run.json``, and the benchmarks print it above their tables.

Reads ``/proc/cpuinfo`` (Linux; elsewhere the platform's own, often empty, CPU name) and torch's version
from the installed package's metadata, so it imports nothing heavy and callers without torch can use it.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["SPEED_FLAGS", "as_line", "cpu_model_and_flags", "describe", "describe_line"]

SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
"""CPU flags that change which kernels torch (oneDNN, FBGEMM, Inductor) runs: the ones worth recording."""


def cpu_model_and_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """``(model name, cpuinfo flags)`` of the first CPU; the platform's name and no flags off Linux.

    The name gets the family and model numbers where cpuinfo has them: a virtual machine often names
    its CPU only "AMD EPYC", and family 25 model 17 (Zen 4) is not family 23 model 49 (Zen 2)."""
    info: dict[str, str] = {}
    flags: set[str] = set()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key and info:  # the blank line after the first CPU's block
                break
            if key == "flags":
                flags = set(value.split())
            elif key in ("model name", "cpu family", "model"):
                info[key] = value.strip()
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in info and "model" in info:
        model += f" (family {info['cpu family']} model {info['model']})"
    return model, flags


def _available_cpus() -> int:
    """CPUs this process may run on (its affinity: what SLURM or taskset gives it), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def describe(torch_threads: int | None = None, gpu: str | None = None) -> dict[str, Any]:
    """The machine as a JSON-ready dict: ``cpu`` (model name), ``cpus`` (available to this process),
    ``cpu_flags`` (those of :data:`SPEED_FLAGS` it has), ``torch`` (installed version), ``python``, and,
    where given, ``torch_threads`` and ``gpu`` (the caller knows them; this module does not import torch)."""
    model, flags = cpu_model_and_flags()
    out: dict[str, Any] = {"cpu": model, "cpus": _available_cpus(),
                           "cpu_flags": [f for f in SPEED_FLAGS if f in flags],
                           "torch": _version("torch"), "python": platform.python_version()}
    if torch_threads is not None:
        out["torch_threads"] = int(torch_threads)
    if gpu is not None:
        out["gpu"] = gpu
    return out


def as_line(d: dict[str, Any]) -> str:
    """A :func:`describe` dict (live, or read back from a record) on one line, e.g. ``AMD EPYC (family 25 model
    17), 2 CPUs, avx2 avx512f avx512_bf16, torch 2.13.0+cpu, 1 torch thread, python 3.11.7``; keys a record
    lacks are left out."""
    parts = [d["cpu"], f"{d['cpus']} CPUs", " ".join(d["cpu_flags"]) or "no avx2/avx512/amx"]
    if d.get("gpu") is not None:
        parts.append(f"GPU {d['gpu']}")
    parts.append(f"torch {d.get('torch') or 'not installed'}")
    if d.get("torch_threads") is not None:
        n = d["torch_threads"]
        parts.append(f"{n} torch thread{'s' if n != 1 else ''}")
    if d.get("python"):
        parts.append(f"python {d['python']}")
    return ", ".join(parts)


def describe_line(torch_threads: int | None = None, gpu: str | None = None) -> str:
    """:func:`describe` on one line (:func:`as_line`)."""
    return as_line(describe(torch_threads, gpu))
