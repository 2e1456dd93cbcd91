"""The stability monitor flags garbled output that the task's parser accepts (text-level degeneracy,
nemo_fp8rl/algorithms/degeneracy.py) and takes ``stability.action`` on it, the same path as the
invalid-response rate (docs/design.md, "One training step")."""

import logging
from types import SimpleNamespace

import pytest

from nemo_fp8rl.config.schema import ConfigError, TrainConfig
from nemo_fp8rl.trainer import RLTrainer, StopTraining
from nemo_fp8rl.trainer.logger import read_metrics
from nemo_fp8rl.validation import validate

GARBLED = "????////" * 8  # verl #4435's FP8 KV-cache output, until max_new_tokens


def _tiny_cfg(out, **stability):
    """The fault tests' tiny run (tests/reliability/test_training_faults.py): arithmetic, no warm-up, FP8."""
    cfg = TrainConfig(output_dir=str(out), seed=3)
    cfg.algorithm.prompts_per_step, cfg.algorithm.group_size, cfg.algorithm.minibatches_per_step = 4, 4, 2
    cfg.warmup.steps = 0
    cfg.rollout.max_new_tokens = 6
    cfg.logger.tensorboard = False
    cfg.logger.progress = "none"
    cfg.fp8.recipe = "tensorwise"
    for k, v in stability.items():
        setattr(cfg.stability, k, v)
    return cfg


def _lenient_parser(trainer, text=None):
    """The task accepts every response (a lenient parser: ``rollout/invalid_frac`` stays 0); with ``text``
    every response decodes to it, as if the rollout engine wrote it."""
    trainer.task.is_valid = lambda _text: True
    if text is not None:
        trainer.task.response_text = lambda _ids: text


def test_the_monitor_flags_text_signals_like_the_invalid_rate(caplog):
    """``RLTrainer._stability`` on synced metrics: a text share over its threshold sets ``stability/garbled``
    and counts towards the streak with ``rollout/invalid_frac`` at 0; shares at or below stay quiet."""
    fake = SimpleNamespace(cfg=TrainConfig(), unstable_steps=0, step_idx=7)
    st = fake.cfg.stability
    quiet = {"rollout/invalid_frac": 0.0, "stability/repetitive_frac": st.repetitive_threshold,
             "stability/nonprintable_frac": 0.0, "stability/replacement_frac": 0.01, "stability/unlikely_frac": 0.03}
    out = dict(quiet)
    RLTrainer._stability(fake, out)
    assert out["stability/garbled"] == 0.0 and fake.unstable_steps == 0
    for key, value in [("stability/repetitive_frac", 0.75), ("stability/nonprintable_frac", 0.1),
                       ("stability/replacement_frac", 0.3), ("stability/unlikely_frac", 0.9)]:
        out = dict(quiet, **{key: value})
        with caplog.at_level(logging.WARNING, logger="nemo_fp8rl.trainer.rl_trainer"):
            caplog.clear()
            RLTrainer._stability(fake, out)
        assert out["stability/garbled"] == 1.0, key
        name = key.split("/")[1]
        assert "unstable (garbled output)" in caplog.text and f"{name} {value:.3f}" in caplog.text, caplog.text
        fake.unstable_steps = 0  # each case starts a streak (the warning is written at its first step)


def test_the_monitor_flags_answers_in_tags_never_closed(caplog):
    """A task's ``reward/unclosed_answer`` (answers its lenient parse scores from a tag never closed) above
    ``stability.unclosed_answer_threshold`` sets ``stability/garbled`` and the warning names it; at the
    threshold, or for a task that does not report it, the step stays quiet."""
    fake = SimpleNamespace(cfg=TrainConfig(), unstable_steps=0, step_idx=3)
    limit = fake.cfg.stability.unclosed_answer_threshold
    for out in ({"rollout/invalid_frac": 0.0}, {"rollout/invalid_frac": 0.0, "reward/unclosed_answer": limit}):
        RLTrainer._stability(fake, out)
        assert out["stability/garbled"] == 0.0 and fake.unstable_steps == 0, out
    out = {"rollout/invalid_frac": 0.0, "reward/unclosed_answer": 0.94, "stability/repetitive_frac": 0.5}
    with caplog.at_level(logging.WARNING, logger="nemo_fp8rl.trainer.rl_trainer"):
        RLTrainer._stability(fake, out)
    assert out["stability/garbled"] == 1.0 and fake.unstable_steps == 1
    assert "repetitive_frac 0.500, unclosed_answer 0.940" in caplog.text, caplog.text


