"""Teacher-forced log-probs of the sampled tokens under each configuration's numerics.

- Rollout configurations: the torch rollout engine (:class:`~nemo_fp8rl.rollout.torch_engine.TorchRolloutEngine`,
  the same numerics as :func:`nemo_fp8rl.rollout.fp8_setup.score_logprobs`), built once per configuration and
  run over the sequences in row chunks (``audit.score_batch``: the [rows, T, vocab] logits of a chunk are
  what is held at once). Calibrated KV-cache scales come from
  :func:`~nemo_fp8rl.rollout.kv_calibration.calibrate_kv_scales` over the sampled sequences.
- Training recipes: the trainer's own model (:func:`~nemo_fp8rl.models.build_actor` with the recipe and
  ``fp8.backend``, the weights loaded through ``load_weights``): ``get_logprobs`` (FP8) against
  ``get_shadow_logprobs`` (the same model with FP8 off), as Calibrated Clipping's shadow forward does.
- Layer ranking: the ranked configuration's engine with one layer at a time swapped for its high-precision
  version (:class:`LayerSwapper`; equal to an engine built with ``high_precision_layers=[i]``, tested), so
  the model is quantized once instead of once per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

import torch

__all__ = ["EngineFactory", "LayerSwapper", "calibrated_kv_scales", "score_engine", "score_train_recipe"]


@dataclasses.dataclass
class EngineFactory:
    """Builds torch rollout engines over the audited weights: ``device``, ``dtype``, ``fp8_gemm``
    (``emulate`` | ``torch``), the training recipe for ``same_as_train``, the tokenizer's end and padding ids
    (where sampling stops, and which ids :func:`~nemo_fp8rl.audit.sampling.sample_responses` suppresses)."""

    model_cfg: Any
    weights: Any
    device: torch.device
    dtype: torch.dtype
    fp8_gemm: str = "emulate"
    train_recipe: Any = None
    eos_id: int = 0
    eos_ids: Optional[Sequence[int]] = None
    pad_id: int = 0

    def build(self, scheme: str = "off", kv_cache: str = "off", kv_kernel: str = "cuda",
              high_precision_layers: Iterable[int] = (), kv_scales: Any = None):
        from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine

        eng = TorchRolloutEngine(self.model_cfg, fp8_scheme=scheme, train_recipe=self.train_recipe, eos_id=self.eos_id,
                                 eos_ids=self.eos_ids, pad_id=self.pad_id, device=self.device, dtype=self.dtype, fp8_gemm=self.fp8_gemm, kv_cache=kv_cache,
                                 kv_kernel=kv_kernel, high_precision_layers=tuple(high_precision_layers))
        eng.update_weights(self.weights, kv_scales=kv_scales)
        return eng

    def high_precision(self):
        """FP8 off everywhere; every layer flagged high precision (so its layers can be swapped into an
        FP8 engine by :class:`LayerSwapper`)."""
        return self.build(high_precision_layers=range(self.model_cfg.num_layers))

    def for_setup(self, setup: Any, kv_kernel: str, kv_scales: Any = None):
        return self.build(setup.scheme, setup.kv_cache, kv_kernel, setup.high_precision_layers, kv_scales)


@torch.no_grad()
def score_engine(engine: Any, tokens: torch.Tensor, lengths: torch.Tensor, *, temperature: float = 1.0,
                 batch: int = 4) -> torch.Tensor:
    """``engine.logprobs`` of ``tokens`` [B, T] in chunks of ``batch`` rows, each cut to its longest row
    (``lengths`` [B]); float32 [B, T] on CPU, 0 beyond a row's length."""
    B, T = tokens.shape
    out = torch.zeros((B, T), dtype=torch.float32)
    for lo in range(0, B, batch):
        hi = min(B, lo + batch)
        t = int(lengths[lo:hi].max())
        out[lo:hi, :t] = engine.logprobs(tokens[lo:hi, :t], temperature=temperature)
    return out * (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1))


def calibrated_kv_scales(model_cfg: Any, weights: Any, tokens: torch.Tensor, lengths: torch.Tensor, setup: Any,
                         device: Any, rows: Optional[Sequence[int]] = None) -> Any:
    """The scales the trainer's ``rollout.fp8.kv_scales=calibrated`` would ship for these weights, calibrated on
    rows ``rows`` of the sampled batch (the trainer's choice: the first response of each prompt group) while
    they fit ``kv_calib_max_tokens`` (at least one)."""
    from nemo_fp8rl.rollout.kv_calibration import calibrate_kv_scales
    from nemo_fp8rl.rollout.model import ModelShape

    idx = torch.as_tensor(list(rows) if rows is not None else range(tokens.shape[0]), dtype=torch.long)
    lens = lengths[idx]
    keep = int((lens.cumsum(0) <= setup.kv_calib_max_tokens).sum().clamp(min=1))
    idx, lens = idx[:keep], lens[:keep]
    return calibrate_kv_scales(ModelShape.from_config(model_cfg), weights, tokens[idx, : int(lens.max())], lens,
                               fmt=setup.kv_cache, percentile=setup.kv_calib_percentile,
                               margin=setup.kv_calib_margin, device=device)


class LayerSwapper:
    """Run an FP8 engine with decoder layer ``i`` alone in high precision, without re-quantizing the model.

    ``engine``: the ranked configuration's engine; ``hp_engine``: :meth:`EngineFactory.high_precision` over
    the same weights. :meth:`swap` puts layer i's high-precision weights (flagged high precision, so its
    linears skip the scheme) into ``engine`` and adds i to its KV cache's high-precision layers; the
    context restores both.
    """

    def __init__(self, engine: Any, hp_engine: Any) -> None:
        self.engine, self.hp = engine, hp_engine

    def swap(self, i: int):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            layers = self.engine.weights.layers
            saved = layers[i]
            kv = self.engine.kv
            saved_hp = kv.high_precision_layers if kv is not None else None
            layers[i] = self.hp.weights.layers[i]
            if kv is not None:
                kv.high_precision_layers = frozenset(saved_hp) | {int(i)}
            try:
                yield self.engine
            finally:
                layers[i] = saved
                if kv is not None:
                    kv.high_precision_layers = saved_hp

        return ctx()


def score_train_recipe(cfg: Any, model_cfg: Any, weights: Any, tokens: torch.Tensor, recipe: str, overrides: dict,
                       *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 log-probs, shadow log-probs) [B, T] of ``tokens`` from the trainer's model under ``recipe``.

    The actor is built as the trainer builds it (``parallel.*``, ``fp8.backend``, ``seed``) with the audited
    weights; one process (the audit does not run under torchrun). Its process groups stay up for the next
    recipe; :func:`nemo_fp8rl.models.destroy_distributed` ends them.
    """
    from nemo_fp8rl.fp8.recipes import resolve_recipe
    from nemo_fp8rl.models import build_actor

    rec = resolve_recipe(recipe, **overrides)
    actor = build_actor(dataclasses.replace(model_cfg, hf_path=None), cfg.parallel, fp8_recipe=rec, seed=cfg.seed,
                        lr=cfg.optim.lr, fp8_backend=cfg.fp8.backend)
    actor.load_weights(weights)
    lp, _ = actor.get_logprobs(tokens, temperature=temperature)
    hp, _ = actor.get_shadow_logprobs(tokens, temperature=temperature)
    del actor
    return lp.float().cpu(), hp.float().cpu()
