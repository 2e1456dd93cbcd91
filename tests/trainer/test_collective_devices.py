"""Tensor collectives of the trainer and the checkpoint put their tensors on the device the default
backend needs (``comm_device()``): NCCL refuses CPU tensors ("No backend type associated with device type
cpu"), so a CPU flag all-reduced after every step stops any multi-GPU run after step 0.

A multi-rank NCCL group needs several GPUs; here it is faked on the CPU: ``dist.get_backend`` answers
``nccl`` (so ``comm_device()`` is ``cuda:0``), torch's ``FakeTensorMode`` makes CUDA tensors without a
GPU, and ``dist.all_reduce`` records the device of what it is given and ends the call there (a fake
tensor has no value to read back).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from nemo_fp8rl.models.checkpointing import _adam_step
from nemo_fp8rl.trainer.rl_trainer import _should_stop

CUDA0 = torch.device("cuda", 0)


class _Reduced(Exception):
    """Raised by the recording all_reduce once it has seen its tensor."""


@pytest.fixture
def nccl_world(monkeypatch):
    """A two-rank NCCL world as the code sees it; returns the devices all_reduce was given."""
    seen = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)
        raise _Reduced

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return seen


@pytest.mark.parametrize("sig", [None, 15])
def test_the_stop_flag_is_reduced_on_the_nccl_device(nccl_world, sig):
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(_Reduced):
        _should_stop(sig)
    assert nccl_world == [CUDA0]


# a plain step count: a tensor would turn fake inside the mode, and a fake tensor has no value for int()
@pytest.mark.parametrize("state", [{0: {"step": 3}}, {}], ids=["stepped", "no_state"])
def test_the_checkpoints_adam_step_is_reduced_on_the_nccl_device(nccl_world, state):
    actor = SimpleNamespace(ddp=None, optimizer=SimpleNamespace(state=state))
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(_Reduced):
        _adam_step(actor)
    assert nccl_world == [CUDA0]


def test_one_rank_needs_no_collective():
    """Without a process group the stop decision is the rank's own signal (no tensor, no collective)."""
    assert not dist.is_initialized()
    assert _should_stop(None) is False
    assert _should_stop(15) is True
