"""JSONL math task: malformed rows name file:line, skip mode counts, math-verify rewards, resume."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_fp8rl.tasks import JsonlDataError, get_task
from nemo_fp8rl.tasks.rewards import has_boxed_answer, math_verify_reward

GOOD = [
    {"prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
    {"prompt": "Compute 6 * 7.", "answer": 42},
    {"prompt": "Half of one?", "answer": "0.5"},
    {"prompt": "Square root of 2?", "answer": "\\sqrt{2}"},
]


def write(tmp_path, lines, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return str(p)


BAD_ROWS = {
    "bad_json": ('{"prompt": "x", "answer": 1', "invalid JSON"),
    "not_object": ('["x", 1]', "expected a JSON object, got list"),
    "missing_field": ({"question": "x", "answer": "1"}, "missing field(s) ['prompt']"),
    "wrong_type_prompt": ({"prompt": 7, "answer": "1"}, "field 'prompt' must be a string, got int"),
    "wrong_type_answer": ({"prompt": "x", "answer": [1]}, "field 'answer' must be a string or a number, got list"),
    "empty_prompt": ({"prompt": "   ", "answer": "1"}, "field 'prompt' is empty"),
    "empty_answer": ({"prompt": "x", "answer": ""}, "field 'answer' is empty"),
    "too_long": ({"prompt": "y" * 40, "answer": "1"}, "prompt is 41 tokens (BOS included) > task.max_prompt_len=32"),
}


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_malformed_row_raises_with_file_and_line(tmp_path, kind):
    row, needle = BAD_ROWS[kind]
    path = write(tmp_path, GOOD[:2] + [""] + [row] + GOOD[2:])  # line 3 is blank (ignored), bad row on line 4
    with pytest.raises(JsonlDataError) as ei:
        get_task("math_jsonl", path=path, max_prompt_len=32)
    msg = str(ei.value)
    assert msg.startswith(f"{path}:4: ") and needle in msg and "task.on_error=skip" in msg, msg


def test_skip_mode_skips_and_counts_by_reason(tmp_path):
    rows = GOOD[:1] + [BAD_ROWS[k][0] for k in sorted(BAD_ROWS)] + GOOD[1:] + [BAD_ROWS["bad_json"][0]]
    task = get_task("math_jsonl", path=write(tmp_path, rows), on_error="skip", max_prompt_len=32)
    assert len(task.rows) == 4
    assert task.skipped_rows == 9
    assert dict(task.skipped_by_reason) == {"bad_json": 2, "not_object": 1, "missing_field": 1, "wrong_type": 2,
                                            "empty": 2, "too_long": 1}
    assert [p.meta["source"].rsplit(":", 1)[1] for p in task.rows] == ["1", "10", "11", "12"]
    assert task.rows[1].answer == "42"  # numbers are accepted and kept as text


def test_no_usable_rows_and_config_errors(tmp_path):
    with pytest.raises(JsonlDataError, match="no usable rows"):
        get_task("math_jsonl", path=write(tmp_path, ["{}", "[]"]), on_error="skip")
    with pytest.raises(FileNotFoundError, match="task.path"):
        get_task("math_jsonl", path=str(tmp_path / "missing.jsonl"))
    path = write(tmp_path, GOOD)
    with pytest.raises(ValueError, match="task.on_error"):
        get_task("math_jsonl", path=path, on_error="ignore")
    with pytest.raises(ValueError, match="prompt_template"):
        get_task("math_jsonl", path=path, prompt_template="Q:")


def test_custom_keys_template_and_tokenizer(tmp_path):
    rows = [{"q": "Find x: x + 1 = 3. Ω", "sol": "2"}]
    task = get_task("math_jsonl", path=write(tmp_path, rows), prompt_key="q", answer_key="sol",
                    prompt_template="Problem: {prompt}\nAnswer:")
    p = task.prompts(1)[0]
    assert p.text == "Problem: Find x: x + 1 = 3. Ω\nAnswer:"
    assert p.ids[0] == task.tokenizer.bos_id and task.tokenizer.decode(p.ids[1:]) == p.text
    # printable ASCII is always in the vocabulary so the model can write \boxed{...} answers
    assert task.tokenizer.decode(task.tokenizer.encode("\\boxed{-3/4}")) == "\\boxed{-3/4}"


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("The sum is $\\frac{3}{4}$, so \\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{41}", "42", 0.1),  # well-formed, wrong: format reward
        ("I think it is 7", "42", 0.0),
        ("}{\\boxed{", "42", 0.0),
    ],
)
def test_math_verify_reward_on_real_answers(response, answer, reward):
    assert math_verify_reward(response, answer, format_reward=0.1)[0] == reward


def test_score_counts_unparsable_gold_as_error(tmp_path):
    rows = GOOD[:2] + [{"prompt": "Broken gold", "answer": "}"}]
    task = get_task("math_jsonl", path=write(tmp_path, rows), shuffle=False)  # default timeout: math_verify is imported in reward_prepare
    try:
        ps = task.prompts(3)
        s = task.score(ps, ["\\boxed{3/4}", "it is 41", "\\boxed{1}"])
        assert s.rewards.tolist() == [1.0, 0.0, 0.0]
        assert s.invalid.tolist() == [False, True, False]
        assert s.errors == 1 and "could not parse the ground-truth" in s.error_messages[0]
    finally:
        task.close()


def test_is_valid_boxed():
    assert has_boxed_answer("so \\boxed{1}")
    assert not has_boxed_answer("\\boxed{}") and not has_boxed_answer("\\boxed{1") and not has_boxed_answer("1}")
    assert has_boxed_answer("\\boxed{\\frac{1}{2}}") and not has_boxed_answer("no answer")


def test_stream_epochs_and_exact_resume(tmp_path):
    path = write(tmp_path, GOOD)
    task = get_task("math_jsonl", path=path, seed=3)
    first_epoch = [p.text for p in task.prompts(4)]
    assert sorted(first_epoch) == sorted(r["prompt"] for r in GOOD)
    task.prompts(2)
    state = task.state_dict()
    after = [p.text for p in task.prompts(9)]  # crosses two epoch boundaries
    other = get_task("math_jsonl", path=path, seed=3)
    other.load_state_dict(state)
    assert [p.text for p in other.prompts(9)] == after
    assert (task.epoch, task.cursor) == (other.epoch, other.cursor) == (3, 3)
    assert [p.text for p in get_task("math_jsonl", path=path, shuffle=False).prompts(4)] == [r["prompt"] for r in GOOD]
    fewer = get_task("math_jsonl", path=write(tmp_path, GOOD[:3], "small.jsonl"))
    with pytest.raises(ValueError, match="same data file"):
        fewer.load_state_dict(state)


def test_data_parallel_shards_are_disjoint_per_epoch_and_resume(tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(11)]
    path = write(tmp_path, rows)
    # per-rank seeds differ (as the trainer passes them); the permutation seed is shared
    shards = [get_task("math_jsonl", path=path, seed=100 + r, shard_rank=r, num_shards=3, shuffle_seed=7)
              for r in range(3)]
    for epoch in range(3):
        seen = [[p.text for p in t.prompts(3)] for t in shards]  # 11 // 3 = 3 rows per rank and epoch
        flat = [x for s in seen for x in s]
        assert len(set(flat)) == 9, f"epoch {epoch}: ranks overlap"
        assert all(t.epoch == epoch and t.cursor == 3 for t in shards)
    state = shards[1].state_dict()
    after = [p.text for p in shards[1].prompts(7)]
    again = get_task("math_jsonl", path=path, seed=101, shard_rank=1, num_shards=3, shuffle_seed=7)
    again.load_state_dict(state)
    assert [p.text for p in again.prompts(7)] == after
    with pytest.raises(ValueError, match="rank 1 of 3, this is rank 0 of 3"):
        get_task("math_jsonl", path=path, seed=100, shard_rank=0, num_shards=3, shuffle_seed=7).load_state_dict(state)
    with pytest.raises(JsonlDataError, match="4 usable rows cannot be shared by 5"):
        get_task("math_jsonl", path=write(tmp_path, GOOD, "four.jsonl"), shard_rank=0, num_shards=5)
    with pytest.raises(ValueError, match="shard_rank=3 / num_shards=3"):
        get_task("math_jsonl", path=path, shard_rank=3, num_shards=3)


def test_trainer_gives_dataset_tasks_a_shard_per_data_parallel_rank(tmp_path):
    from nemo_fp8rl.config.schema import TrainConfig
    from nemo_fp8rl.tasks import task_class
    from nemo_fp8rl.tasks import task_kwargs

    cfg = TrainConfig(seed=2)
    cfg.task.name, cfg.task.path = "math_jsonl", write(tmp_path, GOOD)
    kw = task_kwargs(cfg, task_class("math_jsonl"), seed=2029 + 1, dp_rank=1, dp_size=2)
    assert (kw["seed"], kw["shard_rank"], kw["num_shards"], kw["shuffle_seed"]) == (2030, 1, 2, 2029)
    assert "num_shards" not in task_kwargs(cfg, task_class("math_jsonl"), seed=2029, dp_rank=0, dp_size=1)
    assert "num_shards" not in task_kwargs(cfg, task_class("arithmetic"), seed=2029, dp_rank=1, dp_size=2)


def test_warmup_examples_teach_the_boxed_format(tmp_path):
    task = get_task("math_jsonl", path=write(tmp_path, GOOD))
    tokens, mask = task.warmup_examples(6, torch.Generator().manual_seed(0))
    assert tokens.shape == mask.shape and tokens.shape[0] == 6
    for b in range(6):
        resp = tokens[b][mask[b].bool()].tolist()
        assert resp[-1] == task.tokenizer.eos_id
        text = task.response_text(resp)
        assert task.is_valid(text) and text.startswith("\\boxed{")
        prompt = task.tokenizer.decode(tokens[b][: int(mask[b].argmax())].tolist())
        assert prompt.startswith("<bos>")
        assert math_verify_reward(text, next(str(r["answer"]) for r in GOOD if r["prompt"] == prompt[5:]))[1]
