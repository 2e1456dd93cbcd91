"""The training configuration schema: the only home of defaults (docs/design.md, "Config and run directory").

Hydra composes ``conf/config.yaml`` (config groups: algorithm, fp8, calibration, model, task) on top
of this schema; YAML files hold overrides only. ``validate(cfg)`` rejects bad values and bad
combinations before any work starts, naming the key and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


@dataclass
class Fp8Config:
    """Training FP8 (the trainer's GEMMs). ``recipe: null`` (the ``fp8=off`` group) = high precision."""

    recipe: Optional[str] = None
    """delayed | tensorwise | rowwise | blockwise | mxfp8 (or a Megatron-Bridge alias); null = FP8 off;
    auto (``fp8=auto``) = by hardware when the trainer starts: mxfp8 on sm100+, blockwise on sm90,
    tensorwise on sm89, emulated tensorwise on the CPU (``nemo_fp8rl.fp8.recipes.auto_recipe_name``); the
    run's config.yaml records the recipe picked."""
    fp8_format: Optional[str] = None
    """e4m3 | hybrid | e5m2 (emulation-only stress setting); null = the recipe's default (hybrid for
    delayed/tensorwise, e4m3 otherwise)."""
    pow2_scales: Optional[bool] = None
    """Power-of-two scales; null = the recipe's default."""
    amax_history_len: int = 1
    """Delayed scaling history length (Megatron default 1)."""
    amax_compute_algo: str = "most_recent"
    """Delayed scaling: most_recent | max."""
    margin: int = 0
    """Delayed scaling margin (powers of two of headroom)."""
    accumulation: Optional[str] = None
    """Forward-GEMM accumulation: null = the backend's default (fast on torch/TE, as TE and torchao do;
    exact float32 in the emulation) | fp32 (full accumulation everywhere) | fast (the emulation models
    Hopper's un-promoted accumulation, slowly). dgrad and wgrad always accumulate in full."""
    first_last_layers_bf16: bool = False
    """Keep the first/last transformer layers in high precision (not with delayed)."""
    num_layers_at_start_in_bf16: int = 1
    """With first_last_layers_bf16: layers at the start kept high precision."""
    num_layers_at_end_in_bf16: int = 1
    """With first_last_layers_bf16: layers at the end kept high precision."""
    backend: Optional[str] = None
    """FP8 GEMM backend: emulate (FP8 values, float32 GEMMs; CPU and GPU) | torch (torch's FP8 GEMMs,
    torch._scaled_mm: tensorwise/delayed/rowwise/blockwise on sm89+/sm90, tensorwise/delayed on CPU; layers
    torch cannot run fall back to emulate, counted in the conversion log) | te (Transformer Engine layers,
    GPU). null = auto = te if Transformer Engine imports on a GPU, else torch on an FP8-capable GPU, else
    emulate; on a GPU's torch backend auto also keeps each linear in BF16 that measured slower in FP8 at this
    run's micro-batch size (nemo_fp8rl/fp8/layer_filter.py; logged once with the reasons); torch converts every
    linear it can. Checkpoints resume under any backend."""
    use_te: Optional[bool] = None
    """Deprecated spelling of fp8.backend: true = te, false = emulate (an error if it contradicts fp8.backend)."""
    compile: str = "auto"
    """Fused quantization with torch.compile (Inductor: Triton on GPU, C++ on CPU), bit-equal to eager:
    auto (GPU always; CPU for layers whose weight has >= 100,000 elements, i.e. real models, not the tiny
    demo) | true | false. Where compile is unavailable the quantizer runs eager and says so once."""


@dataclass
class RolloutFp8Config:
    """FP8 of the rollout (inference) engine, separate from training as in real stacks."""

    scheme: str = "vllm_w8a8"
    """off | vllm_w8a8 | vllm_block | same_as_train. Forced to off when training FP8 is off (bf16 arm)."""
    kv_cache: str = "off"
    """FP8 KV cache: off | e4m3 | e5m2 (vLLM's kv_cache_dtype fp8_e4m3 / fp8_e5m2). Keys (after RoPE) and
    values are stored in FP8 with one float32 scale per layer and attended to as read back; the torch
    engine emulates vLLM's GPU rules, the vllm engine runs vLLM's (GPU, or vLLM-CPU with AVX-512 / AMX).
    Forced to off when training FP8 is off (bf16 arm). docs/rollout.md, "FP8 KV cache"."""
    kv_scales: str = "static"
    """Scales of the FP8 KV cache: static (vLLM's default without checkpoint scales: 1.0 for every layer) |
    calibrated (recomputed at every weight sync from a high-precision forward of the synced weights over the
    latest rollout batch, and shipped with the sync: per layer, the kv_calib_percentile-th percentile of the
    per-sequence amax of |k|, |v| and |q|, times kv_calib_margin, over the FP8 maximum; NeMo RL's recipe)."""
    kv_calib_percentile: float = 99.9
    """kv_scales=calibrated: percentile (0, 100] over the sequences' amaxes (NeMo RL: 99.9)."""
    kv_calib_margin: float = 1.05
    """kv_scales=calibrated: headroom factor on the percentile amax (NeMo RL: 1.05)."""
    kv_calib_max_tokens: int = 65536
    """kv_scales=calibrated: most tokens per rank in the calibration forward (one sequence per prompt group of
    the latest rollout batch, in order, until the budget is spent; at least one sequence). Bounds its memory:
    the forward keeps tokens x hidden float32 activations."""
    num_layers_at_start_in_bf16: int = 0
    """First decoder layers the rollout keeps in high precision: their linears skip the FP8 scheme and their
    KV cache stays in the engine dtype (vLLM: the quantization config's ignored layers and
    kv_cache_dtype_skip_layers). Named as the training recipe's fp8.num_layers_at_start_in_bf16; 0 = none."""
    num_layers_at_end_in_bf16: int = 0
    """Last decoder layers the rollout keeps in high precision (as num_layers_at_start_in_bf16); 0 = none."""


@dataclass
class RolloutConfig:
    """Generation."""

    engine: str = "torch"
    """Rollout engine registry name: torch (in-process sampler with a KV cache, emulates every rollout FP8
    scheme) | vllm (vLLM's offline engine; ``pip install nemo-fp8rl[vllm]``; FP8 off on CPU). docs/rollout.md."""
    temperature: float = 1.0
    """Sampling temperature (also divides the trainer's logits, verl convention)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_new_tokens: int = 8
    """Longest response in tokens."""
    stop_on_eos: bool = True
    """Stop a sequence at EOS."""
    stop_check_interval: Optional[int] = None
    """torch engine: decode steps between the checks for responses that ended at EOS or on a stop string
    (each check is one host sync; ended rows leave the batch there, and until then decode on and record
    nothing). The batch depends on it (an ended row draws sampling noise until its check). null = 1 on CPU
    (a sync is free there), 8 on a GPU."""
    stop: List[str] = field(default_factory=list)
    """Stop strings: a response ends at the token whose decoding completes one of them, e.g.
    ``['</answer>']``; the string (and any text past it inside that token) stays in the response, which
    counts as finished (vLLM's ``stop`` with ``include_stop_str_in_output``; the torch engine decodes at
    its stop checks). [] = off. docs/rollout.md."""
    sync_bucket_mb: float = 512.0
    """vllm: weight sync streams the actor's weights to the engine in buckets of at most this many MiB
    (one tensor larger than a bucket is sent alone); bounds the extra memory of a sync."""
    tensor_parallel_size: int = 1
    """vllm: GPUs (CPU: processes) one engine spans, T consecutive ranks of a replica (vLLM's
    ``external_launcher``); must divide parallel.tensor_model_parallel_size x pipeline_model_parallel_size.
    The replica's TP x PP / T engines each generate their share of its batch. docs/rollout.md."""
    gpu_memory_utilization: float = 0.5
    """vllm: fraction of GPU memory the engine may take for weights and KV cache (GPU only; ignored on
    CPU, where VLLM_CPU_KVCACHE_SPACE sets the KV cache in GiB)."""
    enable_sleep: bool = True
    """vllm on GPU, colocated with training: between its rollout and the next weight sync the engine frees
    its weights and KV cache (vLLM sleep mode, level 2: discarded, not offloaded, since the next sync
    rewrites every weight), leaving training the whole GPU. false keeps the engine's memory reserved
    during training. No-op on CPU."""
    cuda_graphs: bool = False
    """Decode with CUDA graphs on a GPU. torch engine: each decode step runs on static shapes (power-of-two
    buckets of live rows and attended positions) and is captured once per bucket and ``generate`` call, then
    replayed (nemo_fp8rl/rollout/decode_graphs.py; a failed capture is logged and the call decodes eagerly);
    without CUDA the same static steps run eagerly. vllm: false builds the engine with ``enforce_eager``.
    Off by default until the GPU check has measured it (docs/rollout.md)."""
    split_prompts: Optional[bool] = None
    """Split each data-parallel rank's rollout batch over its model-parallel (TP x PP) ranks: every rank
    generates its share with its own whole-model engine and the shares are gathered, so the replica's
    GPUs do not all generate the same batch. null = true for vllm, false for torch (the CPU reference
    engine: every rank generates the whole batch)."""
    fp8: RolloutFp8Config = field(default_factory=RolloutFp8Config)

    @property
    def splits_prompts(self) -> bool:
        """``split_prompts`` with its null resolved (true for vllm, false for torch): the one place."""
        return self.split_prompts if self.split_prompts is not None else self.engine != "torch"


@dataclass
class AlgorithmConfig:
    """The RL algorithm: GRPO/DAPO/PPO are presets of these keys (conf/algorithm/)."""

    name: str = "grpo"
    """Preset name (informational)."""
    policy_loss: str = "ppo_clip"
    """Registered policy loss: ppo_clip | reinforce | gspo."""
    adv_estimator: str = "grpo"
    """Registered advantage estimator: grpo | rloo."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO style)."""
    group_size: int = 8
    """Responses sampled per prompt."""
    prompts_per_step: int = 32
    """Prompts per training step (batch = prompts_per_step x group_size sequences)."""
    minibatches_per_step: int = 4
    """Optimizer updates per step (ratios move off 1 after the first)."""
    epochs: int = 1
    """Passes over the step's batch."""
    eps_low: float = 0.2
    """Lower clip: ratio bound 1 - eps_low for negative advantages."""
    eps_high: float = 0.2
    """Upper clip: ratio bound 1 + eps_high for positive advantages (DAPO clip-higher: 0.28)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (null = off)."""
    kl_coef: float = 0.0
    """KL-to-reference coefficient beta (0 = no reference model)."""
    kl_type: str = "k3"
    """KL estimator: k1 | k2 | k3."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more."""
    max_resample_rounds: int = 3
    """DAPO dynamic sampling: extra rollout rounds to refill the batch."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: soft penalty over the last N tokens of max_new_tokens (0 = off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping: penalty at the hard limit."""
    rollout_correction: str = "tis"
    """tis | icepop | none: correction of rollout-vs-trainer mismatch."""
    tis_cap: float = 2.0
    """TIS truncation C (paper: 2)."""
    icepop_low: float = 0.5
    """IcePop: mask tokens whose rollout IS ratio is below this."""
    icepop_high: float = 5.0
    """IcePop: mask tokens whose rollout IS ratio is above this."""
    old_logprobs: str = "recompute"
    """recompute (trainer FP8 forward before the update) | rollout (the rollout engine's log-probs)."""


@dataclass
class CalibrationConfig:
    """Calibrated Clipping (docs/design.md, "Calibrated Clipping"). The ``off`` group disables it."""

    enabled: bool = False
    """Run the BF16 shadow forwards at calibration steps (before the step, per minibatch, and one after the
    last update for the negative push ``calib/neg_push``)."""
    apply: bool = True
    """Use the calibrated bounds (False: measure and log calib/ metrics only, bounds stay nominal). False is
    the only setting allowed with fp8=off: a BF16 run then logs its own calib/ metrics (the shadow forward
    is the model itself), the reference of a study's FP8 arms."""
    interval: int = 20
    """Calibrate at step start_step, then every `interval` steps."""
    ema: float = 0.5
    """Blend of old and new bounds after the first calibration: L <- ema L + (1 - ema) L*."""
    upper_mode: str = "balance"
    """balance | quantile | proportional | fixed."""
    lower_min: float = 0.5
    """Guard: lowest allowed lower bound."""
    upper_max: float = 3.0
    """Guard: highest allowed upper bound."""
    min_tokens: int = 64
    """Fewer negative-advantage tokens than this keeps the previous bounds."""
    max_tokens: int = 65536
    """Random subset of tokens kept per rank per calibration (over its whole round, see ``window``)."""
    window: int = 1
    """Steps pooled per calibration (1 <= window <= interval): the calibration at step c observes steps c to
    c + window - 1 (shadow forwards on each) and computes the bounds once from their tokens, at the last; they
    apply from step c + window. > 1 when one step's batch holds too few negative-advantage tokens for BF16's
    clip share to be measured (``calib/tokens``); costs window x the shadow forwards per interval."""
    start_step: int = 0
    """First calibration step."""
    init_lower: Optional[float] = None
    """Lower bound before the first calibration (null = 1 - eps_low)."""
    init_upper: Optional[float] = None
    """Upper bound before the first calibration (null = 1 + eps_high)."""


@dataclass
class OptimConfig:
    """Optimizer (Adam)."""

    lr: float = 1e-4
    """Learning rate of the RL updates."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    grad_clip: float = 1.0
    """Gradient-norm clipping."""
    distributed: Optional[bool] = None
    """megatron's DistributedDataParallel + distributed optimizer (Adam state and float32 main params
    sharded over data-parallel ranks; BF16 params on GPU) instead of torch AdamW. null = true on GPU,
    false on CPU (there it is slower and only shards the Adam moments; docs/megatron.md)."""


def resolve_distributed_optimizer(distributed: Optional[bool], on_gpu: bool) -> bool:
    """``optim.distributed`` with its null resolved (the one place): null -> true on GPU, false on CPU."""
    return on_gpu if distributed is None else bool(distributed)


@dataclass
class TaskConfig:
    """The verifiable task (conf/task/)."""

    name: str = "arithmetic"
    """arithmetic | math_jsonl | reasoning_gym."""
    digits: int = 3
    """arithmetic: digits per operand."""
    format_reward: float = 0.0
    """arithmetic: reward for a well-formed but wrong answer."""
    path: Optional[str] = None
    """math_jsonl: path of the JSONL file."""
    prompt_key: str = "prompt"
    """math_jsonl: field holding the prompt."""
    answer_key: str = "answer"
    """math_jsonl: field holding the reference answer."""
    on_error: str = "raise"
    """math_jsonl: malformed rows -> raise (error with file:line) | skip (count and skip)."""
    max_prompt_len: int = 256
    """math_jsonl: longest prompt in tokens."""
    prompt_template: str = "{prompt}"
    """math_jsonl, reasoning_gym: how a row's prompt (a problem's question) is shown to the model
    ({prompt} is replaced)."""
    shuffle: bool = True
    """math_jsonl: reshuffle the rows every epoch (seeded; the position is saved in checkpoints)."""
    reward_timeout_s: float = 5.0
    """A reward call slower than this scores 0 and counts in reward/errors."""
    chat_template: bool = True
    """math_jsonl, reasoning_gym: with a Hugging Face tokenizer (model.hf_path) that has a chat template,
    wrap each prompt in it (system turn, user turn, generation prompt); false = plain text."""
    dataset: str = "chain_sum"
    """reasoning_gym: the reasoning-gym dataset (chain_sum, basic_arithmetic, leg_counting, countdown,
    gsm_symbolic, ...; unknown names are refused with the list of valid ones)."""
    dataset_kwargs: Dict[str, Any] = field(default_factory=dict)
    """reasoning_gym: keyword arguments of the dataset's config, e.g. ``{min_terms: 2, max_terms: 4}``;
    ``size`` = problems per seeded chunk of the unbounded stream; ``seed`` comes from the run seed."""
    system_prompt: str = "Put only the final answer in <answer></answer> tags, e.g. <answer>42</answer>."
    """reasoning_gym: system turn of the chat template (plain text before the prompt without one); it
    must ask for the answer in answer_tag tags."""
    answer_tag: str = "answer"
    """reasoning_gym: the response's last non-empty <answer_tag>...</answer_tag> is the scored answer; a
    response without one is invalid (rollout/invalid_frac)."""
    response_prefix: str = ""
    """reasoning_gym: text the assistant turn starts with, appended to every prompt (e.g. ``<answer>``: a
    small model then answers in the tag format); rewards read response_prefix + response."""
    partial_credit: bool = True
    """reasoning_gym: keep the checker's partial scores in (0, 1) (chain_sum scores an answer that merely
    contains the right number len(right answer) / len(answer)); false = exact answers only (reward 1 or 0,
    or format_reward). The other built-in tasks score exact answers only either way."""
    trailing_text_penalty: float = 0.0
    """reasoning_gym: subtracted from the reward of a response with non-whitespace text after the closing
    </answer_tag> of its final answer (format penalty; 0 = off). The share of such responses is logged as
    reward/trailing_text either way. Refused for tasks without a closing answer tag (arithmetic, math_jsonl)."""
    unclosed_answer_penalty: float = 0.0
    """reasoning_gym: subtracted from the reward of a response whose final answer was read from an
    <answer_tag> never closed (the lenient parse, e.g. ``<answer>42`` or ``<answer>3</reference ...``;
    format penalty; 0 = off). The share is logged as reward/unclosed_answer either way. Refused for tasks
    without answer tags (arithmetic, math_jsonl)."""


@dataclass
class WarmupConfig:
    """Supervised warm-up before RL, so RL starts from a policy that is right part of the time."""

    steps: int = 3000
    """Most supervised steps (0 = no warm-up, e.g. for pretrained checkpoints)."""
    target_accuracy: Optional[float] = 0.45
    """Stop as soon as the expected sampled accuracy on held-out demonstrations reaches this (checked
    every eval_interval steps); null = run all steps. A fixed step count is not a fixed starting point:
    the tiny model learns addition in a sudden transition whose step varies by seed (measured: after
    1100 steps seed 1 sampled 0.44, seed 2 0.81, seed 3 0.00). 0.45 is close to the CPU prototype's start, 0.47 (docs/fp8-noise.md)."""
    eval_interval: int = 50
    """Steps between accuracy checks."""
    eval_size: int = 256
    """Held-out demonstrations used for the accuracy check."""
    lr: float = 1e-3
    """Warm-up learning rate."""
    batch_size: int = 64
    """Warm-up sequences per step."""
    cache: bool = True
    """Reuse a warm-up with identical model, task, warm-up settings and seed from cache_dir."""
    cache_dir: str = "runs/.warmup_cache"
    """Where warmed-up weights are cached (keyed by a hash of everything that shapes them)."""


