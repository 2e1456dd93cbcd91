"""Memory plan: per-GPU bytes of a training config, by component, before a job waits in a queue.

``nemo-fp8rl-plan`` (and the launcher's pre-submit check) answers "does ``qwen3_32b`` at TP8 PP2
with ``fp8=blockwise`` and 4k-token sequences fit an 80 GB GPU?" from the config alone. Every number is
computed here from the model shape (``ModelConfig``'s derived sizes: ``head_dim``, ``q_width``,
``kv_width``, ``padded_vocab(tp)``), the layout and the recipe; nothing is looked up. This module is the
byte model; :mod:`nemo_fp8rl.launcher.memory_report` prints a plan and
:mod:`nemo_fp8rl.launcher.memory_cli` is the ``nemo-fp8rl-plan`` command.

What one GPU holds while it trains (the most loaded pipeline stage; each formula is in the docstring of
the function that computes it):

- ``weights``: this rank's parameters, the TP shard of its pipeline stage (:func:`stage_parameters`);
- ``weight copies``: FP8 copies (and transposes) of the linear weights, or their BF16 casts, kept for
  the backward (:func:`weight_copy_bytes`);
- ``grads``: float32 gradients of every parameter; ``optimizer``: Adam moments (+ float32 main
  parameters), replicated or sharded over DP (:func:`state_bytes`);
- ``activations``: tensors saved for the backward of the microbatches in flight
  (:func:`layer_activation_bytes`, :func:`stage_activation_bytes`), and on the last stage the float32
  log-softmax tensors and their gradient (:func:`logits_bytes`);
- ``headroom``: CUDA context, NCCL buffers, allocator fragmentation (an assumed share, :class:`PlanOptions`);
- ``rollout engine`` (optional): a colocated GPU inference engine's weights and the KV cache of the
  rank's rollout batch (:func:`rollout_plan`).

Two optimizer paths are planned side by side:

- ``adamw`` (``optim.distributed=false``, the default on CPU): ``torch.optim.AdamW`` on float32 parameters, every
  data-parallel rank holds all of it: 4 (weights) + 4 (grads) + 8 (two moments) = 16 bytes/parameter,
  Megatron's "fp32 parameters, fp32 gradients, non-distributed" row [1];
- ``distributed`` (Megatron's ``DistributedOptimizer``, ``optim.distributed=true``, the default on GPU): BF16 parameters, float32 main grads,
  float32 main parameters and Adam moments sharded over DP: 2 + 4 + 12/DP bytes/parameter, the
  "bf16 parameters, fp32 gradients" row of [1] (Megatron-LM's ``report_theoretical_memory`` [2] uses
  the same 18 and 6 + 12/DP).

Two device profiles: ``gpu`` (the Transformer Engine layer spec, BF16 activations, the FP8 recipe in
TE) and ``cpu`` (our emulated spec in float32). The ``cpu`` profile is what the tests check against
megatron models built and trained on this machine (saved-for-backward tensors counted exactly, peak
heap measured); the ``gpu`` profile is the same accounting with TE's dtypes and cannot be measured
without a GPU (docs/megatron.md, "Memory plan", says which parts are modelled and why).

Sources: [1] Megatron Core user guide, "Distributed Optimizer" (bytes/parameter table),
https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html;
[2] Megatron-LM ``megatron/training/theoretical_memory_usage.py`` (weights/optimizer of the most loaded
shard, activations from [3] Table 2, in-flight microbatches of 1F1B); [3] Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198 (per-layer
activation bytes: 34 s b h / t with sequence parallelism, with dropout masks and a 4h GeLU MLP).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

GIB = 1024**3

#: Total memory of a GPU as ``nvidia-smi`` reports it (MiB): H100 SXM 80 GB HBM3, H200 141 GB HBM3e.
GPUS_MIB: dict[str, int] = {"h100": 81559, "h200": 143771}
#: Recipes Transformer Engine runs (``rowwise`` is emulation-only: it has no TE recipe, so no GPU plan).
GPU_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
CPU_RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
OPTIMIZERS = ("adamw", "distributed")
DEVICES = ("gpu", "cpu")


class PlanError(ValueError):
    """Input the plan cannot use; the message names the key or option and the fix."""


def _require_vocab(model) -> None:
    """Raises:
        PlanError: ``model.vocab_size`` is unset (the trainer takes it from the task's tokenizer; the plan
            needs it: set ``model.vocab_size`` or let the CLI build the task's tokenizer,
            :func:`nemo_fp8rl.launcher.memory_cli.resolve_for_plan`).
    """
    if model.vocab_size is None:
        raise PlanError("model.vocab_size is null (the trainer takes it from the task's tokenizer); set "
                        "model.vocab_size=<tokenizer size> for the plan")


def _norm_params(model) -> int:
    """Parameters per normalised channel c: 1 (RMSNorm weight) or 2 (LayerNorm weight + bias)."""
    return 1 if model.normalization == "RMSNorm" else 2


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds (element counts, this TP shard of one pipeline stage)."""

    total: int
    fp8_linear: int  # weights of linears that run in FP8 (the recipe's layers)
    hp_linear: int  # weights of transformer linears kept high precision (first_last_layers_bf16)
    head: int  # LM head weight on this rank (0 if none, or tied with PP=1: the embedding is the head)


