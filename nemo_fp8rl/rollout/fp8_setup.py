"""The rollout model's FP8 setup from a config: scheme, KV cache, its scales, high-precision edge layers.

One place turns ``rollout.fp8`` (and whether training runs FP8 at all) into what an engine is built with,
so the trainer, the memory planner and tools that score tokens under the rollout's numerics (e.g. an FP8
audit) agree::

    setup = rollout_fp8_setup(cfg)                 # a TrainConfig (or its rollout.fp8 + layer count)
    engine = get_rollout_engine("torch", model_cfg, eos_id=..., pad_id=..., **setup.engine_kwargs())
    logp = score_logprobs(model_cfg, weights, tokens, setup, kv_scales=...)   # teacher-forced, [B, T]

A BF16 run (training FP8 off) is high precision end to end: its rollout has no FP8 scheme and no FP8 KV
cache, whatever ``rollout.fp8`` says. Importing this module loads no torch (the launcher's memory plan uses it
on a submit host); :func:`score_logprobs` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["RolloutFp8Setup", "edge_layers", "rollout_fp8_setup", "score_logprobs"]


def edge_layers(num_layers: int, first: int = 0, last: int = 0) -> tuple[int, ...]:
    """Indices of the first ``first`` and the last ``last`` of ``num_layers`` decoder layers, sorted
    (``rollout.fp8.num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16``)."""
    if first < 0 or last < 0:
        raise ValueError(f"edge layer counts must be >= 0, got first={first}, last={last}")
    return tuple(sorted(set(range(min(first, num_layers))) | set(range(max(0, num_layers - last), num_layers))))


@dataclass(frozen=True)
class RolloutFp8Setup:
    """The rollout engine's FP8, resolved.

    ``scheme``: the linears' FP8 scheme name (``off`` in a BF16 run); ``kv_cache``: ``off`` | ``e4m3`` |
    ``e5m2``; ``kv_scales``: ``static`` | ``calibrated``; ``high_precision_layers``: decoder layers kept out
    of FP8 (linears and KV cache); ``kv_calib_percentile``, ``kv_calib_margin``, ``kv_calib_max_tokens``: the
    calibration recipe.
    """

    scheme: str = "off"
    kv_cache: str = "off"
    kv_scales: str = "static"
    high_precision_layers: tuple[int, ...] = ()
    kv_calib_percentile: float = 99.9
    kv_calib_margin: float = 1.05
    kv_calib_max_tokens: int = 65536

    @property
    def kv_on(self) -> bool:
        """Whether the KV cache is FP8."""
        return self.kv_cache != "off"

    @property
    def calibrated(self) -> bool:
        """Whether the trainer computes the KV-cache scales (an FP8 cache with ``kv_scales=calibrated``)."""
        return self.kv_on and self.kv_scales == "calibrated"

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~nemo_fp8rl.rollout.get_rollout_engine` (either engine)."""
        return {"fp8_scheme": self.scheme, "kv_cache": self.kv_cache,
                "high_precision_layers": self.high_precision_layers}

    def describe(self) -> str:
        """One line for logs: ``scheme vllm_w8a8, KV cache e4m3 (calibrated scales), layers [0, 27] high precision``."""
        kv = f"KV cache {self.kv_cache} ({self.kv_scales} scales)" if self.kv_on else "KV cache in high precision"
        hp = f", layers {list(self.high_precision_layers)} high precision" if self.high_precision_layers else ""
        return f"scheme {self.scheme}, {kv}{hp}"


def rollout_fp8_setup(cfg: Any, num_layers: Optional[int] = None, training_fp8: Optional[bool] = None) -> RolloutFp8Setup:
    """The rollout's FP8 from a config.

    Args:
        cfg: a :class:`~nemo_fp8rl.config.schema.TrainConfig` (then ``num_layers`` and ``training_fp8`` come
            from ``model.num_layers`` and ``fp8.recipe``), or its ``rollout.fp8`` section
            (:class:`~nemo_fp8rl.config.schema.RolloutFp8Config`) with both given.
        num_layers: decoder layers of the model (for the edge layers).
        training_fp8: whether training runs an FP8 recipe; False forces the rollout to high precision.
    """
    if hasattr(cfg, "rollout"):
        r = cfg.rollout.fp8
        num_layers = cfg.model.num_layers if num_layers is None else num_layers
        training_fp8 = cfg.fp8.recipe not in (None, "off") if training_fp8 is None else training_fp8
    else:
        r = cfg
    if num_layers is None or training_fp8 is None:
        raise TypeError("rollout_fp8_setup(rollout.fp8 section, ...) needs num_layers and training_fp8")
    calib = dict(kv_calib_percentile=float(r.kv_calib_percentile), kv_calib_margin=float(r.kv_calib_margin),
                 kv_calib_max_tokens=int(r.kv_calib_max_tokens))
    if not training_fp8:
        return RolloutFp8Setup(**calib)
    return RolloutFp8Setup(
        scheme=r.scheme, kv_cache=r.kv_cache, kv_scales=r.kv_scales,
        high_precision_layers=edge_layers(int(num_layers), r.num_layers_at_start_in_bf16, r.num_layers_at_end_in_bf16),
        **calib,
    )


def score_logprobs(
    model_cfg: Any,
    weights: Any,
    tokens: Any,
    setup: RolloutFp8Setup,
    *,
    kv_scales: Any = None,
    kv_kernel: str = "cuda",
    train_recipe: Any = None,
    temperature: float = 1.0,
    device: Any = "cpu",
    dtype: Any = None,
    high_precision_layers: Optional[Sequence[int]] = None,
) -> Any:
    """Teacher-forced log-probs of ``tokens`` [B, T] under the rollout's numerics -> float32 [B, T] (CPU).

    ``out[b, t] = log_softmax(logits[b, t - 1] / temperature)[tokens[b, t]]``, ``out[b, 0] = 0`` (the layout
    of ``RolloutBatch.rollout_logp``). The forward is the torch engine's no-cache path, which attends to
    keys and values exactly as its FP8 cache would return them.

    Args:
        model_cfg: :class:`~nemo_fp8rl.config.model.ModelConfig` (``vocab_size`` set).
        weights: Hugging Face-named state dict or stream of ``(name, tensor)`` pairs.
        setup: :func:`rollout_fp8_setup` (or a :class:`RolloutFp8Setup` built by hand: e.g. one layer at a
            time in ``high_precision_layers`` to rank the layers by their share of the mismatch).
        kv_scales: :class:`~nemo_fp8rl.fp8.kv_cache.KvScales` (None: vLLM's static 1.0).
        kv_kernel: ``cuda`` (vLLM on GPU) | ``cpu`` (vLLM-CPU).
        train_recipe: the training recipe, for the ``same_as_train`` scheme.
        device, dtype: where and in which dtype the engine computes (default float32).
        high_precision_layers: overrides ``setup.high_precision_layers``.
    """
    import torch

    from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine

    dtype = torch.float32 if dtype is None else dtype

    kw = setup.engine_kwargs()
    if high_precision_layers is not None:
        kw["high_precision_layers"] = tuple(high_precision_layers)
    engine = TorchRolloutEngine(model_cfg, train_recipe=train_recipe, eos_id=0, pad_id=0, device=device, dtype=dtype,
                                kv_kernel=kv_kernel, **kw)
    try:
        engine.update_weights(weights, kv_scales=kv_scales)
        return engine.logprobs(tokens, temperature=temperature)
    finally:
        engine.close()
