"""audit.prompts_file: good lines load; every bad one names the file (and line) and the fix."""

import pytest

from nemo_fp8rl.audit.prompts import PromptsFileError, prompts_from_file
from nemo_fp8rl.tasks.base import CharTokenizer

TOK = CharTokenizer("abcdefghijklmnopqrstuvwxyz +?0123456789")


def _write(tmp_path, text):
    p = tmp_path / "prompts.jsonl"
    p.write_text(text)
    return p


def test_loads_prompts_in_order_up_to_n(tmp_path):
    p = _write(tmp_path, '{"prompt": "ab", "answer": 1}\n\n{"prompt": "c"}\n{"prompt": "d"}\n')
    assert prompts_from_file(str(p), TOK, 2) == [[1, *TOK.encode("ab")], [1, *TOK.encode("c")]]


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "ab"}\n{"prompt": "c"\n', r"prompts.jsonl:2: invalid JSON .*one JSON object"),
    ('["ab"]\n', r"prompts.jsonl:1: a JSON list, not an object"),
    ('{"question": "ab"}\n', r"prompts.jsonl:1: no 'prompt' field \(fields: \['question'\]\).*audit.prompt_key"),
    ('{"prompt": ""}\n', r"prompts.jsonl:1: 'prompt' must be a non-empty string"),
    ('\n\n', r"holds no prompts"),
])
def test_malformed_lines_name_file_line_and_fix(tmp_path, text, match):
    with pytest.raises(PromptsFileError, match=match):
        prompts_from_file(str(_write(tmp_path, text)), TOK, 4)


def test_missing_file(tmp_path):
    with pytest.raises(PromptsFileError, match=r"audit.prompts_file=.*nope.jsonl'?: no such file; give a JSONL file"):
        prompts_from_file(str(tmp_path / "nope.jsonl"), TOK, 4)