def stage_parameters(model, tp: int, pp: int, stage: int, *, fp8_layers: Optional[set] = None) -> StageParams:
    """Elements of the parameters ``model`` (a ``ModelConfig``) has on one rank of pipeline stage ``stage``
    (0-based).

    Sizes are the config's derived ones (h hidden, n_q d = ``q_width``, n_kv d = ``kv_width``, f FFN,
    V = ``padded_vocab(t)``, L layers). Per transformer layer, with t = TP (megatron's sharding; norms and row-parallel biases replicated)::

        linear  = (h (n_q + 2 n_kv) d  +  n_q d h  +  h f g  +  f h) / t          g = 2 (SwiGLU) or 1
        other   = 2 h c  [+ (n_q + 2 n_kv) d / t  QKV bias]  [+ 2 d  QK norms]
                  [+ h + f g / t + h  linear biases]                               c = 1 RMSNorm, 2 LayerNorm

    Stage s holds layers [s L/PP, (s+1) L/PP); the first stage adds the embedding V h / t, the last the
    final norm h c and the LM head V h / t (untied, or a tied head's copy when PP > 1; tied with PP = 1
    the embedding is the head). ``fp8_layers``: global indices of layers whose linears run FP8 (None =
    all), the rest count as high-precision linears.
    """
    h, t, f, c = model.hidden_size, tp, model.ffn_hidden_size, _norm_params(model)
    q, kv, g = model.q_width, model.kv_width, (2 if model.gated_mlp else 1)
    vocab = model.padded_vocab(tp)
    linear = (h * (q + 2 * kv) + q * h + h * f * g + f * h) // t
    other = 2 * h * c
    if model.qkv_bias:
        other += (q + 2 * kv) // t
    if model.qk_layernorm:
        other += 2 * model.head_dim * c
    if model.add_bias_linear:
        other += h + f * g // t + h
    per_stage = model.num_layers // pp
    first = range(stage * per_stage, (stage + 1) * per_stage)
    n_fp8 = sum(1 for i in first if fp8_layers is None or i in fp8_layers)
    total = per_stage * (linear + other)
    head = 0
    if stage == 0:
        total += vocab * h // t
    if stage == pp - 1:
        total += h * c
        if not model.tied_embeddings or pp > 1:
            head = vocab * h // t
            total += head
    return StageParams(total=total, fp8_linear=n_fp8 * linear, hp_linear=(per_stage - n_fp8) * linear, head=head)


def state_bytes(params: int, optimizer: str, dp: int, device: str) -> dict[str, int]:
    """Weights, gradients and optimizer state of ``params`` elements, in bytes (Megatron's table [1]).

    ``adamw`` (``optim.distributed=false``: float32 parameters, ``torch.optim.AdamW``, state on every DP rank)::

        weights 4 P,  grads 4 P,  optimizer 8 P  (exp_avg + exp_avg_sq, float32)        = 16 P

    ``distributed`` (megatron ``DistributedOptimizer`` + DDP with float32 main grads) on GPU::

        weights 2 P (BF16),  grads 4 P (float32 grad buffer),
        optimizer 12 P / DP (float32 main parameters + two moments, sharded)           = 6 P + 12 P / DP

    and on CPU, where the float32 parameters are the main parameters ([1]'s fp32 row)::

        weights 4 P,  grads 4 P,  optimizer 8 P / DP                                    = 8 P + 8 P / DP
    """
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer {optimizer!r}; choose one of {list(OPTIMIZERS)}")
    if optimizer == "adamw":
        return {"weights": 4 * params, "grads": 4 * params, "optimizer": 8 * params}
    if device == "cpu":  # float32 parameters are the main parameters: only the moments are sharded
        return {"weights": 4 * params, "grads": 4 * params, "optimizer": math.ceil(8 * params / dp)}
    return {"weights": 2 * params, "grads": 4 * params, "optimizer": math.ceil(12 * params / dp)}


def fp8_copy_bytes_per_weight(scaling: str) -> float:
    """Bytes per weight element of Transformer Engine's FP8 copies of a weight kept for the backward.

    A Hopper FP8 GEMM reads both operands K-major, so TE keeps a row-wise copy (forward ``x W^T``) and a
    column-wise (transposed) copy (``dgrad = dy W``) of every FP8 weight, each 1 byte per element plus
    its scales::

        delayed, tensorwise   2 x (1 + 4 / numel)       one float32 scale per tensor (~2)
        blockwise             2 x (1 + 4 / 128^2)       float32 scale per 128 x 128 tile
        mxfp8                 2 x (1 + 1 / 32)          E8M0 byte per 1 x 32 block, per direction
    """
    if scaling in ("delayed", "tensorwise"):
        return 2.0
    if scaling == "blockwise":
        return 2.0 * (1.0 + 4.0 / (128 * 128))
    if scaling == "mxfp8":
        return 2.0 * (1.0 + 1.0 / 32)
    raise PlanError(f"fp8.recipe with scaling {scaling!r} has no Transformer Engine recipe, so no GPU plan; "
                    f"choose one of {list(GPU_RECIPES)} or plan with --device cpu")


