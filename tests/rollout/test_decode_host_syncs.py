"""Decode without a host sync per token (issue 39: ``tok.cpu()`` and ``int(positions.max())`` every step).

A CPU has no host/device split, so the syncs are counted: every call that would wait for a GPU (``.cpu()``,
``.item()``, ``.tolist()``, ``bool``/``int``/``float`` of a tensor, ``nonzero``, a tensor made from host data
such as a Python float scale) made while ``generate`` runs is recorded by a torch-function mode. With a stop check every k steps they grow as N / k, not N.
The checked batch is the same as the batch checked every step wherever sampling draws no noise (greedy; the
log-probs to float rounding, as the GEMMs see other batch sizes), and with sampling every recorded log-prob
is still the engine's own (teacher-forced) one.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout import model as rollout_model
from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine, sampling_generator
from tests.rollout.conftest import CONFIGS, check_rows_end_at_eos, random_hf_weights

_SYNCS = {"cpu", "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
_UPLOADS = {"tensor", "as_tensor"}
"""Tensors made from host data (a Python float scale, a list): on a GPU each is a copy that waits for it."""


class _CountSyncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNCS:
            self.calls.append(name)
        elif name in _UPLOADS and args and not isinstance(args[0], torch.Tensor):
            self.calls.append(f"{name}(host data)")  # on a GPU: a blocking copy to the device
        return func(*args, **(kwargs or {}))


def _engine(k: int | None, eos: int = 2, name: str = "qwen2", scheme: str = "off", **kw) -> TorchRolloutEngine:
    cfg = ModelConfig(name=name, **CONFIGS[name])
    eng = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=eos, pad_id=0, stop_check_interval=k, **kw)
    eng.update_weights(random_hf_weights(cfg, seed=4, logit_scale=4.0))
    return eng


PROMPTS = [[1, 5, 7], [3, 9], [4, 4, 6, 8, 10], [11], [12, 13], [7, 7, 7, 1], [2, 3], [15, 14, 13], [8], [9, 9]]


def _syncs(eng, n: int, stop: bool = True) -> int:
    c = _CountSyncs()
    with c:
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=n, stop_on_eos=stop, temperature=1.0),
                     torch.Generator().manual_seed(0))
    return len(c.calls)


def test_decode_syncs_grow_with_steps_over_k_not_with_steps():
    eng = _engine(k=8, eos=999 % 16)  # an EOS that may come; the checks run either way
    no_stop_short, no_stop_long = _syncs(eng, 4, stop=False), _syncs(eng, 24, stop=False)
    assert no_stop_long == no_stop_short  # without EOS stops: a constant (setup and the final copies)
    short, long = _syncs(eng, 4), _syncs(eng, 24)
    assert long - short <= 2 * (24 // 8)  # at most a check (any + its row selection) every 8 steps
    every = _engine(k=1, eos=999 % 16)
    assert _syncs(every, 24) - _syncs(every, 4) >= 20 - 2  # k=1: one check per step (the CPU default)


@pytest.mark.parametrize("kv_kernel", ["cuda", "cpu"])
@pytest.mark.parametrize("high_precision", [(), (0,)], ids=["all_fp8", "layer0_bf16"])
def test_fp8_kv_cache_decode_uploads_no_scale_per_step(kv_kernel, high_precision):
    """An FP8 KV cache's per-layer scales reach the quantize/dequantize ops as device tensors uploaded once,
    not as Python floats (one blocking upload per layer and token on a GPU, which also fails a CUDA graph
    capture); the decode's syncs stay constant in the number of steps."""
    eng = _engine(k=8, eos=999 % 16, kv_cache="e4m3", kv_kernel=kv_kernel)
    eng.kv.high_precision_layers = frozenset(high_precision)
    c4, c24 = _CountSyncs(), _CountSyncs()
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=2), torch.Generator().manual_seed(0))  # scales uploaded
    for c, n in ((c4, 4), (c24, 24)):
        with c:
            eng.generate(PROMPTS, SamplingParams(max_new_tokens=n, stop_on_eos=False, temperature=1.0),
                         torch.Generator().manual_seed(0))
    assert c24.calls == c4.calls, sorted(set(c24.calls) - set(c4.calls)) or len(c24.calls) - len(c4.calls)


