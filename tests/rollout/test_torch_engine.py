"""The torch rollout engine: numerics against a readable reference, KV cache vs full forward, sampling,
EOS handling, weight sync and its FP8 re-quantization."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.fp8 import get_rollout_scheme
from nemo_fp8rl.rollout import RolloutEngine, SamplingParams, get_rollout_engine, rollout_engine_names
from nemo_fp8rl.rollout.model import ModelShape

from tests._fp8_bounds import assert_fp8_paths_agree, fp8_noise_bound
from .conftest import CONFIGS, random_hf_weights

EOS, PAD = 2, 0


def make_engine(cfg, scheme="off", seed=0, logit_scale=4.0, **kw):
    eng = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=kw.pop("eos_id", EOS), pad_id=PAD, **kw)
    eng.update_weights(random_hf_weights(cfg, seed=seed, logit_scale=logit_scale))
    return eng


RAGGED = [[1, 3, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11, 12, 13, 14], [1, 15, 3]]


# ----------------------------------------------------------------------------- readable reference
def _ref_inv_freq(shape: ModelShape) -> list[float]:
    out = []
    for i in range(shape.head_dim // 2):
        f = 1.0 / shape.rotary_base ** (2 * i / shape.head_dim)
        s = shape.rope_scaling_factor
        if s is not None:  # Llama-3.1: original context 8192, low/high frequency factors 1 and 4
            wl = 2 * math.pi / f
            if wl > 8192:
                f = f / s
            elif wl >= 8192 / 4:
                mu = (8192 / wl - 1) / (4 - 1)
                f = (1 - mu) * f / s + mu * f
        out.append(f)
    return out


def reference_logits(cfg: ModelConfig, sd: dict, tokens: list[int]) -> torch.Tensor:
    """One sequence, float64, per-head loops, RoPE as a complex rotation of (x_j, x_{j+hd/2}) pairs."""
    s = ModelShape.from_config(cfg)
    W = {k: v.double() for k, v in sd.items()}
    H, G, hd, eps = s.num_heads, s.num_groups, s.head_dim, s.norm_epsilon
    T = len(tokens)

    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    inv = torch.tensor(_ref_inv_freq(s), dtype=torch.float64)
    rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64), torch.arange(T, dtype=torch.float64)[:, None] * inv)

    def rope(x):  # x [T, hd]
        z = torch.complex(x[:, : hd // 2], x[:, hd // 2 :]) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    x = W["model.embed_tokens.weight"][tokens]
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        xn = norm(x, W[p + "input_layernorm.weight"])
        proj = {}
        for n in "qkv":
            proj[n] = xn @ W[p + f"self_attn.{n}_proj.weight"].T
            if s.qkv_bias:
                proj[n] = proj[n] + W[p + f"self_attn.{n}_proj.bias"]
        heads = []
        for h in range(H):
            g = h // (H // G)
            qh, kh, vh = (proj[n][:, c * hd : (c + 1) * hd] for n, c in (("q", h), ("k", g), ("v", g)))
            if s.qk_layernorm:
                qh, kh = norm(qh, W[p + "self_attn.q_norm.weight"]), norm(kh, W[p + "self_attn.k_norm.weight"])
            qh, kh = rope(qh), rope(kh)
            scores = qh @ kh.T / math.sqrt(hd)
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            heads.append(torch.softmax(scores, -1) @ vh)
        x = x + torch.cat(heads, -1) @ W[p + "self_attn.o_proj.weight"].T
        xn = norm(x, W[p + "post_attention_layernorm.weight"])
        gate = xn @ W[p + "mlp.gate_proj.weight"].T
        up = xn @ W[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ W[p + "mlp.down_proj.weight"].T
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return norm(x, W["model.norm.weight"]) @ head.T


def test_forward_matches_readable_reference(arch_cfg):
    sd = random_hf_weights(arch_cfg, seed=1, logit_scale=4.0)
    eng = get_rollout_engine("torch", arch_cfg, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    eng.update_weights(sd)
    toks = [1, 5, 9, 3, 14, 7, 7, 2, 11, 4]
    got = eng.forward(torch.tensor([toks]))[0].double()
    ref = reference_logits(arch_cfg, sd, toks)
    assert got.shape == (len(toks), 16)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- cache vs no cache
@pytest.mark.parametrize("scheme", ["off", "vllm_w8a8", "vllm_block"])
def test_kv_cache_logp_equals_full_forward(arch_cfg, scheme):
    eng = make_engine(arch_cfg, scheme)
    out = eng.generate(RAGGED * 3, SamplingParams(max_new_tokens=12), torch.Generator().manual_seed(0))
    out.validate()
    m = out.mask.bool()
    assert int(m.sum()) == int(out.response_lens.sum()) > 0
    ref = eng.logprobs(out.tokens)  # teacher-forced, no cache, right padding: other GEMM shapes
    if scheme == "off":
        torch.testing.assert_close(out.rollout_logp[m], ref[m], atol=2e-5, rtol=0)
        return
    # FP8: per-token (w8a8) and 1x128 (block) activation scales do not depend on the other tokens, so
    # both paths quantize the same values up to float noise; a rare one-code flip moves one token
    # (tests/_fp8_bounds.py). Bound: the FP8 noise of the same tokens (this scheme vs scheme off).
    hp = make_engine(arch_cfg, "off").logprobs(out.tokens)
    assert_fp8_paths_agree(out.rollout_logp, ref, mask=m, float_tol=1e-4, fp8_noise=fp8_noise_bound(ref, hp, m),
                           what=f"{scheme}: cached vs full forward")


def test_greedy_equals_iterated_argmax_of_full_forward():
    cfg = ModelConfig(**CONFIGS["qwen2"])
    eng = make_engine(cfg, "vllm_w8a8")
    prompts = RAGGED
    out = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, stop_on_eos=False),
                       torch.Generator().manual_seed(0))
    for b, p in enumerate(prompts):
        seq = list(p)
        for _ in range(6):  # the naive loop: re-run the whole sequence for every new token
            seq.append(int(eng.forward(torch.tensor([seq]))[0, -1].argmax()))
        assert out.tokens[b, : len(seq)].tolist() == seq


# ----------------------------------------------------------------------------- sampling
def test_same_seed_same_samples_other_seed_differs():
    cfg = ModelConfig(**CONFIGS["llama"])
    eng = make_engine(cfg, "vllm_w8a8", logit_scale=1.0)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10)
    a = eng.generate(RAGGED * 4, params, torch.Generator().manual_seed(123))
    b = eng.generate(RAGGED * 4, params, torch.Generator().manual_seed(123))
    c = eng.generate(RAGGED * 4, params, torch.Generator().manual_seed(124))
    for f in ("tokens", "mask", "rollout_logp", "response_lens", "finished"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert not torch.equal(a.tokens, c.tokens)


def test_tiny_top_p_is_greedy_and_reports_the_nucleus_logp():
    cfg = ModelConfig(**CONFIGS["llama"])
    eng = make_engine(cfg, logit_scale=1.0)
    g = torch.Generator().manual_seed(0)
    greedy = eng.generate(RAGGED, SamplingParams(temperature=0.0, max_new_tokens=8, stop_on_eos=False), g)
    nucleus = eng.generate(RAGGED, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8, stop_on_eos=False), g)
    assert torch.equal(greedy.tokens, nucleus.tokens)
    # the nucleus is the top token alone: it was drawn with probability 1, so its rollout_logp is log 1 = 0
    # (SamplingParams' convention), while greedy reports log_softmax(logits) < 0
    assert torch.equal(nucleus.rollout_logp, torch.zeros_like(nucleus.rollout_logp))
    assert float(greedy.rollout_logp.sum()) < -1.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_logp_is_the_renormalised_nucleus_logp(temperature):
    """rollout_logp = log_softmax(logits / T)[tok] - log(nucleus mass), from a readable per-row reference."""
    cfg = ModelConfig(**CONFIGS["llama"])
    eng = make_engine(cfg, logit_scale=1.0)
    top_p = 0.8
    out = eng.generate(RAGGED, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=8, stop_on_eos=False),
                       torch.Generator().manual_seed(3))
    logits = eng.forward(out.tokens).double()
    checked = 0
    for b in range(out.batch_size):
        p, r = int(out.prompt_lens[b]), int(out.response_lens[b])
        for t in range(p, p + r):
            q = torch.softmax(logits[b, t - 1] / temperature, dim=-1)
            order = q.argsort(descending=True).tolist()
            nucleus, mass = [], 0.0
            for j in order:  # the smallest set of most probable tokens whose mass reaches top_p
                if mass >= top_p:
                    break
                nucleus.append(j)
                mass += float(q[j])
            tok = int(out.tokens[b, t])
            assert tok in nucleus
            want = math.log(float(q[tok])) - math.log(sum(float(q[j]) for j in nucleus))
            assert abs(float(out.rollout_logp[b, t]) - want) < 1e-5, (b, t)
            checked += 1
    assert checked == int(out.mask.sum())
    # the renormalisation matters here: some nucleus is smaller than the vocabulary
    full = eng.logprobs(out.tokens, temperature=temperature) * out.mask
    assert float((out.rollout_logp - full).max()) > 1e-3


def test_temperature_scales_logp():
    cfg = ModelConfig(**CONFIGS["llama"])
    eng = make_engine(cfg, logit_scale=2.0)
    out = eng.generate(RAGGED, SamplingParams(temperature=0.7, max_new_tokens=8), torch.Generator().manual_seed(5))
    torch.testing.assert_close(out.rollout_logp, eng.logprobs(out.tokens, temperature=0.7) * out.mask, atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- EOS and layout
def test_eos_stops_a_row_and_masks_follow():
    cfg = ModelConfig(**CONFIGS["qwen3"])
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_on_eos=True)
    g = torch.Generator().manual_seed(0)
    free = make_engine(cfg, eos_id=999).generate(RAGGED, params, g)  # an id never produced: nothing stops
    assert free.response_lens.tolist() == [10] * 4 and not bool(free.finished.any())
    # Pick as "EOS" the 4th token that the greedy policy generates for row 2; greedy decoding is
    # unchanged up to there, so row 2 must stop exactly at its first occurrence.
    resp2 = free.responses()[2]
    eos = resp2[3]
    stop = resp2.index(eos)
    out = make_engine(cfg, eos_id=eos).generate(RAGGED, params, g)
    out.validate()
    assert out.finished[2] and out.response_lens[2] == stop + 1
    assert out.responses()[2] == resp2[: stop + 1]
    for b, r in enumerate(free.responses()):
        if eos in r:
            assert out.finished[b] and out.responses()[b] == r[: r.index(eos) + 1]
        else:
            assert not out.finished[b] and out.responses()[b] == r
        end = int(out.prompt_lens[b] + out.response_lens[b])
        assert out.tokens[b, :end].tolist() == RAGGED[b] + out.responses()[b]
        assert (out.tokens[b, end:] == PAD).all()
        assert out.mask[b, end - 1] == 1 and (out.mask[b, end:] == 0).all()
        assert (out.rollout_logp[b, end:] == 0).all() and (out.rollout_logp[b, : len(RAGGED[b])] == 0).all()
    assert out.tokens.shape[1] == int((out.prompt_lens + out.response_lens).max())
    # several end ids (generation_config.json lists e.g. <|im_end|> and <|endoftext|>): any one stops a row
    multi = make_engine(cfg, eos_id=999, eos_ids=[eos]).generate(RAGGED, params, g)
    assert multi.responses() == out.responses() and torch.equal(multi.finished, out.finished)


def test_bad_inputs_are_rejected_with_the_fix():
    cfg = ModelConfig(**CONFIGS["llama"], seq_length=16)
    eng = make_engine(cfg)
    g = torch.Generator()
    with pytest.raises(ValueError, match="model.seq_length"):
        eng.generate([[1] * 10], SamplingParams(max_new_tokens=8), g)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1, 2], []], SamplingParams(max_new_tokens=2), g)
    with pytest.raises(ValueError, match=r"outside \[0, 16\)"):
        eng.generate([[1, 16]], SamplingParams(max_new_tokens=2), g)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(RuntimeError, match="update_weights"):
        get_rollout_engine("torch", cfg, fp8_scheme="off", eos_id=EOS, pad_id=PAD).generate([[1]], SamplingParams(), g)
    with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang' \(config key rollout.engine\)"):
        get_rollout_engine("sglang", cfg, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    assert "torch" in rollout_engine_names()
    assert isinstance(eng, RolloutEngine)


# ----------------------------------------------------------------------------- weight sync
def test_weight_sync_validates_keys_and_shapes():
    cfg = ModelConfig(**CONFIGS["qwen2"])
    eng = get_rollout_engine("torch", cfg, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    sd = random_hf_weights(cfg)
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    del bad["model.layers.0.self_attn.k_proj.bias"]
    bad["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    bad["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(64, 64)
    bad["model.layers.1.input_layernorm.weight"] = torch.ones(64, dtype=torch.float64).long()
    with pytest.raises(ValueError) as ei:
        eng.update_weights(bad)
    msg = str(ei.value)
    for needle in ("missing keys (2)", "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.bias",
                   "unexpected keys (1)", "q_norm", "v_proj.weight: shape (64, 64), expected (32, 64)",
                   "input_layernorm.weight: expected a floating-point tensor"):
        assert needle in msg, (needle, msg)
    nan = dict(sd, **{"model.norm.weight": torch.full((64,), float("nan"))})
    with pytest.raises(ValueError, match="NaN"):
        eng.update_weights(nan)


def test_weights_in_any_order_give_the_same_model():
    cfg = ModelConfig(**CONFIGS["qwen3"])
    sd = random_hf_weights(cfg, seed=3)
    keys = list(sd)
    random.Random(0).shuffle(keys)
    a = get_rollout_engine("torch", cfg, fp8_scheme="vllm_w8a8", eos_id=EOS, pad_id=PAD)
    b = get_rollout_engine("torch", cfg, fp8_scheme="vllm_w8a8", eos_id=EOS, pad_id=PAD)
    a.update_weights(sd)
    b.update_weights({k: sd[k] for k in keys})
    t = torch.tensor([RAGGED[2]])
    assert torch.equal(a.forward(t), b.forward(t))


class _TrackedStream:
    """A weight stream (as ``FP8Actor.iter_weights`` yields it) that records, at each ``next``, how many of
    the tensors it yielded before still have their storage referenced by anyone (the consumer): weak
    references to the storages, so views and ``detach()`` of a yielded tensor count as keeping it."""

    def __init__(self, sd: dict[str, torch.Tensor], order: list[str]):
        import weakref

        self._weakref = weakref.ref
        self.items = [(k, sd[k].clone()) for k in order]
        self.alive_max = 0
        self._refs: list = []

    def __iter__(self):
        import gc

        while self.items:
            # generations 0 and 1 only: a cycle holding a just-yielded tensor is young, and a full
            # collection walks every object the test session imported (~0.5 s each, 70 times)
            gc.collect(1)
            self.alive_max = max(self.alive_max, sum(r() is not None for r in self._refs))
            name, t = self.items.pop(0)
            self._refs.append(self._weakref(t.untyped_storage()))
            yield name, t
            del t


def _layer_order(sd: dict) -> list[str]:
    """Embedding, then each layer's tensors, then the final norm and head: the actor's stream order."""
    first = ["model.embed_tokens.weight"]
    last = [k for k in ("model.norm.weight", "lm_head.weight") if k in sd]
    return first + [k for k in sd if k not in first + last] + last


@pytest.mark.parametrize("scheme", ["off", "vllm_block"])
def test_streamed_sync_equals_dict_sync_and_holds_one_layer(scheme):
    """``update_weights(stream)`` builds the same engine as the dict, holding at most one layer of the
    incoming tensors at a time, whatever the number of layers. The engine computes in bfloat16 here, so
    every tensor it keeps is its own copy and any incoming float32 storage still alive is held only by
    the sync itself."""
    cfg = ModelConfig(**dict(CONFIGS["qwen3"], num_layers=6))
    sd = random_hf_weights(cfg, seed=5, logit_scale=4.0)
    kw = dict(fp8_scheme=scheme, eos_id=EOS, pad_id=PAD, dtype=torch.bfloat16)
    a, b = get_rollout_engine("torch", cfg, **kw), get_rollout_engine("torch", cfg, **kw)
    rec_a = a.update_weights(sd)
    stream = _TrackedStream(sd, _layer_order(sd))
    rec_b = b.update_weights(iter(stream))
    assert rec_a == rec_b
    t = torch.tensor([RAGGED[2]])
    assert torch.equal(a.forward(t), b.forward(t))
    per_layer = sum(k.startswith("model.layers.0.") for k in sd)
    assert 0 < stream.alive_max <= per_layer, (stream.alive_max, per_layer)


def test_bad_stream_raises_and_keeps_the_old_weights():
    cfg = ModelConfig(**CONFIGS["qwen2"])
    eng = make_engine(cfg)
    t = torch.tensor([RAGGED[0]])
    before = eng.forward(t)
    sd = random_hf_weights(cfg, seed=9)
    order = _layer_order(sd)
    wrong = dict(sd, **{"model.layers.1.mlp.down_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight: shape \(3, 3\)"):
        eng.update_weights((k, wrong[k]) for k in order)
    with pytest.raises(ValueError, match=r"stream ended without 1 keys: \['model.norm.weight'\]"):
        eng.update_weights((k, sd[k]) for k in order if k != "model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight arrived twice"):
        eng.update_weights((k, sd[k]) for k in order + ["model.norm.weight"])
    with pytest.raises(ValueError, match="unexpected key model.layers.7"):
        eng.update_weights(iter([("model.embed_tokens.weight", sd["model.embed_tokens.weight"]),
                                 ("model.layers.7.mlp.up_proj.weight", torch.zeros(1))]))
    with pytest.raises(ValueError, match="model.vocab_size"):
        eng.update_weights(iter([("model.embed_tokens.weight", torch.zeros(3, 64))]))
    assert eng.weights_version == 1 and torch.equal(eng.forward(t), before)  # nothing half-loaded
    eng.update_weights((k, sd[k]) for k in order)
    assert eng.weights_version == 2 and not torch.equal(eng.forward(t), before)


def test_first_sync_log_says_what_the_scheme_does(caplog):
    """The first sync's line names the quantized weights, and with the scheme off says there are none."""
    cfg = ModelConfig(**CONFIGS["qwen2"])
    sd = random_hf_weights(cfg, seed=7)
    for scheme, says in (("vllm_w8a8", f"FP8 scheme vllm_w8a8 quantizes {4 * cfg.num_layers} linear weights per sync"),
                         ("off", f"FP8 scheme off (no FP8): {4 * cfg.num_layers} linear weights synced in")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nemo_fp8rl.rollout.torch_engine"):
            get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=EOS, pad_id=PAD).update_weights(sd)
        assert says in caplog.text, caplog.text
        assert ("unquantized GEMMs" in caplog.text) == (scheme == "off")