@dataclass
class ProfileConfig:
    """A profile of a range of RL steps (``trainer.profile``; docs/design.md, "Profiling"), like Megatron's
    ``--profile --profile-step-start/--profile-step-end --profile-ranks``. Every step phase (the
    ``timing/<phase>`` timers) is a named range in it: ``phase/step``, ``phase/rollout``,
    ``phase/weight_sync``, ``phase/logprobs``, ``phase/train``, ``phase/shadow``, ``phase/push_forward``."""

    kind: Optional[str] = None
    """null (off) | torch: torch.profiler over the steps (CPU ops, and CUDA kernels on a GPU), written to
    ``<output_dir>/profile/`` as a Chrome/Perfetto trace and a table of the top ops | nsys: the steps
    between ``cudaProfilerStart`` and ``cudaProfilerStop`` with NVTX ranges per phase, for
    ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`` (needs CUDA)."""
    start_step: int = 1
    """First profiled RL step (0-based, the ``step`` of metrics.jsonl). Step 0 compiles and warms up the
    kernels, so the default starts after it."""
    end_step: int = 1
    """Last profiled RL step (inclusive). Keep the range to a few steps: ``kind=torch`` holds every op and
    kernel of the range in host memory until it writes the trace (a tiny CPU step: ~10 MB of trace)."""
    ranks: List[int] = field(default_factory=lambda: [0])
    """Global ranks that profile (each writes its own files)."""
    record_shapes: bool = False
    """torch: record each op's input shapes (bigger trace, grouped table by shape)."""


