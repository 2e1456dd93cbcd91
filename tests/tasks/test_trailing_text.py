"""Text after the final answer's closing tag: the flag, ``reward/trailing_text``, ``task.trailing_text_penalty``
(refused where a task has no closing answer tag); final answers read from a tag never closed
(``reward/unclosed_answer``, ``task.unclosed_answer_penalty``); and the character tokenizer in Hugging Face form (what the
vllm engine loads for stop strings)."""

from __future__ import annotations

import random

import pytest
import torch

from nemo_fp8rl.config.schema import ConfigError, TrainConfig
from nemo_fp8rl.tasks import CharTokenizer, Scores, task_class, task_kwargs
from nemo_fp8rl.tasks.reasoning_gym_reward import extract_answer, trailing_text, unclosed_answer


@pytest.mark.parametrize(("text", "answer", "trailing", "unclosed"), [
    ("<answer>4</answer>", "4", False, False),
    ("work <answer>4</answer> \n\t", "4", False, False),  # whitespace is not text
    ("<answer>4</answer> junk", "4", True, False),  # the run-on that demo-real showed
    ("<answer>4</answer>.", "4", True, False),
    ("<answer>4</answer><answer></answer>", "4", True, False),  # an empty pair is not an answer, but it is text after
    ("<answer>3</answer> so <answer>4</answer>", "4", False, False),  # text before the final answer is fine
    ("<answer>4</answer><answer>5", "5", False, True),  # final answer in an unclosed tag: no closing tag
    ("<answer>42</answer\n\nmore", "42", False, True),
    ("<answer>3</reference tags, e.g. <answer>3</reference>.", "3", False, True),  # issue 41's 2xlr drift
    ("<answer>7</answer> then <answer>", "7", True, False),  # an empty unclosed tag is not the answer
    ("no tags at all", None, False, False),
    ("<answer> </answer> junk", None, False, False),
])
def test_trailing_text_and_unclosed_follow_the_answer_extract_answer_reads(text, answer, trailing, unclosed):
    assert extract_answer(text) == answer
    assert trailing_text(text) is trailing
    assert unclosed_answer(text) is unclosed
    assert trailing_text(text.replace("answer>", "final>"), "final") is trailing
    assert unclosed_answer(text.replace("answer>", "final>"), "final") is unclosed


def test_scores_log_the_share_when_the_task_has_the_notion():
    s = Scores(rewards=torch.tensor([1.0, 0.0, 1.0, 0.5]), correct=torch.tensor([True, False, True, False]),
               invalid=torch.zeros(4, dtype=torch.bool), errors=0)
    assert "reward/trailing_text" not in s.metrics() and "reward/unclosed_answer" not in s.metrics()
    s.trailing = torch.tensor([True, False, False, True])
    s.unclosed = torch.tensor([False, False, True, False])
    assert float(s.metrics()["reward/trailing_text"][0]) == 0.5
    assert float(s.metrics()["reward/unclosed_answer"][0]) == 0.25


def _cfg(task: str, penalty: float, key: str = "trailing_text_penalty") -> TrainConfig:
    cfg = TrainConfig()
    cfg.task.name, cfg.task.path = task, "data.jsonl"
    setattr(cfg.task, key, penalty)
    return cfg


@pytest.mark.parametrize("key", ["trailing_text_penalty", "unclosed_answer_penalty"])
@pytest.mark.parametrize("task", ["arithmetic", "math_jsonl"])
def test_the_penalty_is_refused_where_a_task_has_no_closing_answer_tag(task, key):
    with pytest.raises(ConfigError, match=rf"task.{key}=0.1 .*no closing answer tag.*\['reasoning_gym'\]"):
        task_kwargs(_cfg(task, 0.1, key), task_class(task), seed=0)
    assert key not in task_kwargs(_cfg(task, 0.0, key), task_class(task), seed=0)  # off: fine
    assert task_kwargs(_cfg("reasoning_gym", 0.1, key), task_class("reasoning_gym"), seed=0)[key] == 0.1
    # and validate() refuses it already, as the launcher validates before a job is queued
    from nemo_fp8rl.validation import validate

    with pytest.raises(ConfigError, match=rf"task.{key}=0.1"):
        validate(_cfg(task, 0.1, key))
    validate(_cfg("reasoning_gym", 0.1, key))
    unknown = _cfg("my_own_task", 0.1, key)  # registered by a user's code before the trainer starts: checked then
    assert validate(unknown) is unknown


