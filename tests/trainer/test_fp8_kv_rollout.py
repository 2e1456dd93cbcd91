"""``rollout.fp8.kv_cache=e4m3`` trains on CPU through the torch engine, end to end, at test size.

The run uses calibrated KV-cache scales (recomputed at every weight sync from a high-precision forward
over the latest rollout batch, nemo_fp8rl/trainer/kv_scales.py) and BF16 edge layers, so every piece of
the FP8 KV path runs: the engine's FP8 cache, the calibration tee on the weight stream, the scales'
checkpointing (a resumed run calibrates on the same batch as the uninterrupted one: the trajectories are
equal) and the config keys.
"""

from __future__ import annotations

import math

import pytest
import yaml

from ._cli import metrics, strip_timing, train_in_process

KV = ["fp8=tensorwise", "calibration=off", "rollout.fp8.kv_cache=e4m3", "rollout.fp8.kv_scales=calibrated",
      "rollout.fp8.num_layers_at_start_in_bf16=1", "trainer.checkpoint_interval=1"]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "full"
    train_in_process(out, *KV, "trainer.max_steps=2")
    return out


def test_fp8_kv_cache_trains_with_calibrated_scales(full):
    recs = metrics(full)
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        for n in ("q", "k", "v"):
            s = r[f"kv/{n}_scale_max"]
            assert math.isfinite(s) and s > 0 and s != 1.0  # calibrated, not vLLM's static 1.0
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["train/loss"])
    fp8 = yaml.safe_load((full / "config.yaml").read_text())["rollout"]["fp8"]
    assert fp8["kv_cache"] == "e4m3" and fp8["kv_scales"] == "calibrated" and fp8["num_layers_at_start_in_bf16"] == 1


def test_a_resumed_run_calibrates_as_the_uninterrupted_one(full, tmp_path):
    part = tmp_path / "part"
    train_in_process(part, *KV, "trainer.max_steps=1", f"warmup.cache_dir={full.parent / '.warmup_cache'}")
    train_in_process(part, *KV, "trainer.max_steps=2", "resume=true", f"warmup.cache_dir={full.parent / '.warmup_cache'}")
    assert strip_timing(metrics(part)) == strip_timing(metrics(full))
