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
- DP=1 -> DP=2 on a math_jsonl file: the resumed ranks continue the saved epoch over their new shards
  (no row of it served twice); in-process tests of ``_restore`` check that a DP change re-seeds the
  rollout, minibatch-order and CPU RNG streams and the task's prompt stream from (seed, DP rank, step)
  instead of restarting them (DP rank 0 used to replay the run's opening prompts), and that the same DP
  size still restores them exactly.
- Old per-rank (format 1) checkpoints refuse a layout change with the keys and the way out.

The first three launch the CLI (a torchrun of 2 ranks and one process), mostly interpreter and megatron
start-up: 46-78 s, 42-55 s (the second while it fails after its first launch) and 35-48 s (the DP one)
on the shared 2-core machine at load averages of 4-11; the in-process DP tests take under 5 s.
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


def test_dp1_checkpoint_resumes_at_dp2_continuing_the_epoch(tmp_path):
    """One process (DP=1) on a 20-row math_jsonl file, 4 prompts per step, checkpoints after 2 steps (8
    rows of epoch 0 served); torchrun DP=2 resumes there. Each new rank takes its stride of the saved
    permutation from position 8 (cursor 4): step 2 serves exactly the rows the uninterrupted run's step 2
    served (permutation positions 8-11, split over two ranks), none of the first 8 again."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) for i in range(20)) + "\n")
    run = ["task=math_jsonl", f"task.path={rows}", *BF16]
    full, part = tmp_path / "full", tmp_path / "part"
    run_cli(full, *run, "trainer.max_steps=3", "trainer.checkpoint_interval=2")
    cut_back_to(full, part, 2)
    torchrun_cli(part, 2, *run, "trainer.max_steps=3", "resume=true")
    assert [r["step"] for r in metrics(part)] == [0, 1, 2]
    logs = [p.read_text() for p in sorted(tmp_path.glob("part_torchrun_logs/*/attempt_0/*/stderr.log"))]
    assert len(logs) == 2
    for r, log in enumerate(logs):  # the warning (before the run's own train.log opens) on each rank
        assert "resuming step 2 saved at DP=1 with DP=2" in log and f"DP rank {r}'s rollout sampling" in log
        assert "math_jsonl epoch 0 continued from position 8" in log
    perm = rank_state(full, 2)["task"]["order"]
    assert rank_state(full, 2)["task"]["cursor"] == 8 and rank_state(full, 3)["task"]["cursor"] == 12
    new = [rank_state(part, 3, r)["task"] for r in (0, 1)]
    for r, st in enumerate(new):
        assert st["shard"] == [r, 2] and st["epoch"] == 0 and st["cursor"] == 6
        assert st["order"] == perm[r::2]
    step2 = {new[r]["order"][c] for r in (0, 1) for c in (4, 5)}
    assert step2 == set(perm[8:12])


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


# ---------------------------------------------------------------- a DP change, in-process
def _trainer(task, dp_rank: int, dp_size: int, seed: int = 3):
    """An RLTrainer with only what ``_restore`` touches, built as ``__init__`` builds it (streams seeded by
    seed and DP rank); the actor is a stand-in whose weights load is a no-op."""
    from types import SimpleNamespace

    from nemo_fp8rl.algorithms.mismatch import EntropySurgeMonitor
    from nemo_fp8rl.trainer.rl_trainer import RLTrainer

    tr = object.__new__(RLTrainer)
    tr.cfg = SimpleNamespace(seed=seed)
    tr.actor = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, tp_rank=0, pp_rank=0, device=torch.device("cpu"),
                               load_sharded_checkpoint=lambda *a: None)
    tr.ckpt = SimpleNamespace(device=None)
    tr.task, tr.calibrator, tr.monitor = task, None, EntropySurgeMonitor(window=2, factor=1.5, min_rise=0.05)
    tr.rollout_gen = torch.Generator().manual_seed(seed * 1000 + 17 + dp_rank)
    tr.shuffle_gen = torch.Generator().manual_seed(seed * 1000 + 43 + dp_rank)
    tr.step_idx = tr.consecutive_skips = tr.skipped_total = tr.unstable_steps = 0
    tr.kv_sync = SimpleNamespace(state_dict=lambda: None, load_state_dict=lambda st: None)  # FP8 KV cache off
    return tr


def _saved(trainers, step: int):
    """A format-2 checkpoint of these trainers' local states (one per DP rank, TP = PP = 1)."""
    from nemo_fp8rl.trainer.checkpoint import ShardedCheckpoint

    states = []
    for tr in trainers:
        coords = {"tp_rank": 0, "pp_rank": 0, "dp_rank": tr.actor.dp_rank}
        states.append({
            "step": step, "actor_local": {"coords": coords}, "dp_rank": tr.actor.dp_rank, "dp_size": tr.actor.dp_size,
            "task": tr.task.state_dict(), "calibrator": None, "monitor": tr.monitor.state_dict(),
            "rng": {"rollout": tr.rollout_gen.get_state(), "shuffle": tr.shuffle_gen.get_state(),
                    "torch": torch.get_rng_state()},
            "counters": {"consecutive_skips": 0, "skipped_total": 1, "unstable_steps": 0},
        })
    return ShardedCheckpoint(step=step, directory=None, saved_world_size=len(states), rank_states=states,
                             load_sharded=lambda template: template)


def _draws(tr, n=6):
    return ([p.text for p in tr.task.prompts(n)], torch.rand(n, generator=tr.rollout_gen).tolist(),
            torch.randperm(n, generator=tr.shuffle_gen).tolist())


def test_dp_change_reseeds_streams_instead_of_restarting_them(caplog):
    """DP=1 -> DP=2 (arithmetic): before the fix, DP rank 0 kept its streams as built and replayed the
    run's opening prompts, rollout samples and minibatch order; now every stream is re-seeded from
    (seed, DP rank, step). The same DP size still restores every stream exactly."""
    from nemo_fp8rl.tasks import get_task, reshard_seed

    def arith(dp):
        return get_task("arithmetic", digits=3, seed=3029 + dp)

    with torch.random.fork_rng(devices=[]):
        run = _trainer(arith(0), 0, 1)
        opening = _draws(run)
        _draws(run)
        ckpt = _saved([run], step=2)
        cont = _draws(run)  # the uninterrupted run's next draws

        same = _trainer(arith(0), 0, 1)
        same._restore(ckpt)
        assert _draws(same) == cont  # unchanged DP size: exact

        new = [_trainer(arith(r), r, 2) for r in range(2)]
        with caplog.at_level("WARNING"):
            for tr in new:
                tr._restore(ckpt)
            torch_state = torch.get_rng_state()
        assert torch.equal(torch_state, torch.Generator().manual_seed(reshard_seed(3061 + 1, 2)).get_state())
        assert all(tr.step_idx == 2 and tr.skipped_total == 1 for tr in new)
        after = [_draws(tr) for tr in new]
        for d in after:
            for got, first in zip(d, opening):
                assert got != first  # no stream restarted from its opening
        assert after[0] != after[1]
        msg = caplog.records[0].getMessage()
        assert "saved at DP=1 with DP=2" in msg and "re-seeded from (seed=3, dp_rank=0, step=2)" in msg, msg
        assert "task arithmetic: prompt stream re-seeded from (seed 3029, step 2)" in msg, msg


def test_dp_change_continues_a_math_jsonl_epoch(tmp_path):
    """DP=2 -> DP=1 through ``_restore``: the task gets every saved DP rank's state and goes on with the
    saved epoch (no row served twice), then with the uninterrupted run's next permutation."""
    from nemo_fp8rl.tasks import get_task

    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"row {i}?", "answer": i}) for i in range(10)) + "\n")

    def shard(dp, k):
        kw = {"shard_rank": dp, "num_shards": k, "shuffle_seed": 3029} if k > 1 else {}
        return get_task("math_jsonl", path=str(path), seed=3029 + dp, **kw)

    with torch.random.fork_rng(devices=[]):
        run = [_trainer(shard(r, 2), r, 2) for r in range(2)]
        served = [p.text for tr in run for p in tr.task.prompts(2)]
        ckpt = _saved(run, step=1)
        one = _trainer(shard(0, 1), 0, 1)
        one._restore(ckpt)
        rest = [p.text for p in one.task.prompts(10 - 4)]
        assert one.task.epoch == 0 and len(set(rest)) == 6 and not set(rest) & set(served)
        nxt = [p.text for p in one.task.prompts(10)]
        ref = [[p.text for p in tr.task.prompts(3 + 5)][3:] for tr in run]  # finish epoch 0, then epoch 1
        assert one.task.epoch == 1 and nxt == [ref[j % 2][j // 2] for j in range(10)]