@dataclass
class TrainerConfig:
    """Loop control."""

    max_steps: int = 100
    """RL steps."""
    checkpoint_interval: int = 50
    """Save every N steps (and at the end, see ``save_final``); 0 = only at the end."""
    save_final: bool = True
    """Save a checkpoint when training ends at ``max_steps`` (if the last step has none yet). false: the
    run ends without one, e.g. a benchmark with ``checkpoint_interval=0`` that writes no checkpoint at all
    (an 8B model's checkpoint with its optimizer is ~5 GB). The saves on a stop (non-finite updates,
    instability, a signal) happen either way."""
    keep_last: int = 3
    """Checkpoints kept."""
    async_save: bool = False
    """Write the sharded checkpoint state (``dist/``) with megatron's asynchronous save: the step
    continues while a forked writer writes a host-memory snapshot; the checkpoint is published
    (``meta.json``, rename, ``latest``) once every rank's writer finished, checked at each step end,
    before the next save and before exiting. Until then ``latest`` names the previous checkpoint."""
    max_consecutive_skips: int = 5
    """Stop (with a checkpoint of the last good state) after this many non-finite updates in a row."""
    cpu_threads: Optional[int] = 1
    """torch intra-op threads on CPU (null = torch's default). The tiny model's kernels are too small
    to gain from more threads, and extra threads slow it down when cores are shared."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Profile a range of steps (``trainer.profile.kind=torch`` or ``nsys``); off by default."""


