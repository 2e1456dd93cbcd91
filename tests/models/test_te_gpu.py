"""GPU (marker ``gpu``): the tiny model on megatron's Transformer Engine spec with each TE FP8 recipe.

- one train step with TE FP8 gives a finite loss and finite log-probs;
- log-probs under TE FP8 and under our emulation of the same recipe (same weights, same
  microbatches, local spec on the GPU) agree to within the FP8 noise level, measured as the distance
  of the emulated FP8 log-probs from the high-precision shadow.
"""

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig

from ._scenarios import make_batch, pg_loss

pytestmark = pytest.mark.gpu

RECIPES = ["delayed", "tensorwise", "blockwise", "mxfp8"]


def _supported(recipe: str) -> tuple[bool, str]:
    from nemo_fp8rl.fp8.te import te_support

    return te_support(recipe)


def _build(recipe, use_te, **kw):
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    r = get_recipe(recipe, **kw) if recipe else None
    return build_actor(ModelConfig(vocab_size=16), ParallelConfig(micro_batch_size=8), fp8_recipe=r, seed=0,
                       lr=1e-4, use_te=use_te)


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_fp8_train_step_and_parity_with_emulation(recipe):
    ok, reason = _supported(recipe)
    if not ok:
        pytest.skip(f"{recipe} not supported on this GPU/TE: {reason}")
    batch = {k: v.cuda() for k, v in make_batch(16, B=8, T=32).items()}
    te_actor = _build(recipe, use_te=True)
    emu_actor = _build(recipe, use_te=False)
    assert te_actor.use_te and not emu_actor.use_te
    w_te, w_emu = te_actor.export_weights(), emu_actor.export_weights()
    assert all(torch.equal(w_te[k], w_emu[k]) for k in w_te)  # same weights on both specs

    te_lp, _ = te_actor.get_logprobs(batch["tokens"])
    emu_lp, _ = emu_actor.get_logprobs(batch["tokens"])
    hp_lp, _ = emu_actor.get_shadow_logprobs(batch["tokens"])
    te_hp, _ = te_actor.get_shadow_logprobs(batch["tokens"])
    m = batch["mask"].bool()
    noise = (emu_lp - hp_lp)[m].abs().mean().item()
    gap = (te_lp - emu_lp)[m].abs().mean().item()
    assert noise > 0 and (te_lp - te_hp)[m].abs().mean().item() > 0  # FP8 really on in both
    assert gap <= 1.5 * noise, f"TE vs emulation {gap:.4f} exceeds the FP8 noise level {noise:.4f}"
    torch.testing.assert_close(te_hp[m], hp_lp[m], atol=0.05, rtol=0)  # both BF16 high precision

    metrics = te_actor.train_step(batch, pg_loss)
    assert torch.isfinite(metrics["train/loss"][0]) and metrics["train/skipped"][0] == 0
    assert torch.isfinite(metrics["train/grad_norm"][0])
    assert torch.isfinite(te_actor.get_logprobs(batch["tokens"])[0]).all()


def test_te_first_last_layers_bf16():
    ok, reason = _supported("tensorwise")
    if not ok:
        pytest.skip(reason)
    actor = _build("tensorwise", use_te=True, first_last_layers_bf16=True)
    assert actor.model.config.first_last_layers_bf16
    batch = {k: v.cuda() for k, v in make_batch(16, B=8, T=32).items()}
    assert torch.isfinite(actor.train_step(batch, pg_loss)["train/loss"][0])
