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


def test_entropy_surge_flags_spike_only():
    curve = [0.30, 0.31, 0.29, 0.30, 0.30, 0.31, 0.29, 0.95, 0.30, 0.30]
    out = _run(EntropySurgeMonitor(window=5, factor=2.0, min_history=3), curve)
    assert [o["stability/entropy_surge"] for o in out] == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert out[7]["stability/entropy_ratio"] == pytest.approx(0.95 / 0.30)


def test_entropy_slow_decline_and_noise_never_surge():
    g = torch.Generator().manual_seed(0)
    decline = [0.6 * 0.98**i for i in range(60)]
    noisy = (0.3 + 0.05 * torch.randn(60, generator=g)).clamp(min=0.15).tolist()
    for curve in (decline, noisy):
        out = _run(EntropySurgeMonitor(window=10, factor=2.0), curve)
        assert sum(o["stability/entropy_surge"] for o in out) == 0


def test_entropy_needs_history_and_adapts_to_new_level():
    mon = EntropySurgeMonitor(window=4, factor=1.5, min_history=3)
    out = _run(mon, [0.2, 0.9])  # huge jump but only one past value
    assert out[1]["stability/entropy_surge"] == 0
    mon = EntropySurgeMonitor(window=4, factor=1.5, min_history=3)
    out = _run(mon, [0.2, 0.2, 0.2, 0.8, 0.8, 0.8, 0.8])
    # surge at the jump; once the (lower) median of the last 4 values reaches the new level it stops:
    # medians seen: 0.2 (x3 history), 0.2 [.2 .2 .2 .8], 0.2 [.2 .2 .8 .8], 0.8 [.2 .8 .8 .8]
    assert [o["stability/entropy_surge"] for o in out] == [0, 0, 0, 1, 1, 1, 0]
    assert mon.surges == 3


def test_entropy_monitor_resume_is_exact():
    curve = [0.3, 0.32, 0.28, 0.3, 0.9, 0.31, 0.7, 0.3]
    full = _run(EntropySurgeMonitor(window=4, min_history=2), curve)
    a = EntropySurgeMonitor(window=4, min_history=2)
    first = _run(a, curve[:5])
    b = EntropySurgeMonitor(window=4, min_history=2)
    b.load_state_dict(a.state_dict())
    assert first + _run(b, curve[5:]) == full


def test_entropy_monitor_errors():
    with pytest.raises(ValueError, match="factor"):
        EntropySurgeMonitor(factor=1.0)
    with pytest.raises(ValueError, match="min_history"):
        EntropySurgeMonitor(window=3, min_history=5)
    with pytest.raises(ValueError, match="finite"):
        EntropySurgeMonitor().update(float("nan"))
