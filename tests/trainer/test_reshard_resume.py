"""A run resumed at another parallel layout continues the run: the real CLI, torchrun, gloo.

- TP=2 -> TP=1 (FP8 off, AdamW): a 2-rank TP=2 run of 3 steps checkpoints after its second step
  (``step_2``; steps are numbered from 0) and at the end. A copy cut back to ``step_2`` (what a kill
  right after that checkpoint leaves) is resumed by one process at TP=1, which runs the third step. It
  logs step index 2 once (not 0), and its metrics equal the uninterrupted run's step 2 (same launch,
  so no second TP=2 start-up) to float32 summation noise: with FP8 off a TP change
  only changes the order of the sums inside the split GEMMs (and of the vocab-parallel softmax), so the
  resumed weights and Adam state are the saved ones bit for bit and every metric moves by a few float32
  ulps (measured: at most 2.3e-7 relative for ratios and grad norm; the loss, a sum of terms that cancel
  down to ~4e-4, by 3e-8 absolute). The tolerance (1e-5 relative or 1e-6 absolute) keeps a 40x margin
  over that and stays far below what a lost restore gives (measured with the loaded Adam moments
  zeroed: the step-2 ratios move by 2.5e-3 relative, the loss by 46%). The data position, RNG streams,
  counters and stability monitor of the resumed run's next checkpoint equal the uninterrupted run's.
- PP=2 -> TP=1 with emulated MXFP8 and Calibrated Clipping: a PP change moves no sum (same GEMMs on
  fewer ranks), so the resumed step must equal the uninterrupted PP=2 run's exactly, calibration state
  included. Under PP only the last stage's calibrator observes tokens; the trainer broadcasts its state
  and ``calib/*`` metrics to the other stages after each update, so every saved rank holds the run's
  calibration state (before that fix, rank 0 logged and saved nominal bounds with ``calibrated: false``).
- Old per-rank (format 1) checkpoints refuse a layout change with the keys and the way out.

The first two launch the CLI (a torchrun of 2 ranks, then one process), mostly interpreter and megatron
start-up: 46-75 s and 42-55 s (the second while it fails after its first launch) on the shared 2-core
machine at load averages of 5-11; the whole file takes 75 s of CPU time.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ._cli import metrics, run_cli, strip_timing
from ._reshard import cut_back_to, rank_state, torchrun_cli

BF16 = ["fp8=off", "calibration=off", "seed=3", "algorithm.old_logprobs=rollout"]
REL, ABS = 1e-5, 1e-6


def _close(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)
    return a == b


def test_tp2_checkpoint_resumes_at_tp1(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    torchrun_cli(full, 2, *BF16, "parallel.tensor_model_parallel_size=2", "trainer.max_steps=3",
                 "trainer.checkpoint_interval=2")
    meta = json.loads((full / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["format"] == 2 and meta["world_size"] == 2
    assert meta["fingerprint"]["parallel.tensor_model_parallel_size"] == 2
    cut_back_to(full, part, 2)

    proc = run_cli(part, *BF16, "trainer.max_steps=3", "resume=true")  # TP=1, one process
    assert f"resumed from {part}/checkpoints/step_2" in proc.stdout + proc.stderr

    want, got = strip_timing(metrics(full)), strip_timing(metrics(part))
    assert [r["step"] for r in got] == [0, 1, 2]  # the step counter continued; step 2 logged once
    assert got[:2] == want[:2]  # the TP=2 steps before the checkpoint are kept as they were
    w, g = want[2], got[2]
    assert set(g) == set(w)
    for k in ("train/loss", "reward/mean", "policy/entropy", "train/grad_norm", "policy/ratio_min",
              "policy/ratio_mean", "policy/ratio_max", "policy/approx_kl", "clip/lower", "clip/upper"):
        assert g[k] is not None and math.isfinite(g[k]), k
    assert w["reward/mean"] > 0 and w["train/grad_norm"] > 0  # a step that learns something
    bad = {k: (g[k], w[k]) for k in w if not _close(g[k], w[k])}
    assert not bad, bad
    # the same tokens were sampled: discrete metrics are equal, not only close
    for k in ("reward/mean", "reward/accuracy", "rollout/response_len", "train/global_tokens"):
        assert g[k] == w[k], k

    # the resumed run's next checkpoint (TP=1, one rank) carries on the uninterrupted run's state
    a, b = rank_state(part, 3), rank_state(full, 3)
    assert a["actor_local"]["layout"]["tp"] == 1 and b["actor_local"]["layout"]["tp"] == 2
    assert a["step"] == b["step"] == 3
    assert a["task"]["prompts_served"] == b["task"]["prompts_served"]  # data position
    for k in ("rng_state", "warmup_rng_state"):
        assert torch.equal(a["task"][k], b["task"][k]), k
    for k in ("rollout", "shuffle", "torch"):
        assert torch.equal(a["rng"][k], b["rng"][k]), k
    assert a["counters"] == b["counters"]
    assert a["monitor"]["history"] == pytest.approx(b["monitor"]["history"], rel=REL, abs=ABS)


MX = ["fp8=mxfp8", "calibration=paper", "calibration.interval=2", "calibration.min_tokens=4", "seed=3",
      "model.num_layers=2", "algorithm.old_logprobs=rollout"]


def test_pp2_checkpoint_resumes_at_tp1_with_calibration_state(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    torchrun_cli(full, 2, *MX, "parallel.pipeline_model_parallel_size=2", "trainer.max_steps=3",
                 "trainer.checkpoint_interval=2")
    # every rank of the saved run holds the run's calibration state (any of them may be restored)
    saved = [rank_state(full, 2, r)["calibrator"] for r in (0, 1)]
    assert saved[0] == saved[1], saved
    cut_back_to(full, part, 2)
    run_cli(part, *MX, "trainer.max_steps=3", "resume=true")
    want, got = strip_timing(metrics(full)), strip_timing(metrics(part))
    assert [r["step"] for r in got] == [0, 1, 2]
    assert got == want  # PP moves no sum: exact, calib/* and clip/* included
    assert rank_state(part, 3)["calibrator"] == rank_state(full, 3, 1)["calibrator"]


def test_per_rank_checkpoint_refuses_a_layout_change(tmp_path):
    """Format 1 (``rank_<r>.pt`` with the whole actor state) is tied to its layout: another world size or
    other ``parallel.*`` values are refused with the keys, and the message says how to get to format 2."""
    from nemo_fp8rl.trainer.checkpoint import CheckpointError, CheckpointManager

    mgr = CheckpointManager(str(tmp_path))
    fp = {"model.hidden_size": 128, "parallel.tensor_model_parallel_size": 2}
    mgr.save(1, {"x": torch.ones(2)}, fp)  # no sharded state: format 1
    assert json.loads((tmp_path / "checkpoints" / "step_1" / "meta.json").read_text())["format"] == 1
    now = dict(fp, **{"parallel.tensor_model_parallel_size": 1})
    with pytest.raises(CheckpointError) as e:
        mgr.load(1, now)
    msg = str(e.value)
    assert "parallel.tensor_model_parallel_size: checkpoint=2 now=1" in msg
    assert "per-rank (format 1)" in msg and "resume once with the saved parallel.* values" in msg
    assert torch.equal(mgr.load(1, fp)["x"], torch.ones(2))  # the saved layout still loads it

    meta_path = tmp_path / "checkpoints" / "step_1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["world_size"] = 2  # as if saved by 2 ranks
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"saved with world size 2, resuming with 1.*resume once with"):
        mgr.load(1, fp)
