"""Profile a range of RL steps (``trainer.profile``; docs/design.md, "Profiling").

Where an RL step's time goes is the first question of a slow FP8 run: the GEMMs, the quantizers around
them, the host, or another phase (rollout, weight sync, shadow forwards). The trainer profiles the
steps ``start_step..end_step`` (inclusive) on the ranks listed in ``trainer.profile.ranks``, the way
Megatron's ``--profile`` does:

- ``kind=torch``: ``torch.profiler`` records CPU ops and, on a GPU, CUDA kernels and memory copies over
  the steps, and writes ``<output_dir>/profile/rank<r>_steps<a>-<b>.json`` (a Chrome trace: open it in
  Perfetto or ``chrome://tracing``) and ``rank<r>_steps<a>-<b>.txt`` (the top ops by self time, with
  their counts). Each step phase is a named range in the trace (``phase/rollout``, ``phase/train``, ...:
  :func:`nemo_fp8rl.trainer.timing.timed`).
- ``kind=nsys``: the trainer calls ``cudaProfilerStart`` before the first step of the range and
  ``cudaProfilerStop`` after the last, and pushes an NVTX range per phase while profiling; Nsight Systems
  run as ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop ...`` records exactly
  those steps. Needs CUDA.

A run that stops inside the range (a signal, ``trainer.max_steps``, an error) writes the steps it
profiled when the trainer closes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from nemo_fp8rl.config.schema import ConfigError, ProfileConfig
from nemo_fp8rl.trainer import timing

__all__ = ["StepProfiler"]

logger = logging.getLogger(__name__)


class StepProfiler:
    """Starts and stops the profiler around the configured steps of one rank.

    Args:
        cfg: ``trainer.profile``.
        rank: this process's global rank.
        world_size: ranks in the job (a listed rank beyond it is an error: nothing would be profiled).
        out_dir: the run's ``output_dir``; files go to ``<out_dir>/profile/``.

    Raises:
        ConfigError: ``kind=nsys`` without CUDA, or ``ranks`` naming no rank of this job.
    """

    def __init__(self, cfg: ProfileConfig, rank: int, world_size: int, out_dir: Path) -> None:
        self.cfg = cfg
        self.enabled = cfg.kind is not None and rank in cfg.ranks
        self.rank = rank
        self.dir = Path(out_dir) / "profile"
        self._prof: Optional[torch.profiler.profile] = None
        self._nsys_on = False
        self._first: Optional[int] = None
        self._last: Optional[int] = None
        if cfg.kind is None:
            return
        missing = [r for r in cfg.ranks if r >= world_size]
        if missing:
            raise ConfigError(f"trainer.profile.ranks={list(cfg.ranks)}: the job has {world_size} rank(s) "
                              f"(0..{world_size - 1}), so {missing} would profile nothing; list ranks below {world_size}")
        if cfg.kind == "nsys" and not torch.cuda.is_available():
            raise ConfigError("trainer.profile.kind=nsys needs a CUDA GPU (Nsight Systems records GPU work, started "
                              "by cudaProfilerStart); on a CPU use trainer.profile.kind=torch")

    @property
    def active(self) -> bool:
        """Whether the steps run now are being profiled."""
        return self._prof is not None or self._nsys_on

    def before_step(self, step: int) -> None:
        """Start profiling if ``step`` is the range's first (or the run resumed inside the range)."""
        if not self.enabled or self.active or not self.cfg.start_step <= step <= self.cfg.end_step:
            return
        self._first = step
        if self.cfg.kind == "torch":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            timing.device_sync()  # the trace starts with the device idle: no kernel of an earlier step in it
            self._prof = torch.profiler.profile(activities=activities, record_shapes=self.cfg.record_shapes)
            self._prof.__enter__()
        else:
            timing.device_sync()
            torch.cuda.profiler.start()  # cudaProfilerStart, its error checked
            timing.set_nvtx(True)
            self._nsys_on = True
        logger.info("profile (%s): rank %d from step %d to step %d", self.cfg.kind, self.rank, step, self.cfg.end_step)

    def after_step(self, step: int) -> None:
        """Stop and write the profile after the range's last step."""
        if self.active:
            self._last = step
            if step >= self.cfg.end_step:
                self.stop()

    def stop(self) -> None:
        """Stop profiling and write what was recorded (idempotent; the trainer calls it when it closes)."""
        if self._nsys_on:
            timing.device_sync()
            timing.set_nvtx(False)
            torch.cuda.profiler.stop()  # cudaProfilerStop
            self._nsys_on = False
            logger.info("profile (nsys): rank %d stopped after step %s (cudaProfilerStop)", self.rank, self._last)
        if self._prof is None:
            return
        timing.device_sync()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if self._last is None:  # stopped before its first step finished: nothing to write
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"rank{self.rank}_steps{self._first}-{self._last}"
        prof.export_chrome_trace(str(stem) + ".json")
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages(group_by_input_shape=self.cfg.record_shapes).table(sort_by=sort_by, row_limit=40)
        (Path(str(stem) + ".txt")).write_text(
            f"torch.profiler, rank {self.rank}, steps {self._first}-{self._last}, sorted by {sort_by}\n{table}\n")
        logger.info("profile (torch): rank %d steps %d-%d written to %s.{json,txt}", self.rank, self._first,
                    self._last, stem)
