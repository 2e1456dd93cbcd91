"""The Hugging Face tokenizer adapter and the math_jsonl task on top of it (local tokenizer, no download)."""

import json

import pytest

from nemo_fp8rl.tasks import CharTokenizer, HFTokenizer, Tokenizer, get_task


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return HFTokenizer.from_pretrained(tokenizer_dir)


def test_interface_and_special_ids(tok, tokenizer_dir):
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(raw) == 300
    im_end, eot = raw.convert_tokens_to_ids("<|im_end|>"), raw.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_id == im_end and tok.eos_ids == (im_end, eot)  # tokenizer's eos, then generation_config's
    assert tok.pad_id == eot and tok.bos_id is None and tok.has_chat_template


def test_encode_decode(tok):
    text = "Let x = 4. Then 2x = 8, so \\boxed{8}. ünïcode ✓"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert len(tok.encode("\\boxed{8}")) < len("\\boxed{8}")  # real BPE merges, not characters
    # specials stay visible; ids past the tokenizer (the model's padded rows) render as <unk:ID>
    assert tok.decode([tok.eos_id]) == "<|im_end|>"
    assert tok.decode(tok.encode("ab") + [305] + tok.encode("c")) == "ab<unk:305>c"


def test_chat_template_prompt(tok):
    ids = tok.encode_prompt("What is 2 + 3?")
    assert tok.decode(ids) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    sys_ids = tok.encode_prompt("Hi", system_prompt="Be brief.")
    assert tok.decode(sys_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert tok.decode(tok.encode_prompt("Hi", chat_template=False)) == "Hi"


def test_errors(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        HFTokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        HFTokenizer.from_pretrained(tmp_path / "empty")
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    raw.eos_token = None
    with pytest.raises(ValueError, match="has no EOS token"):
        HFTokenizer(raw)
    assert HFTokenizer(raw, extra_eos_ids=[7]).eos_id == 7


def write_jsonl(tmp_path, rows):
    p = tmp_path / "math.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


ROWS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Compute 12 * 7.", "answer": 84},
        {"prompt": "Solve y - 3 = 10.", "answer": "13"}]


def test_math_jsonl_with_checkpoint_tokenizer(tmp_path, tok, tokenizer_dir):
    task = get_task("math_jsonl", path=str(write_jsonl(tmp_path, ROWS)), tokenizer=str(tokenizer_dir),
                    prompt_template="{prompt} Put the answer in \\boxed{{}}.", shuffle=False)
    assert isinstance(task.tokenizer, HFTokenizer) and task.tokenizer.vocab_size == 300
    p = task.prompts(1)[0]
    assert p.ids == tok.encode_prompt("What is 2 + 3? Put the answer in \\boxed{}.")
    assert tok.decode(p.ids).endswith("<|im_start|>assistant\n")
    tokens, mask = task.warmup_examples(4)
    for row, m in zip(tokens.tolist(), mask.tolist()):
        resp = [t for t, k in zip(row, m) if k]
        assert resp[-1] == tok.eos_id
        assert task.response_text(resp).startswith("\\boxed{")
    # response decoding stops at EOS; scoring uses math-verify on the text
    resp = tok.encode("so \\boxed{5}") + [tok.eos_id] + tok.encode("junk")
    assert task.response_text(resp) == "so \\boxed{5}"
    assert task.score([p], [task.response_text(resp)]).correct.tolist() == [True]
    task.close()
    plain = get_task("math_jsonl", path=str(write_jsonl(tmp_path, ROWS)), tokenizer=str(tokenizer_dir),
                     chat_template=False, shuffle=False)
    assert plain.prompts(1)[0].ids == tok.encode("What is 2 + 3?")
    # a tokenizer object works as well, and prompt length limits count the template's tokens
    with pytest.raises(ValueError, match=r"prompt is \d+ tokens \(special tokens included\) > task.max_prompt_len=8"):
        get_task("math_jsonl", path=str(write_jsonl(tmp_path, ROWS)), tokenizer=tok, max_prompt_len=8)


def test_default_is_still_the_character_tokenizer(tmp_path):
    task = get_task("math_jsonl", path=str(write_jsonl(tmp_path, ROWS)), shuffle=False)
    assert isinstance(task.tokenizer, CharTokenizer)
    assert task.prompts(1)[0].ids == [task.tokenizer.bos_id] + task.tokenizer.encode("What is 2 + 3?")
    with pytest.raises(TypeError, match="give a Hugging Face checkpoint/tokenizer directory"):
        get_task("math_jsonl", path=str(write_jsonl(tmp_path, ROWS)), tokenizer=3)
