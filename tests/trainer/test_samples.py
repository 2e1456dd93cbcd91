"""Sample generations (``logger.samples``): the trainer writes decoded rollouts to ``samples.jsonl`` at the
chosen steps, a resume drops those of the lost trajectory, the report shows the first/middle/last ones."""

import json

import pytest

from nemo_fp8rl.config.schema import ConfigError, TrainConfig
from nemo_fp8rl.validation import validate
from nemo_fp8rl.report import make_report, pick_sample_steps
from nemo_fp8rl.trainer.logger import MetricsLogger

from ._cli import DEMO_STEPS, metrics, run_cli


def test_cli_writes_decoded_samples_and_report_shows_them(demo_runs, tmp_path):
    # the demo's bf16 arm (tests/conftest.py): TINY's 4 prompts x 4 responses, arithmetic task with format
    # reward 0.5, 4 steps; the demo's logger.samples (first, middle, last step: 0, 1, 3), 2 per step
    out = demo_runs["bf16"]
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 0, 1, 1, 3, 3]
    for r in recs:
        assert set(r) == {"step", "prompt", "question", "answer", "response", "reward", "correct", "invalid"}
        # the prompt as the model saw it: BOS + "aaa+bbb=" (the question) for the character tokenizer
        assert r["prompt"] == "<bos>" + r["question"] and len(r["question"]) == 8 and r["question"][3] == "+"
        a, b = int(r["question"][:3]), int(r["question"][4:7])
        assert r["answer"] == f"{a + b:04d}"
        # exact match 1, well-formed but wrong 0.5 (format_reward), malformed 0 = invalid
        assert r["correct"] == (r["response"] == r["answer"])
        assert r["reward"] == (1.0 if r["correct"] else 0.0 if r["invalid"] else 0.5)
    # two samples of one step come from two different prompts (the first response of each group)
    assert recs[0]["question"] != recs[1]["question"]
    assert len(metrics(out)) == DEMO_STEPS

    rep = make_report([str(out)], str(tmp_path / "report"))
    summary = (rep / "summary.md").read_text()
    assert "## Sample generations" in summary
    assert "Step 0:" in summary and "Step 1:" in summary and "Step 3:" in summary
    assert f"question: {recs[-1]['question']}" in summary


def test_no_samples_by_default(tmp_path):
    out = tmp_path / "run"
    run_cli(out, "trainer.max_steps=1")
    assert not (out / "samples.jsonl").exists()
    assert "Sample generations" not in (make_report([str(out)], str(tmp_path / "rep")) / "summary.md").read_text()


def test_resume_drops_samples_of_the_lost_steps(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=False, progress="none", max_steps=4)
    for step in range(4):
        log.log_samples(step, [{"response": f"r{step}a"}, {"response": f"r{step}b"}])
    resumed = MetricsLogger(str(tmp_path), tensorboard=False, progress="none", max_steps=4, start_step=2)
    resumed.log_samples(2, [{"response": "new"}])
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["response"]) for r in lines] == [(0, "r0a"), (0, "r0b"), (1, "r1a"), (1, "r1b"), (2, "new")]


def test_pick_sample_steps():
    assert pick_sample_steps([]) == []
    assert pick_sample_steps([5, 5]) == [5]
    assert pick_sample_steps([0, 9]) == [0, 9]
    assert pick_sample_steps([9, 0, 4, 4, 2, 7]) == [0, 4, 9]


@pytest.mark.parametrize("samples,per_step", [([-1], 3), ([0, 2], 0)])
def test_bad_sample_settings_are_rejected(samples, per_step):
    cfg = TrainConfig()
    cfg.logger.samples, cfg.logger.samples_per_step = samples, per_step
    with pytest.raises(ConfigError, match=r"logger\.samples=.*logger\.samples_per_step"):
        validate(cfg)
