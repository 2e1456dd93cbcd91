"""The rollout engine against the Megatron actor (integration): same weights via export_weights().

- FP8 off everywhere: the engine's sampled-token log-probs equal the trainer's teacher-forced log-probs.
- Training FP8 on, rollout ``vllm_w8a8``: they differ by the expected FP8 mismatch (~0.1 nat per token
  here; docs/design.md, "FP8"), and the engine still equals the trainer's high-precision shadow forward
  when its own scheme is off.
- ``same_as_train`` reproduces the trainer's FP8 forward exactly on the same batch; in cached decoding
  per-tensor activation scales see other tokens than in the trainer's full forward, so they differ.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._fp8_bounds import assert_fp8_paths_agree, fp8_noise_bound

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "out.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "_actor_parity.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def _masked(o, key, arm, scheme):
    m = o[f"{arm}/{scheme}/mask"].bool()
    assert int(m.sum()) > 100
    return o[f"{arm}/{scheme}/{key}"][m]


def test_export_round_trip_is_exact(parity):
    assert parity["bf16/export_max_err"] == 0.0 and parity["fp8/export_max_err"] == 0.0


def test_fp8_off_rollout_logp_equals_trainer_teacher_forced(parity):
    r = _masked(parity, "rollout_logp", "bf16", "off")
    t = _masked(parity, "trainer_logp", "bf16", "off")
    torch.testing.assert_close(r, t, atol=2e-5, rtol=0)
    assert float(r.mean()) < -0.05  # real, non-degenerate probabilities (not all ~0)
    # the same holds for the FP8 actor's high-precision shadow forward
    torch.testing.assert_close(_masked(parity, "rollout_logp", "fp8", "off"),
                               _masked(parity, "shadow_logp", "fp8", "off"), atol=2e-5, rtol=0)


def test_fp8_rollout_differs_from_fp8_trainer_by_the_expected_mismatch(parity):
    d = _masked(parity, "rollout_logp", "fp8", "vllm_w8a8") - _masked(parity, "trainer_logp", "fp8", "vllm_w8a8")
    assert 0.02 < float(d.abs().mean()) < 0.3, float(d.abs().mean())
    assert abs(float(d.mean())) < 3 * float(d.std())
    # and the trainer's FP8 forward differs from its own shadow by a similar amount (both are FP8 noise)
    t = _masked(parity, "trainer_logp", "fp8", "off") - _masked(parity, "shadow_logp", "fp8", "off")
    assert 0.02 < float(t.abs().mean()) < 0.3


def test_same_as_train_reproduces_the_trainer_quantization(parity):
    full = _masked(parity, "engine_full_logp", "fp8", "same_as_train")
    trainer = _masked(parity, "trainer_logp", "fp8", "same_as_train")
    # Two implementations (the engine's fused QKV vs Megatron's layers): the same FP8 values up to float
    # noise, which can flip a rare rounding (tests/_fp8_bounds.py); bound: the trainer's own FP8 noise.
    noise = fp8_noise_bound(trainer, _masked(parity, "shadow_logp", "fp8", "same_as_train"))
    assert_fp8_paths_agree(full, trainer, float_tol=2e-5, fp8_noise=noise, what="same_as_train full forward")
    cached = _masked(parity, "rollout_logp", "fp8", "same_as_train")
    assert float((cached - trainer).abs().mean()) > 1e-3  # tensorwise activation scales depend on the batch
