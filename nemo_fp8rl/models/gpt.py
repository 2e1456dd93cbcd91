"""Build a megatron-core ``GPTModel`` (this rank's pipeline stage) from our ``ModelConfig``.

``ModelConfig`` field names follow megatron's ``TransformerConfig``; :func:`make_transformer_config`
adds what our runs always need:

- no dropout (RL fine-tuning), ``calculate_per_token_loss=True`` (megatron does not divide the loss by
  the number of microbatches; the actor normalises by global token/sequence counts itself),
  ``variable_seq_lengths=True`` (pipeline stages exchange activation shapes, so microbatches may
  differ in length and size);
- CPU: ``use_cpu_initialization``, no fused kernels (no apex / TE on CPU), gloo-friendly settings;
- GPU: float32 master parameters with BF16 autocast by default (``params_dtype: bfloat16`` gives BF16
  parameters instead, norm weights included), and with the TE spec the recipe's FP8 fields
  (:meth:`~nemo_fp8rl.fp8.Fp8Recipe.to_megatron_kwargs`).

Megatron's initialisation runs (it also sets the ``tensor_model_parallel`` attributes of sharded
parameters), but its values depend on the layout; the actor overwrites them with
:func:`nemo_fp8rl.models.hf_weights.init_hf_state_dict` through ``load_weights``, which is
independent of the TP/PP layout (same seed -> same model for any layout).

Vocabulary padding follows megatron: rows are padded to a multiple of
``make_vocab_size_divisible_by x TP``; padded logits are masked out of every softmax we compute.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

# padded_vocab_size is Megatron's vocabulary padding, derived once with ModelConfig (ModelConfig.padded_vocab);
# it is exported here too because models/__init__.py and models/actor.py import it from this module.
from nemo_fp8rl.config.model import ModelConfig, ParallelConfig, padded_vocab_size

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def te_available() -> bool:
    """True when CUDA and Transformer Engine are both usable."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def resolve_use_te(use_te: Optional[bool], device: "torch.device | None" = None) -> bool:
    """``None`` -> TE when the model is on CUDA and TE is available; ``True`` without them raises."""
    on_cpu = device is not None and torch.device(device).type == "cpu"
    if use_te is None:
        return te_available() and not on_cpu
    if use_te and on_cpu:
        raise ValueError("use_te=True but the model runs on the CPU (no CUDA, or device='cpu'): Transformer "
                         "Engine needs a GPU; use use_te=None/False for the emulated-FP8 spec")
    if use_te and not te_available():
        raise ValueError(
            "use_te=True needs CUDA and transformer_engine; pass use_te=None/False to use the "
            "emulated-FP8 local spec (CPU), or install the GPU extra on a CUDA machine"
        )
    return bool(use_te)


def resolve_model_fp8_backend(fp8_backend: Optional[str], use_te: Optional[bool],
                              device: "torch.device | None" = None) -> str:
    """``fp8.backend`` (or the older ``use_te`` switch) -> ``te`` | ``torch`` | ``emulate`` for a model on ``device``.

    ``fp8_backend=None`` with ``use_te=None``: ``te`` when Transformer Engine imports on a GPU, else
    ``torch`` on an FP8-capable GPU, else ``emulate``. ``use_te=True`` means ``te``; ``use_te=False``
    means ``emulate`` unless ``fp8_backend`` names another non-TE backend.
    """
    from nemo_fp8rl.fp8.backends import resolve_fp8_backend

    if fp8_backend == "te" or use_te:
        resolve_use_te(True, device)  # raises naming what is missing
        if fp8_backend not in (None, "te"):
            raise ValueError(f"use_te=True contradicts fp8.backend={fp8_backend!r}; set only fp8.backend")
        return "te"
    if fp8_backend == "auto":  # auto = null, plus the per-layer rule the caller applies (layer_filter.py)
        fp8_backend = None
    if use_te is False and fp8_backend is None:
        return "emulate"  # the older switch: use_te=False meant the emulated spec (as fp8.use_te=false does)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    te_ok = use_te is None and device.type == "cuda" and te_available()
    return resolve_fp8_backend(fp8_backend, device, te_available=te_ok)


