"""Run a function in 2 gloo processes (CPU) and collect each rank's return value.

The children are fresh interpreters that load the function's file by path, so this works whatever
pytest's import mode is (``prepend`` or ``importlib``). Usage from a test::

    run_gloo(Path(__file__).parent / "_dist_cases.py", "case_name", arg1, ...)

runs ``case_name(rank, world, arg1, ...)`` on every rank of a gloo group and returns the results.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def run_gloo(cases_file: str | os.PathLike, func: str, *args, world: int = 2, timeout: float = 120.0) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "args.pkl"), "wb") as f:
            pickle.dump(args, f)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]),
            OMP_NUM_THREADS="1",
        )
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(cases_file), func, str(rank), str(world), tmp],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
        outputs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=timeout)
                outputs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for rank, (p, out) in enumerate(zip(procs, outputs)):
            if p.returncode != 0:
                raise RuntimeError(f"rank {rank} failed with exit code {p.returncode}:\n{out[-4000:]}")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _child(cases_file: str, func: str, rank: int, world: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_dist_cases_child", cases_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(tmp, "args.pkl"), "rb") as f:
        args = pickle.load(f)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=rank, world_size=world
    )
    try:
        result = getattr(mod, func)(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
