"""The runnable NeMo RL example (examples/nemo_rl_calibrated_clip.py) and the FP8-off worker mixin."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from nemo_fp8rl.fp8 import convert_to_fp8, get_recipe
from nemo_fp8rl.integrations.nemo_rl import Fp8ShadowWorkerMixin

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nemo_rl_calibrated_clip.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("nemo_rl_calibrated_clip", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_runs_the_nemo_rl_loop_with_calibration():
    ex = _load_example()
    history = ex.run(steps=3, interval=1, verbose=False)
    assert len(history) == 3
    for m in history:
        assert {"loss", "token_mult_prob_error", "gen_kl_error", "num_valid_samples", "is_oob_ratio"} <= set(
            m
        )
        # NeMo RL semantics: each metric / number of global batches (4), summed over microbatches
        assert m["num_valid_samples"] == 64 / 4 and m["calib/tokens"] > 0 and m["calib/skipped"] == 0
        assert m["token_mult_prob_error"] > 1.0  # rollout (rowwise) and trainer (tensorwise) FP8 disagree
    # bounds in force at a step are the ones the previous step's calibration set (nominal at step 0)
    assert (history[0]["clip/lower"], history[0]["clip/upper"]) == pytest.approx((0.8, 1.28))
    assert (history[1]["clip/lower"], history[1]["clip/upper"]) != pytest.approx((0.8, 1.28))


class _Worker(Fp8ShadowWorkerMixin):
    def __init__(self, model):
        self.model = model


@pytest.mark.parametrize("chunks", [1, 2])
def test_worker_mixin_turns_fp8_off_and_back_on(chunks):
    ex = _load_example()
    plain = [ex.bigram_policy(seed=i) for i in range(chunks)]
    fp8 = [convert_to_fp8(copy.deepcopy(m), get_recipe("tensorwise")) for m in plain]
    worker = _Worker(fp8 if chunks > 1 else fp8[0])
    ids = torch.randint(0, ex.VOCAB, (4, 10), generator=torch.Generator().manual_seed(0))

    def lps(models):
        with torch.no_grad():
            return [ex.token_logprobs(m, ids) for m in models]

    on = lps(fp8)
    worker.set_fp8_shadow(True)
    worker.set_fp8_shadow(True)  # idempotent
    off = lps(fp8)
    worker.set_fp8_shadow(False)
    worker.set_fp8_shadow(False)
    for a, b, c, d in zip(on, off, lps(plain), lps(fp8)):
        torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-6)  # shadow = same weights without FP8
        assert not torch.allclose(a, c, atol=1e-4)  # FP8 really was on before
        torch.testing.assert_close(d, a, rtol=0, atol=0)  # and is on again after
