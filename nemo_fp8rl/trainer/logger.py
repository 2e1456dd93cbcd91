"""Per-step metrics: ``metrics.jsonl`` (one object per step), TensorBoard, and a progress display;
sample generations: ``samples.jsonl`` (one object per decoded rollout at the ``logger.samples`` steps:
``step``, ``prompt``, ``question``, ``answer``, ``response``, ``reward``, ``correct``, ``invalid``).

On resume from step N, lines of ``metrics.jsonl`` and ``samples.jsonl`` for steps >= N are dropped
(they belong to the trajectory that was lost) and TensorBoard events from step N on are purged, so
every step appears exactly once.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

PROGRESS_KEYS = ("reward/mean", "policy/entropy", "clip/lower", "clip/upper", "clip/low_frac")


def truncate_jsonl(path: Path, first_dropped_step: int) -> int:
    """Keep only well-formed lines with ``step < first_dropped_step``; returns the lines kept."""
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < first_dropped_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)
    return len(kept)


class MetricsLogger:
    """Writes every step's metrics; only the global rank 0 writes."""

    def __init__(self, output_dir: str, *, tensorboard: bool, progress: str, max_steps: int,
                 start_step: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.samples_path = Path(output_dir) / "samples.jsonl"
        self.max_steps = max_steps
        self.tb = None
        self.mode = progress
        if progress == "auto":
            self.mode = "bar" if sys.stdout.isatty() else "lines"
        self._t0 = time.time()
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(self.path, start_step) if self.path.exists() else self.path.touch()
        truncate_jsonl(self.samples_path, start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(output_dir) / "tb"), purge_step=start_step if start_step > 0 else None)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        rec = {"step": step}
        rec.update({k: (v if isinstance(v, (int, float)) and math.isfinite(v) else (None if isinstance(v, float) else v))
                    for k, v in sorted(metrics.items())})
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        self._progress(step, metrics)

    def log_samples(self, step: int, records: List[dict]) -> None:
        """Append ``records`` (decoded generations of ``step``) to ``samples.jsonl``, one line each."""
        if not self.enabled or not records:
            return
        with open(self.samples_path, "a") as f:
            for r in records:
                f.write(json.dumps({"step": step, **r}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _progress(self, step: int, m: Dict[str, float]) -> None:
        if self.mode == "none":
            return
        parts = [f"{k.split('/')[-1]}={m[k]:.3f}" for k in PROGRESS_KEYS if k in m and m[k] is not None]
        if "calib/alpha_bf16" in m:
            parts.append(f"alpha_bf16={m['calib/alpha_bf16']:.3f} alpha_fp8={m.get('calib/alpha_fp8_nominal', float('nan')):.3f}")
        elapsed = time.time() - self._t0
        line = f"step {step + 1}/{self.max_steps} " + " ".join(parts) + f" [{elapsed:.0f}s]"
        if self.mode == "bar":
            width = 20
            done = int(width * (step + 1) / max(1, self.max_steps))
            sys.stdout.write("\r[" + "#" * done + "." * (width - done) + "] " + line[:160])
            if step + 1 >= self.max_steps:
                sys.stdout.write("\n")
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def read_metrics(output_dir: str, name: str = "metrics.jsonl") -> list[dict]:
    """All records of ``<output_dir>/metrics.jsonl`` (or ``name``, e.g. ``samples.jsonl``), skipping a cut
    last line."""
    path = Path(output_dir) / name
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