def weight_copy_bytes(sp: StageParams, scaling: Optional[str], optimizer: str, device: str, in_flight: int = 1) -> int:
    """Copies of weights that live from a layer's forward to its backward.

    GPU: an FP8 linear keeps its FP8 copies (:func:`fp8_copy_bytes_per_weight`) in TE's weight cache,
    one per module (megatron marks the first microbatch of a step, later ones reuse the cache). A BF16
    GEMM on float32 parameters (``adamw`` path: autocast) saves a 2-byte BF16 cast of its weight per
    forward, so one per microbatch in flight (``in_flight``, see :func:`stage_activation_bytes`); that
    covers the BF16 arm, layers kept high precision and the LM head (megatron's plain linear, always
    BF16). With BF16 parameters (``distributed``) a BF16 GEMM uses the parameter itself::

        copies = n_fp8 b_fp8(recipe)  +  [adamw] 2 k (n_hp + n_head)          k = microbatches in flight

    CPU (emulated spec): ``delayed``, ``tensorwise`` and ``blockwise`` save the float32 fake-quantized
    weight for the backward (4 bytes per element, per microbatch in flight); ``rowwise``/``mxfp8``
    requantize from the parameter along the other dimension, so they keep none.
    """
    if device == "cpu":
        return 4 * in_flight * sp.fp8_linear if scaling in ("delayed", "tensorwise", "blockwise") else 0
    fp8 = 0 if scaling is None else round(sp.fp8_linear * fp8_copy_bytes_per_weight(scaling))
    hp = sp.hp_linear + (sp.fp8_linear if scaling is None else 0) + sp.head
    return fp8 + (2 * in_flight * hp if optimizer == "adamw" else 0)


def layer_activation_bytes(model, tokens: int, tp: int, *, scaling: Optional[str], device: str,
                           sequence_parallel: bool, fp8_layer: bool = True) -> int:
    """Bytes one transformer layer saves for its backward, for ``tokens`` = micro batch x sequence tokens.

    GPU (TE spec, BF16 activations; t = TP; with sequence parallelism every term is divided by t,
    without it the norm inputs/outputs (the h terms) are whole on every TP rank). Per token::

        norms      2 x (2h input + a h normalised output saved by the next linear)
        attention  2 (n_q + 2 n_kv) d  (q, k, v after RoPE; flash attention keeps no s x s scores)
                   + 2 n_q d  output  + a' n_q d  (the projection's own FP8 copy of its input)
        QK norm    [2 (n_q + n_kv) d  inputs of the per-head norms]
        MLP        2 g f  fc1 output  [+ 2 f  SiLU output, kept by the gating product]  + a f  fc2 input
                   (g = 2 and the SiLU term for SwiGLU; GeLU's output is the fc2 input itself)

    with a = 2 for BF16 GEMM inputs and 1 for FP8 (TE saves the quantized input; + scales: 1/32 for
    mxfp8, 4/128 for blockwise), a' = 0 for BF16 (the attention output is the same tensor). For a
    GeLU MLP (g = 1, f = 4h) with multi-head attention and BF16 this is 32 h per token, [3]'s 34 h
    (Table 2, sequence parallel + selective recompute) without its two 1-byte dropout masks.

    CPU (emulated spec, float32, no sequence parallelism; measured structure of the saved tensors)::

        4 x [ 3 h per norm (input, x / rms, output) x 2
              + attention / t: GQA 4 n_q d (q after RoPE, k and v repeated to the query heads, output);
                MHA 3 (n_q + n_kv) d (q, k after RoPE, the fused QKV output that v is a view of, output)
              + MLP / t: SwiGLU 2 f + 3 f (fc1 output, then the activation's input copy, its output
                and the gated product), GeLU 2 f (fc1 output, activation output)
              + n_q / t (log-sum-exp)  + 2 (1 / rms of the two norms)
              + QK norm / t: GQA 2 n_q d + n_kv d + (n_q + 2 n_kv) d (copies of the norm inputs, x / rms,
                the fused QKV output); MHA (n_q + n_kv) d (x / rms; the inputs are views of the fused
                QKV output, already counted); + n_q + n_kv (1 / rms) ]
        + n_q d / t (the projection's fake-quantized input) for per-tensor FP8 (delayed, tensorwise)
        + RoPE: 4 tensors of s x d per layer (independent of the micro batch; see
          :func:`stage_activation_bytes`).
    """
    h, t, f = model.hidden_size, tp, model.ffn_hidden_size
    q, kv, g = model.q_width, model.kv_width, (2 if model.gated_mlp else 1)
    heads, groups = model.num_attention_heads, model.num_kv_heads
    if device == "cpu":
        gqa = heads > groups
        attn = 4 * q if gqa else 3 * q + 3 * kv
        mlp = (g + 3) * f if model.gated_mlp else 2 * f
        per = 6 * h + (attn + mlp + heads) / t + 2
        if model.qk_layernorm:
            # GQA: copies of the norm inputs, x / rms and the fused QKV output; MHA: the inputs are views
            # of the fused QKV output (already counted), so only x / rms of q and k
            per += ((2 * q + kv + q + 2 * kv) if gqa else (q + kv)) / t + (heads + groups) / t
        if fp8_layer and scaling in ("delayed", "tensorwise"):
            per += q / t
        return round(4 * per * tokens)
    fp8 = fp8_layer and scaling is not None
    a = 1.0 if fp8 else 2.0
    if fp8 and scaling == "mxfp8":
        a += 1.0 / 32
    elif fp8 and scaling == "blockwise":
        a += 4.0 / 128
    norm_terms = 2 * (2 * h + a * h)
    sharded = (2 * (q + 2 * kv) + 2 * q + (a if fp8 else 0.0) * q
               + (2 * (q + kv) if model.qk_layernorm else 0) + 2 * g * f + (2 * f if model.gated_mlp else 0) + a * f)
    per = (norm_terms + sharded) / t if sequence_parallel else norm_terms + sharded / t
    return round(per * tokens)


