"""reasoning_gym task: the seeded stream (determinism, DP shards, resume, reshard), rewards against
reasoning-gym's own scorer, config errors, the chat template, the preset, and a 2-step GRPO CLI run."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("reasoning_gym")
import reasoning_gym  # noqa: E402

from nemo_fp8rl.config.schema import ConfigError, TaskConfig  # noqa: E402
from nemo_fp8rl.resources import conf_dir  # noqa: E402
from nemo_fp8rl.tasks import get_task, task_class  # noqa: E402
from nemo_fp8rl.tasks.reasoning_gym_reward import extract_answer, reasoning_gym_reward  # noqa: E402


def _ranks(k, seed=3, **kw):
    """The tasks of a k-rank run as the trainer builds them (task_kwargs): per-rank seed, shared stream seed."""
    base = seed * 1000 + 29
    if k == 1:
        return [get_task("reasoning_gym", seed=base, **kw)]
    return [get_task("reasoning_gym", seed=base + r, shard_rank=r, num_shards=k, shuffle_seed=base, **kw)
            for r in range(k)]


def _g(p) -> int:
    """Stream index of a prompt (from its source ``reasoning_gym/<dataset>:<g>``)."""
    return int(p.meta["source"].rsplit(":", 1)[1])


def test_stream_is_deterministic_and_is_reasoning_gyms_own_problems():
    a, b = _ranks(1), _ranks(1)
    pa, pb = a[0].prompts(12), b[0].prompts(12)
    assert [p.text for p in pa] == [p.text for p in pb] and [p.ids for p in pa] == [p.ids for p in pb]
    assert [_g(p) for p in pa] == list(range(12))
    other = _ranks(1, seed=4)[0].prompts(12)
    assert [p.text for p in other] != [p.text for p in pa]
    # chain_sum draws item i from Random(seed + i): the chunked stream is one seeded dataset, no chunk repeats
    t = a[0]
    whole = reasoning_gym.create_dataset("chain_sum", seed=t.stream_seed, size=10**6)
    assert [p.meta["entry"]["question"] for p in pa] == [whole[g]["question"] for g in range(12)]
    small = _ranks(1, dataset_kwargs={"size": 5})[0]
    assert small.chunk_size == 5
    assert [p.meta["entry"]["question"] for p in small.prompts(12)] == [whole[g]["question"] for g in range(12)]
    # every chunk is reasoning-gym's dataset with the chunk's seed
    ref = reasoning_gym.create_dataset("chain_sum", seed=(small.stream_seed + 2 * 5) % 2**32, size=5)
    assert small.entry(13) == ref[3]
    assert pa[0].answer == pa[0].meta["entry"]["answer"]
    assert pa[0].ids[0] == t.tokenizer.bos_id and t.tokenizer.decode(pa[0].ids[1:]).startswith(t.system_prompt)


@pytest.mark.parametrize("k", [2, 3])
def test_dp_shards_do_not_overlap_and_cover_the_stream(k):
    ranks = _ranks(k)
    served = [[_g(p) for p in t.prompts(7)] for t in ranks]
    flat = [g for s in served for g in s]
    assert len(set(flat)) == len(flat) and sorted(flat) == list(range(7 * k))
    single = _ranks(1)[0]
    for t, s in zip(ranks, served):
        assert t.stream_seed == single.stream_seed
        assert all(t.entry(g) == single.entry(g) for g in s)


def test_resume_continues_with_the_same_problems():
    t = _ranks(2, dataset_kwargs={"size": 4})[1]
    t.prompts(5)
    state = t.state_dict()
    after = t.prompts(6)  # crosses chunk boundaries
    fresh = _ranks(2, dataset_kwargs={"size": 4})[1]
    fresh.load_state_dict(state)
    again = fresh.prompts(6)
    assert [p.text for p in again] == [p.text for p in after] and [_g(p) for p in again] == [_g(p) for p in after]
    assert fresh.prompts_served == t.prompts_served == 11
    with pytest.raises(ValueError, match="rank 1 of 2, this is rank 0 of 2"):
        _ranks(2, dataset_kwargs={"size": 4})[0].load_state_dict(state)
    with pytest.raises(ValueError, match="resume with the same task.dataset"):
        get_task("reasoning_gym", dataset="basic_arithmetic", seed=3029, shard_rank=1, num_shards=2,
                 shuffle_seed=3029, dataset_kwargs={"size": 4}).load_state_dict(state)


@pytest.mark.parametrize(("k_old", "k_new"), [(1, 2), (2, 3), (3, 1)])
def test_reshard_continues_after_every_served_problem(k_old, k_new):
    old = _ranks(k_old)
    served = {_g(p) for r, t in enumerate(old) for p in t.prompts(3 + r)}  # unequal, as with dynamic sampling
    saved = [t.state_dict() for t in old]
    new = _ranks(k_new)
    notes = [t.reshard_state(saved, r, k_new, step=4) for r, t in enumerate(new)]
    top = k_old * (3 + k_old - 1)
    skipped = top - len(served)
    assert all(f"continued at problem {top} ({len(served)} served before the resume, {skipped} skipped)" in s
               for s in notes), notes
    later = [_g(p) for t in new for p in t.prompts(4)]
    assert len(set(later)) == len(later) and not set(later) & served
    assert sorted(later) == list(range(top, top + 4 * k_new))
    # a second resume of the resharded run continues it exactly
    st = [t.state_dict() for t in new]
    again = _ranks(k_new)
    for t, s in zip(again, st):
        t.load_state_dict(s)
    assert [[_g(p) for p in t.prompts(2)] for t in again] == [[_g(p) for p in t.prompts(2)] for t in new]
    with pytest.raises(ValueError, match="pass one state per saved DP rank"):
        _ranks(k_new)[0].reshard_state(saved[::-1] if k_old > 1 else saved * 2, 0, k_new, step=4)


def test_reward_matches_reasoning_gyms_scorer():
    t = get_task("reasoning_gym", dataset="chain_sum", seed=11, format_reward=0.25)  # default timeout: see below
    try:
        ps = t.prompts(3)
        right, wrong = ps[0].answer, str(int(ps[1].answer) + 1)
        responses = [f"Sum: <answer> {right} </answer>", f"<answer>{wrong}</answer>", "I think it is " + ps[2].answer,
                     "<answer></answer>"]
        scores = t.score(ps + ps[2:], responses)
        ds = reasoning_gym.create_dataset("chain_sum")
        assert ds.score_answer(right, ps[0].meta["entry"]) == 1.0 and ds.score_answer(wrong, ps[1].meta["entry"]) == 0.0
        assert scores.rewards.tolist() == [1.0, 0.25, 0.0, 0.0]
        assert scores.correct.tolist() == [True, False, False, False]
        assert scores.invalid.tolist() == [False, False, True, True]
        assert scores.errors == 0
    finally:
        t.close()
    # partial credit comes from the dataset's own checker (countdown scores a wrong expression 0.01)
    e = reasoning_gym.create_dataset("countdown", seed=1, size=5)[0]
    kw = {"dataset": "countdown", "dataset_kwargs_json": "{}"}
    own = reasoning_gym.create_dataset("countdown")
    for resp, ans in [(f"<answer>{e['answer']}</answer>", e["answer"]), ("<answer>1 + 1</answer>", "1 + 1")]:
        r, ok = reasoning_gym_reward(resp, e, **kw)
        assert r == own.score_answer(ans, e) and ok == (r >= 1.0)
    assert reasoning_gym_reward("<answer>1 + 1</answer>", e, **kw)[0] < 1.0
    assert reasoning_gym_reward("no tags", e, **kw) == (0.0, False)
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer><answer> </answer>") == "2"
    assert extract_answer("<final>x</final>", "final") == "x"
    # an unclosed last tag (a small model stops, or mistypes the closing tag) counts up to '<' or a line break
    assert extract_answer("<answer>1") == "1" and extract_answer("<answer>42</answer\n\nmore") == "42"
    assert extract_answer("<answer>82</answer}<|im_end|>") == "82" and extract_answer("<answer> <|im_end|>") is None


def test_partial_credit_off_makes_the_reward_binary():
    """chain_sum's checker gives an answer that contains the right number len(right) / len(answer);
    task.partial_credit=false keeps only exact answers (correct is the same either way)."""
    on = get_task("reasoning_gym", dataset="chain_sum", seed=11)
    off = get_task("reasoning_gym", dataset="chain_sum", seed=11, partial_credit=False)
    off_fmt = get_task("reasoning_gym", dataset="chain_sum", seed=11, partial_credit=False, format_reward=0.25)
    entry = on.prompts(1)[0].meta["entry"]
    right = entry["answer"]
    padded = f"<answer>{right}9</answer>"  # the right number as a substring: partial credit
    own = reasoning_gym.create_dataset("chain_sum").score_answer(f"{right}9", entry)
    assert own == len(right) / (len(right) + 1)  # the checker's partial score, what the default keeps
    assert on.reward_fn(padded, entry) == (own, False)
    assert off.reward_fn(padded, entry) == (0.0, False)
    assert off_fmt.reward_fn(padded, entry) == (0.25, False)
    for t in (on, off, off_fmt):
        assert t.reward_fn(f"<answer>{right}</answer>", entry) == (1.0, True)
        assert t.reward_fn("no tags", entry) == (0.0, False)
    with pytest.raises(ConfigError, match=r"task.partial_credit='no' must be true .* or false"):
        get_task("reasoning_gym", partial_credit="no")


def test_response_prefix_is_prompted_and_scored():
    """task.response_prefix='<answer>': the prompt ends with it, the reward reads prefix + response."""
    plain = get_task("reasoning_gym", dataset="chain_sum", seed=11)
    # the default 5 s per-call timeout: the worker imports reasoning_gym (1-19 s under load) in reward_prepare,
    # outside it (this test timed out the first call on a loaded machine before that)
    t = get_task("reasoning_gym", dataset="chain_sum", seed=11, response_prefix="<answer>")
    try:
        p0, q0 = plain.prompts(1)[0], t.prompts(1)[0]
        assert q0.ids == p0.ids + t.tokenizer.encode("<answer>")
        scores = t.score([q0, q0, q0], [f"{q0.answer}</answer>", f"{q0.answer}", "no number"])
        assert scores.rewards.tolist()[:2] == [1.0, 1.0] and scores.correct.tolist() == [True, True, False]
        assert t.is_valid(q0.answer) and not plain.is_valid(q0.answer)
    finally:
        t.close()
        plain.close()


def test_config_errors_name_the_key_and_the_valid_values():
    with pytest.raises(ConfigError, match=r"task.dataset='chain_summ' is not a reasoning-gym dataset; valid names: "
                                          r"\[.*'chain_sum'.*\]"):
        get_task("reasoning_gym", dataset="chain_summ")
    with pytest.raises(ConfigError, match=r"task.dataset_kwargs has \['terms'\].*valid keys: \['allow_negation', "
                                          r"'max_digits', 'max_terms', 'min_digits', 'min_terms', 'size'\]"):
        get_task("reasoning_gym", dataset_kwargs={"terms": 3})
    with pytest.raises(ConfigError, match="not valid for reasoning-gym's 'chain_sum': max_terms must be >= min_terms"):
        get_task("reasoning_gym", dataset_kwargs={"min_terms": 5, "max_terms": 2})
    with pytest.raises(ConfigError, match="task.dataset_kwargs=.* must be a mapping"):
        get_task("reasoning_gym", dataset_kwargs=[3])
    with pytest.raises(ConfigError, match="task.dataset_kwargs.seed is not allowed"):
        get_task("reasoning_gym", dataset_kwargs={"seed": 1})
    with pytest.raises(ConfigError, match="task.prompt_template"):
        get_task("reasoning_gym", prompt_template="no placeholder")
    with pytest.raises(ConfigError, match=r"problems in a row were skipped \(\{'too_long'"):
        get_task("reasoning_gym", max_prompt_len=8).prompts(1)


def test_chat_template_and_system_prompt(tmp_path):
    from tests.hf._fixtures import make_tokenizer

    hf = make_tokenizer(tmp_path / "tok")
    t = get_task("reasoning_gym", tokenizer=str(tmp_path / "tok"), seed=2, system_prompt="Answer in <answer> tags.")
    p = t.prompts(1)[0]
    msgs = [{"role": "system", "content": "Answer in <answer> tags."}, {"role": "user", "content": p.text}]
    rendered = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nAnswer in <answer> tags.<|im_end|>")
    assert t.tokenizer.decode(p.ids) == rendered and p.ids == t.tokenizer.encode(rendered)
    tokens, mask = t.warmup_examples(3)
    for row, m in zip(tokens, mask):
        resp = t.response_text(row[m.bool()].tolist())
        assert extract_answer(resp) is not None and t.is_valid(resp)
    plain = get_task("reasoning_gym", tokenizer=str(tmp_path / "tok"), seed=2, chat_template=False, system_prompt="")
    assert t.tokenizer.decode(plain.prompts(1)[0].ids) == p.text


def test_preset_and_schema_defaults_match_the_constructor():
    path = conf_dir() / "task" / "reasoning_gym.yaml"  # (its comments: tests/test_yaml_comments.py)
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert cfg.pop("name") == "reasoning_gym"
    params = inspect.signature(task_class("reasoning_gym").__init__).parameters
    for k, v in cfg.items():
        assert v == (params[k].default if params[k].default is not None else {}), k
    schema = TaskConfig()
    for f in dataclasses.fields(TaskConfig):
        if f.name in params and f.name not in ("seed",):
            default = params[f.name].default
            assert getattr(schema, f.name) == ({} if default is None and f.name == "dataset_kwargs" else default), f.name
    assert get_task("reasoning_gym", **cfg).prompts(1)[0].meta["entry"]["metadata"]["source_dataset"] == "chain_sum"


def test_grpo_cli_two_steps_with_a_hf_checkpoint(tmp_path):
    from tests.hf._fixtures import make_checkpoint, make_tokenizer
    from tests.trainer._cli import metrics, run_cli

    ckpt = make_checkpoint("qwen3", tmp_path / "qwen3-tiny", seed=1)
    make_tokenizer(ckpt)
    out = tmp_path / "run"
    run_cli(out, f"model.hf_path={ckpt}", "task=reasoning_gym", "task.dataset=chain_sum",
            "+task.dataset_kwargs.max_terms=3", "task.format_reward=0.5", "fp8=blockwise", "warmup.steps=0",
            "trainer.max_steps=2", "algorithm.prompts_per_step=2", "algorithm.group_size=2",
            "algorithm.minibatches_per_step=1", "rollout.max_new_tokens=4", "parallel.micro_batch_size=4",
            "model.seq_length=256",
            # a BPE tokenizer decodes for the torch engine's stop strings; the format penalty is wired through
            "rollout.stop=['</answer>']", "task.trailing_text_penalty=0.1",
            timeout=600)
    recs = metrics(out)
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        for k in ("reward/mean", "rollout/invalid_frac", "train/loss", "policy/entropy", "reward/trailing_text",
                  "reward/unclosed_answer"):
            assert k in r and r[k] is not None and math.isfinite(r[k]), (k, r.get(k))
        assert r["reward/errors"] == 0
        assert -0.1 <= r["reward/mean"] <= 1.0 and 0.0 <= r["rollout/invalid_frac"] <= 1.0
        assert 0.0 <= r["reward/trailing_text"] <= 1.0 and 0.0 <= r["reward/unclosed_answer"] <= 1.0
    import yaml

    task = yaml.safe_load((out / "config.yaml").read_text())["task"]
    assert task["name"] == "reasoning_gym" and task["dataset_kwargs"] == {"max_terms": 3}
    assert task["trailing_text_penalty"] == 0.1
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["stop"] == ["</answer>"]
    # the stream position is in the checkpoint: 2 steps x 2 prompts
    state = torch.load(out / "checkpoints" / "step_2" / "rank_0.pt", map_location="cpu", weights_only=False)
    assert state["task"]["position"] == 4 and state["task"]["dataset"] == "chain_sum"
