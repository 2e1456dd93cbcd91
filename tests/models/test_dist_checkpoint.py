"""Layout-free checkpoints through megatron dist_checkpointing (format 2), for real on CPU/gloo.

- 2 processes (one launch): one step at TP=2 with AdamW, saved; resumed at TP=1 x DP=2, at PP=2 and at
  DP=2 with the distributed optimizer (which saves again); TP=2 with AdamW resumes that one; a
  tied-embedding QK-norm model saved at PP=2 (head copy on the last stage) resumes at TP=2. Every
  resumed actor holds exactly the saved weights, the reference policy of the saving run, and its
  next update equals the uninterrupted one-process run's update to float32 tolerance (Adam moments
  and step resharded);
- one process: a same-layout resume (delayed FP8 scaling state, reference) is bit-exact, a changed FP8
  recipe is refused, corrupt/truncated/missing dist files are named, the trainer reads an old per-rank
  (format 1) checkpoint and continues its trajectory exactly.
"""

import pytest
import torch

from . import _scenarios as S
from ._dist import run_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from nemo_fp8rl.models import destroy_distributed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank of run_ranks
    try:
        ref = S.reshard_uninterrupted()
        ref["tied"] = S.reshard_uninterrupted(S.CFG_B)
    finally:
        torch.set_num_threads(threads)
    destroy_distributed()
    return ref, run_ranks("reshard_checkpoints", str(tmp_path_factory.mktemp("reshard")))


NAMES = ["tp1_dp2", "pp2", "dp2_dist", "dist_to_tp2"]