def validate_model_config(cfg: ModelConfig) -> None:
    """Reject shapes megatron would fail on later, naming the key to change."""
    if cfg.vocab_size is None or cfg.vocab_size < 1:
        raise ValueError("model.vocab_size is not set; it is taken from the task tokenizer - set "
                         "model.vocab_size (or build the task first and pass its tokenizer's size)")
    if cfg.normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"model.normalization={cfg.normalization!r}; use RMSNorm or LayerNorm")
    if cfg.activation not in ("swiglu", "gelu"):
        raise ValueError(f"model.activation={cfg.activation!r}; use swiglu or gelu")
    if cfg.params_dtype not in _DTYPES:
        raise ValueError(f"model.params_dtype={cfg.params_dtype!r}; use one of {sorted(_DTYPES)}")
    if cfg.kv_channels is None and cfg.hidden_size % cfg.num_attention_heads != 0:
        raise ValueError(
            f"model.hidden_size={cfg.hidden_size} is not divisible by model.num_attention_heads="
            f"{cfg.num_attention_heads}; set model.kv_channels (head dim) explicitly"
        )
    head_dim = cfg.head_dim
    if head_dim % 2 != 0:
        raise ValueError(f"head dim {head_dim} must be even for RoPE; change model.kv_channels")
    groups = cfg.num_kv_heads
    if cfg.num_attention_heads % groups != 0:
        raise ValueError(
            f"model.num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"model.num_query_groups={groups}"
        )
    if cfg.rope_scaling_factor is not None and cfg.rope_scaling_factor <= 0:
        raise ValueError("model.rope_scaling_factor must be > 0 (or null for no scaling)")


