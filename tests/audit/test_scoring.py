"""The audit's scoring and sampling against the rollout engine they adapt: the layer swap equals an engine
built with that layer in high precision, a configuration identical to high precision scores identically,
chunked scoring equals one forward, and the EOS suppression only changes where a response may end."""

import dataclasses

import pytest
import torch

from nemo_fp8rl.audit import stats
from nemo_fp8rl.audit.sampling import sample_responses
from nemo_fp8rl.audit.scoring import EngineFactory, LayerSwapper, score_engine
from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.fp8.kv_cache import KvScales
from nemo_fp8rl.models.hf_weights import init_hf_state_dict
from nemo_fp8rl.rollout import SamplingParams
from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine

CFG = ModelConfig(vocab_size=48, num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, seq_length=64, init_method_std=0.2)


@pytest.fixture(scope="module")
def factory():
    return EngineFactory(CFG, init_hf_state_dict(CFG, seed=3), torch.device("cpu"), torch.float32)


def _batch(n=3, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (n, T), generator=g)
    lengths = torch.tensor([T, T - 5, T - 9][:n])
    return tokens, lengths


def test_layer_swap_equals_an_engine_with_that_layer_in_high_precision(factory):
    tokens, lengths = _batch()
    scales = KvScales.static(CFG.num_layers)
    base = factory.build("vllm_w8a8", "e4m3", kv_scales=scales)
    swapper = LayerSwapper(base, factory.high_precision())
    before = score_engine(base, tokens, lengths)
    for i in range(CFG.num_layers):
        fresh = score_engine(factory.build("vllm_w8a8", "e4m3", high_precision_layers=[i], kv_scales=scales),
                             tokens, lengths)
        with swapper.swap(i) as eng:
            swapped = score_engine(eng, tokens, lengths)
        assert torch.equal(swapped, fresh), i
        assert not torch.equal(swapped, before)
    assert torch.equal(score_engine(base, tokens, lengths), before)  # restored


def test_identical_configuration_scores_identically(factory):
    """FP8 off built twice: the same log-probs bit for bit, so every statistic is exactly zero."""
    tokens, lengths = _batch()
    a = score_engine(factory.high_precision(), tokens, lengths)
    b = score_engine(factory.build(), tokens, lengths)
    assert torch.equal(a, b)
    mask = (torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)).float()
    mask[:, :4] = 0
    r = stats.config_stats(b, a, mask, side="rollout", eps_low=0.2, eps_high=0.2,
                           response_pos=torch.arange(tokens.shape[1]).expand_as(tokens) - 4, position_buckets=[0, 8])
    assert r["mean_abs_dlogp"] == 0 and r["noise_clip"] == 0 and r["kl"] == 0


def test_chunked_scoring_equals_one_forward(factory):
    tokens, lengths = _batch()
    eng = factory.build("vllm_w8a8")
    full = eng.logprobs(tokens)
    chunked = score_engine(eng, tokens, lengths, batch=2)
    valid = torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)
    torch.testing.assert_close(chunked[valid], full[valid], rtol=0, atol=1e-5)
    assert (chunked[~valid] == 0).all()


def test_sampling_without_suppression_is_the_engines_and_suppression_reaches_the_length(factory):
    eng = factory.high_precision()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    a = sample_responses(eng, prompts, params, torch.Generator().manual_seed(5))
    b = eng.generate(prompts, params, torch.Generator().manual_seed(5))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.response_lens, b.response_lens)
    # make EOS the greedy first token: the engine stops at once; with min_new_tokens every row runs to 12
    greedy = dataclasses.replace(params, temperature=0.0)
    first = eng.generate(prompts, greedy, torch.Generator()).tokens[0, 3]
    eos_eng = TorchRolloutEngine(CFG, fp8_scheme="off", eos_id=int(first), pad_id=0)
    eos_eng.update_weights(factory.weights)
    assert int(eos_eng.generate(prompts[:1], greedy, torch.Generator()).response_lens[0]) == 1
    c = sample_responses(eos_eng, prompts, greedy, torch.Generator(), min_new_tokens=12)
    assert c.response_lens.tolist() == [12, 12, 12]
    resp = c.tokens[c.mask.bool()]
    assert not (resp == first).any()


def test_the_audit_samples_with_the_tokenizers_end_ids(factory):
    """The engines stop at (and sampling suppresses) the tokenizer's EOS ids, not a placeholder id."""
    from types import SimpleNamespace

    from nemo_fp8rl.audit.run import engine_factory
    from nemo_fp8rl.audit.settings import AuditRunConfig

    tok = SimpleNamespace(eos_id=7, eos_ids=(7, 9), pad_id=5)
    f = engine_factory(AuditRunConfig(), CFG, factory.weights, tok, torch.device("cpu"), torch.float32, "emulate")
    eng = f.high_precision()
    assert (eng.eos_id, eng.eos_ids, eng.pad_id) == (7, (7, 9), 5)
    out = sample_responses(eng, [[1, 2, 3]] * 4, SamplingParams(max_new_tokens=30), torch.Generator().manual_seed(0),
                           min_new_tokens=30)
    assert out.response_lens.tolist() == [30] * 4 and not torch.isin(out.tokens[out.mask.bool()], torch.tensor([7, 9])).any()