@dataclass
class LoggerConfig:
    """Metrics output."""

    tensorboard: bool = True
    """Write TensorBoard event files to <output_dir>/tb."""
    progress: str = "auto"
    """auto (bar on a terminal, lines otherwise) | bar | lines | none."""
    samples: List[int] = field(default_factory=list)
    """Steps (0-based) after whose rollout the trainer appends ``samples_per_step`` decoded generations
    (prompt as the model saw it, response, reward) to ``<output_dir>/samples.jsonl``, so garbled text is
    visible next to the metrics (``nemo-fp8rl-report`` shows them); [] = none. E.g. ``[0,10,19]``."""
    samples_per_step: int = 3
    """Generations written per sample step: the first response of each of the step's first prompts."""


@dataclass
class StabilityConfig:
    """Entropy-surge and garbled-output monitor."""

    surge_factor: float = 1.5
    """Surge when entropy > surge_factor x its baseline B (and above B by surge_min_rise); B is the median
    entropy of the ``window`` steps that end ``window`` steps before the current one (docs/design.md, "One training step")."""
    surge_min_rise: float = 0.05
    """Surge only when entropy exceeds its baseline by more than this many nats."""
    window: int = 20
    """Baseline window and lag, in steps."""
    invalid_threshold: float = 0.5
    """Garbled output when a step's invalid-response rate (``rollout/invalid_frac``) exceeds this."""
    repeat_min_chars: int = 32
    """A response is repetitive when its longest run of a repeated unit (1 to 32 characters, at least two
    copies; ``nemo_fp8rl.algorithms.degeneracy``) is at least this many characters and at least
    ``repeat_min_frac`` of the response. Far above real outputs: the answers of the built-in tasks are
    shorter than 32 characters (``0579``, ``<answer>-138</answer>``), and 48 zero-shot SmolLM2-135M
    responses to chain_sum (temperature 1, up to 128 tokens, up to 634 characters) had runs of at most 13."""
    repeat_min_frac: float = 0.5
    """The share of its response a repeat run must cover to count (with ``repeat_min_chars``): a long
    healthy response with one ruler line stays quiet; a decoding loop runs to ``max_new_tokens`` and
    covers most of its response."""
    repetitive_threshold: float = 0.25
    """Garbled output when more than this share of a step's responses is repetitive
    (``stability/repetitive_frac``). Healthy runs measure 0; a collapse loops on most prompts, while a
    model that loops on a few (a known BF16 habit of long chain-of-thought) stays below."""
    nonprintable_threshold: float = 0.02
    """Garbled output when more than this share of a step's response characters is non-printable (control,
    surrogate, private-use or unassigned code points; ``stability/nonprintable_frac``). Healthy text has
    none; SmolLM2 sampling random byte tokens writes 6%."""
    replacement_threshold: float = 0.05
    """Garbled output when more than this share of a step's response characters is U+FFFD
    (``stability/replacement_frac``). A healthy response has at most one, where ``max_new_tokens`` cuts a
    multi-byte character (1/len: at most 4% for responses of 25 characters or more); SmolLM2 sampling
    random byte tokens writes 20%."""
    unlikely_prob: float = 1e-4
    """Calibration steps: a sampled response token is very unlikely when the BF16 shadow forward gives it a
    probability below this (``stability/unlikely_frac``)."""
    unlikely_threshold: float = 0.2
    """Garbled output when more than this share of a calibration step's response tokens is very unlikely.
    Sampling that matches the model gives the model's own tail mass: 3.3% for zero-shot SmolLM2-135M at
    temperature 1 on chain_sum (the most diffuse real case; 1741 tokens), 98% for tokens drawn uniformly
    from its vocabulary."""
    unclosed_answer_threshold: float = 0.5
    """Garbled output when more than this share of a step's final answers was read from an answer tag that is
    never closed (``reward/unclosed_answer``, for tasks that report it: ``reasoning_gym``, whose lenient parse
    still scores such answers). The other finished runs of issue 41's 2x-lr confirmation measured at most
    0.125 at any step; recompute + TIS on its seed 22 drifted to ``<answer>3.0</`` followed by repeated junk: above 0.5 at 74 of
    its 100 steps, while its reward recovered (docs/results.md)."""
    action: str = "warn"
    """warn | stop | none: on a step flagged unstable (surge or garbled), log a warning; ``stop``
    also checkpoints and stops the run after ``patience`` consecutive flagged steps (exit code 3)."""
    patience: int = 3
    """Consecutive unstable steps before ``action=stop`` stops the run."""


