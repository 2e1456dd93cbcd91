"""Where vLLM 0.32's in-process offline engine needs help to serve an RL trainer, each fix in one place.

- Process settings vLLM reads from the environment (:func:`set_vllm_env`, :func:`set_vllm_fp8_env`):
  the engine core in this process (weights pass by reference), a small CPU KV cache, no thread pinning,
  quiet logs; for FP8 rollout, the kernel choices that compute the scheme and not another one.
- Functions run on vLLM's worker through ``collective_rpc``: finish an in-place reload for a tied LM head
  (:func:`reprocess_tied_lm_head`), close a reload whose stream raised (:func:`abandon_reload`), report
  which FP8 kernels the linears got (:func:`fp8_linear_report`), write and read the FP8 KV-cache scales of
  the attention layers (:func:`apply_kv_scales`, :func:`read_kv_scales`).
- :func:`quiet_expected_reload_warnings`: vLLM's per-sync warning for modules that never receive weights.
- :func:`keep_torch_rng`: undo what building and running vLLM does to torch's process-wide state.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

__all__ = [
    "VLLM_ENV",
    "VLLM_FP8_ENV",
    "abandon_reload",
    "apply_kv_scales",
    "fp8_linear_report",
    "keep_torch_rng",
    "quiet_expected_reload_warnings",
    "read_kv_scales",
    "reprocess_tied_lm_head",
    "set_vllm_env",
    "set_vllm_fp8_env",
]

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: weights pass by reference
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (the CPU backend's default is larger)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin OpenMP threads (the trainer shares the cores)
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM logs to stdout; keep its INFO lines out of the trainer's output
}
"""Process-wide vLLM settings for the in-process offline engine (setdefault: a user's own export wins)."""

VLLM_FP8_ENV = {
    # DeepGEMM's default on Hopper/Blackwell re-quantizes block weights and activation scales to powers of
    # two (UE8M0); vllm_block's scales are amax / 448 in float32.
    "VLLM_USE_DEEP_GEMM_E8M0": "0",
    # FlashInfer's block-scale GEMM takes BF16 activations and quantizes them inside the kernel, a path
    # whose activation rounding we have not matched to vllm_block; DeepGEMM/CUTLASS use vLLM's 1x128 quantizer.
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
}
"""FP8 rollout: kernel choices that would compute something other than the scheme. Required values (a
user's export of another value is refused, not overridden)."""


def set_vllm_env() -> None:
    """Set :data:`VLLM_ENV` where unset; before the first ``import vllm`` of the process (its logger reads
    the level at import). Raises ``ValueError`` when the user exported multiprocessing on."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise ValueError(
            "VLLM_ENABLE_V1_MULTIPROCESSING is set to "
            f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}: the vllm rollout engine streams weights to an "
            "engine in this process; unset it or set it to 0"
        )


def set_vllm_fp8_env(scheme: str) -> None:
    """Set :data:`VLLM_FP8_ENV` for rollout FP8 scheme ``scheme``; ``ValueError`` if the user exported another value."""
    for k, v in VLLM_FP8_ENV.items():
        if os.environ.setdefault(k, v) != v:
            raise ValueError(f"{k}={os.environ[k]!r}: rollout.fp8.scheme={scheme} with "
                             f"rollout.engine=vllm needs {k}={v} ({k} changes the FP8 computation); unset it")


def reprocess_tied_lm_head(worker: Any) -> None:
    """Run on vLLM's worker after a reload of a model with tied embeddings: redo the LM head's post-load step.

    vLLM 0.32's in-place reload processes a layer only when weights for it arrive. A tied LM head
    receives none (its weight *is* the embedding, reloaded through ``embed_tokens``), so its derived kernel
    state keeps the old weights: on CPU the packed GEMM weight that ``dispatch_cpu_unquantized_gemm``
    made at load time (logits then came from the dummy weights). Re-running the quant method's
    ``process_weights_after_loading`` rebuilds it from the (shared, updated) weight.
    """
    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def abandon_reload(worker: Any) -> None:
    """Run on vLLM's worker after a ``reload_weights`` whose iterator raised: close vLLM's layerwise reload.

    vLLM 0.32's reload (``model_loader/reload``) moves every layer to the meta device and buffers the
    tensors of a module until all of them arrived. Raising midway leaves modules half-loaded, with
    buffered tensors and progress counters that the next reload would add to (processing a module early
    from stale parts and dropping the rest as "excessive loading"). ``finalize_layerwise_reload`` is the
    step vLLM runs after a complete load: modules that received nothing get their kernel tensors back
    (old weights), half-loaded ones are processed with what they have, and every counter is reset. The
    weights are then a mix: the engine refuses to generate until a complete sync.
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    finalize_layerwise_reload(runner.get_model(), runner.model_config)


def fp8_linear_report(worker: Any, scheme: str, high_precision_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """Run on vLLM's worker: the FP8 kernels the linears got and what in them departs from ``scheme``.

    Returns ``{"kernels": sorted kernel class names, "problems": ["<module>: <why>", ...]}``. Checked (vLLM
    0.32 names): ``vllm_block`` needs ``Fp8LinearMethod`` with block quantization, no Marlin, a kernel that
    quantizes activations itself with vLLM's ``QuantFP8`` (1x128 groups, float32 scales: not UE8M0);
    ``vllm_w8a8`` needs ``Fp8PerTensorOnlineLinearMethod``, no Marlin, per-token dynamic activations. The
    linears of ``high_precision_layers`` (BF16 edge layers) must be unquantized instead.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.utils import extract_layer_index

    kernels: set[str] = set()
    problems: list[str] = []
    for prefix, mod in worker.model_runner.get_model().named_modules():
        if not isinstance(mod, LinearBase):
            continue
        qm = getattr(mod, "quant_method", None)
        if ".layers." in prefix and extract_layer_index(prefix) in high_precision_layers:
            if type(qm).__name__ != "UnquantizedLinearMethod":
                problems.append(f"{prefix}: a high-precision edge layer got {type(qm).__name__}")
            continue
        kernel = getattr(qm, "fp8_linear", None)
        kernels.add(type(kernel).__name__ if kernel is not None else type(qm).__name__)
        why = None
        if getattr(qm, "use_marlin", False):
            why = "weight-only FP8 (Marlin)"
        elif scheme == "vllm_block":
            quant = getattr(kernel, "quant_fp8", None)
            if type(qm).__name__ != "Fp8LinearMethod" or not getattr(qm, "block_quant", False):
                why = f"{type(qm).__name__} is not block FP8"
            elif not getattr(kernel, "apply_input_quant", True) or quant is None:
                why = (f"{type(kernel).__name__} takes BF16 activations (weight-only FP8, or quantized inside the "
                       "kernel), not vLLM's 1x128 activation quantizer")
            elif getattr(quant, "use_ue8m0", False) or getattr(kernel, "use_deep_gemm_e8m0", False):
                why = f"{type(kernel).__name__} rounds scales to powers of two (UE8M0)"
        elif scheme == "vllm_w8a8":
            from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8DynamicTokenSym

            if type(qm).__name__ != "Fp8PerTensorOnlineLinearMethod":
                why = f"{type(qm).__name__} is not online per-tensor FP8"
            elif getattr(qm, "activation_quant_key", None) != kFp8DynamicTokenSym:
                why = f"activations quantized as {getattr(qm, 'activation_quant_key', None)}, not per token"
        if why:
            problems.append(f"{prefix}: {why}")
    return {"kernels": sorted(kernels), "problems": problems}


def apply_kv_scales(worker: Any, q: list[float], k: list[float], v: list[float]) -> list[int]:
    """Run on vLLM's worker: set every FP8-cache attention layer's scales to ``q[i]``, ``k[i]``, ``v[i]``.

    vLLM 0.32 keeps them in four places per layer: the float32 device buffers ``_q_scale``, ``_k_scale``,
    ``_v_scale`` (read by the CUDA cache writer and FlashAttention's descales), the host floats
    ``_q_scale_float``, ``_k_scale_float``, ``_v_scale_float`` (read by the CPU backend), and the host tensors
    ``_k_scale_cpu``, ``_v_scale_cpu``. All are written. The device buffers are part of the model's weights:
    a reload resets them (to 1.0 without a quantization config) and ``sleep(level=2)`` discards them
    (vLLM issue #25800: FP8 KV after sleep level 2 gives gibberish), so the engine calls this after every
    weight sync and every wake-up. Layers whose cache is not FP8 (``kv_cache_dtype_skip_layers``) keep
    vLLM's 1.0. Returns the layer indices written.
    """
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.utils.torch_utils import is_quantized_kv_cache

    done = []
    for prefix, mod in worker.model_runner.get_model().named_modules():
        if not isinstance(mod, Attention) or not is_quantized_kv_cache(mod.kv_cache_dtype):
            continue
        i = extract_layer_index(prefix)
        for name, values in (("q", q), ("k", k), ("v", v)):
            getattr(mod, f"_{name}_scale").fill_(float(values[i]))
            setattr(mod, f"_{name}_scale_float", float(values[i]))
        mod._k_scale_cpu.fill_(float(k[i]))
        mod._v_scale_cpu.fill_(float(v[i]))
        done.append(i)
    return sorted(done)


def read_kv_scales(worker: Any) -> dict[int, dict[str, Any]]:
    """Run on vLLM's worker: per attention layer, its cache dtype and the scales it holds (device buffers
    and host floats), ``{i: {"kv_cache_dtype": ..., "q": .., "k": .., "v": .., "q_float": .., ...}}``."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    out: dict[int, dict[str, Any]] = {}
    for prefix, mod in worker.model_runner.get_model().named_modules():
        if isinstance(mod, Attention):
            rec: dict[str, Any] = {"kv_cache_dtype": mod.kv_cache_dtype}
            for name in ("q", "k", "v"):
                rec[name] = float(getattr(mod, f"_{name}_scale").float().cpu())
                rec[f"{name}_float"] = float(getattr(mod, f"_{name}_scale_float"))
            out[extract_layer_index(prefix)] = rec
    return out


class _ExpectedReloadWarnings(logging.Filter):
    """Drop vLLM's "<module>: Failed to load weights" warning for modules that never receive synced tensors.

    vLLM 0.32's in-place reload warns, at every sync, for each module with tensors but no checkpoint
    weight in the sync: rotary embeddings (computed buffers) and a tied LM head (its weight is the
    embedding). Expected here, printed every RL step otherwise. Any other module's warning (e.g. after
    a sync that failed midway) still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and record.args:
            name = str(record.args[0])
            return not (name.endswith("RotaryEmbedding") or name == "ParallelLMHead")
        return True


def quiet_expected_reload_warnings() -> None:
    """Install :class:`_ExpectedReloadWarnings` on vLLM's reload logger (once per process)."""
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in reload_log.filters):
        reload_log.addFilter(_ExpectedReloadWarnings())


@contextlib.contextmanager
def keep_torch_rng():
    """Undo what vLLM's in-process engine does to torch's process-wide state.

    Building ``LLM`` seeds torch's global RNG, sets torch's thread count to 1 and replaces
    ``torch.set_num_threads`` by a function that only logs a warning (vLLM's CPU worker expects to own
    pinned threads; with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` nothing is pinned). The trainer's random
    streams and thread count must not depend on the rollout engine: all three are restored.
    """
    state, threads, set_threads = torch.random.get_rng_state(), torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
