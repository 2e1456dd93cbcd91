import math

import pytest
import torch

from nemo_fp8rl.algorithms import EntropySurgeMonitor, metrics_to_floats, mismatch_metrics


def test_mismatch_metrics_hand_values():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    d = torch.tensor([[0.1, -0.3, 0.0], [0.2, 0.5, 9.0]])  # last entry is padding
    old = rollout + d
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = metrics_to_floats(mismatch_metrics(old, rollout, mask))
    valid = [0.1, -0.3, 0.0, 0.2, 0.5]
    assert out["mismatch/logp_abs_diff_mean"] == pytest.approx(sum(abs(x) for x in valid) / 5, rel=1e-5)
    assert out["mismatch/logp_abs_diff_max"] == pytest.approx(0.5, rel=1e-5)
    assert out["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in valid) / 5, rel=1e-4)
    assert out["mismatch/token_mult_prob_error"] == pytest.approx(
        sum(math.exp(abs(x)) for x in valid) / 5, rel=1e-5
    )
    assert "mismatch/fp8_bf16_logp_abs_diff_mean" not in out
    hp = old - torch.tensor([[0.2, 0.2, -0.2], [0.0, 0.4, 5.0]])
    out2 = metrics_to_floats(mismatch_metrics(old, rollout, mask, hp_old_logp=hp))
    assert out2["mismatch/fp8_bf16_logp_abs_diff_mean"] == pytest.approx(
        (0.2 + 0.2 + 0.2 + 0 + 0.4) / 5, rel=1e-5
    )


def test_identical_logprobs_give_no_mismatch():
    lp = -torch.rand(4, 5)
    out = metrics_to_floats(mismatch_metrics(lp, lp.clone(), None))
    assert out["mismatch/logp_abs_diff_max"] == 0.0 and out["mismatch/k3_kl"] == 0.0
    assert out["mismatch/token_mult_prob_error"] == 1.0


def _run(monitor, curve):
    return [metrics_to_floats(monitor.update(h)) for h in curve]


def _flags(out):
    return [int(o["stability/entropy_surge"]) for o in out]


# Mean token entropy per step of the BF16 arm of the study's lr 1e-3 stress condition (seed 1, 60 steps;
# `run_study.py --only stress` overrides, rerun 2026-11-30 with trainer.cpu_threads=1): it jumps from
# 0.25 to 0.5 within three steps of the first update and stays near 0.58; reward fell to 0 and half of
# the responses were malformed. The running-median monitor flagged none of it (max ratio 1.83 at step 2).
LR1E3_BF16 = [
    0.25, 0.356, 0.456, 0.505, 0.506, 0.519, 0.546, 0.568, 0.551, 0.536, 0.57, 0.554, 0.591, 0.575, 0.586,
    0.579, 0.58, 0.55, 0.564, 0.589, 0.621, 0.598, 0.588, 0.612, 0.586, 0.581, 0.543, 0.591, 0.57, 0.573,
    0.572, 0.581, 0.603, 0.581, 0.599, 0.557, 0.598, 0.55, 0.585, 0.584, 0.596, 0.569, 0.57, 0.595, 0.563,
    0.549, 0.598, 0.591, 0.603, 0.579, 0.589, 0.582, 0.608, 0.589, 0.593, 0.588, 0.602, 0.583, 0.591, 0.556,
]


def test_recorded_lr1e3_collapse_is_flagged_while_it_stays_up():
    mon = EntropySurgeMonitor()  # the defaults of stability.*: window 20, factor 1.5, min_rise 0.05
    out = _run(mon, LR1E3_BF16)
    # baseline = step 0 (0.25) through step 20, then the median of the growing lagged window: every step
    # from the first one above 1.5 x 0.25 stays flagged until that window's median has risen (step 25)
    assert _flags(out) == [0, 0] + [1] * 23 + [0] * 35
    assert out[1]["stability/entropy_ratio"] == pytest.approx(0.356 / 0.25)
    assert out[20]["stability/entropy_ratio"] == pytest.approx(0.621 / 0.25)
    assert out[24]["stability/entropy_ratio"] == pytest.approx(0.586 / 0.356)  # lower median of steps 0..3
    assert out[25]["stability/entropy_ratio"] == pytest.approx(0.581 / 0.456)  # median of steps 0..4: < 1.5


def test_jump_after_a_stable_phase_flags_every_step_until_the_lagged_median_moves():
    w = 10
    g = torch.Generator().manual_seed(0)
    low = (0.30 + 0.01 * torch.randn(45, generator=g)).tolist()
    high = (0.55 + 0.01 * torch.randn(40, generator=g)).tolist()
    out = _run(EntropySurgeMonitor(window=w), low + high)
    flags = _flags(out)
    # baseline of step t: median of steps [t - 2w, t - w); it stays at the low level until more than half
    # of that window is post-jump, i.e. through step 45 + w + w // 2
    assert flags == [0] * 45 + [1] * (w + w // 2 + 1) + [0] * (40 - w - w // 2 - 1)
    # a running median of the last w steps (the old monitor) would follow after about w / 2 steps:
    assert sum(flags) > w


def test_single_step_spike_flags_that_step_only():
    curve = [0.30, 0.31, 0.29, 0.30, 0.30, 0.31, 0.29, 0.95] + [0.30, 0.31, 0.29, 0.30] * 10
    for w in (1, 3, 5, 20):
        out = _run(EntropySurgeMonitor(window=w), curve)
        assert _flags(out) == [0] * 7 + [1] + [0] * 40, w
        assert out[7]["stability/entropy_ratio"] == pytest.approx(0.95 / (0.30 if w > 1 else 0.31))  # w=1: step 5


def test_slow_decline_slow_rise_and_noise_never_surge():
    g = torch.Generator().manual_seed(0)
    decline = [0.6 * 0.98**i for i in range(120)]
    noisy = (0.3 + 0.03 * torch.randn(120, generator=g)).clamp(min=0.15).tolist()
    drift_up = [0.30 + 0.0005 * i for i in range(120)]  # +0.06 over the run: below min_rise per lag
    for curve in (decline, noisy, drift_up):
        for w in (5, 20):
            assert sum(_flags(_run(EntropySurgeMonitor(window=w), curve))) == 0


def test_min_rise_keeps_small_absolute_changes_at_low_entropy_quiet():
    curve = [0.02] * 10 + [0.06] * 10  # 3x, but only 0.04 nats
    assert sum(_flags(_run(EntropySurgeMonitor(window=3), curve))) == 0
    assert sum(_flags(_run(EntropySurgeMonitor(window=3, min_rise=0.0), curve))) > 0


def test_trainer_patience_stops_on_the_collapse_not_on_a_spike():
    """The trainer's streak counter (what stability.action=stop compares with stability.patience)."""
    from types import SimpleNamespace

    from nemo_fp8rl.config.schema import TrainConfig
    from nemo_fp8rl.trainer.rl_trainer import RLTrainer

    def longest_streak(curve):
        fake = SimpleNamespace(cfg=TrainConfig(), unstable_steps=0, step_idx=0)
        mon, streak = EntropySurgeMonitor(), 0
        for h in curve:
            out = metrics_to_floats(mon.update(h))
            RLTrainer._stability(fake, out)
            streak = max(streak, fake.unstable_steps)
        return streak

    patience = TrainConfig().stability.patience
    assert patience > 1
    assert longest_streak([0.30, 0.31, 0.29, 0.30, 0.95, 0.30, 0.31, 0.29] * 3) == 1 < patience
    assert longest_streak(LR1E3_BF16) == 23 >= patience


def test_entropy_monitor_resume_is_exact():
    curve = LR1E3_BF16[:30]
    full = _run(EntropySurgeMonitor(window=4), curve)
    for cut in (1, 5, 9, 20):
        a = EntropySurgeMonitor(window=4)
        first = _run(a, curve[:cut])
        b = EntropySurgeMonitor(window=4)
        b.load_state_dict(a.state_dict())
        assert first + _run(b, curve[cut:]) == full
        assert b.surges == sum(_flags(full))


def test_entropy_monitor_errors():
    with pytest.raises(ValueError, match="factor"):
        EntropySurgeMonitor(factor=1.0)
    with pytest.raises(ValueError, match="window"):
        EntropySurgeMonitor(window=0)
    with pytest.raises(ValueError, match="min_rise"):
        EntropySurgeMonitor(min_rise=-0.1)
    with pytest.raises(ValueError, match="finite"):
        EntropySurgeMonitor().update(float("nan"))
