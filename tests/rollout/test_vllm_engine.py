"""The vLLM rollout engine against the torch engine (the reference) on the same weights, with real vLLM.

One ``LLM`` for the module (building one takes ~30 s on 2 cores). FP8 is off in every comparison, so
both engines compute the same float32 function and differ only by summation order (~1e-6): 1e-4 holds
on any x86 CPU (tests/_fp8_bounds.py explains why FP8 comparisons need other bounds).
"""

from __future__ import annotations

import gc
import math
import signal
import weakref

import psutil
import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import RolloutEngine, SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout.model import ModelShape
from nemo_fp8rl.rollout.vllm_support import check_vllm_supported, vllm_available
from nemo_fp8rl.rollout.vllm_sync import iter_weight_buckets

from .conftest import random_hf_weights

NO_VLLM = "vLLM is not installed (pip install nemo-fp8rl[vllm]; make install does it)"
needs_vllm = pytest.mark.skipif(not vllm_available(), reason=NO_VLLM)

EOS, PAD = 2, 0
TOL = 1e-4  # float32, FP8 off: summation-order noise is ~1e-6
# Qwen3-style: GQA, per-head QK norm, tied embeddings (vLLM's CPU attention needs head_dim >= 32).
CFG = ModelConfig(name="qwen3", vocab_size=64, num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, untie_embeddings_and_output_weights=False,
                  seq_length=320)
RAGGED = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13, 14], [1, 15, 3]]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    sd = random_hf_weights(CFG, seed=seed)
    # tied embeddings: N(0, 1) rows would give logits of std ~11 (one token takes all the mass); 0.12
    # gives std ~1.4, so sampling, EOS and top-p have real choices
    sd["model.embed_tokens.weight"] *= 0.12
    return sd


@pytest.fixture(scope="module")
def weights():
    return {"a": _weights(0), "b": _weights(1)}


@pytest.fixture(scope="module")
def engines(weights):
    """(vllm engine, torch engine) built once; tests leave the vllm engine with weights "a"."""
    if not vllm_available():
        pytest.skip(NO_VLLM)
    torch.manual_seed(1234)
    rng, threads, set_threads = torch.random.get_rng_state(), torch.get_num_threads(), torch.set_num_threads
    handlers = {s: signal.getsignal(s) for s in _JOB_SIGNALS}
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    # a tiny bucket: every sync streams the model in many buckets (a layer split across buckets)
    v = get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, sync_bucket_mb=0.05)
    v.update_weights(weights["a"])
    v.generate(RAGGED, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0))
    # vLLM reseeds torch's RNG, sets 1 thread and disables torch.set_num_threads: the engine undoes all three
    _TORCH_STATE_KEPT.update(rng=torch.equal(rng, torch.random.get_rng_state()), threads=torch.get_num_threads() == threads,
                             set_num_threads=torch.set_num_threads is set_threads)
    _PROCESS_STATE.update(handlers_kept=[s.name for s in _JOB_SIGNALS if signal.getsignal(s) is not handlers[s]] or True,
                          new_processes=[" ".join(p.cmdline()[:3]) for p in psutil.Process().children(recursive=True)
                                         if p.pid not in children])
    t = get_rollout_engine("torch", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    yield v, t
    v.close()  # frees vLLM before the next module's engine
    v.close()  # idempotent
    assert v.sleep() is False and v.wake_up() is False
    with pytest.raises(RuntimeError, match="closed"):
        v.generate(RAGGED, SamplingParams(max_new_tokens=2), torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="closed"):
        v.update_weights(weights["a"])


_TORCH_STATE_KEPT: dict[str, bool] = {}
_JOB_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
_PROCESS_STATE: dict[str, object] = {}


def test_the_engine_leaves_torch_global_state_alone(engines):
    assert _TORCH_STATE_KEPT == {"rng": True, "threads": True, "set_num_threads": True}


def test_the_engine_starts_no_process_and_keeps_the_signal_handlers(engines):
    """Preemption with rollout.engine=vllm: SLURM's USR1/TERM and a terminal's Ctrl-C go to the job's whole
    process group. The engine (built, synced, generating) runs in the trainer's process and starts no other
    (no engine core, worker or compile pool that the signal would kill mid-step), and the trainer's handlers
    for those signals stay installed, so the trainer finishes its step and checkpoints (docs/reliability.md)."""
    assert _PROCESS_STATE == {"handlers_kept": True, "new_processes": []}


def _torch_logp(t, weights, out, temperature):
    t.update_weights(weights)
    return t.logprobs(out.tokens, temperature=temperature) * out.mask


def test_layout_and_logprobs_match_the_torch_engine(engines, weights):
    v, t = engines
    for temperature in (1.0, 0.7):
        out = v.generate(RAGGED, SamplingParams(temperature=temperature, max_new_tokens=12, stop_on_eos=False),
                         torch.Generator().manual_seed(0))
        out.validate()
        assert out.response_lens.tolist() == [12] * 4 and not out.finished.any()
        assert [out.tokens[b, : len(p)].tolist() for b, p in enumerate(RAGGED)] == RAGGED
        d = (out.rollout_logp - _torch_logp(t, weights["a"], out, temperature)).abs().max()
        assert float(d) < TOL, (temperature, float(d))
        assert float(out.rollout_logp.sum()) < -1.0  # real log-probs, not zeros


def test_greedy_logp_is_log_softmax_of_the_logits(engines, weights):
    v, t = engines
    out = v.generate(RAGGED, SamplingParams(temperature=0.0, max_new_tokens=8, stop_on_eos=False),
                     torch.Generator().manual_seed(0))
    out.validate()
    assert float((out.rollout_logp - _torch_logp(t, weights["a"], out, 1.0)).abs().max()) < TOL


def test_top_p_logp_follows_the_sampling_params_convention(engines, weights):
    """rollout_logp = log_softmax(logits / T)[tok] - log(nucleus mass), as the torch engine reports it."""
    v, t = engines
    top_p, temperature = 0.8, 0.7
    out = v.generate(RAGGED, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12, stop_on_eos=False),
                     torch.Generator().manual_seed(0))
    t.update_weights(weights["a"])
    logits = t.forward(out.tokens).double()
    want = torch.zeros_like(out.rollout_logp, dtype=torch.float64)
    for b in range(out.batch_size):
        p, r = int(out.prompt_lens[b]), int(out.response_lens[b])
        for i in range(p, p + r):
            q = torch.softmax(logits[b, i - 1] / temperature, dim=-1)
            sq, order = q.sort(descending=True)
            nucleus = order[(sq.cumsum(0) - sq) < top_p]
            tok = int(out.tokens[b, i])
            assert tok in nucleus.tolist()
            want[b, i] = math.log(float(q[tok])) - math.log(float(q[nucleus].sum()))
    assert float((out.rollout_logp.double() - want).abs().max()) < TOL
    # the convention matters here: without the renormalisation the values differ
    full = _torch_logp(t, weights["a"], out, temperature)
    assert float((out.rollout_logp - full).max()) > 1e-3


