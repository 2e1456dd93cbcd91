"""Calibrated FP8 KV-cache scales (NeMo RL's percentile and margin) and the rollout's FP8 setup from a config.

The collector's streamed, chunked, masked forward is held against a plain loop over the layers of the
whole batch; the trainer's sync against the collector; the config's refusals name the key.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.config.schema import ConfigError, TrainConfig, check_values
from nemo_fp8rl.fp8.kv_cache import KvScales, percentile_nearest_rank, scale_from_amax
from nemo_fp8rl.rollout.fp8_setup import RolloutFp8Setup, rollout_fp8_setup, score_logprobs
from nemo_fp8rl.rollout.kv_calibration import KvAmaxCollector, calibrate_kv_scales, kv_scales_from_amax
from nemo_fp8rl.rollout.model import (
    ModelShape, _attend, _build_layer, _mlp_and_residual, _qkv, rope_cos_sin, rope_inv_freq,
)
from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine
from nemo_fp8rl.trainer.kv_scales import KvScaleSync

from .conftest import random_hf_weights

CFG = ModelConfig(name="kv", vocab_size=32, num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, seq_length=64, add_qkv_bias=True)  # Qwen2-style: biased keys, no QK norm
TOKENS = torch.tensor([[1, 3, 4, 5, 6, 7, 0, 0], [1, 8, 9, 0, 0, 0, 0, 0], [1, 9, 9, 9, 9, 9, 9, 2]])
LENGTHS = torch.tensor([6, 3, 8])


@pytest.fixture(scope="module")
def weights():
    sd = random_hf_weights(CFG, seed=0)
    sd["model.layers.1.self_attn.k_proj.bias"][:8] += 30.0  # Qwen2-like large key biases in one layer
    return sd


def _reference_amax(weights) -> torch.Tensor:
    """[L, 3, B]: a plain float32 forward of the whole batch, amax of |q|, |k|, |v| over each row's valid tokens."""
    from nemo_fp8rl.fp8.rollout import RolloutScheme

    shape, off = ModelShape.from_config(CFG), RolloutScheme()
    B, T = TOKENS.shape
    cos, sin = rope_cos_sin(torch.arange(T).expand(B, T), rope_inv_freq(shape))
    h = weights["model.embed_tokens.weight"][TOKENS]
    out = torch.zeros(shape.num_layers, 3, B)
    for i in range(shape.num_layers):
        sd = {k: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")}
        lw = _build_layer(shape, i, sd, off, torch.device("cpu"), torch.float32, {})
        q, k, v = _qkv(shape, lw, off, h, cos, sin)
        for j, x in enumerate((q, k, v)):
            for b in range(B):
                out[i, j, b] = x[b, :, : LENGTHS[b]].abs().max()
        h = _mlp_and_residual(shape, lw, off, h, _attend(shape, q, k, v, None))
    return out


def test_collector_matches_a_plain_forward_in_any_stream_order(weights):
    want = _reference_amax(weights)
    shape = ModelShape.from_config(CFG)
    for order in (list(weights.items()), list(reversed(weights.items()))):  # reversed: embedding last
        c = KvAmaxCollector(shape, TOKENS, LENGTHS, chunk_tokens=16)  # chunks of 2 rows
        passed = list(c.tee(iter(order)))
        assert [n for n, _ in passed] == [n for n, _ in order] and c.done  # pairs pass unchanged
        torch.testing.assert_close(c.amax, want, rtol=1e-6, atol=1e-6)
    assert float(want[1, 1].min()) > 10.0  # the biased layer's keys are large
    scales = calibrate_kv_scales(shape, weights, TOKENS, LENGTHS, fmt="e4m3", percentile=99.9, margin=1.05)
    pamax = percentile_nearest_rank(want, 99.9)
    torch.testing.assert_close(scales.k, scale_from_amax(pamax[:, 1], "e4m3", 1.05), rtol=1e-6, atol=0)
    torch.testing.assert_close(scales.q, pamax[:, 0] * 1.05 / 448, rtol=1e-6, atol=0)


def test_collector_refuses_an_incomplete_stream(weights):
    c = KvAmaxCollector(ModelShape.from_config(CFG), TOKENS, LENGTHS)
    for _ in c.tee({k: v for k, v in weights.items() if not k.startswith("model.layers.2.")}):
        pass
    with pytest.raises(RuntimeError, match="2 of 3 layers"):
        c.percentile_amax(99.9)
    with pytest.raises(ValueError, match="1..T valid tokens"):
        KvAmaxCollector(ModelShape.from_config(CFG), TOKENS, torch.tensor([0, 3, 8]))


def test_calibrated_scales_cut_the_cache_error(weights):
    """A layer whose values are ~1e-3 (its output projection 1e3 larger: the same function): with vLLM's
    static 1.0 they fall into E4M3's subnormals (steps of 2^-9), calibrated scales keep 3 mantissa bits.
    (A scale cannot help the relative precision of large values, only saturation and underflow.)"""
    shape = ModelShape.from_config(CFG)
    weights = dict(weights)
    a = "model.layers.1.self_attn."
    for name, f in ((a + "v_proj.weight", 1e-3), (a + "v_proj.bias", 1e-3), (a + "o_proj.weight", 1e3)):
        weights[name] = weights[name] * f
    cal = calibrate_kv_scales(shape, weights, TOKENS, LENGTHS)
    assert float(cal.v[1]) < 1e-4 < float(cal.v[0])
    setup = RolloutFp8Setup(scheme="off", kv_cache="e4m3", kv_scales="calibrated")
    ref = score_logprobs(CFG, weights, TOKENS, RolloutFp8Setup())
    err = {name: float((score_logprobs(CFG, weights, TOKENS, setup, kv_scales=s) - ref).abs().max())
           for name, s in (("static", None), ("calibrated", cal))}
    assert err["calibrated"] < 0.1 * err["static"], err


def test_kv_scale_sync(weights):
    class Task:
        def prompts(self, n, generator):
            lens = torch.randint(2, 6, (n,), generator=generator).tolist()
            return [dataclasses.make_dataclass("P", ["ids"])([1] + [3 + j for j in range(k - 1)]) for k in lens]

    setup = RolloutFp8Setup(scheme="off", kv_cache="e4m3", kv_scales="calibrated")
    sync = KvScaleSync(setup, CFG, task=Task(), seed=1, dp_rank=0, prompts=3)
    engine = TorchRolloutEngine(CFG, eos_id=2, pad_id=0, **setup.engine_kwargs())
    metrics = sync.sync(engine, iter(weights.items()))  # first sync: seeded task prompts
    first = sync.scales
    assert engine.kv_scales == first and first != KvScales.static(3)
    assert float(metrics["kv/k_scale_max"][0]) == float(first.k.max())
    batch = type("B", (), {"tokens": TOKENS, "prompt_lens": torch.tensor([2, 2, 2]), "response_lens": LENGTHS - 2})
    sync.observe(batch)
    state = sync.state_dict()
    sync.sync(engine, weights)
    assert sync.scales == calibrate_kv_scales(ModelShape.from_config(CFG), weights, TOKENS, LENGTHS)
    again = KvScaleSync(setup, CFG, task=Task(), seed=1, dp_rank=0, prompts=3)
    again.load_state_dict(state)
    again.sync(TorchRolloutEngine(CFG, eos_id=2, pad_id=0, **setup.engine_kwargs()), weights)
    assert again.scales == sync.scales  # resumed: the same calibration batch
    static = KvScaleSync(dataclasses.replace(setup, kv_scales="static"), CFG, task=Task(), seed=1, dp_rank=0, prompts=3)
    eng = TorchRolloutEngine(CFG, eos_id=2, pad_id=0, **setup.engine_kwargs())
    assert static.sync(eng, weights) == {} and eng.kv_scales == KvScales.static(3) and static.state_dict() is None


def test_calibration_rows_are_one_per_group_within_the_token_budget():
    setup = RolloutFp8Setup(scheme="off", kv_cache="e4m3", kv_scales="calibrated", kv_calib_max_tokens=10)
    sync = KvScaleSync(setup, CFG, task=None, seed=1, dp_rank=0, prompts=3, group_size=2)
    tokens = torch.arange(6 * 9).view(6, 9)
    lens = torch.tensor([3, 9, 4, 9, 5, 9])  # rows 0, 2, 4 open the three groups: 3 + 4 <= 10 < 3 + 4 + 5
    sync.observe(type("B", (), {"tokens": tokens, "prompt_lens": lens - 1, "response_lens": torch.ones(6)}))
    st = sync.state_dict()
    assert st["lengths"].tolist() == [3, 4] and torch.equal(st["tokens"], tokens[[0, 2], :4])
    tight = KvScaleSync(dataclasses.replace(setup, kv_calib_max_tokens=1), CFG, task=None, seed=1, dp_rank=0,
                        prompts=3, group_size=2)
    tight.observe(type("B", (), {"tokens": tokens, "prompt_lens": lens - 1, "response_lens": torch.ones(6)}))
    assert tight.state_dict()["lengths"].tolist() == [3]  # at least one sequence


def test_setup_from_the_config():
    cfg = TrainConfig()
    cfg.fp8.recipe = "blockwise"
    cfg.model.num_layers = 4
    r = cfg.rollout.fp8
    r.kv_cache, r.kv_scales, r.num_layers_at_start_in_bf16, r.num_layers_at_end_in_bf16 = "e4m3", "calibrated", 1, 2
    s = rollout_fp8_setup(cfg)
    assert (s.scheme, s.kv_cache, s.high_precision_layers, s.calibrated) == ("vllm_w8a8", "e4m3", (0, 2, 3), True)
    assert s.engine_kwargs() == {"fp8_scheme": "vllm_w8a8", "kv_cache": "e4m3", "high_precision_layers": (0, 2, 3)}
    assert "KV cache e4m3 (calibrated scales)" in s.describe()
    bf16 = rollout_fp8_setup(r, num_layers=4, training_fp8=False)  # the BF16 arm: high precision end to end
    assert (bf16.scheme, bf16.kv_cache, bf16.high_precision_layers, bf16.calibrated) == ("off", "off", (), False)
    with pytest.raises(TypeError, match="num_layers and training_fp8"):
        rollout_fp8_setup(r)


def test_score_logprobs_is_the_engines(weights):
    setup = RolloutFp8Setup(scheme="vllm_w8a8", kv_cache="e4m3", high_precision_layers=(2,))
    scales = KvScales(torch.full((3,), 0.01), torch.full((3,), 0.05), torch.full((3,), 0.02))
    e = TorchRolloutEngine(CFG, eos_id=2, pad_id=0, **setup.engine_kwargs())
    e.update_weights(weights, kv_scales=scales)
    assert torch.equal(score_logprobs(CFG, weights, TOKENS, setup, kv_scales=scales), e.logprobs(TOKENS))
    none = score_logprobs(CFG, weights, TOKENS, setup, kv_scales=scales, high_precision_layers=(0, 1, 2))
    assert torch.equal(none, score_logprobs(CFG, weights, TOKENS, RolloutFp8Setup()))


@pytest.mark.parametrize("key,value,words", [
    ("kv_cache", "fp8", "rollout.fp8.kv_cache='fp8' is not valid"),
    ("kv_scales", "max", "rollout.fp8.kv_scales='max' is not valid"),
    ("kv_scales", "calibrated", "rollout.fp8.kv_cache=off; set rollout.fp8.kv_cache=e4m3"),
    ("kv_calib_percentile", 0.0, "rollout.fp8.kv_calib_percentile=0.0 must be in (0, 100]"),
    ("kv_calib_margin", -1.0, "rollout.fp8.kv_calib_margin=-1.0 must be a number > 0"),
    ("kv_calib_max_tokens", 0, "rollout.fp8.kv_calib_max_tokens=0 must be an integer >= 1"),
    ("num_layers_at_start_in_bf16", -1, "rollout.fp8.num_layers_at_start_in_bf16=-1 must be an integer >= 0"),
    ("num_layers_at_end_in_bf16", 9, "exceeds model.num_layers"),
])
def test_config_refusals_name_the_key(key, value, words):
    cfg = TrainConfig()
    setattr(cfg.rollout.fp8, key, value)
    with pytest.raises(ConfigError) as e:
        check_values(cfg)
    assert words in str(e.value)


def test_scales_from_amax_per_layer():
    pamax = torch.tensor([[448.0, 44.8, 0.0], [1.0, 2.0, 4.0]])
    s = kv_scales_from_amax(pamax, "e4m3", 1.0)
    assert s.q.tolist() == [1.0, pytest.approx(1 / 448)] and s.k.tolist() == [pytest.approx(0.1), pytest.approx(2 / 448)]
    assert s.v.tolist() == [1.0, pytest.approx(4 / 448)]  # an amax of 0 keeps vLLM's 1.0