def logits_bytes(model, tokens: int, tp: int, device: str) -> int:
    """Last stage: the vocab-parallel log-softmax of one micro batch at its backward peak.

    :func:`~nemo_fp8rl.models.logprobs.vocab_parallel_logprobs` runs in float32 and keeps p = softmax(z)
    and the masked logits z for the backward (the entropy gradient needs both: 2 x 4 bytes per vocab
    entry of this TP rank). Its backward holds the gradient dz and, while it adds the entropy term
    g_H p (E_p[z] - z), two more [tokens, V / t] float32 temporaries (3 x 4 bytes); on GPU the gradient
    enters the BF16 LM head as a 2-byte cast::

        logits = tokens x V / t x (2 x 4 saved + 3 x 4 backward [+ 2 on GPU])        V = model.padded_vocab(t)
    """
    per = 8 + 12 + (2 if device == "gpu" else 0)
    return per * tokens * model.padded_vocab(tp) // tp


@dataclass(frozen=True)
class PlanOptions:
    """What the plan assumes besides the training config."""

    dp: int = 1
    """Data-parallel size (world / (TP x PP))."""
    device: str = "gpu"
    """gpu (TE spec, capacity check) | cpu (emulated spec; host memory, no capacity check)."""
    gpu: str = "h100"
    """GPU name (:data:`GPUS_MIB`); ignored when gpu_memory_gib is set."""
    gpu_memory_gib: Optional[float] = None
    """Memory of one GPU in GiB (overrides ``gpu``)."""
    headroom: float = 0.10
    """Share of the GPU kept free for the CUDA context, NCCL buffers and allocator fragmentation. An
    assumption, not a measurement: raise it if a run that the plan passes runs out of memory."""
    rollout_share: Optional[float] = None
    """Share of the GPU a colocated GPU rollout engine reserves (vLLM's ``gpu_memory_utilization``);
    None = the config's engine: ``vllm`` reserves ``rollout.gpu_memory_utilization``, ``torch`` runs on the
    host (no GPU memory)."""

    @property
    def capacity_bytes(self) -> Optional[int]:
        if self.device == "cpu":
            return None
        if self.gpu_memory_gib is not None:
            return int(self.gpu_memory_gib * GIB)
        return GPUS_MIB[self.gpu] * 1024**2

    @property
    def gpu_label(self) -> str:
        if self.gpu_memory_gib is not None:
            return f"{self.gpu_memory_gib:g} GiB GPU"
        return f"{self.gpu} ({GPUS_MIB[self.gpu] / 1024:.1f} GiB)"

    def check(self) -> None:
        if self.device not in DEVICES:
            raise PlanError(f"--device {self.device!r}; choose one of {list(DEVICES)}")
        if self.gpu_memory_gib is None and self.gpu not in GPUS_MIB:
            raise PlanError(f"--gpu {self.gpu!r} is not known; choose one of {sorted(GPUS_MIB)} or give "
                            "--gpu-memory-gib <GiB>")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise PlanError(f"--gpu-memory-gib {self.gpu_memory_gib} must be > 0")
        if not 0.0 <= self.headroom < 1.0:
            raise PlanError(f"--headroom {self.headroom} must be in [0, 1)")
        if self.rollout_share is not None and not 0.0 < self.rollout_share < 1.0:
            raise PlanError(f"--rollout-share {self.rollout_share} must be in (0, 1): the engine's share of the GPU")
        if self.dp < 1:
            raise PlanError(f"data-parallel size {self.dp} must be >= 1")


@dataclass(frozen=True)
class RolloutPlan:
    """A colocated GPU rollout engine (vLLM-style, same TP x PP split as training) of one rank."""

    reserved: int  # share x capacity
    weights: int
    kv_per_sequence: int
    sequences: int  # the engine's rollout batch: prompts_per_step / DP x group_size (/ its engines when split)
    scheme: str
    sleeps: bool = False
    """The engine frees its GPU memory while training runs (vLLM sleep mode, ``rollout.enable_sleep``):
    its reservation then competes only with the training state that stays resident during generation."""
    kv_cache: str = "off"
    """``rollout.fp8.kv_cache``: ``off`` (keys and values in BF16, 2 bytes) or an FP8 format (1 byte)."""

    @property
    def kv_capacity(self) -> int:
        return max(0, self.reserved - self.weights)

    @property
    def concurrent(self) -> int:
        """Sequences whose KV cache fits at once (the engine queues the rest)."""
        return self.kv_capacity // self.kv_per_sequence if self.kv_per_sequence else 0

    @property
    def fits(self) -> bool:
        return self.concurrent >= 1


