"""Stop strings (``rollout.stop``, ``SamplingParams.stop``) in the torch engine, against a per-token reference.

The reference is vLLM's detokenizer rule checked after every token (``include_stop_str_in_output=True``):
the response ends at the first token ``n > min_tokens`` whose text ``T(n)`` holds a stop string ending
after ``len(T(n - 1))``; the token stays whole. The torch engine checks only every ``stop_check_interval``
steps and must find the same token, record nothing after it, and leave everything alone without stop
strings (bit for bit: same tokens, log-probs and syncs as a call with ``stop=()``).
"""

from __future__ import annotations

import random

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.config.schema import ConfigError, RolloutConfig, TrainConfig
from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout.stop_strings import stop_string_end
from nemo_fp8rl.rollout.vllm_support import vllm_available
from nemo_fp8rl.tasks.base import CharTokenizer
from nemo_fp8rl.validation import validate

from .conftest import CONFIGS, random_hf_weights
from .test_decode_host_syncs import _CountSyncs

TOK = CharTokenizer("abcdefghijklm")  # 16 ids: <pad> <bos> <eos> a..m, the test models' vocabulary
EOS = 2
PROMPTS = [[1, 5, 7], [3, 9], [4, 4, 6, 8, 10], [11], [12, 13], [7, 7, 7, 1], [2, 3], [15, 14, 13], [8], [9, 9]]
CFG = ModelConfig(name="qwen2", **CONFIGS["qwen2"])
WEIGHTS = random_hf_weights(CFG, seed=4, logit_scale=4.0)


def reference_end(ids, stop, min_tokens=0):
    """vLLM's check after every token: the first n > min_tokens with a stop string ending in token n's text."""
    for n in range(min_tokens + 1, len(ids) + 1):
        text, before = TOK.decode(ids[:n]), len(TOK.decode(ids[: n - 1]))
        if any(text.find(s, max(before - len(s) + 1, 0)) >= 0 for s in stop):
            return n
    return None


def _engine(k=1, tokenizer=TOK, scheme="off"):
    eng = get_rollout_engine("torch", CFG, fp8_scheme=scheme, eos_id=EOS, pad_id=0, stop_check_interval=k,
                             tokenizer=tokenizer)
    eng.update_weights(WEIGHTS)
    return eng


def _gen(k, stop=(), temperature=0.0, seed=0, prompts=PROMPTS, n=12, eos=True, min_tokens=0, tokenizer=TOK):
    params = SamplingParams(max_new_tokens=n, temperature=temperature, stop=stop, stop_on_eos=eos, min_tokens=min_tokens)
    return _engine(k, tokenizer).generate(prompts, params, torch.Generator().manual_seed(seed))


FIELDS = ("tokens", "prompt_lens", "response_lens", "mask", "rollout_logp", "finished")


def _assert_same(a, b, logp_atol=0.0):
    for f in FIELDS:
        if f == "rollout_logp" and logp_atol:
            torch.testing.assert_close(a.rollout_logp, b.rollout_logp, rtol=0, atol=logp_atol)
        else:
            assert torch.equal(getattr(a, f), getattr(b, f)), f


# ---------------------------------------------------------------- the rule
def test_the_rule_is_the_per_token_reference():
    rng = random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(1, 16) for _ in range(rng.randrange(1, 30))]  # <bos> included: a multi-char token
        stop = tuple({"".join(rng.choice("abc<") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))})
        m = rng.choice([0, 0, 1, 3])
        want = reference_end(ids, stop, m)
        assert stop_string_end(ids, stop, TOK.decode, m) == want, (ids, stop, m)
        # an earlier check that found nothing in the first c tokens does not change the answer
        c = rng.randrange(0, len(ids) + 1)
        if want is None or want > c:
            assert stop_string_end(ids, stop, TOK.decode, m, checked=c) == want, (ids, stop, m, c)


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_the_rule_is_vllms_check_stop_strings():
    """vLLM's own function, fed one token at a time as its detokenizer does (include_stop_str_in_output)."""
    from vllm.v1.engine.detokenizer import check_stop_strings

    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(1, 16) for _ in range(rng.randrange(1, 30))]
        stop = sorted({"".join(rng.choice("abc<s") for _ in range(rng.randrange(1, 4))) for _ in range(2)})
        m, text, want = rng.choice([0, 2]), "", None
        for n, i in enumerate(ids, start=1):
            new = TOK.decode([i])
            text += new
            if n > m and check_stop_strings(text, len(new), stop, include_in_output=True) is not None:
                want = n
                break
        assert stop_string_end(ids, tuple(stop), TOK.decode, m) == want, (ids, stop, m)