def test_same_generator_same_batch_in_any_composition(engines):
    v, _ = engines
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_on_eos=False)
    a = v.generate(RAGGED, params, torch.Generator().manual_seed(7))
    b = v.generate(RAGGED, params, torch.Generator().manual_seed(7))
    for f in ("tokens", "mask", "rollout_logp", "response_lens", "finished"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    # a prompt's response depends on its seed only: the first prompt alone, with the same generator state
    alone = v.generate(RAGGED[:1], params, torch.Generator().manual_seed(7))
    assert alone.responses()[0] == a.responses()[0]
    assert torch.equal(alone.rollout_logp[0], a.rollout_logp[0, : alone.tokens.shape[1]])
    # ... and inside a larger batch (the same prompts again after it: other seeds, other responses)
    big = v.generate(RAGGED * 3, params, torch.Generator().manual_seed(7))
    assert big.responses()[:4] == a.responses()
    assert big.responses()[4:8] != a.responses()
    c = v.generate(RAGGED, params, torch.Generator().manual_seed(8))
    assert not torch.equal(a.tokens, c.tokens)


def test_eos_stops_and_is_kept_as_the_last_token(engines):
    v, _ = engines
    prompts = [[1, 3 + i, 5 + i] for i in range(16)]
    free = v.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, stop_on_eos=False),
                      torch.Generator().manual_seed(1))
    stop = v.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, stop_on_eos=True),
                      torch.Generator().manual_seed(1))
    stop.validate()
    assert int(stop.finished.sum()) >= 1, "no response sampled EOS: pick a seed where some do"
    for b, (f, s) in enumerate(zip(free.responses(), stop.responses())):
        cut = f.index(EOS) + 1 if EOS in f else len(f)
        assert s == f[:cut], b  # same seed: identical until the first EOS, which ends the response
        assert bool(stop.finished[b]) == (EOS in f)
        n = int(stop.prompt_lens[b]) + len(s)
        assert torch.equal(stop.rollout_logp[b, :n], free.rollout_logp[b, :n])