@dataclass
class TrainConfig:
    """One RL run."""

    output_dir: str = "runs/default"
    """Run directory (config.yaml, metrics.jsonl, tb/, checkpoints/)."""
    seed: int = 1
    """Seed of everything (model init, sampling, minibatch order)."""
    resume: bool = False
    """Continue from <output_dir>/checkpoints/latest when it exists."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)


def check_choice(key: str, value, options) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``value`` is one of ``options`` (any iterable of names)."""
    options = list(options)
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of {options}")



def _resolve_fp8_backend_key(f: Fp8Config) -> None:
    """Check ``fp8.backend`` and fold the deprecated ``fp8.use_te`` into it (one name per concept)."""
    check_choice("fp8.compile", str(f.compile).lower(), ["auto", "true", "false"])
    if f.backend is not None:
        check_choice("fp8.backend", f.backend, ["auto", "emulate", "torch", "te"])
    if f.use_te is not None:
        implied = "te" if f.use_te else "emulate"
        if f.backend not in (None, "auto") and f.backend != implied and not (f.backend == "torch" and not f.use_te):
            raise ConfigError(f"fp8.use_te={f.use_te} contradicts fp8.backend={f.backend}; fp8.use_te is the "
                              "deprecated spelling of fp8.backend: remove it and keep fp8.backend")
        if f.backend in (None, "auto"):
            f.backend = implied
        f.use_te = None


