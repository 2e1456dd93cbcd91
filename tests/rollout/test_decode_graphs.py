"""Static-shape decode (``rollout.cuda_graphs``, nemo_fp8rl/rollout/decode_graphs.py) against the eager path.

Without CUDA the static steps run eagerly over the same buffers a CUDA graph would replay: the batch and
length buckets, the live slots, the moves to a smaller bucket. So this checks everything but the capture:
the sampler sees the eager path's batch (greedy batches equal, every recorded log-prob the engine's own to
float rounding; the GEMMs see bucket-sized batches), with EOS, stop-string checks every k steps and an FP8
KV cache. The capture itself runs in the GPU check; here a capture that cannot run (no CUDA) must fall back
to the eager static steps with a warning, not fail the call.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import SamplingParams, decode_graphs, get_rollout_engine
from nemo_fp8rl.rollout.decode_graphs import StaticDecode, batch_bucket, length_bucket
from tests.rollout.conftest import CONFIGS, check_rows_end_at_eos, random_hf_weights

PROMPTS = [[1, 5, 7], [3, 9], [4, 4, 6, 8, 10], [11], [12, 13], [7, 7, 7, 1], [2, 3], [15, 14, 13], [8], [9, 9]]


@pytest.fixture
def small_buckets(monkeypatch):
    """Buckets the tiny batches pass through (2, 4, 8, ... rows; 4, 8, 16 positions)."""
    monkeypatch.setattr(decode_graphs, "MIN_BATCH_BUCKET", 2)
    monkeypatch.setattr(decode_graphs, "MIN_LENGTH_BUCKET", 4)


def _engine(k: int, eos: int, graphs: bool, name: str = "qwen2", **kw):
    cfg = ModelConfig(name=name, **CONFIGS[name])
    eng = get_rollout_engine("torch", cfg, fp8_scheme=kw.pop("scheme", "off"), eos_id=eos, pad_id=0,
                             stop_check_interval=k, cuda_graphs=graphs, **kw)
    eng.update_weights(random_hf_weights(cfg, seed=4, logit_scale=4.0))
    return eng


@functools.lru_cache(maxsize=None)
def _spread_eos(name: str = "qwen2") -> int:
    """A token the greedy policy emits first at the most different steps across rows (rows end apart)."""
    b = _engine(1, 99, False, name).generate(PROMPTS * 3, SamplingParams(max_new_tokens=12, stop_on_eos=False,
                                                                         temperature=0.0), torch.Generator())
    best, spread = None, -1
    for t in range(1, 16):
        first = set()
        for r in range(len(PROMPTS) * 3):
            resp = b.tokens[r, b.prompt_lens[r]: b.prompt_lens[r] + b.response_lens[r]].tolist()
            first.add(resp.index(t) if t in resp else 99)
        if len(first) > spread:
            best, spread = t, len(first)
    assert spread >= 3
    return best


def test_buckets():
    assert [batch_bucket(n, 512) for n in (1, 8, 9, 200, 256, 257, 512)] == [8, 8, 16, 256, 256, 512, 512]
    assert batch_bucket(300, 300) == 300 and batch_bucket(5, 6) == 6  # never above the call's rows
    assert [length_bucket(s, 4096) for s in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024, 4096]
    assert length_bucket(70, 100) == 100
    with pytest.raises(ValueError):
        batch_bucket(0, 8)


@pytest.mark.parametrize("name,k", [("qwen2", 1), ("llama31", 3)])
def test_greedy_static_decode_is_the_eager_batch(small_buckets, name, k):
    eos = _spread_eos(name)
    params = SamplingParams(max_new_tokens=12, stop_on_eos=True, temperature=0.0)
    ref = _engine(k, eos, False, name).generate(PROMPTS * 3, params, torch.Generator().manual_seed(0))
    assert 0 < int(ref.finished.sum()) < len(PROMPTS) * 3  # rows end at different steps: buckets shrink
    got = _engine(k, eos, True, name).generate(PROMPTS * 3, params, torch.Generator().manual_seed(0))
    for f in ("tokens", "prompt_lens", "response_lens", "finished", "mask"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, rtol=0, atol=1e-5)


# (the FP8 cache with FP8 linears too is left out: there the eager decode and the full forward already differ
# by FP8 rounding flips, ~0.03 in a log-prob, so the teacher-forced log-probs are no reference)
@pytest.mark.parametrize("kv_cache,scheme", [("off", "vllm_w8a8"), ("e4m3", "off")])
def test_sampled_static_decode_records_the_engines_logprobs(small_buckets, kv_cache, scheme):
    eos = _spread_eos()
    eng = _engine(2, eos, True, kv_cache=kv_cache, scheme=scheme)
    b = eng.generate(PROMPTS * 3, SamplingParams(max_new_tokens=12, stop_on_eos=True, temperature=1.0),
                     torch.Generator().manual_seed(3))
    check_rows_end_at_eos(b, eos)
    torch.testing.assert_close(b.rollout_logp * b.mask, eng.logprobs(b.tokens) * b.mask, rtol=0, atol=1e-5)


def test_rows_move_to_the_first_slots_when_a_smaller_bucket_fits(small_buckets):
    """The bookkeeping of :class:`StaticDecode` across stop checks: slots, the bucket, the moved cache rows."""
    from nemo_fp8rl.rollout.model import KVCache, ModelShape

    eng = _engine(1, 2, True)
    shape = ModelShape.from_config(ModelConfig(name="qwen2", **CONFIGS["qwen2"]))
    cache = KVCache.empty(shape, 8, 10, torch.device("cpu"), torch.float32)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.arange(8, dtype=torch.float32).view(8, 1, 1, 1).expand_as(t))  # row r holds r
    s = StaticDecode(shape, eng.weights, eng.scheme, cache, capture=False)
    assert s.rows == 8
    s.keep(torch.tensor([0, 2, 3, 5, 6]))  # 5 live rows: still the 8-row bucket, nothing moves
    assert s.rows == 8 and s.slots.tolist() == [0, 2, 3, 5, 6] and cache.k[0][5, 0, 0, 0] == 5
    s.keep(torch.tensor([1, 3, 4]))  # rows in slots 2, 5, 6 -> 4-row bucket: moved to slots 0..2
    assert s.rows == 4 and s.slots.tolist() == [0, 1, 2]
    assert [int(cache.k[1][i, 0, 0, 0]) for i in range(3)] == [2, 5, 6]
    assert [int(cache.v[0][i, 0, 0, 0]) for i in range(3)] == [2, 5, 6]
    logits = s.step(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), length=7)
    assert logits.shape == (3, 16) and s.tok[:3].tolist() == [1, 2, 3] and s.pos[:3].tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="3 are live"):
        s.step(torch.tensor([1, 2]), torch.tensor([4, 5]), length=7)


def test_a_capture_that_cannot_run_falls_back_to_eager_static_steps(small_buckets, caplog, monkeypatch):
    """Capture requested where it cannot run (no CUDA here): one warning with the reason, the same batch."""
    eos = _spread_eos()
    params = SamplingParams(max_new_tokens=8, stop_on_eos=True, temperature=1.0)
    ref = _engine(1, eos, True).generate(PROMPTS, params, torch.Generator().manual_seed(5))
    made = []
    orig = StaticDecode.__init__

    def forced(self, *a, capture, **kw):
        orig(self, *a, capture=True, **kw)
        made.append(self)

    monkeypatch.setattr(StaticDecode, "__init__", forced)
    with caplog.at_level(logging.WARNING, logger="nemo_fp8rl.rollout.decode_graphs"):
        got = _engine(1, eos, True).generate(PROMPTS, params, torch.Generator().manual_seed(5))
    assert made and made[0].fallback and not made[0].graphs
    assert sum("capturing the decode step" in r.getMessage() for r in caplog.records) == 1
    for f in ("tokens", "response_lens", "finished", "rollout_logp"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


def test_config_key_reaches_the_engine_and_is_checked():
    from nemo_fp8rl.config.schema import ConfigError, TrainConfig
    from nemo_fp8rl.validation import validate

    cfg = TrainConfig()
    assert cfg.rollout.cuda_graphs is False  # off until a GPU check measures it
    cfg.rollout.cuda_graphs = "yes"
    with pytest.raises(ConfigError, match="rollout.cuda_graphs"):
        validate(cfg)
    cfg.rollout.cuda_graphs = True
    m = ModelConfig(name="qwen2", **CONFIGS["qwen2"])
    eng = get_rollout_engine("torch", m, fp8_scheme="off", eos_id=2, pad_id=0, options=cfg.rollout)
    assert eng.cuda_graphs is True
    with pytest.raises(ValueError, match="rollout.cuda_graphs"):
        get_rollout_engine("torch", m, fp8_scheme="off", eos_id=2, pad_id=0, cuda_graphs=1)


def test_static_decode_adds_no_host_sync_per_step(small_buckets):
    """As the eager path (tests/rollout/test_decode_host_syncs.py): syncs grow with steps / k, not with steps."""
    from tests.rollout.test_decode_host_syncs import _syncs

    eng = _engine(8, _spread_eos(), True)
    assert _syncs(eng, 24, stop=False) == _syncs(eng, 4, stop=False)
    assert _syncs(eng, 24) - _syncs(eng, 4) <= 2 * (24 // 8)


def _recording_static(monkeypatch) -> list:
    made = []
    orig = StaticDecode.__init__

    def record(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(StaticDecode, "__init__", record)
    return made


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,dtype,kv_cache", [("off", torch.float32, "off"), ("vllm_w8a8", torch.bfloat16, "off"),
                                                   ("vllm_w8a8", torch.bfloat16, "e4m3")])
def test_cuda_graph_decode_captures_and_matches_the_engine(small_buckets, monkeypatch, scheme, dtype, kv_cache):
    """On CUDA the steps are captured (no fallback; BF16 with FP8 linears on torch's scaled GEMM and the Triton
    activation quantizers too, and with an FP8 KV cache: its scales are device tensors uploaded before the
    capture) and replay the engine's own log-probs; float32 without FP8 gives the eager batch."""
    eos = _spread_eos()
    cfg = ModelConfig(name="qwen2", **CONFIGS["qwen2"])
    sd = random_hf_weights(cfg, seed=4, logit_scale=4.0)

    def engine(graphs):
        e = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=eos, pad_id=0, device="cuda", dtype=dtype,
                               fp8_gemm="torch", cuda_graphs=graphs, kv_cache=kv_cache)
        e.update_weights(sd)
        return e

    made = _recording_static(monkeypatch)
    eng = engine(True)
    params = SamplingParams(max_new_tokens=12, stop_on_eos=True, temperature=0.0 if scheme == "off" else 1.0)
    got = eng.generate(PROMPTS * 3, params, torch.Generator().manual_seed(0))
    got.validate()
    assert made and made[0].fallback is None and len(made[0].graphs) >= 2, [s.fallback for s in made]
    m = got.mask.bool()
    lp = eng.logprobs(got.tokens)
    if scheme == "off":
        ref = engine(False).generate(PROMPTS * 3, params, torch.Generator().manual_seed(0))
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.finished, ref.finished)
        torch.testing.assert_close(got.rollout_logp[m], lp[m], atol=1e-3, rtol=0)
    else:  # BF16 activations: the cached decode and the full forward round differently
        assert 0 < int(m.sum()) and float((got.rollout_logp[m] - lp[m]).abs().mean()) < 0.1
