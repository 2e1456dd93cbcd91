"""Checkpoint writer driven by the kill -9 test: saves a trainer-sized state every step, forever."""

import sys

import torch

from nemo_fp8rl.trainer.checkpoint import CheckpointManager

out = sys.argv[1]
mgr = CheckpointManager(out, keep_last=2)
start = (mgr.latest_step() or 0) + 1
g = torch.Generator().manual_seed(0)
for step in range(start, 10**9):
    # about the size of the tiny run's state (weights + AdamW moments), tagged with the step
    state = {"step": step, "w": torch.randn(600_000, generator=g), "m": torch.randn(600_000, generator=g)}
    mgr.save(step, state, {"model.hidden_size": 128})
    print(step, flush=True)