def test_sync_requantizes_fused_weights_per_tensor():
    cfg = ModelConfig(**CONFIGS["qwen2"])
    scheme = get_rollout_scheme("vllm_w8a8")
    eng = get_rollout_engine("torch", cfg, fp8_scheme="vllm_w8a8", eos_id=EOS, pad_id=PAD)
    sd = random_hf_weights(cfg, seed=7, logit_scale=4.0)
    p = "model.layers.0.self_attn."
    # Make k's amax the largest of q/k/v: with fused quantization the one per-tensor scale follows it.
    sd[p + "k_proj.weight"][0, 0] = 3.0
    rec1 = dict(eng.update_weights(sd))
    fused = torch.cat([sd[p + f"{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(eng.weights.layers[0].w_qkv, scheme.quantize_weight(fused))
    assert rec1[p + "qkv_proj"]["amax"] == 3.0
    assert 0 < rec1[p + "qkv_proj"]["rel_err"] < 0.1
    assert not torch.equal(eng.weights.layers[0].w_qkv, fused)  # it really was quantized

    tokens = torch.tensor([RAGGED[2] + [3, 4, 5]])
    lp1 = eng.logprobs(tokens)
    # A trainer update of 1e-4 relative size: every scale is recomputed from the new weights.
    g = torch.Generator().manual_seed(1)
    sd2 = {k: v * (1 + 1e-4 * torch.randn(v.shape, generator=g)) for k, v in sd.items()}
    rec2 = eng.update_weights(sd2)
    assert eng.weights_version == 2
    fused2 = torch.cat([sd2[p + f"{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(eng.weights.layers[0].w_qkv, scheme.quantize_weight(fused2))
    changed = [k for k in rec2 if rec2[k]["amax"] != rec1[k]["amax"]]
    assert len(changed) == len(rec2) == 4 * cfg.num_layers
    lp2 = eng.logprobs(tokens)
    assert not torch.equal(lp1, lp2)


# ----------------------------------------------------------------------------- FP8 mismatch
def test_fp8_rollout_logp_differs_from_high_precision_by_a_plausible_amount():
    """Same weights, same tokens: scheme off vs FP8 schemes. docs/fp8-noise.md gives the measured per-token noise
    std ~0.2 for E4M3 on a toy stack; here we require it to be clearly nonzero and well below 1 nat."""
    cfg = ModelConfig(vocab_size=16, num_layers=3, hidden_size=128, num_attention_heads=4, ffn_hidden_size=384)
    sd = random_hf_weights(cfg, seed=11, logit_scale=6.0)
    engines = {}
    for s in ("off", "vllm_w8a8", "vllm_block"):
        engines[s] = get_rollout_engine("torch", cfg, fp8_scheme=s, eos_id=EOS, pad_id=PAD)
        engines[s].update_weights(sd)
    out = engines["off"].generate([[1, 5, 6, 7, 8]] * 32, SamplingParams(max_new_tokens=12, stop_on_eos=False),
                                  torch.Generator().manual_seed(0))
    m = out.mask.bool()
    hp = engines["off"].logprobs(out.tokens)[m]
    torch.testing.assert_close(out.rollout_logp[m], hp, atol=2e-5, rtol=0)
    diffs = {}
    for s in ("vllm_w8a8", "vllm_block"):
        d = engines[s].logprobs(out.tokens)[m] - hp
        diffs[s] = d
        assert 1e-3 < float(d.abs().mean()) < 0.3, (s, float(d.abs().mean()))
        assert abs(float(d.mean())) < 3 * float(d.std()) + 1e-3  # noise, not a systematic shift
    assert not torch.equal(diffs["vllm_w8a8"], diffs["vllm_block"])


def test_sync_records_scales_when_the_scheme_reports_them():
    from nemo_fp8rl.fp8.rollout import VllmW8A8

    class W8A8WithScales(VllmW8A8):  # a scheme that exposes its per-tensor weight scale amax / 448
        def weight_scales(self, w):
            return w.abs().amax() / 448.0

    cfg = ModelConfig(**CONFIGS["llama"])
    eng = get_rollout_engine("torch", cfg, fp8_scheme=W8A8WithScales(), eos_id=EOS, pad_id=PAD)
    rec = eng.update_weights(random_hf_weights(cfg))
    assert eng.scheme_name == "W8A8WithScales"
    for name, r in rec.items():
        assert r["scale"] == pytest.approx(r["amax"] / 448.0) and r["num_scales"] == 1.0, name


def test_bfloat16_compute_tracks_float32():
    """dtype=bfloat16 (the GPU setting) runs the same code path; its log-probs stay near float32's."""
    cfg = ModelConfig(**CONFIGS["qwen2"])
    sd = random_hf_weights(cfg, seed=2, logit_scale=4.0)
    f32 = get_rollout_engine("torch", cfg, fp8_scheme="vllm_w8a8", eos_id=EOS, pad_id=PAD)
    bf16 = get_rollout_engine("torch", cfg, fp8_scheme="vllm_w8a8", eos_id=EOS, pad_id=PAD, dtype=torch.bfloat16)
    f32.update_weights(sd)
    bf16.update_weights(sd)
    out = bf16.generate(RAGGED * 2, SamplingParams(max_new_tokens=8), torch.Generator().manual_seed(0))
    out.validate()
    assert out.rollout_logp.dtype == torch.float32 and bf16.weights.layers[0].w_qkv.dtype == torch.bfloat16
    d = (out.rollout_logp - f32.logprobs(out.tokens) * out.mask)[out.mask.bool()]
    assert 0 < float(d.abs().mean()) < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_engine_matches_cpu(dtype):
    """The CUDA engine's sampled log-probs are the CPU float32 engine's: within float32 summation-order
    rounding for a float32 engine, and as near as BF16 compute tracks float32 on the CPU
    (test_bfloat16_compute_tracks_float32) for the BF16 engine the trainer builds on a GPU."""
    cfg = ModelConfig(**CONFIGS["qwen3"])
    sd = random_hf_weights(cfg, seed=4, logit_scale=4.0)
    # tied embeddings: the N(0, 1) embedding as the head makes every next-token distribution one-hot (all
    # log-probs 0 on both engines, which would compare nothing); a quarter of it leaves them spread
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 0.25
    # scheme off: with FP8 a GPU summation order could move a value across a rounding boundary
    cpu = get_rollout_engine("torch", cfg, fp8_scheme="off", eos_id=EOS, pad_id=PAD)
    gpu = get_rollout_engine("torch", cfg, fp8_scheme="off", eos_id=EOS, pad_id=PAD, device="cuda", dtype=dtype)
    cpu.update_weights(sd)
    gpu.update_weights(sd)
    out = gpu.generate(RAGGED * 2, SamplingParams(max_new_tokens=8), torch.Generator().manual_seed(0))
    out.validate()
    m = out.mask.bool()
    ref = cpu.logprobs(out.tokens)[m]
    assert (ref < -0.01).float().mean() > 0.5  # the compared log-probs are not all ~0
    if dtype == torch.float32:
        torch.testing.assert_close(out.rollout_logp[m], ref, atol=1e-3, rtol=0)
    else:
        assert float((out.rollout_logp[m] - ref).abs().mean()) < 0.1


def test_concat_of_shares_is_the_batch_of_their_rows():
    """``RolloutBatch.concat``: the rows of each share in order, re-padded to the widest (what the trainer
    gathers when model-parallel ranks split a rollout); the result passes ``validate()``."""
    from nemo_fp8rl.rollout import RolloutBatch

    eng = make_engine(ModelConfig(**CONFIGS["llama"]))
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    a = eng.generate(RAGGED[:1], params, torch.Generator().manual_seed(0))  # one short prompt
    b = eng.generate(RAGGED[1:], params, torch.Generator().manual_seed(1))
    both = RolloutBatch.concat([a, b], PAD)
    both.validate()
    assert both.batch_size == a.batch_size + b.batch_size
    assert both.responses() == a.responses() + b.responses()
    for part, rows in ((a, slice(0, 1)), (b, slice(1, None))):
        T = part.tokens.shape[1]
        assert torch.equal(both.tokens[rows, :T], part.tokens) and torch.equal(both.rollout_logp[rows, :T], part.rollout_logp)
        assert bool((both.tokens[rows, T:] == PAD).all()) and bool((both.mask[rows, T:] == 0).all())
    with pytest.raises(ValueError, match="at least one"):
        RolloutBatch.concat([], PAD)