def test_garbled_text_a_lenient_parser_accepts_is_flagged_and_stops_the_run(tmp_path):
    """Every response decodes to "????////..." and the task accepts it: the invalid rate is 0, the text
    monitor flags every step, and ``stability.action=stop`` stops after ``patience`` steps with a checkpoint."""
    out = tmp_path / "run"
    tr = RLTrainer(_tiny_cfg(out, action="stop", patience=2))
    tr.cfg.trainer.max_steps, tr.cfg.trainer.checkpoint_interval = 10, 0
    tr.setup()
    _lenient_parser(tr, GARBLED)
    with pytest.raises(StopTraining, match="2 consecutive steps flagged unstable"):
        tr.fit()
    recs = read_metrics(str(out))
    assert [r["stability/garbled"] for r in recs] == [1.0, 1.0]
    assert all(r["rollout/invalid_frac"] == 0.0 for r in recs)
    assert all(r["stability/repetitive_frac"] == 1.0 and r["stability/repeat_run_max"] == 64.0 for r in recs)
    assert tr.ckpt.latest_step() == 2


def test_calibration_steps_measure_unlikely_tokens_with_the_shadow_forward(tmp_path, close_trainer):
    """On a calibration step the BF16 shadow log-probs give ``stability/unlikely_frac``; a clean step (the
    model's own samples, parser lenient) is not flagged; other steps have no ``unlikely_frac``. With
    ``stability.unlikely_prob`` near 1 every sampled token counts as unlikely and the step is flagged."""
    cfg = _tiny_cfg(tmp_path / "a")
    cfg.calibration.enabled, cfg.calibration.interval, cfg.calibration.min_tokens = True, 2, 4
    tr = RLTrainer(cfg)
    tr.setup()
    _lenient_parser(tr)
    m0, m1 = tr.step(), tr.step()
    # an untrained 16-token model samples near-uniformly: p ~ 1/16, far above 1e-4
    assert m0["stability/unlikely_frac"] == 0.0 and "stability/unlikely_frac" not in m1
    assert m0["stability/garbled"] == 0.0 and m1["stability/garbled"] == 0.0
    assert m0["stability/repetitive_frac"] == 0.0 and m0["stability/nonprintable_frac"] == 0.0
    tr.cfg.stability.unlikely_prob = 0.99
    m2 = tr.step()
    assert m2["stability/unlikely_frac"] == pytest.approx(1.0) and m2["stability/garbled"] == 1.0
    close_trainer(tr)


@pytest.mark.parametrize("key,value,msg", [
    ("repetitive_threshold", 1.0, "stability.repetitive_threshold=1.0 must be in [0, 1)"),
    ("replacement_threshold", -0.1, "stability.replacement_threshold=-0.1 must be in [0, 1)"),
    ("repeat_min_chars", 1, "stability.repeat_min_chars=1 must be >= 2"),
    ("repeat_min_frac", 1.5, "stability.repeat_min_frac=1.5 in [0, 1]"),
    ("unlikely_prob", 0.0, "stability.unlikely_prob=0.0 must be in (0, 1)"),
    ("unclosed_answer_threshold", 1.0, "stability.unclosed_answer_threshold=1.0 must be in [0, 1)"),
])
def test_bad_thresholds_are_refused_naming_the_key(key, value, msg):
    cfg = TrainConfig()
    setattr(cfg.stability, key, value)
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        validate(cfg)