def test_weight_sync_changes_tokens_logprobs_follow_and_revert_restores(engines, weights):
    v, t = engines
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_on_eos=False)
    # a prompt longer than one KV block: after a sync, its cached prefix blocks must not be reused
    block = v.llm.llm_engine.vllm_config.cache_config.block_size
    long_prompt = [1] + [3 + (i * 7) % 60 for i in range(block + 9)]
    assert len(long_prompt) + params.max_new_tokens <= CFG.seq_length
    prompts = RAGGED + [long_prompt]
    before = v.generate(prompts, params, torch.Generator().manual_seed(3))
    v.update_weights(weights["b"])
    try:
        after = v.generate(prompts, params, torch.Generator().manual_seed(3))
        after.validate()
        assert after.responses() != before.responses()
        d = (after.rollout_logp - _torch_logp(t, weights["b"], after, 1.0)).abs().max()
        assert float(d) < TOL, float(d)
    finally:
        v.update_weights(weights["a"])
    again = v.generate(prompts, params, torch.Generator().manual_seed(3))
    assert again.responses() == before.responses()
    assert float((again.rollout_logp - before.rollout_logp).abs().max()) < TOL


def _storage_refs():
    """(refs, watch): ``watch(t)`` keeps a weak reference to t's storage (alive while any alias or view of t is)."""
    refs: list[tuple[weakref.ref, int]] = []

    def watch(t: torch.Tensor) -> None:
        refs.append((weakref.ref(t.untyped_storage()), t.numel() * t.element_size()))

    return refs, watch


def _alive_bytes(refs) -> int:
    return sum(n for r, n in refs if r() is not None)


def test_stream_sync_equals_dict_sync_and_holds_one_bucket(engines, weights):
    """update_weights(actor.iter_weights()): the same engine as a dict sync, without collecting the stream."""
    v, _ = engines
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_on_eos=False)
    v.update_weights(weights["b"])
    want = v.generate(RAGGED, params, torch.Generator().manual_seed(5))
    refs, watch = _storage_refs()
    held: list[int] = []

    def stream():  # like FP8Actor.iter_weights: a fresh tensor per pair, dropped once handed on
        for name, t in weights["b"].items():
            gc.collect()
            held.append(_alive_bytes(refs))
            t = t.clone()
            watch(t)
            yield name, t
            del t

    try:
        info = v.update_weights(stream())
        got = v.generate(RAGGED, params, torch.Generator().manual_seed(5))
    finally:
        v.update_weights(weights["a"])
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.rollout_logp, want.rollout_logp)
    sizes = {n: t.numel() * t.element_size() for n, t in weights["b"].items()}
    assert info["bytes"] == sum(sizes.values())
    # What is still held when the stream is asked for its next tensor: at most the engine's bucket, the
    # parts of one fused module vLLM buffers until its last part arrives (q/k/v or gate/up), and the tensor
    # in flight. A collected stream would hold everything (the model is > 2x that bound).
    p = "model.layers.0."
    fused = max(sum(sizes[p + f"self_attn.{x}_proj.weight"] for x in "qkv"),
                sum(sizes[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")))
    bound = v.bucket_bytes + fused + max(sizes.values())
    print(f"stream sync: at most {max(held)} B held (bound {bound} B, model {sum(sizes.values())} B)")
    assert max(held) <= bound, (max(held), bound, held)
    assert sum(sizes.values()) > 2 * bound
    gc.collect()
    assert _alive_bytes(refs) == 0  # nothing of the stream is kept after the sync


def test_a_sync_that_fails_midway_stops_generation_until_a_complete_sync(engines, weights):
    v, _ = engines
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_on_eos=False)
    want = v.generate(RAGGED, params, torch.Generator().manual_seed(6))
    half = len(weights["b"]) // 2

    def broken(exc=None):  # weights "b" until the middle of the stream, then a bad tensor or an error
        for i, (name, t) in enumerate(weights["b"].items()):
            if i == half:
                if exc is not None:
                    raise exc
                t = t[..., :-1]
            yield name, t

    with pytest.raises(ValueError, match=r"weight sync rejected: .*shape"):
        v.update_weights(broken())
    with pytest.raises(RuntimeError, match="mix of old and new weights.*complete sync"):
        v.generate(RAGGED, params, torch.Generator().manual_seed(6))
    with pytest.raises(OSError, match="gather failed"):  # the trainer's side of the stream failing
        v.update_weights(broken(OSError("gather failed")))
    with pytest.raises(RuntimeError, match="mix of old and new weights"):
        v.generate(RAGGED, params, torch.Generator().manual_seed(6))
    v.update_weights(iter(weights["a"].items()))  # a complete sync recovers, exactly
    got = v.generate(RAGGED, params, torch.Generator().manual_seed(6))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.rollout_logp, want.rollout_logp)

    # refused before vLLM got anything (the embedding comes first): the engine keeps its weights
    big = dict(weights["a"])
    big["model.embed_tokens.weight"] = torch.cat([big["model.embed_tokens.weight"]] * 2)
    for bad in (iter(big.items()), big):  # a stream (checked pair by pair) and a dict (checked at once)
        with pytest.raises(ValueError, match=r"128 rows but the vllm engine was built for model.vocab_size=64"):
            v.update_weights(bad)
    still = v.generate(RAGGED, params, torch.Generator().manual_seed(6))
    assert torch.equal(still.tokens, want.tokens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_sleep_and_wake_up_are_no_ops_on_cpu(engines):
    v, _ = engines
    assert isinstance(v, RolloutEngine)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_on_eos=False)
    want = v.generate(RAGGED, params, torch.Generator().manual_seed(0))
    assert not v.sleep_enabled and v.sleep() is False and v.wake_up() is False
    got = v.generate(RAGGED, params, torch.Generator().manual_seed(0))
    got.validate()
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.rollout_logp, want.rollout_logp)