# ---------------------------------------------------------------- SamplingParams and config
def test_sampling_params_stop_is_a_tuple_of_non_empty_strings():
    assert SamplingParams().stop == ()
    assert SamplingParams(stop=["</answer>", "\n\n"]).stop == ("</answer>", "\n\n")  # a config list becomes a tuple
    for bad in ("</answer>", ("",), ("a", ""), (3,), None):
        with pytest.raises(ValueError, match=r"rollout\.stop"):
            SamplingParams(stop=bad)
    r = RolloutConfig(stop=["</answer>"], temperature=0.7, max_new_tokens=5)
    assert SamplingParams.from_config(r) == SamplingParams(temperature=0.7, max_new_tokens=5, stop=("</answer>",))
    assert SamplingParams.from_config(RolloutConfig()) == SamplingParams(max_new_tokens=8)


@pytest.mark.parametrize("bad", [[""], ["</answer>", ""], "</answer>"])
def test_config_validation_refuses_bad_stop_strings(bad):
    cfg = TrainConfig()
    cfg.rollout.stop = bad
    with pytest.raises(ConfigError, match=r"rollout\.stop"):
        validate(cfg)
    cfg.rollout.stop = ["</answer>"]
    validate(cfg)


def test_stop_strings_need_the_tokenizer():
    with pytest.raises(ValueError, match=r"rollout\.stop needs the task's tokenizer"):
        _gen(1, stop=("a",), tokenizer=None)
    with pytest.raises(TypeError, match="decode"):
        get_rollout_engine("torch", CFG, fp8_scheme="off", eos_id=EOS, pad_id=0, tokenizer=object())


# ---------------------------------------------------------------- the torch engine
@pytest.mark.parametrize("stop", [("kg",), ("di", "m"), ("<bos>k",)])
def test_a_stop_string_ends_a_row_at_the_token_that_completes_it(stop):
    free = _gen(1)  # greedy, EOS on, no stop strings
    got = _gen(1, stop=stop)
    got.validate()
    ended = 0
    for b, (f, g) in enumerate(zip(free.responses(), got.responses())):
        end = reference_end(f, stop)
        want = f if end is None else f[:end]
        assert g == want, (b, TOK.decode(f), TOK.decode(g))
        assert bool(got.finished[b]) == (end is not None or bool(free.finished[b]))
        n = int(got.prompt_lens[b]) + len(g)
        assert (got.tokens[b, n:] == 0).all() and (got.rollout_logp[b, n:] == 0).all()
        ended += end is not None
    assert 0 < ended < len(PROMPTS)
    # the log-probs are the engine's own (teacher-forced) ones, to the rounding of other batch sizes
    lp = _engine().logprobs(got.tokens)
    torch.testing.assert_close(got.rollout_logp, lp * got.mask, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stop", [("kg",), ("di", "m")])
@pytest.mark.parametrize("scheme", ["off", "vllm_w8a8"])
def test_the_check_interval_does_not_change_where_rows_stop(stop, scheme):
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=stop)
    ref = _engine(1, scheme=scheme).generate(PROMPTS, params, torch.Generator().manual_seed(0))
    assert 0 < int(ref.finished.sum()) < len(PROMPTS)
    for k in (2, 3, 5, 100):
        got = _engine(k, scheme=scheme).generate(PROMPTS, params, torch.Generator().manual_seed(0))
        # the log-probs to float rounding: the GEMMs see other batch sizes (ended rows leave later)
        _assert_same(got, ref, logp_atol=1e-5)
    # sampled, one row: nothing else shares the noise, so every interval gives the same bits
    for seed in range(4):
        one = [_gen(k, stop=("kg", "<eos>"), temperature=1.0, seed=seed, prompts=PROMPTS[:1], n=16) for k in (1, 4)]
        _assert_same(one[1], one[0])