def test_default_interval_is_1_on_cpu_and_8_on_gpu():
    cfg = ModelConfig(name="qwen3", **CONFIGS["qwen3"])
    assert TorchRolloutEngine(cfg, fp8_scheme="off", eos_id=2, pad_id=0).stop_check_interval == 1
    assert TorchRolloutEngine(cfg, fp8_scheme="off", eos_id=2, pad_id=0, device="cuda").stop_check_interval == 8
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="stop_check_interval"):
            TorchRolloutEngine(cfg, fp8_scheme="off", eos_id=2, pad_id=0, stop_check_interval=bad)


def _eos_that_ends_rows_at_different_steps(eng) -> int:
    """A token the greedy policy emits first at different steps in different rows (so rows end apart)."""
    b = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, stop_on_eos=False, temperature=0.0),
                     torch.Generator().manual_seed(0))
    best, spread = None, -1
    for t in range(1, 16):
        first = []
        for r in range(len(PROMPTS)):
            resp = b.tokens[r, b.prompt_lens[r]: b.prompt_lens[r] + b.response_lens[r]].tolist()
            first.append(resp.index(t) if t in resp else 99)
        s = len(set(first))
        if s > spread:
            best, spread = t, s
    assert spread >= 3
    return best


@pytest.mark.parametrize("scheme", ["off", "vllm_w8a8"])
def test_greedy_batch_does_not_depend_on_the_check_interval(scheme):
    eos = _eos_that_ends_rows_at_different_steps(_engine(1, scheme=scheme))
    params = SamplingParams(max_new_tokens=10, stop_on_eos=True, temperature=0.0)
    ref = _engine(1, eos=eos, scheme=scheme).generate(PROMPTS, params, torch.Generator().manual_seed(0))
    assert 0 < int(ref.finished.sum()) < len(PROMPTS)
    for k in (2, 3, 100):
        got = _engine(k, eos=eos, scheme=scheme).generate(PROMPTS, params, torch.Generator().manual_seed(0))
        for f in ("tokens", "prompt_lens", "response_lens", "finished", "mask"):
            assert torch.equal(getattr(got, f), getattr(ref, f)), (k, f)
        # the log-probs to float rounding: the GEMMs see other batch sizes (ended rows leave later)
        torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, rtol=0, atol=1e-5)


