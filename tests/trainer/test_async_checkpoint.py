"""``trainer.async_save``: megatron's asynchronous sharded save, run for real on CPU (gloo, forked writer).

- the state an asynchronous save publishes loads bit for bit like a synchronous save of the same step,
  and nothing is published (no ``step_<N>``, ``latest`` unchanged) until :meth:`poll`/:meth:`wait`;
- snapshot: parameters and Adam moments changed in place right after ``save()`` returns are saved
  with their values at save time;
- a write error in the forked writer raises ``CheckpointError`` at finalize on every rank, removes the
  partial directory and leaves ``latest`` on the previous checkpoint;
- ``kill -9`` of the trainer while its writer writes: ``latest`` stays on the previous checkpoint, only
  ``.tmp-step_<N>`` is left (removed by the next save), and the writer and megatron's results-queue
  manager die with the trainer;
- that manager ignores the job's stop signals, and one killed from outside is replaced at the next save;
- a run checkpointed asynchronously (inside the loop, published by the per-step poll) and resumed
  continues exactly like the uninterrupted run (which the synchronous-save resume test also equals);
- SIGTERM to the trainer's process group with a save every step: the last step's checkpoint is published
  before the clean exit.

The in-process tests take 0.3-10 s each; the CLI ones 13-48 s (interpreter and megatron start-up) on
the shared 2-core machine.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ._cli import metrics, run_cli, signal_group_when, strip_timing
from ._reshard import cut_back_to

TINY = {"vocab_size": 19, "make_vocab_size_divisible_by": 4, "num_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "ffn_hidden_size": 96, "seq_length": 32, "qk_layernorm": True,
        "untie_embeddings_and_output_weights": False}
FP = {"k": 1}
KILL_HELPER = str(Path(__file__).with_name("_async_ckpt_kill.py"))


def _actor(seed=0):
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    return build_actor(ModelConfig(**TINY), ParallelConfig(micro_batch_size=3), seed=seed, lr=1e-3,
                       weight_decay=0.01, fp8_recipe=get_recipe("delayed"), device="cpu", keep_reference=True)


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY["vocab_size"], (6, 12), generator=g)
    mask = torch.zeros(6, 12)
    mask[:, 4:] = 1.0
    return {"tokens": tokens, "mask": mask, "advantages": torch.randn(6, generator=g)}


def _pg_loss(mb, logprobs, entropy, *, global_tokens, global_seqs):
    m = mb["mask"]
    loss = -((logprobs * mb["advantages"][:, None] * m).sum() + 0.01 * (entropy * m).sum()) / global_tokens
    return loss, {}


def _trained():
    a = _actor()
    a.train_step(_batch(), _pg_loss)
    return a


def _save(actor, d, step, async_save):
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    mgr = CheckpointManager(str(d), async_save=async_save)
    sharded, local = actor.sharded_checkpoint_state()
    mgr.save(step, {"actor_local": local}, FP, sharded=sharded)
    return mgr


def _loaded_state(d, step):
    """Everything a checkpoint restores into a fresh actor (weights, Adam state, FP8 histories, reference)."""
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    b = _actor(seed=9)
    ck = CheckpointManager(str(d)).load(step, FP)
    b.load_sharded_checkpoint([s["actor_local"] for s in ck.rank_states], ck.load_sharded)
    return b.state_dict_for_checkpoint()


def _assert_same(x, y, path="state"):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), path
    elif isinstance(x, dict):
        assert set(x) == set(y), path
        for k in x:
            _assert_same(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), path
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same(u, v, f"{path}[{i}]")
    else:
        assert x == y, path


def test_async_save_publishes_on_poll_and_loads_like_a_sync_save(tmp_path):
    a = _trained()
    _save(a, tmp_path / "sync", 1, async_save=False)
    mgr = _save(a, tmp_path / "async", 1, async_save=True)
    root = tmp_path / "async" / "checkpoints"
    # scheduled, not published: the writer may be done already, but only the finalize publishes
    assert mgr.pending_step == 1 and mgr.latest_step() is None
    assert (root / ".tmp-step_1").is_dir() and not (root / ".tmp-step_1" / "meta.json").exists()
    deadline = time.time() + 60
    while mgr.poll() is None:  # the trainer's per-step, non-blocking finalize
        assert time.time() < deadline, "the async writer did not finish"
        time.sleep(0.05)
    assert mgr.pending_step is None and mgr.latest_step() == 1
    assert not (root / ".tmp-step_1").exists()
    # same files (megatron's planner names them by rank and bucket) and the same loaded state
    assert _names(root / "step_1") == _names(tmp_path / "sync" / "checkpoints" / "step_1")
    _assert_same(_loaded_state(tmp_path / "async", 1), _loaded_state(tmp_path / "sync", 1))


def _names(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_state_changed_right_after_save_returns_is_saved_as_it_was(tmp_path):
    a = _trained()
    want = a.state_dict_for_checkpoint()
    want = {k: want[k] for k in ("model", "optimizer", "reference")}
    want = torch.load(_roundtrip(want), weights_only=False)  # a deep copy
    mgr = _save(a, tmp_path, 1, async_save=True)
    with torch.no_grad():  # what the next optimizer step does, in place, while the writer writes
        for p in a.model.parameters():
            p.add_(1.0)
        for st in a.optimizer.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].mul_(3.0)
    a.train_step(_batch(), _pg_loss)
    mgr.wait()
    got = _loaded_state(tmp_path, 1)
    _assert_same({k: got[k] for k in want}, want)


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_write_failure_raises_at_finalize_and_keeps_latest(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from nemo_fp8rl.trainer.checkpoint import CheckpointError

    a = _actor()
    mgr = _save(a, tmp_path, 1, async_save=True)
    mgr.wait()

    def disk_full(*args, **kwargs):  # runs in the forked writer's worker processes
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
    sharded, local = a.sharded_checkpoint_state()
    mgr.save(2, {"actor_local": local}, FP, sharded=sharded)  # returns: the failure is in the writer
    with pytest.raises(CheckpointError, match=r"\.tmp-step_2/dist failed: .*No space left on device.*partial "
                                              r"checkpoint was removed"):
        mgr.wait()
    root = tmp_path / "checkpoints"
    assert mgr.pending_step is None and mgr.latest_step() == 1
    assert (root / "latest").read_text().strip() == "step_1"
    assert not (root / ".tmp-step_2").exists() and not (root / "step_2").exists()
    assert mgr.load(1, FP).step == 1
    monkeypatch.undo()
    mgr.save(2, {"actor_local": local}, FP, sharded=sharded)  # the next save works
    assert mgr.wait() == root / "step_2" and mgr.latest_step() == 2


def test_kill9_during_async_write_keeps_latest_on_the_previous_checkpoint(tmp_path):
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    proc = subprocess.Popen([sys.executable, KILL_HELPER, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        word, manager = proc.stdout.readline().split()
        assert word == "scheduled"
        pid_file = tmp_path / "writer.pid"
        deadline = time.time() + 60
        while not pid_file.is_file() or not pid_file.read_text():
            assert time.time() < deadline, "the async writer did not start"
            time.sleep(0.05)
        writer = int(pid_file.read_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        root = tmp_path / "checkpoints"
        assert (root / "latest").read_text().strip() == "step_1"
        assert (root / ".tmp-step_2").is_dir() and not (root / ".tmp-step_2" / "meta.json").exists()
        assert not (root / "step_2").exists()
        mgr = CheckpointManager(str(tmp_path))
        assert mgr.latest_step() == 1 and mgr.steps() == [1]
        assert mgr.load(1, FP).step == 1
        deadline = time.time() + 10  # the writer dies with its trainer (PR_SET_PDEATHSIG)
        while _alive(writer) or _alive(int(manager)):
            assert time.time() < deadline, (f"async writer {writer} or results-queue manager {manager} outlived "
                                            "the killed trainer")
            time.sleep(0.05)
        mgr.save(2, {"step": 2}, FP)  # the next save replaces the stale temporary directory
        assert mgr.latest_step() == 2 and not (root / ".tmp-step_2").exists()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_results_queue_manager_ignores_the_jobs_signals_and_is_replaced_if_it_dies():
    """megatron's results-queue manager (started by :func:`_ensure_results_queue` before every save) outlives
    SIGTERM/SIGUSR1/SIGINT sent to it, as SLURM sends them to the whole job; killed from outside (SIGKILL:
    the OOM killer), the next save's call starts a new one and megatron gets a working queue again."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from nemo_fp8rl.trainer import dist_checkpoint

    dist_checkpoint._ensure_results_queue()
    first = dist_checkpoint._manager._process
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.kill(first.pid, s)
    time.sleep(0.5)
    assert first.is_alive()
    filesystem_async._results_queue.put("a")
    assert filesystem_async._results_queue.get(timeout=10) == "a"
    os.kill(first.pid, signal.SIGKILL)
    first.join(10)
    dist_checkpoint._ensure_results_queue()
    assert dist_checkpoint._manager._process is not first and dist_checkpoint._manager._process.is_alive()
    filesystem_async._results_queue.put("b")
    assert filesystem_async._results_queue.get(timeout=10) == "b"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


