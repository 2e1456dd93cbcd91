"""The negative push (nemo_fp8rl.algorithms.push) in the trainer: logged on calibration steps only, in a
BF16 run with ``calibration=measure`` too, and exactly what the weights' change makes it (two in-process
2-step tiny runs, a few seconds each)."""

import math

from ._cli import metrics, train_in_process

PUSH = ("calib/neg_push", "calib/pos_push", "calib/neg_alt_mass", "calib/neg_alt_mass_gain", "calib/neg_push_tokens")
ARGS = ("calibration=measure", "calibration.interval=2", "calibration.min_tokens=4", "trainer.max_steps=2",
        "trainer.checkpoint_interval=0", "algorithm.old_logprobs=rollout", "algorithm.minibatches_per_step=2")


def test_bf16_run_logs_the_push_on_calibration_steps(tmp_path):
    out = tmp_path / "bf16"
    train_in_process(out, "fp8=off", *ARGS)  # calibration=measure is accepted with FP8 off
    recs = metrics(out)
    assert [r["step"] for r in recs] == [0, 1]
    for key in (*PUSH, "timing/push_forward"):
        assert key in recs[0] and math.isfinite(recs[0][key]), key
        assert key not in recs[1], key  # step 1 does not calibrate (interval 2)
    r = recs[0]
    assert r["calib/neg_push_tokens"] > 0  # the seeded batch has negative-advantage tokens
    assert 0.0 <= r["calib/neg_alt_mass"] <= 1.0
    # the shadow forward is the model itself: BF16's own clipped share on both sides
    assert r["calib/alpha_bf16"] == r["calib/alpha_fp8_nominal"]
    # a real update moved the negative tokens' log-probs (sign not asserted: a single Adam step need not
    # lower every token's average; measured here: neg_push -0.11, pos_push +0.05)
    assert r["calib/neg_push"] != 0.0


def test_push_is_zero_when_the_update_changes_nothing(tmp_path):
    """lr 1e-30: Adam moves each weight by ~1e-30, below float32 resolution of any nonzero weight, so the
    shadow forwards before and after the step agree: the push and the moved mass are 0 (FP8 arm: the
    high-precision push is measured by the FP8-off forward, whatever the FP8 ratios did)."""
    out = tmp_path / "fp8"
    train_in_process(out, "fp8=tensorwise", *ARGS, "optim.lr=1e-30")
    r = metrics(out)[0]
    assert r["calib/neg_push_tokens"] > 0
    assert abs(r["calib/neg_push"]) < 1e-6 and abs(r["calib/pos_push"]) < 1e-6
    assert abs(r["calib/neg_alt_mass_gain"]) < 1e-6 and 0.0 < r["calib/neg_alt_mass"] < 1.0