def _check_rollout_fp8(r: RolloutFp8Config, num_layers: int) -> None:
    """``rollout.fp8``'s KV-cache and edge-layer keys (the scheme's name is checked by ``validate``)."""
    check_choice("rollout.fp8.kv_cache", r.kv_cache, ["off", "e4m3", "e5m2"])
    check_choice("rollout.fp8.kv_scales", r.kv_scales, ["static", "calibrated"])
    if r.kv_scales == "calibrated" and r.kv_cache == "off":
        raise ConfigError("rollout.fp8.kv_scales=calibrated calibrates the FP8 KV cache, but rollout.fp8.kv_cache=off; "
                          "set rollout.fp8.kv_cache=e4m3 or rollout.fp8.kv_scales=static")
    if not (isinstance(r.kv_calib_percentile, (int, float)) and 0.0 < r.kv_calib_percentile <= 100.0):
        raise ConfigError(f"rollout.fp8.kv_calib_percentile={r.kv_calib_percentile!r} must be in (0, 100] "
                          "(NeMo RL uses 99.9)")
    if not (isinstance(r.kv_calib_margin, (int, float)) and math.isfinite(r.kv_calib_margin) and r.kv_calib_margin > 0):
        raise ConfigError(f"rollout.fp8.kv_calib_margin={r.kv_calib_margin!r} must be a number > 0 (NeMo RL uses 1.05; "
                          "below 1 the largest keys and values saturate)")
    if not (isinstance(r.kv_calib_max_tokens, int) and not isinstance(r.kv_calib_max_tokens, bool)
            and r.kv_calib_max_tokens >= 1):
        raise ConfigError(f"rollout.fp8.kv_calib_max_tokens={r.kv_calib_max_tokens!r} must be an integer >= 1")
    for key in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        n = getattr(r, key)
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            raise ConfigError(f"rollout.fp8.{key}={n!r} must be an integer >= 0 (0 = no high-precision edge layers)")
    if r.num_layers_at_start_in_bf16 + r.num_layers_at_end_in_bf16 > num_layers:
        raise ConfigError(
            f"rollout.fp8.num_layers_at_start_in_bf16={r.num_layers_at_start_in_bf16} + num_layers_at_end_in_bf16="
            f"{r.num_layers_at_end_in_bf16} exceeds model.num_layers={num_layers}; lower them (or use "
            "rollout.fp8.scheme=off and rollout.fp8.kv_cache=off for a high-precision rollout)")


