"""Run a function of a scenarios file in N fresh processes launched like ``torchrun`` would.

Shared by ``tests/models`` and ``tests/hf`` (each binds its own ``_scenarios.py``). Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in its
environment, so ``nemo_fp8rl.models.init_distributed`` takes its torchrun path (gloo on CPU). The
children load the scenario file by path, call ``func(*args)``, and ``torch.save`` the return value;
the parent returns the list of per-rank results. Works whatever pytest's import mode is.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenarios: Path, func: str, *args, world: int = 2, timeout: float = 300.0) -> list:
    """Run ``scenarios.func(*args)`` on ``world`` gloo ranks; returns the per-rank return values."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "args.pkl"), "wb") as f:
            pickle.dump(args, f)
        port = str(_free_port())
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]))
            procs.append(subprocess.Popen([sys.executable, __file__, str(scenarios), func, tmp], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        failed = [(rank, p.returncode, out) for rank, (p, out) in enumerate(zip(procs, outs)) if p.returncode != 0]
        if failed:
            raise RuntimeError("\n".join(f"--- rank {r} exited with {rc}:\n{out[-5000:]}" for r, rc, out in failed))
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _child(scenarios: str, func: str, tmp: str) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_scenarios_child", scenarios)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(tmp, "args.pkl"), "rb") as f:
        args = pickle.load(f)
    from nemo_fp8rl.models import destroy_distributed

    try:
        result = getattr(mod, func)(*args)
    finally:
        destroy_distributed()
    torch.save(result, os.path.join(tmp, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])
