"""Arithmetic task: tokenizer, prompt format, hand-checked rewards, warm-up examples, exact resume."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_fp8rl.tasks import ArithmeticTask, CharTokenizer, Tokenizer, get_task, task_names


@pytest.fixture
def task():
    t = get_task("arithmetic", digits=3, format_reward=0.1)
    yield t
    t.close()


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="0123456789+= ", max_size=40))
def test_char_tokenizer_round_trip(text):
    tok = CharTokenizer("0123456789+= ")
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_specials_and_errors():
    tok = CharTokenizer("ab")
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 5)
    assert tok.decode([1, 3, 4, 2, 0, 9]) == "<bos>ab<eos><pad><unk:9>"
    with pytest.raises(ValueError, match=r"\['c', 'd'\].*position 1"):
        tok.encode("acd")
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer("aba")


def test_prompt_format_and_vocabulary(task):
    assert task.tokenizer.vocab_size == 16
    p = task._prompt(123, 456)
    assert p.text == "123+456=" and p.answer == "0579"
    assert p.ids == [1] + [task.tokenizer.encode(c)[0] for c in "123+456="]
    assert task._prompt(7, 5).text == "007+005=" and task._prompt(999, 999).answer == "1998"
    ps = task.prompts(64)
    for q in ps:
        a, b = q.meta["a"], q.meta["b"]
        assert 0 <= a < 1000 and 0 <= b < 1000
        assert q.answer == f"{a + b:04d}" and len(q.ids) == 9
    assert len({(q.meta["a"], q.meta["b"]) for q in ps}) > 60
    assert "arithmetic" in task_names() and "math_jsonl" in task_names()


def test_rewards_hand_checked(task):
    p = task._prompt(123, 456)  # answer 0579
    responses = ["0579", "0578", "579", "05790", "0579 ", "", "<pad>0579", "1234"]
    s = task.score([p] * len(responses), responses)
    assert s.rewards.tolist() == pytest.approx([1.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1])
    assert s.correct.tolist() == [True, False, False, False, False, False, False, False]
    assert s.invalid.tolist() == [False, False, True, True, True, True, True, False]
    assert s.errors == 0
    plain = ArithmeticTask(digits=2)
    try:
        s2 = plain.score([plain._prompt(50, 50)] * 2, ["100", "101"])
        assert s2.rewards.tolist() == [1.0, 0.0]  # no format reward by default
    finally:
        plain.close()


def test_response_text_cuts_at_first_eos(task):
    t = task.tokenizer
    ids = t.encode("0579") + [t.eos_id] + t.encode("12") + [t.pad_id]
    assert task.response_text(ids) == "0579"
    assert task.response_text(t.encode("05")) == "05"  # truncated, no EOS: kept as is (invalid)
    assert task.response_text([t.eos_id]) == ""


def test_response_text_cuts_at_any_of_several_eos_ids(task, monkeypatch):
    """HF chat tokenizers end responses with any of ``eos_ids`` (Qwen3: <|im_end|> and <|endoftext|>)."""
    t = task.tokenizer
    plus = t.encode("+")[0]
    monkeypatch.setattr(t, "eos_ids", (t.eos_id, plus), raising=False)
    assert task.response_text(t.encode("05") + [plus] + t.encode("79") + [t.eos_id]) == "05"


def test_warmup_examples_are_correct_sums(task):
    tokens, mask = task.warmup_examples(32)
    assert tokens.shape == mask.shape == (32, 14) and tokens.dtype == torch.long
    for b in range(32):
        text = task.tokenizer.decode(tokens[b].tolist())
        assert text.startswith("<bos>") and text.endswith("<eos>")
        a, rest = text[5:].split("+")
        bb, ans = rest.split("=")
        assert ans == f"{int(a) + int(bb):04d}<eos>"
        assert mask[b].tolist() == [0.0] * 9 + [1.0] * 5
    # successive calls give new examples; the prompt stream is untouched by warm-up
    t2, _ = task.warmup_examples(32)
    assert not torch.equal(tokens, t2)
    fresh = get_task("arithmetic", digits=3)
    assert [p.text for p in fresh.prompts(8)] == [p.text for p in task.prompts(8)]


def test_exact_resume_and_eval_set(task):
    task.prompts(5)
    state = task.state_dict()
    a = [p.text for p in task.prompts(7)]
    other = get_task("arithmetic", digits=3, format_reward=0.1)
    other.load_state_dict(state)
    assert [p.text for p in other.prompts(7)] == a
    assert other.prompts_served == task.prompts_served == 12
    assert [p.text for p in task.eval_prompts(10)] == [p.text for p in other.eval_prompts(10)]
    with pytest.raises(KeyError, match="missing"):
        other.load_state_dict({"prompts_served": 3})


def test_config_errors():
    with pytest.raises(ValueError, match="task.digits"):
        get_task("arithmetic", digits=0)
    with pytest.raises(ValueError, match="task.format_reward"):
        get_task("arithmetic", format_reward=1.5)
    with pytest.raises(ValueError, match=r"does not take \['digit'\].*valid keys"):
        get_task("arithmetic", digit=3)
    with pytest.raises(ValueError, match="registered tasks"):
        get_task("addition")
