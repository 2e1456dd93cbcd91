"""Run a function of ``tests/hf/_scenarios.py`` in N fresh processes set up as ``torchrun`` would.

The same pattern as ``tests/models/_dist.py`` (torchrun environment variables -> gloo world via
``init_distributed``; results come back through ``torch.save``), pointed at this folder's scenarios.
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

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(func: str, *args, world: int = 2, timeout: float = 300.0) -> list:
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
            procs.append(subprocess.Popen([sys.executable, __file__, func, tmp], env=env,
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


def _child(func: str, tmp: str) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_hf_scenarios_child", _HERE / "_scenarios.py")
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
    _child(sys.argv[1], sys.argv[2])