def check_values(cfg: TrainConfig) -> TrainConfig:
    """Reject values and combinations of this config's own keys that cannot work, naming the key and the
    fix. Returns cfg (with ``fp8.use_te`` folded into ``fp8.backend``).

    The checks that need a component (registered names, FP8 recipes, what the rollout engines run) are
    the component's; :func:`nemo_fp8rl.validation.validate` runs them all.
    """
    a, c = cfg.algorithm, cfg.calibration
    if not 0.0 < a.eps_low < 1.0:
        raise ConfigError(f"algorithm.eps_low={a.eps_low} must be in (0, 1): the lower bound 1 - eps_low must stay positive")
    if a.eps_high <= 0.0:
        raise ConfigError(f"algorithm.eps_high={a.eps_high} must be > 0")
    if a.dual_clip is not None and a.dual_clip <= 1.0:
        raise ConfigError(f"algorithm.dual_clip={a.dual_clip} must be > 1 (or null to disable dual clip)")
    if a.group_size < 1 or a.prompts_per_step < 1:
        raise ConfigError("algorithm.group_size and algorithm.prompts_per_step must be >= 1")
    if a.adv_estimator in ("grpo", "rloo") and a.group_size < 2:
        raise ConfigError(
            f"algorithm.group_size={a.group_size} with adv_estimator={a.adv_estimator}: group-relative "
            "advantages need at least 2 responses per prompt; set algorithm.group_size>=2"
        )
    batch = a.group_size * a.prompts_per_step
    if a.minibatches_per_step < 1 or batch % a.minibatches_per_step:
        raise ConfigError(
            f"algorithm.minibatches_per_step={a.minibatches_per_step} must divide the batch "
            f"(prompts_per_step x group_size = {batch})"
        )
    check_choice("algorithm.kl_type", a.kl_type, ["k1", "k2", "k3"])
    check_choice("algorithm.agg_mode", a.agg_mode,
            ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
    check_choice("algorithm.old_logprobs", a.old_logprobs, ["recompute", "rollout"])
    if a.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_coef={a.kl_coef} must be >= 0")
    if a.tis_cap <= 0 or not (0 < a.icepop_low < a.icepop_high):
        raise ConfigError("algorithm.tis_cap must be > 0 and 0 < algorithm.icepop_low < algorithm.icepop_high")
    if a.epochs < 1:
        raise ConfigError("algorithm.epochs must be >= 1")

    _resolve_fp8_backend_key(cfg.fp8)
    if cfg.rollout.temperature <= 0 or not (0 < cfg.rollout.top_p <= 1):
        raise ConfigError("rollout.temperature must be > 0 and rollout.top_p in (0, 1]")
    if cfg.rollout.max_new_tokens < 1:
        raise ConfigError("rollout.max_new_tokens must be >= 1")
    sci = cfg.rollout.stop_check_interval
    if sci is not None and (isinstance(sci, bool) or not isinstance(sci, int) or sci < 1):
        raise ConfigError(f"rollout.stop_check_interval={sci!r} must be an integer >= 1, or null (1 on CPU, 8 on GPU)")
    for key in ("enable_sleep", "cuda_graphs"):
        if not isinstance(getattr(cfg.rollout, key), bool):
            raise ConfigError(f"rollout.{key}={getattr(cfg.rollout, key)!r} must be true or false")
    _check_rollout_fp8(cfg.rollout.fp8, cfg.model.num_layers)

    if c.interval < 1:
        raise ConfigError(f"calibration.interval={c.interval} must be >= 1")
    if not (isinstance(c.window, int) and not isinstance(c.window, bool) and 1 <= c.window <= c.interval):
        raise ConfigError(f"calibration.window={c.window!r} must be an integer in [1, calibration.interval = "
                          f"{c.interval}]: a calibration pools the first `window` steps of each interval")
    if not 0.0 <= c.ema < 1.0:
        raise ConfigError(f"calibration.ema={c.ema} must be in [0, 1)")
    if not 0.0 < c.lower_min <= 1.0 - a.eps_low:
        raise ConfigError(
            f"calibration.lower_min={c.lower_min} must be in (0, 1 - algorithm.eps_low = {1 - a.eps_low:g}]"
        )
    if c.upper_max < 1.0 + a.eps_high:
        raise ConfigError(
            f"calibration.upper_max={c.upper_max} must be >= 1 + algorithm.eps_high = {1 + a.eps_high:g}"
        )
    # calibration=measure (apply=false) is allowed in a BF16 run: the shadow forward is the model itself
    # and the calib/ metrics (clipped share, negative push) are the BF16 reference of a study's FP8 arms
    if c.enabled and c.apply and cfg.fp8.recipe in (None, "off"):
        raise ConfigError(
            "calibration is on but training FP8 is off (fp8=off): Calibrated Clipping corrects FP8 ratios; "
            "choose an FP8 recipe (e.g. fp8=blockwise), calibration=off, or calibration=measure (apply=false: "
            "log BF16's own calib/ metrics, bounds nominal)"
        )

    m, p = cfg.model, cfg.parallel
    if m.num_attention_heads < 1 or m.hidden_size % m.num_attention_heads and m.kv_channels is None:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; set model.kv_channels explicitly or change the sizes"
        )
    groups = m.num_kv_heads
    if m.num_attention_heads % groups:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} must be a multiple of model.num_query_groups={groups}"
        )
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError("parallel.tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1")
    if m.num_attention_heads % tp or groups % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} must divide model.num_attention_heads="
            f"{m.num_attention_heads} and model.num_query_groups={groups}"
        )
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"parallel.tensor_model_parallel_size={tp} must divide model.ffn_hidden_size={m.ffn_hidden_size}")
    if m.num_layers % pp:
        raise ConfigError(
            f"parallel.pipeline_model_parallel_size={pp} must divide model.num_layers={m.num_layers}"
        )
    if p.micro_batch_size < 1:
        raise ConfigError("parallel.micro_batch_size must be >= 1")

    t = cfg.trainer
    if not isinstance(t.async_save, bool):
        raise ConfigError(f"trainer.async_save={t.async_save!r} must be true or false")
    if t.max_steps < 0 or t.checkpoint_interval < 0 or t.keep_last < 1 or t.max_consecutive_skips < 1:
        raise ConfigError(
            "trainer.max_steps and trainer.checkpoint_interval must be >= 0, trainer.keep_last and "
            "trainer.max_consecutive_skips >= 1"
        )
    o = cfg.optim
    if not (o.lr > 0 and math.isfinite(o.lr)):
        raise ConfigError(f"optim.lr={o.lr} must be a positive number")
    if o.grad_clip <= 0:
        raise ConfigError(f"optim.grad_clip={o.grad_clip} must be > 0")
    if o.distributed is not None and not isinstance(o.distributed, bool):
        raise ConfigError(f"optim.distributed={o.distributed!r} must be true, false or null (null = true on GPU, "
                          "false on CPU)")
    check_choice("logger.progress", cfg.logger.progress, ["auto", "bar", "lines", "none"])
    if any(not isinstance(k, int) or k < 0 for k in cfg.logger.samples) or cfg.logger.samples_per_step < 1:
        raise ConfigError(f"logger.samples={list(cfg.logger.samples)} must list step numbers >= 0 (e.g. "
                          f"logger.samples=[0,10,19]) and logger.samples_per_step={cfg.logger.samples_per_step} be >= 1")
    pr = cfg.trainer.profile
    check_choice("trainer.profile.kind", pr.kind, [None, "torch", "nsys"])
    if not 0 <= pr.start_step <= pr.end_step:
        raise ConfigError(f"trainer.profile.start_step={pr.start_step} and end_step={pr.end_step} must satisfy "
                          "0 <= start_step <= end_step (an inclusive range of RL steps, e.g. start_step=5 end_step=6)")
    if not pr.ranks or any(not isinstance(r, int) or r < 0 for r in pr.ranks):
        raise ConfigError(f"trainer.profile.ranks={list(pr.ranks)} must list global ranks >= 0 (e.g. "
                          "trainer.profile.ranks=[0])")
    st = cfg.stability
    check_choice("stability.action", st.action, ["warn", "stop", "none"])
    if st.patience < 1:
        raise ConfigError(f"stability.patience={st.patience} must be >= 1")
    if not (0 <= st.invalid_threshold < 1):
        raise ConfigError(f"stability.invalid_threshold={st.invalid_threshold} must be in [0, 1) "
                          "(the invalid-response rate above which a step counts as garbled)")
    for key in ("repetitive_threshold", "nonprintable_threshold", "replacement_threshold", "unlikely_threshold",
                "unclosed_answer_threshold"):
        if not 0 <= getattr(st, key) < 1:
            raise ConfigError(f"stability.{key}={getattr(st, key)} must be in [0, 1) (the share of a step above "
                              "which it counts as garbled)")
    if st.repeat_min_chars < 2 or not 0 <= st.repeat_min_frac <= 1:
        raise ConfigError(f"stability.repeat_min_chars={st.repeat_min_chars} must be >= 2 (a repeat holds two "
                          f"copies of its unit) and stability.repeat_min_frac={st.repeat_min_frac} in [0, 1]")
    if not 0 < st.unlikely_prob < 1:
        raise ConfigError(f"stability.unlikely_prob={st.unlikely_prob} must be in (0, 1) (the BF16 probability "
                          "below which a sampled token counts as very unlikely, e.g. 1e-4)")
    check_choice("task.on_error", cfg.task.on_error, ["raise", "skip"])
    w = cfg.warmup
    if w.steps < 0 or w.batch_size < 1 or w.eval_interval < 1 or w.eval_size < 1:
        raise ConfigError("warmup.steps must be >= 0, warmup.batch_size, eval_interval and eval_size >= 1")
    if w.target_accuracy is not None and not 0.0 < w.target_accuracy <= 1.0:
        raise ConfigError(f"warmup.target_accuracy={w.target_accuracy} must be in (0, 1] (or null to run all steps)")
    if cfg.stability.window < 1 or cfg.stability.surge_factor <= 1.0 or cfg.stability.surge_min_rise < 0:
        raise ConfigError("stability.window must be >= 1, stability.surge_factor > 1 and stability.surge_min_rise "
                          ">= 0")
    return cfg