def test_sampled_rows_record_nothing_after_the_stop_token():
    stop = ("ab", "c")
    b = _gen(4, stop=stop, temperature=1.0, seed=3, prompts=PROMPTS * 3, n=14)
    b.validate()
    assert 0 < int(b.finished.sum()) < b.batch_size
    for r in range(b.batch_size):
        p, n = int(b.prompt_lens[r]), int(b.response_lens[r])
        resp = b.tokens[r, p : p + n].tolist()
        end = reference_end(resp, stop)
        assert end in (None, n)  # the first completion of a stop string is the last token
        assert bool(b.finished[r]) == (end is not None or resp[-1] == EOS)
        assert EOS not in resp[:-1]
        assert (b.tokens[r, p + n :] == 0).all() and (b.rollout_logp[r, p + n :] == 0).all()
    lp = _engine().logprobs(b.tokens)
    torch.testing.assert_close(b.rollout_logp * b.mask, lp * b.mask, rtol=0, atol=1e-5)


def test_text_past_the_stop_string_inside_the_last_token_stays():
    """'<bo' is completed by the token '<bos>': the response keeps that token, 's>' included (vLLM's token_ids)."""
    got = _gen(1, stop=("<bo",))
    texts = [TOK.decode(r) for r in got.responses()]
    cut = [t for t in texts if "<bo" in t]
    assert cut and all(t.endswith("<bos>") and t.count("<bo") == 1 for t in cut)
    assert all(bool(got.finished[i]) for i, t in enumerate(texts) if t in cut)


def test_min_tokens_ignores_stop_strings_that_end_in_the_first_tokens():
    stop, m = ("a", "b", "c", "d", "e", "f", "g", "h"), 3  # nearly every token ends a row without min_tokens
    got = _gen(1, stop=stop, min_tokens=m, eos=False, n=10)
    free = _gen(1, min_tokens=m, eos=False, n=10)
    for f, g in zip(free.responses(), got.responses()):
        end = reference_end(f, stop, m)
        assert end is None or end > m
        assert g == (f if end is None else f[:end])
    assert any(reference_end(f, stop) is not None and reference_end(f, stop) <= m for f in free.responses())


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("eos", [True, False])
def test_without_stop_strings_or_with_one_that_never_occurs_nothing_changes(k, eos):
    """The default path (stop=()) is untouched, bit for bit, engine tokenizer or not; a stop string that
    never occurs ('z' is not in the vocabulary) changes no token, log-prob or flag either."""
    for temperature in (1.0, 0.0):
        base = _gen(k, temperature=temperature, seed=5, prompts=PROMPTS * 2, eos=eos, tokenizer=None)
        assert 0 < int(base.finished.sum()) < base.batch_size or not eos
        _assert_same(_gen(k, temperature=temperature, seed=5, prompts=PROMPTS * 2, eos=eos), base)
        _assert_same(_gen(k, stop=("z", "zz"), temperature=temperature, seed=5, prompts=PROMPTS * 2, eos=eos), base)


def test_stop_checks_sync_once_per_interval():
    eng = _engine(8)

    def syncs(n, stop):
        c = _CountSyncs()
        with c:
            eng.generate(PROMPTS, SamplingParams(max_new_tokens=n, temperature=1.0, stop=stop),
                         torch.Generator().manual_seed(0))
        return len(c.calls)

    stop = ("zz",)  # never ends a row: every check reads the batch
    assert syncs(24, stop) - syncs(4, stop) <= 2 * (24 // 8)  # a transfer (+ a row selection) per check
    every = _engine(1)
    c = _CountSyncs()
    with c:
        every.generate(PROMPTS, SamplingParams(max_new_tokens=24, temperature=1.0, stop=stop), torch.Generator().manual_seed(0))
    assert len(c.calls) >= 23  # k=1: a check every step
