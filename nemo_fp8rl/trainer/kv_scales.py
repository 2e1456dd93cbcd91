"""The trainer's side of the FP8 KV cache: every weight sync ships the scales the rollout engine uses.

``rollout.fp8.kv_scales=static``: the engine keeps vLLM's default scales (1.0); a sync is just a sync.

``rollout.fp8.kv_scales=calibrated`` (NeMo RL's per-step recalibration): at every weight sync the synced
weights stream through a high-precision forward of the rollout model over calibration sequences
(:class:`nemo_fp8rl.rollout.kv_calibration.KvAmaxCollector`, no second export of the weights); per layer
the percentile amax of |q|, |k|, |v| is reduced with ``max`` over all ranks and turned into scales
(``amax * margin / M``), which go to the engine right after the sync (:meth:`KvScaleSync.sync`).

Which sequences: the latest rollout batch of this rank (prompts and responses: the keys and values the
next rollout will cache look like these), given by :meth:`KvScaleSync.observe` after each rollout: its
first response of every prompt group, in order, while they fit ``rollout.fp8.kv_calib_max_tokens``. Before
the first rollout of a fresh run there is none: ``algorithm.prompts_per_step / DP`` prompts are drawn
from the task with a generator seeded by (seed, DP rank), leaving the task's prompt stream untouched. The
batch is part of the checkpoint (:meth:`state_dict`), so a resumed run calibrates exactly as the
uninterrupted one would have.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from nemo_fp8rl.algorithms import make_metric
from nemo_fp8rl.fp8.kv_cache import KvScales

__all__ = ["KvScaleSync"]

log = logging.getLogger(__name__)

_SEED_OFFSET = 941  # the calibration prompts' stream: seed * 1000 + 941 + DP rank


class KvScaleSync:
    """Weight syncs that carry the rollout engine's FP8 KV-cache scales.

    Args:
        setup: :class:`~nemo_fp8rl.rollout.fp8_setup.RolloutFp8Setup` of the run.
        model_cfg: the policy's :class:`~nemo_fp8rl.config.model.ModelConfig`.
        task: the run's task (calibration prompts before the first rollout: ``task.prompts(n, generator)``).
        seed, dp_rank: the run's seed and this rank's data-parallel index.
        prompts: how many prompts to draw before the first rollout.
        group_size: responses per prompt in a rollout batch (``algorithm.group_size``).
        device: where the high-precision forward runs (the actor's device).
        pad_id: padding id of the calibration batch.
    """

    def __init__(self, setup: Any, model_cfg: Any, *, task: Any, seed: int, dp_rank: int, prompts: int,
                 group_size: int = 1, device: Any = "cpu", pad_id: int = 0) -> None:
        self.setup = setup
        self.enabled = bool(setup.calibrated)
        self.model_cfg = model_cfg
        self.task, self.seed, self.dp_rank, self.prompts = task, int(seed), int(dp_rank), max(1, int(prompts))
        self.group_size = max(1, int(group_size))
        self.device = torch.device(device)
        self.pad_id = int(pad_id)
        self._tokens: Optional[torch.Tensor] = None  # [B, T] the latest rollout batch (calibration data)
        self._lengths: Optional[torch.Tensor] = None  # [B]
        self.scales: Optional[KvScales] = None
        """The scales shipped with the last sync (None before the first calibrated sync)."""

    # ------------------------------------------------------------------ the sync
    def sync(self, engine: Any, weights: Any) -> Dict[str, Any]:
        """``engine.update_weights(weights)``, and with calibrated scales the scales of these weights,
        computed while they stream to the engine and set on it right after. Collective when the job has
        several ranks (a ``max`` all-reduce). Returns metrics: ``kv/{q,k,v}_scale_max``, the largest scale
        over the layers (empty when static)."""
        if not self.enabled:
            engine.update_weights(weights)
            return {}
        from nemo_fp8rl.rollout.kv_calibration import KvAmaxCollector, kv_scales_from_amax
        from nemo_fp8rl.rollout.model import ModelShape

        tokens, lengths = self._data()
        collector = KvAmaxCollector(ModelShape.from_config(self.model_cfg), tokens, lengths, self.device)
        engine.update_weights(collector.tee(weights))
        pamax = collector.percentile_amax(self.setup.kv_calib_percentile).to(self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(pamax, op=dist.ReduceOp.MAX)  # every engine gets the same, most conservative scales
        self.scales = kv_scales_from_amax(pamax.cpu(), self.setup.kv_cache, self.setup.kv_calib_margin)
        engine.set_kv_scales(self.scales)
        return {f"kv/{n}_scale_max": make_metric(getattr(self.scales, n).max(), "max") for n in ("q", "k", "v")}

    def observe(self, batch: Any) -> None:
        """Keep the rollout batch's calibration rows for the next sync: the first response of each prompt group
        (rows 0, G, 2G, ... of ``tokens`` [B, T]; lengths ``prompt_lens + response_lens``), in order, while
        their tokens fit ``kv_calib_max_tokens`` (at least one row)."""
        if not self.enabled:
            return
        rows = torch.arange(0, batch.tokens.shape[0], self.group_size)
        lengths = (batch.prompt_lens + batch.response_lens).detach().cpu()[rows]
        keep = int((lengths.cumsum(0) <= self.setup.kv_calib_max_tokens).sum().clamp(min=1))
        rows, lengths = rows[:keep], lengths[:keep]
        self._tokens = batch.tokens.detach().cpu()[rows, : int(lengths.max())].clone()
        self._lengths = lengths.clone()

    def _data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The calibration batch: the latest rollout's, or (first sync of a fresh run) seeded task prompts."""
        if self._tokens is not None:
            return self._tokens, self._lengths
        g = torch.Generator().manual_seed(self.seed * 1000 + _SEED_OFFSET + self.dp_rank)
        ids = [p.ids for p in self.task.prompts(self.prompts, generator=g)]
        lengths = torch.tensor([len(i) for i in ids])
        tokens = torch.full((len(ids), int(lengths.max())), self.pad_id, dtype=torch.long)
        for b, i in enumerate(ids):
            tokens[b, : len(i)] = torch.as_tensor(i, dtype=torch.long)
        log.info("FP8 KV-cache scales: the first sync calibrates on %d task prompts (no rollout yet)", len(ids))
        return tokens, lengths

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> Optional[dict]:
        """The calibration batch of the next sync (None when static or before the first rollout)."""
        if not self.enabled or self._tokens is None:
            return None
        return {"tokens": self._tokens, "lengths": self._lengths}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore :meth:`state_dict` (None, e.g. a checkpoint without an FP8 KV cache: seeded prompts next)."""
        if state is None or not self.enabled:
            self._tokens = self._lengths = None
            return
        self._tokens, self._lengths = state["tokens"].long(), state["lengths"].long()
