import math

import pytest
import torch

from nemo_fp8rl.algorithms import rollout_correction


def _batch():
    # is ratios exp(old - rollout) = [0.25, 1.0, 3.0] / [6.0, 0.6, pad]
    ratios = torch.tensor([[0.25, 1.0, 3.0], [6.0, 0.6, 100.0]])
    rollout = torch.tensor([[-1.0, -0.5, -2.0], [-3.0, -0.2, -1.0]])
    old = rollout + ratios.log()
    old[1, 2] = float("nan")  # garbage in padding must not leak
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return old, rollout, mask


def test_tis_truncates_at_cap():
    old, rollout, mask = _batch()
    w, m = rollout_correction(old, rollout, mask, "tis")
    torch.testing.assert_close(w, torch.tensor([[0.25, 1.0, 2.0], [2.0, 0.6, 0.0]]))
    w5, _ = rollout_correction(old, rollout, mask, "tis", cap=5.0)
    torch.testing.assert_close(w5, torch.tensor([[0.25, 1.0, 3.0], [5.0, 0.6, 0.0]]))
    assert m["mismatch/is_ratio_mean"][0].item() == pytest.approx((0.25 + 1 + 3 + 6 + 0.6) / 5)
    assert m["mismatch/is_ratio_min"][0].item() == pytest.approx(0.25)
    assert m["mismatch/is_ratio_max"][0].item() == pytest.approx(6.0)
    assert m["mismatch/is_ratio_min"][1] == "min" and m["mismatch/is_ratio_max"][1] == "max"
    assert m["mismatch/masked_frac"][0].item() == 0.0


def test_icepop_masks_outside_band_and_keeps_ratio_inside():
    old, rollout, mask = _batch()
    w, m = rollout_correction(old, rollout, mask, "icepop", lo=0.5, hi=5.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 3.0], [0.0, 0.6, 0.0]]))
    assert m["mismatch/masked_frac"][0].item() == pytest.approx(2 / 5)


def test_none_and_plain_is():
    old, rollout, mask = _batch()
    w, _m = rollout_correction(old, rollout, mask, "none")
    torch.testing.assert_close(w, mask.float())
    w_is, _ = rollout_correction(old, rollout, mask, "is")
    torch.testing.assert_close(w_is, torch.tensor([[0.25, 1.0, 3.0], [6.0, 0.6, 0.0]]))


def test_weights_are_detached_and_finite():
    old, rollout, mask = _batch()
    old = old.clone().requires_grad_(True)
    w, m = rollout_correction(old, rollout, mask, "tis")
    assert not w.requires_grad and torch.isfinite(w).all()
    assert all(math.isfinite(v[0].item()) for v in m.values())


def test_errors():
    old, rollout, mask = _batch()
    with pytest.raises(ValueError, match="tis.*icepop"):
        rollout_correction(old, rollout, mask, "seq-mask-tis")
    with pytest.raises(ValueError, match="cap"):
        rollout_correction(old, rollout, mask, "tis", cap=0.0)
    with pytest.raises(ValueError, match="lo < hi"):
        rollout_correction(old, rollout, mask, "icepop", lo=2.0, hi=1.0)
    with pytest.raises(ValueError, match="rollout_logp has shape"):
        rollout_correction(old, rollout[:, :2], mask, "tis")