def test_sync_buckets_hold_one_bucket_at_a_time():
    """iter_weight_buckets alone: the tensors it took and has not handed on fit in one bucket (+ the one converting)."""
    sizes = [10, 30, 5, 100, 1, 1, 2, 60, 3]  # float32 elements: 4 bytes each
    bucket = 40 * 4
    refs, watch = _storage_refs()
    held: list[int] = []

    def stream():
        for i, n in enumerate(sizes):
            gc.collect()
            held.append(_alive_bytes(refs))  # what the consumer side still holds when the next tensor is pulled
            t = torch.full((n,), float(i))
            watch(t)
            yield f"w{i}", t
            del t

    counter: dict[str, float] = {}
    got = []
    for name, t in iter_weight_buckets(stream(), bucket, torch.float32, counter=counter):
        got.append((name, int(t.numel())))  # the consumer drops each tensor at once
        del t
    assert got == [(f"w{i}", n) for i, n in enumerate(sizes)]  # every tensor once, in order, unchanged
    assert counter["bytes"] == 4 * sum(sizes)
    # never more than one bucket (a tensor larger than a bucket is a bucket of its own) ...
    assert max(held) <= max(bucket, 4 * max(sizes)), held
    assert held == [0, 40, 160, 20, 400, 4, 8, 16, 240], held  # w0 + w1 fill the first bucket, w3 goes alone
    # ... and a dtype change copies: the source tensors are then not held at all past their conversion
    refs.clear()
    held.clear()
    for _ in iter_weight_buckets(stream(), bucket, torch.float64):
        pass
    assert max(held) == 0, held


def test_missing_vllm_names_the_key_and_the_install(monkeypatch):
    import sys

    from nemo_fp8rl.config.schema import TrainConfig
    from nemo_fp8rl.validation import validate

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to import
    assert not vllm_available()
    with pytest.raises(ValueError, match=r"rollout.engine=vllm.*pip install nemo-fp8rl\[vllm\].*rollout.engine=torch"):
        get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    cfg = TrainConfig()
    cfg.rollout.engine = "vllm"
    validate(cfg)  # validation does not need vLLM (a launcher may validate on a machine without it)


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
@pytest.mark.parametrize("scheme", ["vllm_w8a8", "vllm_block"])
def test_fp8_rollout_on_cpu_stops_before_any_work_with_the_alternative(scheme):
    """vLLM computes the FP8 rollout schemes on NVIDIA GPUs only: the constructor refuses before building."""
    check_vllm_supported(fp8_scheme=scheme)  # the setup itself is fine (a GPU node runs it) ...
    with pytest.raises(ValueError) as e:  # ... this machine cannot
        get_rollout_engine("vllm", CFG, fp8_scheme=scheme, eos_id=EOS, pad_id=PAD)
    msg = str(e.value)
    assert f"rollout.fp8.scheme={scheme}" in msg and "rollout.engine=torch" in msg and "NVIDIA GPU" in msg, msg
    assert "'cpu'" in msg and "AMX" in msg, msg  # what vLLM's platform reports here


def test_schemes_vllm_cannot_compute_are_refused_anywhere():
    with pytest.raises(ValueError, match=r"rollout.fp8.scheme=same_as_train.*vllm_block or vllm_w8a8.*rollout.engine=torch"):
        check_vllm_supported(fp8_scheme="same_as_train", installed=False)
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2 does not divide the 3 processes"):
        check_vllm_supported(tensor_parallel_size=2, installed=False, world_size=3)