def test_sampled_batch_with_late_checks_records_the_engines_logprobs():
    """k > 1 with sampling: a row records nothing after its EOS, and every recorded log-prob is the engine's."""
    eng = _engine(1)
    eos = _eos_that_ends_rows_at_different_steps(eng)
    eng = _engine(4, eos=eos)
    b = eng.generate(PROMPTS * 3, SamplingParams(max_new_tokens=12, stop_on_eos=True, temperature=1.0),
                     torch.Generator().manual_seed(3))
    check_rows_end_at_eos(b, eos)
    lp = eng.logprobs(b.tokens)
    torch.testing.assert_close(b.rollout_logp * b.mask, lp * b.mask, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama31"])
def test_sdpa_gqa_equals_repeated_kv(name, monkeypatch):
    shape = rollout_model.ModelShape.from_config(ModelConfig(name=name, **CONFIGS[name]))
    g = torch.Generator().manual_seed(0)
    H, G, hd = shape.num_heads, shape.num_groups, shape.head_dim
    q = torch.randn(3, H, 5, hd, generator=g)
    k, v = torch.randn(3, G, 7, hd, generator=g), torch.randn(3, G, 7, hd, generator=g)
    mask = torch.rand(3, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    rep = H // G
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask).transpose(1, 2).reshape(3, 5, -1)
    assert rollout_model._SDPA_GQA  # this torch has enable_gqa
    assert torch.equal(rollout_model._attend(shape, q, k, v, mask), ref)
    monkeypatch.setattr(rollout_model, "_SDPA_GQA", False)  # the fallback of older torch
    assert torch.equal(rollout_model._attend(shape, q, k, v, mask), ref)


_GQA_CASES = [(torch.bfloat16, False, True), (torch.bfloat16, True, False), (torch.float32, False, False),
              (torch.float32, True, False)]
"""(dtype, masked, enable_gqa on CUDA): FlashAttention, the only CUDA kernel with grouped KV heads, takes
neither a mask nor float32."""


@pytest.mark.parametrize("dtype,masked,gqa", _GQA_CASES)
def test_cuda_attention_repeats_kv_where_flash_cannot_run(dtype, masked, gqa):
    """On CUDA ``enable_gqa`` only for an unmasked half-precision attention, else K and V repeated (CUDA
    tensors made as fake tensors on the CPU); on the CPU always (its kernels take grouped heads)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 3, 8, dtype=dtype, device="cuda")
        mask = torch.ones(2, 1, 3, 3, dtype=torch.bool, device="cuda") if masked else None
        assert rollout_model._sdpa_gqa(q, mask) is gqa
    cpu_mask = torch.ones(2, 1, 3, 3, dtype=torch.bool) if masked else None
    assert rollout_model._sdpa_gqa(torch.empty(2, 4, 3, 8, dtype=dtype), cpu_mask) is True


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,masked,gqa", _GQA_CASES)
def test_cuda_attention_needs_no_math_kernel(dtype, masked, gqa):
    """Every attention the engine runs on CUDA (prefill, masked decode, an FP8 KV cache's float32 read-back)
    has a fused SDPA kernel: with the math kernel (the [B, H, Tq, S] scores in memory) switched off it runs,
    and equals the repeated-K/V reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = rollout_model.ModelShape.from_config(  # Qwen3-8B's attention: 32 query heads, 8 KV heads of 128
        ModelConfig(name="qwen3_8b_widths", vocab_size=16, num_layers=1, hidden_size=4096, num_attention_heads=32,
                    num_query_groups=8, kv_channels=128, ffn_hidden_size=128, qk_layernorm=True))
    g = torch.Generator(device="cuda").manual_seed(0)
    tq, s = (1, 300) if masked else (300, 300)
    q = torch.randn(4, 32, tq, 128, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(4, 8, s, 128, generator=g, device="cuda").to(dtype) for _ in range(2))
    mask = torch.rand(4, 1, tq, s, generator=g, device="cuda") > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        got = rollout_model._attend(shape, q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1), attn_mask=mask,
        is_causal=mask is None).transpose(1, 2).reshape(4, tq, -1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_sampling_generator_keeps_a_generator_on_the_engines_device():
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    assert sampling_generator(g, "cpu") is g and torch.equal(g.get_state(), state)  # CPU: nothing drawn


@pytest.mark.parametrize("stream", [True, False])
def test_weight_sync_checks_finiteness_with_one_host_read_whatever_the_depth(stream):
    """The finiteness check of a weight sync reads one flag vector for the whole sync, not one bool per tensor
    (issue 39: ~400 syncs for a Qwen3-8B on a GPU); a non-finite stream is still refused, after its last pair,
    naming every bad tensor."""
    from nemo_fp8rl.rollout.model import ModelShape, checked_weight_stream

    counts = []
    for layers in (2, 6):
        cfg = ModelConfig(name="qwen2", **dict(CONFIGS["qwen2"], num_layers=layers))
        sd = random_hf_weights(cfg, seed=1)
        c = _CountSyncs()
        with c:
            got = list(checked_weight_stream(ModelShape.from_config(cfg), iter(sd.items()) if stream else sd))
        assert [k for k, _ in got] == list(sd)
        counts.append(len(c.calls))
    assert counts == [1, 1]
    bad = dict(sd)
    bad["model.layers.3.mlp.up_proj.weight"] = bad["model.layers.3.mlp.up_proj.weight"].clone()
    bad["model.layers.3.mlp.up_proj.weight"][2, 5] = float("inf")
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
    seen = []
    with pytest.raises(ValueError, match="NaN or Inf") as ei:
        for name, _ in checked_weight_stream(ModelShape.from_config(cfg), iter(bad.items()) if stream else bad):
            seen.append(name)
    assert "model.layers.3.mlp.up_proj.weight" in str(ei.value) and "model.norm.weight" in str(ei.value)
    assert seen == ([] if not stream else list(bad))  # a dict is refused up front, a stream after its last pair
