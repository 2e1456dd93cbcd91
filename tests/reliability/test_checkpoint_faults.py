"""Checkpoints survive kill -9 at any moment and refuse corrupt, truncated or mismatched files."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_fp8rl.trainer.checkpoint import CheckpointError, CheckpointManager

WRITER = str(Path(__file__).with_name("_ckpt_writer.py"))
FP = {"model.hidden_size": 128}


def test_kill9_during_checkpoint_writes_never_leaves_a_bad_checkpoint(tmp_path):
    """>= 20 trials: kill -9 the writer at a random moment; the newest complete checkpoint always loads."""
    rng = random.Random(1234)
    deadline = time.time() + 240
    trials = 0
    last_seen = 0
    while trials < 20 and time.time() < deadline:
        proc = subprocess.Popen([sys.executable, WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        first = proc.stdout.readline()  # at least one new checkpoint per trial
        assert first.strip(), "writer did not save"
        time.sleep(rng.uniform(0.0, 0.4))  # then kill somewhere inside later writes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        trials += 1
        mgr = CheckpointManager(str(tmp_path), keep_last=2)
        latest = mgr.latest_step()
        assert latest is not None and latest >= last_seen >= 0
        state = mgr.load(latest, FP)  # resume finds the newest complete checkpoint
        assert state["step"] == latest
        for s in mgr.steps():  # and no complete-looking checkpoint fails to load
            assert mgr.load(s, FP)["step"] == s
        last_seen = latest
    assert trials >= 20, f"only {trials} trials in the time bound"
    # the next writer continues after the newest checkpoint and cleans stale temporaries
    proc = subprocess.Popen([sys.executable, WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert int(proc.stdout.readline()) == last_seen + 1
    proc.kill()
    proc.wait()


def _one(tmp_path, steps=(1, 2)):
    mgr = CheckpointManager(str(tmp_path), keep_last=3)
    for s in steps:
        mgr.save(s, {"step": s, "w": torch.arange(1000.0) + s}, FP)
    return mgr


def test_bit_flip_is_detected_and_named(tmp_path):
    mgr = _one(tmp_path)
    f = tmp_path / "checkpoints" / "step_2" / "rank_0.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_2/rank_0\.pt is corrupt"):
        mgr.load(2, FP)
    assert mgr.load(1, FP)["step"] == 1  # older checkpoints are untouched


def test_truncated_and_missing_files(tmp_path):
    mgr = _one(tmp_path)
    f = tmp_path / "checkpoints" / "step_2" / "rank_0.pt"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        mgr.load(2, FP)
    f.unlink()
    with pytest.raises(CheckpointError, match=r"rank_0\.pt is missing"):
        mgr.load(2, FP)
    (tmp_path / "checkpoints" / "step_2" / "meta.json").unlink()
    assert mgr.latest_step() == 1  # an incomplete directory is never chosen
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        mgr.load(2, FP)


def test_changed_model_config_is_refused_with_keys(tmp_path):
    mgr = _one(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.hidden_size: checkpoint=128 now=64"):
        mgr.load(2, {"model.hidden_size": 64})


def test_keep_last_and_latest_pointer(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    for s in range(1, 6):
        mgr.save(s, {"step": s}, FP)
    assert mgr.steps() == [4, 5]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_5"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_disk_full_leaves_no_partial_checkpoint(small_tmpfs):
    """A real full filesystem (tmpfs of 1 MiB): the write fails clearly, older checkpoints survive."""
    mnt = small_tmpfs("1m")
    mgr = CheckpointManager(str(mnt), keep_last=3)
    mgr.save(1, {"step": 1, "w": torch.zeros(1000)}, FP)
    with pytest.raises(CheckpointError, match="partial checkpoint was removed"):
        mgr.save(2, {"step": 2, "w": torch.zeros(1_000_000)}, FP)  # 4 MB does not fit
    names = sorted(p.name for p in (mnt / "checkpoints").iterdir())
    assert names == ["latest", "step_1"], names
    assert mgr.load(mgr.latest_step(), FP)["step"] == 1