ARM = ["fp8=tensorwise", "calibration=paper", "calibration.interval=2", "calibration.min_tokens=4",
       "algorithm.old_logprobs=rollout"]


def test_resume_from_an_async_checkpoint_is_exact(tmp_path):
    """4 steps (synchronous saves) == 3 steps with asynchronous saves (step_2 written while step 3 trains,
    published by the loop's poll), cut back to step_2, resumed to 4 with asynchronous saves."""
    full, run, part = tmp_path / "full", tmp_path / "run", tmp_path / "part"
    run_cli(full, *ARM, "trainer.max_steps=4", "trainer.checkpoint_interval=2")
    run_cli(run, *ARM, "trainer.max_steps=3", "trainer.checkpoint_interval=2", "trainer.async_save=true")
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_2", "step_3"]
    assert (ck / "latest").read_text().strip() == "step_3"
    log = (run / "train.log").read_text()
    assert "step_2 published: asynchronous save" in log and "step_3 published: asynchronous save" in log
    cut_back_to(run, part, 2)
    run_cli(part, *ARM, "trainer.max_steps=4", "trainer.checkpoint_interval=2", "trainer.async_save=true",
            "resume=true")
    a, b = strip_timing(metrics(full)), strip_timing(metrics(part))
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert a == b


def test_sigterm_with_async_saves_publishes_the_last_step_and_exits_cleanly(tmp_path):
    """A save every step (each waits for the previous one, the loop's poll publishes finished ones);
    SIGTERM to the process group: the step finishes, its checkpoint is written and published before the exit, nothing pending."""
    from ._cli import TINY as CLI_TINY

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *CLI_TINY, f"output_dir={out}",
           f"warmup.cache_dir={tmp_path / '.warmup_cache'}", "trainer.max_steps=200", "trainer.checkpoint_interval=1",
           "trainer.async_save=true"]
    # SIGTERM to the whole group: megatron's results-queue manager and the forked writer get it too
    rc, err = signal_group_when(cmd, lambda: (out / "metrics.jsonl").is_file() and len(metrics(out)) >= 3,
                                signal.SIGTERM)
    assert rc == 0, err[-2000:]
    logged = len(metrics(out))
    assert 3 <= logged < 200
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step_{logged}"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    assert f"step_{logged} published: asynchronous save" in (out / "train.log").read_text()