def test_config_validation_accepts_fp8_rollout_with_vllm_on_a_host_without_gpu(monkeypatch):
    """Validation runs on the SLURM submit host (no GPU): it refuses only what vLLM cannot run anywhere."""
    from nemo_fp8rl.config.schema import ConfigError, TrainConfig
    from nemo_fp8rl.validation import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = TrainConfig()
    cfg.rollout.engine = "vllm"
    cfg.fp8.recipe = "blockwise"
    for scheme in ("vllm_block", "vllm_w8a8", "off"):
        cfg.rollout.fp8.scheme = scheme
        validate(cfg)
    cfg.rollout.fp8.scheme = "same_as_train"
    with pytest.raises(ConfigError, match="rollout.fp8.scheme=same_as_train.*rollout.engine=torch"):
        validate(cfg)
    cfg.rollout.fp8.scheme, cfg.model.num_query_groups = "vllm_block", 2  # K/V: 2 x 32 = 64 rows
    with pytest.raises(ConfigError, match="rollout.fp8.scheme=vllm_block.*multiple of 128 rows"):
        validate(cfg)
    cfg.rollout.fp8.scheme = "vllm_w8a8"  # per-tensor: no block constraint
    validate(cfg)
    cfg.fp8.recipe = None  # the bf16 arm forces the rollout scheme off
    validate(cfg)
    cfg.rollout.fp8.scheme = "vllm_block"
    cfg.rollout.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size"):
        validate(cfg)


def test_block_fp8_needs_fused_parts_in_whole_blocks():
    from nemo_fp8rl.rollout.vllm_support import check_block_shape

    check_block_shape(ModelShape.from_config(ModelConfig(vocab_size=64, num_layers=1, hidden_size=256,
                                                         num_attention_heads=2, num_query_groups=1,
                                                         ffn_hidden_size=512)))
    with pytest.raises(ValueError, match=r"multiple of 128 rows.*k_proj/v_proj.*rollout.engine=torch"):
        check_block_shape(ModelShape.from_config(CFG))  # 2 KV groups x 32 = 64 rows


def _cli():
    """tests/trainer/_cli.py (the real training CLI in a subprocess with tiny sizes), loaded by path."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_trainer_cli", Path(__file__).parents[1] / "trainer" / "_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_vllm
def test_trainer_runs_with_vllm_and_resumes_exactly(tmp_path):
    """2 RL steps with rollout.engine=vllm (FP8 off) == the same run resumed from its step-1 checkpoint (a fresh
    vLLM engine synced from the restored weights); vLLM agrees with the trainer. Two CLI runs, not three: the
    run itself stops without a final checkpoint (trainer.save_final=false), so resuming it redoes step 1."""
    import shutil

    cli = _cli()
    arm = ["fp8=off", "rollout.engine=vllm", "rollout.sync_bucket_mb=0.1", "trainer.max_steps=2",
           "trainer.checkpoint_interval=1", "trainer.save_final=false"]
    full, part = tmp_path / "full", tmp_path / "part"
    cli.run_cli(full, *arm)
    assert (full / "checkpoints" / "latest").read_text().strip() == "step_1"
    shutil.copytree(full, part)
    cli.run_cli(part, *arm, "resume=true")
    a, b = cli.metrics(full), cli.metrics(part)
    assert [r["step"] for r in b] == [0, 1]  # the resumed run's step 1 replaced the copied one
    assert cli.strip_timing(a) == cli.strip_timing(b)
    assert b[1]["timing/rollout"] != a[1]["timing/rollout"]  # step 1 was run again, not kept from the copy
    for r in a:
        # FP8 off: vLLM's log-probs of its own samples are the trainer's (float32 both) up to float noise
        assert r["mismatch/logp_abs_diff_max"] < TOL, r["mismatch/logp_abs_diff_max"]
        assert r["rollout/response_len"] > 0
        assert 0 < r["timing/weight_sync"] < r["timing/rollout"]


@needs_vllm
def test_two_data_parallel_ranks_each_own_an_engine(tmp_path):
    """torchrun with 2 gloo ranks: each rank builds its vLLM engine in its own process for its own prompts."""
    import subprocess
    import sys

    cli = _cli()
    out = tmp_path / "dp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "nemo_fp8rl.train",
           *cli.TINY, f"output_dir={out}", f"warmup.cache_dir={tmp_path / '.warmup_cache'}", "fp8=off",
           "rollout.engine=vllm", "trainer.max_steps=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    recs = cli.metrics(out)
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert r["mismatch/logp_abs_diff_max"] < TOL, r["mismatch/logp_abs_diff_max"]
