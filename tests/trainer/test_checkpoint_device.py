"""``CheckpointManager`` finds the model's device itself (issue 39: on the H200 a ``CheckpointManager(d)``
without ``device`` ran megatron's checkpoint code inside the CPU shims in an NCCL process, which refuse).

The NCCL process is faked on CPU: a one-rank gloo group whose ``get_backend()`` answers ``nccl``; the
megatron reads and writes are replaced by recorders that enter ``cpu_megatron`` with the device they
were given, as the real ones do (the shims refuse to activate for a CPU device in an NCCL process).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from nemo_fp8rl.models.cpu_schedules import cpu_megatron
from nemo_fp8rl.trainer import checkpoint
from nemo_fp8rl.trainer.checkpoint import CheckpointManager, infer_device

FP = {"k": 1}


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo default group (the one already there if some test made one)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


@pytest.fixture
def recorders(monkeypatch):
    """Replace megatron's sharded save/load with recorders of the device they are given."""
    seen = []

    def save(sharded, directory, device):
        seen.append(("save", torch.device(device)))
        with cpu_megatron("checkpoint", device=device):
            pass

    def load(template, directory, device):
        seen.append(("load", torch.device(device)))
        with cpu_megatron("checkpoint", device=device):
            return template

    monkeypatch.setattr(checkpoint, "dist_save", save)
    monkeypatch.setattr(checkpoint, "dist_load", load)
    return seen


def _fake_nccl(monkeypatch):
    real = dist.get_backend
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group is None else real(group))


def test_nccl_process_saves_and_loads_without_the_cpu_shims(tmp_path, one_rank_group, recorders, monkeypatch):
    _fake_nccl(monkeypatch)
    sharded = {"model": {"w": torch.zeros(3)}}
    mgr = CheckpointManager(str(tmp_path))  # no device: what the H200's GPU test did
    mgr.save(1, {"local": 1}, FP, sharded=sharded)
    ck = mgr.load(1, FP)
    ck.load_sharded(sharded)
    assert [(what, d.type) for what, d in recorders] == [("save", "cuda"), ("load", "cuda")]


def test_an_explicit_device_wins(tmp_path, one_rank_group, recorders, monkeypatch):
    _fake_nccl(monkeypatch)
    mgr = CheckpointManager(str(tmp_path), device="cpu")
    with pytest.raises(checkpoint.CheckpointError, match="NCCL"):  # the shims' refusal, as asked for
        mgr.save(1, {"local": 1}, FP, sharded={"model": {"w": torch.zeros(3)}})
    assert recorders == [("save", torch.device("cpu"))]


def test_gloo_infers_the_tensors_device(one_rank_group):
    assert dist.get_backend() == "gloo"
    assert infer_device({"model": {"w": torch.zeros(2)}, "k": [1, "x"]}) == torch.device("cpu")
    # a megatron ShardedTensor-like object: its .data names the device
    off_cpu = types.SimpleNamespace(key="w", data=torch.empty(2, device="meta"))
    assert infer_device({"model": {"a": torch.zeros(1), "w": off_cpu}}).type == "meta"
    assert infer_device({}) == torch.device("cpu")