@pytest.mark.parametrize("name", NAMES)
def test_resume_at_another_layout_continues_the_trajectory(runs, name):
    ref, ranks = runs
    update_ref = {k: ref["final"][k] - ref["at_ckpt"][k] for k in ref["final"]}
    scale = max(float(u.abs().max()) for u in update_ref.values())
    assert scale > 5e-4  # the step moves the weights well beyond the tolerances below
    for res in ranks:
        out = res[name]
        saved = res["saved"]
        # the saved weights, exactly (vocabulary padding, QKV groups, swiglu halves, PP stages resharded)
        assert all(torch.equal(out["loaded"][k], saved[k]) for k in saved), name
        # the reference policy came along (log-probs at float noise: other GEMM shapes at TP=2)
        torch.testing.assert_close(out["ref_lp"], ref["ref_lp"], atol=2e-6, rtol=0)
        # the next update is the uninterrupted run's: Adam moments and step were restored
        for k, u in update_ref.items():
            diff = float((out["final"][k] - out["loaded"][k] - u).abs().max())
            assert diff < 0.005 * scale, (name, k, diff, scale)  # measured: 0.1% (float noise)
        for k, v in ref["metrics"].items():
            assert out["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-5), (name, k)


def test_tied_embeddings_saved_at_pp2_resume_at_tp2(runs):
    """The head copy of a tied embedding lives on the last stage at PP=2 and nowhere at TP=2."""
    ref, ranks = runs
    ref = ref["tied"]
    scale = max(float((ref["final"][k] - ref["at_ckpt"][k]).abs().max()) for k in ref["final"])
    for res in ranks:
        out, saved = res["tied_pp2_to_tp2"], res["tied_saved"]
        assert all(torch.equal(out["loaded"][k], saved[k]) for k in saved)
        assert out["layout"] == (2, 1, 1, False)
        for k in ref["final"]:  # the uninterrupted update, from the restored moments
            diff = float((out["final"][k] - out["loaded"][k] - (ref["final"][k] - ref["at_ckpt"][k])).abs().max())
            assert diff < 0.005 * scale, (k, diff, scale)
        for k, v in ref["metrics"].items():
            assert out["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-5), k


def test_fp8_delayed_state_is_merged_over_tp_shards(runs):
    """TP=2 -> TP=1: each linear's amax history is the element-wise max of its two shards' histories
    (the amax of a tensor is the max of its shards' amaxes), its scale the min of theirs."""
    _, ranks = runs
    saved = [res["fp8_saved"] for res in ranks]  # the two TP shards
    assert saved[0].keys() == saved[1].keys() and saved[0]
    differ = [not torch.equal(saved[0][g][r]["amax_history"], saved[1][g][r]["amax_history"])
              for g in saved[0] for r in saved[0][g]]
    assert any(differ) and not all(differ)  # sharded operands saw other amaxes, replicated ones the same
    for res in ranks:
        loaded = res["fp8_loaded"]
        assert loaded.keys() == saved[0].keys()
        for g, roles in loaded.items():
            for r, st in roles.items():
                hist = torch.maximum(saved[0][g][r]["amax_history"], saved[1][g][r]["amax_history"])
                assert torch.equal(st["amax_history"], hist), (g, r)
                assert torch.equal(st["scale"], torch.minimum(saved[0][g][r]["scale"], saved[1][g][r]["scale"]))


def test_layouts_are_the_ones_claimed(runs):
    _, ranks = runs
    want = {"tp1_dp2": (1, 1, 2, False), "pp2": (1, 2, 1, False), "dp2_dist": (1, 1, 2, True),
            "dist_to_tp2": (2, 1, 1, False)}
    for res in ranks:
        assert {n: res[n]["layout"] for n in want} == want


# ------------------------------------------------------------------ one process
def _actor(fp8="delayed", seed=0, distributed=False):
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    return build_actor(ModelConfig(**S.CFG_B), ParallelConfig(micro_batch_size=3), seed=seed, lr=1e-3,
                       weight_decay=0.01, fp8_recipe=get_recipe(fp8) if fp8 else None, device="cpu",
                       keep_reference=True, distributed_optimizer=distributed)


def _save(actor, d, step=1):
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    sharded, local = actor.sharded_checkpoint_state()
    return CheckpointManager(str(d)).save(step, {"actor_local": local}, {"k": 1}, sharded=sharded)


def _load(actor, d, step=1):
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    ck = CheckpointManager(str(d)).load(step, {"k": 1})
    actor.load_sharded_checkpoint([s["actor_local"] for s in ck.rank_states], ck.load_sharded)


@pytest.mark.parametrize("distributed", [False, True])
def test_same_layout_resume_is_bit_exact(tmp_path, distributed):
    batch = S.make_batch(S.CFG_B["vocab_size"])
    a = _actor(distributed=distributed)
    a.train_step(batch, S.pg_loss)
    _save(a, tmp_path)
    a.train_step(batch, S.pg_loss)
    want = a.get_logprobs(batch["tokens"])[0]
    want_ref = a.get_reference_logprobs(batch["tokens"])[0]
    b = _actor(seed=9, distributed=distributed)
    _load(b, tmp_path)
    b.train_step(batch, S.pg_loss)
    assert torch.equal(b.get_logprobs(batch["tokens"])[0], want)  # incl. the delayed-scaling amax histories
    assert torch.equal(b.get_reference_logprobs(batch["tokens"])[0], want_ref)
    with pytest.raises(ValueError, match="same fp8 recipe"):
        _load(_actor(fp8="tensorwise"), tmp_path)


def _mixed_dtype_actor(seed):
    """CPU distributed optimizer over BF16 matrices and float32 norm weights: the GPU layout before BF16
    norms (megatron's torch norms ignored params_dtype), built by hand since the CPU path runs float32."""
    from nemo_fp8rl.models import optim
    from nemo_fp8rl.models.actor import FP8Actor

    a = _actor(fp8=None, seed=seed)
    with torch.no_grad():
        for name, p in a.model.named_parameters():
            if "layernorm" not in name:
                p.data = p.data.to(torch.bfloat16)
    ddp, opt = optim.build_distributed_optimizer(a.model, lr=1e-3, weight_decay=0.01, adam_betas=(0.9, 0.999),
                                                 adam_eps=1e-8, grad_clip=1.0, device=torch.device("cpu"))
    return FP8Actor(a.model, a.model_cfg, a.parallel_cfg, fp8_recipe=None, use_te=False, optimizer=opt,
                    grad_clip=1.0, fp8_report=a.fp8_report, ddp=ddp)


def test_mixed_dtype_distributed_optimizer_resumes(tmp_path):
    """BF16 and float32 parameters under the distributed optimizer: main parameters are saved for the BF16
    ones only, and the load asks for exactly those (it asked for every parameter's: megatron's KeyError
    on `main_param.decoder.layers.input_layernorm.weight` on the H200). Same layout: bit-exact; AdamW on
    float32 parameters takes the float32 main parameters, not their BF16 rounding."""
    from nemo_fp8rl.models.checkpointing import _full_moments

    batch = S.make_batch(S.CFG_B["vocab_size"])
    a = _mixed_dtype_actor(0)
    dtypes = {p.dtype for p in a.model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}
    a.train_step(batch, S.pg_loss)
    mains = {n: _full_moments(a, p)["main_param"].clone() for n, p in a.model.named_parameters()
             if p.dtype == torch.bfloat16}
    norms = {n: p.detach().clone() for n, p in a.model.named_parameters() if p.dtype == torch.float32}
    _save(a, tmp_path)
    a.train_step(batch, S.pg_loss)
    want = a.get_logprobs(batch["tokens"])[0]

    b = _mixed_dtype_actor(9)
    _load(b, tmp_path)
    b.train_step(batch, S.pg_loss)
    assert torch.equal(b.get_logprobs(batch["tokens"])[0], want)

    c = _actor(fp8=None, seed=9)  # AdamW, float32 parameters
    _load(c, tmp_path)
    got = dict(c.model.named_parameters())
    assert mains and all(torch.equal(got[n], m) for n, m in mains.items())
    assert norms and all(torch.equal(got[n], v) for n, v in norms.items())


def test_corrupt_truncated_and_missing_dist_files_are_named(tmp_path):
    from nemo_fp8rl.trainer.checkpoint import CheckpointError, CheckpointManager

    a = _actor(fp8=None)
    _save(a, tmp_path, 1)
    _save(a, tmp_path, 2)
    d = tmp_path / "checkpoints" / "step_2" / "dist"
    shard = sorted(d.glob("*.distcp"))[0]
    orig = shard.read_bytes()
    data = bytearray(orig)
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    mgr = CheckpointManager(str(tmp_path))
    with pytest.raises(CheckpointError, match=rf"dist/{shard.name} is corrupt"):
        mgr.load(2, {"k": 1})
    shard.write_bytes(bytes(data[:10]))
    with pytest.raises(CheckpointError, match="truncated"):
        mgr.load(2, {"k": 1})
    shard.write_bytes(orig)
    (d / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"common\.pt is missing"):
        mgr.load(2, {"k": 1})
    _load(_actor(fp8=None), tmp_path, 1)  # the older checkpoint is untouched
    with pytest.raises(CheckpointError, match=r"k: checkpoint=1 now=2"):
        mgr.load(1, {"k": 2})


def test_trainer_resumes_an_old_per_rank_checkpoint(tmp_path):
    """Format 1 (rank_<r>.pt with the whole actor state, written before dist_checkpointing): the trainer
    still loads it and continues exactly as the uninterrupted run."""
    from nemo_fp8rl.config.schema import TrainConfig
    from nemo_fp8rl.trainer import RLTrainer
    from nemo_fp8rl.trainer.rl_trainer import model_fingerprint

    def cfg(out, steps):
        c = TrainConfig(output_dir=str(out), seed=3)
        c.algorithm.prompts_per_step, c.algorithm.group_size, c.algorithm.minibatches_per_step = 4, 4, 2
        c.warmup.steps = 0
        c.rollout.max_new_tokens = 6
        c.logger.tensorboard, c.logger.progress = False, "none"
        c.fp8.recipe = "delayed"
        c.algorithm.entropy_coef = 0.01
        c.algorithm.kl_coef = 0.01  # a reference policy in the checkpoint
        c.trainer.max_steps, c.trainer.checkpoint_interval = steps, 0
        return c

    old = RLTrainer(cfg(tmp_path / "old", 3))
    old.setup()
    old.step()
    st = {  # what RLTrainer._state returned before format 2
        "step": old.step_idx, "actor": old.actor.state_dict_for_checkpoint(), "task": old.task.state_dict(),
        "calibrator": None, "monitor": old.monitor.state_dict(),
        "rng": {"rollout": old.rollout_gen.get_state(), "shuffle": old.shuffle_gen.get_state(),
                "torch": torch.get_rng_state()},
        "counters": {"consecutive_skips": 0, "skipped_total": 0, "unstable_steps": old.unstable_steps},
    }
    old.ckpt.save(old.step_idx, st, model_fingerprint(old.cfg))
    want = [old.step() for _ in range(2)]  # the uninterrupted continuation
    old.close()  # the engine, the reward worker and the signal handlers it installed
    c = cfg(tmp_path / "old", 3)
    c.resume = True
    resumed = RLTrainer(c)
    resumed.setup()
    assert resumed.step_idx == 1
    got = [resumed.step() for _ in range(2)]
    resumed.close()
    strip = [{k: v for k, v in m.items() if not k.startswith("timing/")} for m in want]
    assert [{k: v for k, v in m.items() if not k.startswith("timing/")} for m in got] == strip


@pytest.mark.gpu
def test_gpu_resume_with_te_fused_adam(tmp_path):
    """GPU: the distributed optimizer runs TE's FusedAdam (step counted per group, BF16 parameters with
    float32 main parameters); a format-2 checkpoint resumes it, and AdamW checkpoints resume into it and
    back."""
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor

    mc, pc = ModelConfig(vocab_size=16), ParallelConfig(micro_batch_size=8)
    batch = {k: v.cuda() for k, v in S.make_batch(16, B=8, T=32).items()}
    for save_dist, load_dist in ((True, True), (False, True), (True, False)):
        a = build_actor(mc, pc, seed=0, lr=1e-4, distributed_optimizer=save_dist)
        a.train_step(batch, S.pg_loss)
        d = tmp_path / f"{save_dist}_{load_dist}"
        _save(a, d)
        a.train_step(batch, S.pg_loss)
        want = a.get_logprobs(batch["tokens"])[0]
        b = build_actor(mc, pc, seed=5, lr=1e-4, distributed_optimizer=load_dist)
        _load(b, d)
        b.train_step(batch, S.pg_loss)
        got = b.get_logprobs(batch["tokens"])[0]
        # BF16 parameters on one side only: BF16 rounding of the weights (AdamW takes the saved float32
        # main parameters, the distributed optimizer AdamW's float32 weights as main parameters)
        torch.testing.assert_close(got, want, atol=1e-3 if save_dist == load_dist else 0.05, rtol=0)
