"""Run a function in 2 gloo processes (CPU) and collect each rank's return value."""

from __future__ import annotations

import os
import pickle
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, out_dir: str, fn, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_gloo(fn, *args, world: int = 2) -> list:
    """Spawn ``world`` processes running ``fn(rank, world, *args)`` under a gloo group; return results.

    ``fn`` must be importable (module level). Results are pickled per rank and returned in rank order.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file, tmp, fn, args), nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