def rollout_plan(model, tp: int, pp: int, seq: int, sequences: int, scheme: str, reserved: int, *,
                 vocab_rows: int, kv_cache: str = "off", high_precision_layers: int = 0) -> RolloutPlan:
    """Weights and KV cache of a GPU rollout engine split over ``tp`` x ``pp`` GPUs, per GPU.

    ``vocab_rows`` (V below) are the embedding / LM-head rows counted: the plan passes the trainer's padded
    vocabulary (``model.padded_vocab(training TP)``), whatever the engine's own TP.

    Weights: the engine's FP8 scheme stores linear weights in 1 byte (``vllm_w8a8`` per-tensor scale,
    ``vllm_block`` + float32 scale per 128 x 128 tile), embeddings/LM head/norms in BF16 (2 bytes);
    ``off`` stores everything in BF16::

        weights = [b_lin L linear + 2 (V h (2 if untied else 1) + norms)] / (t PP)

    KV cache of one sequence of ``seq`` tokens (keys and values of the rank's L / PP layers and n_kv / t KV
    heads, at least one head when t > n_kv: replicated), b_kv bytes per element: 2 (BF16) or, with an FP8
    KV cache (``kv_cache`` ``e4m3`` / ``e5m2``), 1 (vLLM's per-layer scales are two floats a layer)::

        kv = 2 (k, v) x b_kv x (L / PP) x max(1, n_kv / t) x d x seq

    ``high_precision_layers`` (BF16 edge layers, ``rollout.fp8.num_layers_at_start/end_in_bf16``): that many
    layers keep 2-byte linears and a 2-byte KV cache; spread evenly over the PP stages in this estimate.
    """
    g = 2 if model.gated_mlp else 1
    h, f, q, kv, layers = model.hidden_size, model.ffn_hidden_size, model.q_width, model.kv_width, model.num_layers
    per_layer = h * (q + 2 * kv) + q * h + h * f * g + f * h
    rest = vocab_rows * h * (1 if model.tied_embeddings else 2) + layers * 2 * h + h
    b_lin = {"off": 2.0, "vllm_w8a8": 1.0, "vllm_block": 1.0 + 4.0 / (128 * 128), "same_as_train": 1.0}
    if scheme not in b_lin:
        raise PlanError(f"rollout.fp8.scheme={scheme!r}; choose one of {sorted(b_lin)}")
    if kv_cache not in ("off", "e4m3", "e5m2"):
        raise PlanError(f"rollout.fp8.kv_cache={kv_cache!r}; choose one of ['off', 'e4m3', 'e5m2']")
    hp = min(max(0, int(high_precision_layers)), layers)
    weights = round((b_lin[scheme] * (layers - hp) * per_layer + 2.0 * hp * per_layer + 2 * rest) / (tp * pp))
    kv_heads = max(1, model.num_kv_heads // tp)
    b_kv = 2.0 if kv_cache == "off" else (1.0 * (layers - hp) + 2.0 * hp) / layers  # mean bytes per element
    kv_bytes = round(2 * b_kv * (layers // pp) * kv_heads * model.head_dim * seq)
    return RolloutPlan(reserved=reserved, weights=weights, kv_per_sequence=kv_bytes, sequences=sequences, scheme=scheme,
                       kv_cache=kv_cache)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes of one arm (recipe x optimizer) at the most loaded pipeline stage."""

    recipe: Optional[str]  # None = BF16
    optimizer: str
    stage: int
    components: dict[str, int]
    recompute_activations: int  # activations with full layer recompute (for comparison)
    capacity: Optional[int]
    headroom: int
    rollout: Optional[RolloutPlan]
    microbatches: int
    in_flight: int

    @property
    def arm(self) -> str:
        return self.recipe or "bf16"

    @property
    def train_total(self) -> int:
        return sum(self.components.values())

    @property
    def available(self) -> Optional[int]:
        """Bytes training may use: capacity - headroom - the rollout engine's reservation (nothing of it
        when the engine sleeps during training)."""
        if self.capacity is None:
            return None
        held = self.rollout.reserved if self.rollout is not None and not self.rollout.sleeps else 0
        return self.capacity - self.headroom - held

    @property
    def resident(self) -> int:
        """Training bytes that stay on the GPU while the rollout engine generates: everything but the
        activations and logits of a step (weights, FP8 copies, grad buffers, optimizer state)."""
        return self.train_total - self.components.get("activations", 0) - self.components.get("logits", 0)

    @property
    def generation_fits(self) -> bool:
        """A sleeping engine wakes up next to the resident training state: resident + reservation fit."""
        if self.capacity is None or self.rollout is None or not self.rollout.sleeps:
            return True
        return self.resident + self.rollout.reserved <= self.capacity - self.headroom

    @property
    def fits(self) -> bool:
        if self.capacity is None:
            return True
        return (self.train_total <= self.available and self.generation_fits
                and (self.rollout is None or self.rollout.fits))

    def summary(self) -> str:
        """One line: what the plan says for this arm."""
        gib = self.train_total / GIB
        if self.capacity is None:
            return (f"{self.arm}/{self.optimizer}: {self.train_total / 2**20:.1f} MiB per rank (host memory, "
                    "no capacity check)")
        verdict = "fits" if self.fits else "does NOT fit"
        r = self.rollout
        extra = f", rollout engine {r.reserved / GIB:.1f} GiB" if r is not None and not r.sleeps else ""
        gen = ""
        if r is not None and r.sleeps:
            gen = (f"; generation: resident training state {self.resident / GIB:.1f} GiB + rollout engine "
                   f"{r.reserved / GIB:.1f} GiB of {(self.capacity - self.headroom) / GIB:.1f} GiB")
        if r is not None and not r.fits:
            gen += (f"; the rollout engine's share ({r.reserved / GIB:.1f} GiB) is smaller than its weights "
                    f"({r.weights / GIB:.1f} GiB)" if r.reserved < r.weights else
                    "; the rollout engine's share holds its weights but not one sequence's KV cache")
        return (f"{self.arm}/{self.optimizer}: training {gib:.1f} GiB of {self.available / GIB:.1f} GiB available "
                f"(capacity {self.capacity / GIB:.1f} GiB - headroom {self.headroom / GIB:.1f}{extra}){gen}: {verdict}")


def _fp8_layers(cfg, recipe) -> Optional[set]:
    """Global layer indices that run FP8 (megatron's first_last_layers_bf16 rule); None = all."""
    if recipe is None or not cfg.fp8.first_last_layers_bf16:
        return None
    L = cfg.model.num_layers
    start, end = cfg.fp8.num_layers_at_start_in_bf16, cfg.fp8.num_layers_at_end_in_bf16
    return {i for i in range(L) if not (i < start or i >= L - end)}


def microbatches(cfg, dp: int) -> int:
    """Microbatches of one optimizer update on one DP rank::

        n = ceil(prompts_per_step x group_size / minibatches_per_step / DP / micro_batch_size)
    """
    a = cfg.algorithm
    per_rank = a.prompts_per_step * a.group_size // a.minibatches_per_step
    return max(1, math.ceil(per_rank / dp / cfg.parallel.micro_batch_size))


def stage_activation_bytes(cfg, stage: int, *, recipe, device: str, dp: int,
                           recompute: bool = False) -> tuple[int, int]:
    """Activations held by pipeline stage ``stage`` at its peak: ``(bytes, microbatches in flight)``.

    Megatron's 1F1B schedule (non-interleaved) runs PP - s warm-up forwards on stage s before its first
    backward, so it holds ``k = min(PP - s, n_microbatches)`` microbatches' activations [2]::

        activations = k x [ sum over the stage's layers of layer_activation_bytes(tokens = mbs x s)
                            (+ CPU RoPE tables: 4 x 4 s d per layer) ]
                      + last stage: the final norm of one microbatch (CPU 3 x 4 h, GPU 2 x 2 h (/ t with
                        sequence parallelism) per token); the logits are :func:`logits_bytes`

    With full recompute (``recompute=True``) a layer keeps only its input (2 h bytes per token on GPU,
    / t under sequence parallelism) and one layer at a time is recomputed in the backward.
    """
    p, m = cfg.parallel, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    tokens = p.micro_batch_size * m.seq_length
    n_micro = microbatches(cfg, dp)
    in_flight = min(pp - stage, n_micro)
    fp8_layers = _fp8_layers(cfg, recipe)
    scaling = recipe.scaling if recipe is not None else None
    per_stage = m.num_layers // pp
    sp = p.sequence_parallel and device == "gpu"
    layer_bytes = []
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        fp8_layer = recipe is not None and (fp8_layers is None or i in fp8_layers)
        b = layer_activation_bytes(m, tokens, tp, scaling=scaling, device=device, sequence_parallel=sp,
                                   fp8_layer=fp8_layer)
        if device == "cpu":
            b += 4 * 4 * m.seq_length * m.head_dim
        layer_bytes.append(b)
    if recompute:
        act_bytes = 4 if device == "cpu" else 2
        inputs = act_bytes * m.hidden_size * tokens // (tp if sp else 1)
        per_micro = per_stage * inputs + max(layer_bytes)
    else:
        per_micro = sum(layer_bytes)
    total = in_flight * per_micro
    if stage == pp - 1:
        total += (3 * 4 * m.hidden_size * tokens) if device == "cpu" else (4 * m.hidden_size * tokens // (tp if sp else 1))
    return total, in_flight


def plan_arm(cfg, options: PlanOptions, *, recipe_name: Optional[str], optimizer: str) -> MemoryPlan:
    """The plan of one arm: ``cfg`` (a validated TrainConfig) with FP8 recipe ``recipe_name`` (None = BF16)
    and ``optimizer``; the most loaded pipeline stage (largest training total) is reported."""
    from nemo_fp8rl.fp8 import resolve_recipe

    options.check()
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    _require_vocab(cfg.model)
    if recipe_name is not None:
        f = cfg.fp8
        recipe = resolve_recipe(recipe_name, first_last_layers_bf16=f.first_last_layers_bf16 and recipe_name != "delayed",
                                num_layers_at_start_in_bf16=f.num_layers_at_start_in_bf16,
                                num_layers_at_end_in_bf16=f.num_layers_at_end_in_bf16)
    else:
        recipe = None
    scaling = recipe.scaling if recipe is not None else None
    if options.device == "gpu" and scaling is not None:
        fp8_copy_bytes_per_weight(scaling)  # raises for recipes TE does not have
    fp8_layers = _fp8_layers(cfg, recipe) if recipe is not None else None
    best = None
    for stage in range(pp):
        sp = stage_parameters(cfg.model, tp, pp, stage, fp8_layers=fp8_layers if recipe is not None else set())
        comps = state_bytes(sp.total, optimizer, options.dp, options.device)
        act, in_flight = stage_activation_bytes(cfg, stage, recipe=recipe, device=options.device, dp=options.dp)
        tokens = p.micro_batch_size * cfg.model.seq_length
        comps = {"weights": comps["weights"],
                 "weight copies": weight_copy_bytes(sp, scaling, optimizer, options.device, in_flight),
                 "grads": comps["grads"], "optimizer": comps["optimizer"], "activations": act,
                 "logits": logits_bytes(cfg.model, tokens, tp, options.device) if stage == pp - 1 else 0}
        rec, _ = stage_activation_bytes(cfg, stage, recipe=recipe, device=options.device, dp=options.dp,
                                        recompute=True)
        if best is None or sum(comps.values()) > sum(best[0].values()):
            best = (comps, rec, stage, in_flight)
    comps, rec, stage, in_flight = best
    cap = options.capacity_bytes
    rollout = None
    share = rollout_share(cfg, options)
    if cap is not None and share is not None:
        a = cfg.algorithm
        from nemo_fp8rl.rollout.fp8_setup import rollout_fp8_setup

        r8 = rollout_fp8_setup(cfg, training_fp8=recipe is not None)  # the BF16 arm generates in BF16
        scheme = r8.scheme
        vllm = cfg.rollout.engine == "vllm"
        # our vllm engine: a whole model per rank, split over rollout.tensor_parallel_size GPUs (no PP);
        # a what-if engine for another config (--rollout-share): sharded like training
        r_tp, r_pp = (cfg.rollout.tensor_parallel_size, 1) if vllm else (tp, pp)
        sequences = a.prompts_per_step // options.dp * a.group_size
        split = cfg.rollout.splits_prompts
        if split:  # the replica's TP x PP / r_tp engines each generate their share (rollout.split_prompts)
            engines = max(1, (tp * pp) // (r_tp if vllm else 1))
            sequences = -(-sequences // engines)
        rollout = rollout_plan(cfg.model, r_tp, r_pp, cfg.model.seq_length, sequences, scheme, int(share * cap),
                               vocab_rows=cfg.model.padded_vocab(tp), kv_cache=r8.kv_cache,
                               high_precision_layers=len(r8.high_precision_layers))
        if vllm and cfg.rollout.enable_sleep:
            rollout = dataclasses.replace(rollout, sleeps=True)
    return MemoryPlan(
        recipe=recipe_name, optimizer=optimizer, stage=stage, components=comps, recompute_activations=rec,
        capacity=cap, headroom=0 if cap is None else int(options.headroom * cap), rollout=rollout,
        microbatches=microbatches(cfg, options.dp), in_flight=in_flight,
    )


def rollout_share(cfg, options: PlanOptions) -> Optional[float]:
    """The GPU share the rollout engine reserves: ``--rollout-share``, else ``rollout.gpu_memory_utilization``
    for the vllm engine on a GPU, else None (the torch engine runs on the host)."""
    if options.rollout_share is not None:
        return options.rollout_share
    if options.device == "gpu" and cfg.rollout.engine == "vllm":
        return float(cfg.rollout.gpu_memory_utilization)
    return None


def config_recipe(cfg) -> Optional[str]:
    """The config's own FP8 recipe, canonical name (aliases resolved), or None for BF16."""
    from nemo_fp8rl.fp8.recipes import build_fp8_recipe

    recipe = build_fp8_recipe(cfg)
    return None if recipe is None else recipe.scaling


def config_optimizer(cfg, device: str = "gpu") -> str:
    """``distributed`` when the config runs Megatron's distributed optimizer, else ``adamw``.

    ``optim.distributed``: true, false, or null = true on GPU and false on CPU
    (:func:`~nemo_fp8rl.config.schema.resolve_distributed_optimizer`)."""
    from nemo_fp8rl.config.schema import resolve_distributed_optimizer

    return "distributed" if resolve_distributed_optimizer(cfg.optim.distributed, device == "gpu") else "adamw"


def plan_config(cfg, options: PlanOptions) -> MemoryPlan:
    """The plan of the config as it will run (its own recipe and optimizer)."""
    return plan_arm(cfg, options, recipe_name=config_recipe(cfg), optimizer=config_optimizer(cfg, options.device))


def plan_table(cfg, options: PlanOptions) -> list[MemoryPlan]:
    """BF16 and every FP8 recipe of the device (GPU: TE's), for both optimizer paths."""
    recipes = [None, *(GPU_RECIPES if options.device == "gpu" else CPU_RECIPES)]
    return [plan_arm(cfg, options, recipe_name=r, optimizer=o) for o in OPTIMIZERS for r in recipes]


def _with(cfg, section: str, **changes):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def suggest_fixes(cfg, options: PlanOptions, *, world: Optional[int] = None, gpus_per_node: int = 8,
                  limit: int = 3) -> list[str]:
    """Knobs that would make ``cfg`` fit, cheapest first (at most ``limit``).

    Tried in order: the distributed optimizer; a smaller ``parallel.micro_batch_size``; a larger
    ``parallel.tensor_model_parallel_size`` (within a node) or ``parallel.pipeline_model_parallel_size``
    with the same number of GPUs (``world``) when DP allows, else with more GPUs; when no single knob
    does, the smallest TP x PP layout that fits at the same DP; a smaller ``--rollout-share``.
    """
    recipe, optimizer = config_recipe(cfg), config_optimizer(cfg, options.device)
    out: list[str] = []

    def fits(c, opt=optimizer, o=options) -> bool:
        try:
            return plan_arm(c, o, recipe_name=recipe, optimizer=opt).fits
        except (PlanError, ValueError):
            return False

    if optimizer == "adamw" and fits(cfg, "distributed"):
        out.append("optim.distributed=true")
    p, m = cfg.parallel, cfg.model
    mbs = p.micro_batch_size // 2
    while mbs >= 1:
        if fits(_with(cfg, "parallel", micro_batch_size=mbs)):
            out.append(f"parallel.micro_batch_size={mbs}")
            break
        mbs //= 2
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    groups = m.num_kv_heads
    world = world or tp * pp * options.dp
    for key, sizes in (("tensor_model_parallel_size", [t for t in (2, 4, 8) if t > tp and t <= gpus_per_node]),
                       ("pipeline_model_parallel_size", [q for q in (2, 4, 8, 16) if q > pp])):
        for size in sizes:
            new_tp, new_pp = (size, pp) if key.startswith("tensor") else (tp, size)
            if (m.num_attention_heads % new_tp or groups % new_tp or m.ffn_hidden_size % new_tp
                    or m.num_layers % new_pp):
                continue
            c = _with(cfg, "parallel", **{key: size})
            # the job's GPUs (DP shrinks), else the same DP on more GPUs
            dps = ([world // (new_tp * new_pp)] if world % (new_tp * new_pp) == 0 else []) + [options.dp]
            dp = next((d for d in dict.fromkeys(dps) if fits(c, o=dataclasses.replace(options, dp=d))), None)
            if dp is not None:
                gpus = "" if new_tp * new_pp * dp == world else f" (with {new_tp * new_pp * dp} GPUs for DP={dp})"
                out.append(f"parallel.{key}={size}{gpus}")
                break
    if not out:  # no single knob: the smallest TP x PP layout (TP within a node) that fits at the same DP
        layouts = sorted(((t, q) for t in (1, 2, 4, 8) for q in (1, 2, 4, 8, 16)
                          if t <= gpus_per_node and t * q > tp * pp and not (m.num_attention_heads % t or groups % t
                                                                          or m.ffn_hidden_size % t or m.num_layers % q)),
                         key=lambda tq: (tq[0] * tq[1], tq[1]))
        for t, q in layouts:
            if fits(_with(cfg, "parallel", tensor_model_parallel_size=t, pipeline_model_parallel_size=q)):
                out.append(f"parallel.tensor_model_parallel_size={t} parallel.pipeline_model_parallel_size={q} "
                           f"({t * q} GPUs per model replica, {t * q * options.dp} for DP={options.dp})")
                break
    share = rollout_share(cfg, options)
    if share is not None:
        vllm_key = options.rollout_share is None  # the config's own vllm engine
        for new in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
            if new != share and fits(cfg, o=dataclasses.replace(options, rollout_share=new)):
                out.append(f"rollout.gpu_memory_utilization={new}" if vllm_key
                           else f"a rollout engine share of {new} (--rollout-share {new})")
                break
    return out[:limit]


def megatron_reference(cfg, dp: int, optimizer: str) -> dict[str, int]:
    """Megatron-LM's theoretical memory [2] for the same model and layout, for comparison (GPU, bytes).

    Re-derived from the formulas [2] documents (its code is not used):

    - weights + grads + optimizer of the most loaded shard: ``P_max x (18 | 6 + 12 / DP)`` with
      P_max = (P_block / PP + V h) / t, plus V h / t for an untied head when PP = 1; P_block = L [2 h
      (g' f + c) + 2 h (n_q d + n_kv d)] + c h with g' = 3/2 for SwiGLU (no biases, no QK norms);
    - activations of the first stage, sequence parallelism with selective recompute: per layer
      s b h (18 + 4 f / h) / t ([3] Table 2 without the attention scores), times L x min(1, n / PP),
      + (8 s b PP + s b h PP) / t for the embedding, + 4 s b h (1 + V / h) / t for the logits when PP = 1;
      without sequence parallelism s b h (10 + 24 / t) per layer (+ the same embedding terms, logits
      2 s b (V / t + h)), times 1.05.

    [2] models multi-head attention with q = h and a 4h-style MLP, not GQA or SwiGLU's 2f-wide fc1;
    our plan counts those (docs/megatron.md compares the two).
    """
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    _require_vocab(m)
    h, f, c, vocab = m.hidden_size, m.ffn_hidden_size, _norm_params(m), m.padded_vocab(tp)
    g = 1.5 if m.gated_mlp else 1.0
    layer = 2 * h * (g * f + c) + 2 * h * (m.q_width + m.kv_width)
    block = m.num_layers * layer + c * h
    emb = vocab * h
    p_max = (block / pp + emb) / tp + (emb / tp if not m.tied_embeddings and pp == 1 else 0)
    per_param = 18 if optimizer == "adamw" else 6 + 12 / dp
    s, b = m.seq_length, p.micro_batch_size
    n = microbatches(cfg, dp)
    if p.sequence_parallel:
        act = s * b * h * (18 + 4 * f / h) * m.num_layers
        act += 8 * s * b * pp + s * b * h * pp
        act *= min(1.0, n / pp) if pp > 1 else 1.0
        if pp == 1:
            act += 4 * s * b * h * (1 + vocab / h)
        act /= tp
    else:
        act = s * b * h * (10 + 24 / tp) * m.num_layers + 8 * s * b * pp + s * b * h * pp
        act *= min(1.0, n / pp) if pp > 1 else 1.0
        if pp == 1:
            act += 2 * (s * b * vocab / tp + s * b * h)
        act *= 1.05
    return {"weights+optimizer": round(p_max * per_param), "activations": round(act)}


def memory_plan_setting(value) -> Optional[tuple[Optional[str], Optional[float]]]:
    """``launcher.memory_plan``: a GPU name (``h100``), its memory in GiB (a number), or ``off``/false
    (no check) -> ``(gpu, gpu_memory_gib)`` or None for off.

    Raises:
        PlanError: naming the key and the accepted values.
    """
    if value is None or value is True:
        return ("h100", None)
    if value is False or (isinstance(value, str) and value.strip().lower() in ("off", "false", "none")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return (None, float(value))
    if isinstance(value, str) and value.strip().lower() in GPUS_MIB:
        return (value.strip().lower(), None)
    raise PlanError(f"launcher.memory_plan={value!r}: use a GPU name {sorted(GPUS_MIB)}, the GPU memory in GiB "
                    "(e.g. 94) or off")


__all__ = [
    "CPU_RECIPES", "DEVICES", "GIB", "GPUS_MIB", "GPU_RECIPES", "MemoryPlan", "OPTIMIZERS", "PlanError",
    "PlanOptions", "RolloutPlan", "StageParams", "config_optimizer", "config_recipe", "fp8_copy_bytes_per_weight",
    "layer_activation_bytes", "logits_bytes", "megatron_reference", "memory_plan_setting", "microbatches",
    "plan_arm", "plan_config", "plan_table", "rollout_plan", "rollout_share", "stage_activation_bytes",
    "stage_parameters", "state_bytes", "suggest_fixes", "weight_copy_bytes",
]
