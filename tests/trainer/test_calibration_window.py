"""calibration.window in the trainer: a round pools its steps' tokens, calibrates at its last step, and a run
resumed inside a round ends it exactly as the uninterrupted run does (the pooled tokens are checkpointed)."""

from ._cli import demo_overrides, metrics, strip_timing, train_in_process
from ._reshard import rank_state

# the demo's calibrated arm at test size (its rewards vary within groups from step 0), in rounds of 2 of 3 steps
RUN = [*demo_overrides("fp8_calibrated"), "calibration.interval=3", "calibration.window=2",
       "trainer.checkpoint_interval=1", "trainer.keep_last=4"]


def test_a_round_pools_two_steps_and_resumes_inside_it_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process(full, *RUN, "trainer.max_steps=4")
    recs = metrics(full)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    # shadow passes (and the negative push) on both steps of each round; the bounds come at its last step
    assert ["calib/neg_push" in r for r in recs] == [True, True, False, True]
    assert ["calib/tokens" in r for r in recs] == [False, True, False, False]
    assert recs[0]["clip/lower"] == recs[1]["clip/lower"] == 0.8  # nominal until the first round ends
    # the first calibration (33 pooled tokens) is in the state saved after step 1, and in force at step 2
    before, after = rank_state(full, 1)["calibrator"], rank_state(full, 2)["calibrator"]
    assert not before["calibrated"] and after["calibrated"] and after["last_step"] == 1
    assert recs[1]["calib/tokens"] > 0 and recs[1]["calib/skipped"] == 0
    assert (recs[2]["clip/lower"], recs[2]["clip/upper"]) == (after["lower"], after["upper"])
    # after step 0 and after step 3 a round is open: the checkpoint holds its pooled tokens
    for step, first in ((1, 0), (4, 3)):
        pooled = rank_state(full, step)["calibrator"]["round"]
        assert pooled["step"] == first and pooled["data"].shape[0] == 3 and pooled["data"].shape[1] > 0
    assert rank_state(full, 2)["calibrator"]["round"] is None

    # stopped after step 0, inside the first round, then resumed to step 4: the same trajectory
    train_in_process(part, *RUN, "trainer.max_steps=1")
    train_in_process(part, *RUN, "trainer.max_steps=4", "resume=true")
    assert strip_timing(metrics(part)) == strip_timing(recs)