def make_transformer_config(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    fp8_recipe=None,
    use_te: bool = False,
    device: "torch.device | str | None" = None,
):
    """megatron ``TransformerConfig`` for our model and layout (FP8 fields only on the TE path)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_fp8rl.models.parallel import resolve_device

    validate_model_config(model_cfg)
    on_gpu = resolve_device(device).type == "cuda"
    params_dtype = _DTYPES[model_cfg.params_dtype]
    if not on_gpu and params_dtype != torch.float32:
        raise ValueError(f"model.params_dtype={model_cfg.params_dtype} on CPU: the CPU path runs float32 "
                         "(FP8 is emulated on top); set model.params_dtype=float32")
    if parallel_cfg.sequence_parallel and not use_te:
        raise ValueError("parallel.sequence_parallel=true needs the Transformer Engine spec (megatron's torch "
                         "norms reject it); set parallel.sequence_parallel=false or run on GPU with TE")
    # GPU with float32 parameters: BF16 compute via autocast, float32 master weights for AdamW.
    autocast = on_gpu and params_dtype == torch.float32
    kw = dict(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.kv_channels,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        normalization=model_cfg.normalization,
        layernorm_epsilon=model_cfg.norm_epsilon,
        gated_linear_unit=model_cfg.activation == "swiglu",
        activation_func=F.silu if model_cfg.activation == "swiglu" else F.gelu,
        add_bias_linear=model_cfg.add_bias_linear,
        add_qkv_bias=model_cfg.add_qkv_bias,
        qk_layernorm=model_cfg.qk_layernorm,
        init_method_std=model_cfg.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        enable_autocast=autocast,
        autocast_dtype=torch.bfloat16 if autocast else None,
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        use_cpu_initialization=not on_gpu,
        # Megatron's own init runs (it also tags sharded parameters with `tensor_model_parallel`, which
        # the grad-norm and checkpoint code rely on); the actor then overwrites the values.
        perform_initialization=True,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        # Dense model; megatron rejects variable_seq_lengths with its default MoE dispatcher name anyway.
        moe_token_dispatcher_type="alltoall",
        # = megatron's default "full" (whole layer), without its deprecation warning; no CUDA graphs are used.
        cuda_graph_scope=[],
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=False,
    )
    if use_te and fp8_recipe is not None:
        kw.update(fp8_recipe.to_megatron_kwargs())
    return TransformerConfig(**kw)


def build_gpt_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    fp8_recipe=None,
    use_te: Optional[bool] = None,
    device: "torch.device | str | None" = None,
    fp8_backend: Optional[str] = None,
    fp8_auto_tokens: Optional[int] = None,
):
    """Build this rank's stage of the GPT (init_distributed must have run) on ``device`` (None = CUDA
    when available). ``fp8_backend``/``use_te``: see :func:`resolve_model_fp8_backend` (``te`` builds the
    Transformer Engine spec, ``emulate``/``torch`` our linears with that GEMM backend). ``fp8_auto_tokens``:
    ``fp8.backend=auto``'s per-layer rule (``fp8/layer_filter.py``) for micro-batches of that many rows.

    Returns:
        ``(model, report)``: a megatron ``GPTModel`` on the current device (float parameters, not yet
        initialised) and the FP8 conversion report of the emulated spec (None on the TE path).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nemo_fp8rl.fp8.megatron import apply_fp8_to_megatron_model
    from nemo_fp8rl.models.parallel import resolve_device
    from nemo_fp8rl.models.spec import CpuRotaryEmbedding, local_fp8_block_spec, te_layer_spec

    device = resolve_device(device)
    backend = resolve_model_fp8_backend(fp8_backend, use_te, device)
    use_te = backend == "te"
    if fp8_recipe is not None and use_te:
        from nemo_fp8rl.fp8.te import check_block_scale_env

        fp8_recipe.to_megatron_kwargs()  # raises for recipes TE does not have (rowwise)
        check_block_scale_env(fp8_recipe)  # megatron's blockwise recipe takes TE's import-time scale type
    config = make_transformer_config(model_cfg, parallel_cfg, fp8_recipe=fp8_recipe, use_te=use_te, device=device)
    # The local block builds its norms in params_dtype too, so with BF16 parameters every parameter is BF16.
    spec = te_layer_spec(model_cfg.qk_layernorm) if use_te else local_fp8_block_spec(config, model_cfg.qk_layernorm)

    tp = parallel_cfg.tensor_model_parallel_size
    vocab = model_cfg.padded_vocab(tp)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    # We initialise tied embeddings identically on the first and last stage ourselves (load_weights)
    # and all-reduce their gradients in the actor; without an embedding group megatron skips its own
    # start-up all-reduce, which would call `.cuda()` on CPU.
    pg.embd = None
    rope_scaling = model_cfg.rope_scaling_factor is not None
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=model_cfg.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=model_cfg.rotary_base,
        rope_scaling=rope_scaling,
        rope_scaling_factor=model_cfg.rope_scaling_factor or 8.0,
        pg_collection=pg,
    )
    if device.type == "cpu":
        model.rotary_pos_emb = CpuRotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=model_cfg.rotary_base,
            rope_scaling=rope_scaling,
            rope_scaling_factor=model_cfg.rope_scaling_factor or 8.0,
            use_cpu_initialization=True,
            cp_group=pg.cp,
        )
    else:
        model.cuda(torch.cuda.current_device())
    if use_te:
        report = None
        if fp8_recipe is not None:
            log.info("FP8 (%s): Transformer Engine layers (backend=te)", fp8_recipe.name)
    else:
        report = apply_fp8_to_megatron_model(model, fp8_recipe, backend=backend, auto_tokens=fp8_auto_tokens)
    return model, report


__all__ = [
    "te_available",
    "resolve_model_fp8_backend",
    "resolve_use_te",
    "padded_vocab_size",
    "validate_model_config",
    "make_transformer_config",
    "build_gpt_model",
]
