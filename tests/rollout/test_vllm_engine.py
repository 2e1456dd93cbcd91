"""The vLLM rollout engine against the torch engine (the reference) on the same weights, with real vLLM.

One ``LLM`` for the module (building one takes ~30 s on 2 cores). FP8 is off in every comparison, so
both engines compute the same float32 function and differ only by summation order (~1e-6): 1e-4 holds
on any x86 CPU (tests/_fp8_bounds.py explains why FP8 comparisons need other bounds).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout.vllm_engine import _bucket_names, check_vllm_supported, vllm_available

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
    # a tiny bucket: every sync streams the model in many buckets (a layer split across buckets)
    v = get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, sync_bucket_mb=0.05)
    v.update_weights(weights["a"])
    v.generate(RAGGED, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0))
    # vLLM reseeds torch's RNG, sets 1 thread and disables torch.set_num_threads: the engine undoes all three
    _TORCH_STATE_KEPT.update(rng=torch.equal(rng, torch.random.get_rng_state()), threads=torch.get_num_threads() == threads,
                             set_num_threads=torch.set_num_threads is set_threads)
    t = get_rollout_engine("torch", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    return v, t


_TORCH_STATE_KEPT: dict[str, bool] = {}


def test_the_engine_leaves_torch_global_state_alone(engines):
    assert _TORCH_STATE_KEPT == {"rng": True, "threads": True, "set_num_threads": True}


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


def test_sync_buckets_are_bounded():
    sizes = {"a": 10, "b": 30, "c": 5, "d": 100, "e": 1}
    buckets = _bucket_names(sizes, 40)
    assert [n for bk in buckets for n in bk] == list(sizes)  # every tensor once, in order
    assert buckets == [["a", "b"], ["c"], ["d"], ["e"]]
    assert all(sum(sizes[n] for n in bk) <= 40 or len(bk) == 1 for bk in buckets)


def test_missing_vllm_names_the_key_and_the_install(monkeypatch):
    import sys

    from nemo_fp8rl.config.schema import TrainConfig, validate

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to import
    assert not vllm_available()
    with pytest.raises(ValueError, match=r"rollout.engine=vllm.*pip install nemo-fp8rl\[vllm\].*rollout.engine=torch"):
        get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    cfg = TrainConfig()
    cfg.rollout.engine = "vllm"
    validate(cfg)  # validation does not need vLLM (a launcher may validate on a machine without it)


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
@pytest.mark.parametrize("scheme", ["vllm_w8a8", "vllm_block", "same_as_train"])
def test_fp8_rollout_on_cpu_stops_with_the_alternative(scheme):
    with pytest.raises(ValueError) as e:
        check_vllm_supported(fp8_scheme=scheme)
    msg = str(e.value)
    assert f"rollout.fp8.scheme={scheme}" in msg and "rollout.engine=torch" in msg and "not on this CPU" in msg
    with pytest.raises(ValueError, match="rollout.fp8.scheme"):
        get_rollout_engine("vllm", CFG, fp8_scheme=scheme, eos_id=EOS, pad_id=PAD)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_config_validation_refuses_fp8_rollout_with_vllm_before_any_work():
    from nemo_fp8rl.config.schema import ConfigError, TrainConfig, validate

    cfg = TrainConfig()
    cfg.rollout.engine = "vllm"
    cfg.fp8.recipe = "blockwise"
    cfg.rollout.fp8.scheme = "vllm_block"
    with pytest.raises(ConfigError, match="rollout.engine=torch"):
        validate(cfg)
    cfg.rollout.fp8.scheme = "off"
    validate(cfg)
    cfg.fp8.recipe, cfg.rollout.fp8.scheme = None, "vllm_w8a8"  # the bf16 arm forces the rollout scheme off
    validate(cfg)
    cfg.rollout.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size"):
        validate(cfg)


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
    """3 RL steps with rollout.engine=vllm (FP8 off) == 2 steps + resume to 3; vLLM agrees with the trainer."""
    cli = _cli()
    arm = ["fp8=off", "rollout.engine=vllm", "rollout.sync_bucket_mb=0.1", "trainer.checkpoint_interval=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    cli.run_cli(full, *arm, "trainer.max_steps=3")
    cli.run_cli(part, *arm, "trainer.max_steps=2")
    cli.run_cli(part, *arm, "trainer.max_steps=3", "resume=true")
    a, b = cli.metrics(full), cli.metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2]
    assert cli.strip_timing(a) == cli.strip_timing(b)
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