def test_the_penalty_lowers_the_reward_of_run_on_responses():
    pytest.importorskip("reasoning_gym")
    from nemo_fp8rl.tasks import get_task

    for bad in (-0.1, float("nan"), True):
        for key in ("trailing_text_penalty", "unclosed_answer_penalty"):
            with pytest.raises(ConfigError, match=f"task.{key}"):
                get_task("reasoning_gym", **{key: bad})
    tasks = {p: get_task("reasoning_gym", dataset="chain_sum", seed=11, format_reward=0.25,
                         trailing_text_penalty=p) for p in (0.0, 0.3)}
    tasks["unclosed"] = get_task("reasoning_gym", dataset="chain_sum", seed=11, format_reward=0.25,
                                 unclosed_answer_penalty=0.4)
    try:
        ps = tasks[0.0].prompts(2)
        right, wrong = ps[0].answer, str(int(ps[1].answer) + 1)
        responses = [f"<answer>{right}</answer>", f"<answer>{right}</answer> and then some junk",
                     f"<answer>{wrong}</answer>\n", f"<answer>{wrong}</answer>?", "no answer, then text",
                     f"<answer>{right}</reference tags, e.g. <answer>{right}</reference>."]
        prompts = [ps[0], ps[0], ps[1], ps[1], ps[1], ps[0]]
        off, on = (tasks[p].score(prompts, responses) for p in (0.0, 0.3))
        assert off.rewards.tolist() == [1.0, 1.0, 0.25, 0.25, 0.0, 1.0]  # the lenient parse scores the last one
        assert off.trailing.tolist() == on.trailing.tolist() == [False, True, False, True, False, False]
        assert off.unclosed.tolist() == on.unclosed.tolist() == [False, False, False, False, False, True]
        assert on.rewards.tolist() == pytest.approx([1.0, 0.7, 0.25, -0.05, 0.0, 1.0])
        assert on.correct.tolist() == off.correct.tolist() == [True, True, False, False, False, True]
        assert float(on.metrics()["reward/trailing_text"][0]) == pytest.approx(2 / 6)
        assert float(on.metrics()["reward/unclosed_answer"][0]) == pytest.approx(1 / 6)
        # task.unclosed_answer_penalty: only the answer in a tag never closed scores less
        unclosed = tasks["unclosed"].score(prompts, responses)
        assert unclosed.rewards.tolist() == pytest.approx([1.0, 1.0, 0.25, 0.25, 0.0, 0.6])
        assert unclosed.correct.tolist() == off.correct.tolist()
        # task.response_prefix: the tag opened in the prompt counts
        pre = get_task("reasoning_gym", dataset="chain_sum", seed=11, response_prefix="<answer>")
        try:
            q = pre.prompts(1)[0]
            assert pre.score([q, q], [f"{q.answer}</answer>", f"{q.answer}</answer> more"]).trailing.tolist() == [False, True]
        finally:
            pre.close()
    finally:
        for t in tasks.values():
            t.close()


def test_dynamic_sampling_merge_keeps_the_flags():
    from nemo_fp8rl.rollout import RolloutBatch
    from nemo_fp8rl.trainer.rl_trainer import _merge_groups

    def part(flags):
        n = len(flags)
        batch = RolloutBatch.from_padded(torch.ones(n, 4, dtype=torch.long), torch.full((n,), 2), torch.full((n,), 2),
                                         torch.zeros(n, 4), torch.zeros(n, dtype=torch.bool))
        scores = Scores(rewards=torch.zeros(n), correct=torch.zeros(n, dtype=torch.bool),
                        invalid=torch.zeros(n, dtype=torch.bool), errors=0, trailing=torch.tensor(flags),
                        unclosed=~torch.tensor(flags))
        return batch, scores, torch.zeros(n), torch.zeros(n)

    _, scores, _, _ = _merge_groups([part([True, False]), part([False, True])], [(1, 0), (0, 0)], 2, 0)
    assert scores.trailing.tolist() == [False, True, True, False]
    assert scores.unclosed.tolist() == [True, False, False, True]


def test_the_character_tokenizer_in_hugging_face_form_decodes_alike(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from nemo_fp8rl.tasks.hf_tokenizer import save_hf_tokenizer

    tok = CharTokenizer("\n" + "".join(chr(c) for c in range(32, 127)))
    assert save_hf_tokenizer(tok, tmp_path) == tok.eos_id
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (len(hf), hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.vocab_size, 0, 1, 2)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    text = "x = 4\n<answer>42</answer> ."
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    with pytest.raises(TypeError, match="Hugging Face form"):
        save_hf_tokenizer(object(), tmp_path / "other")
