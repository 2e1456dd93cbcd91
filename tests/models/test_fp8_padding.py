"""FP8 token padding for Transformer Engine (issue 26): every FP8 GEMM TE runs sees a legal token count.

TE's linears refuse FP8 inputs whose tokens are not a multiple of 8 (``assert_dim_for_fp8_exec``). The
actor right-pads each microbatch's sequence (``token_pad_multiple``) and cuts the logits back before any
log-prob or loss sees them. Checked here on CPU: the rule against a readable stand-in of TE's assertion,
and a real actor (emulated FP8, TE's assertion hooked onto every FP8 linear) with odd sequence lengths and
a short last microbatch, whose log-probs and losses never see a padded position.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.fp8 import get_recipe
from nemo_fp8rl.models import actor as actor_mod
from nemo_fp8rl.models import build_actor

from ._scenarios import make_batch, pg_loss

VOCAB = 16


def te_assert_dim_for_fp8_exec(*tensors: torch.Tensor) -> None:
    """Stand-in of Transformer Engine's ``assert_dim_for_fp8_exec`` (TE 2.8, pytorch/utils.py), which its
    Linear, LayerNormLinear and LayerNormMLP call on the input and the weight of every FP8 forward: the
    product of all dimensions but the last (the tokens) a multiple of 8, the last (the features) a
    multiple of 16. TE 2.8 asserts; newer TE raises ValueError with the same rule."""
    for t in tensors:
        tokens, features = math.prod(t.shape[:-1]), t.shape[-1]
        assert tokens % 8 == 0 and features % 16 == 0, (
            f"FP8 execution requires tokens % 8 == 0 and features % 16 == 0, got dims={list(t.shape)}")


def te_mxfp8_quantizable(t: torch.Tensor) -> bool:
    """TE 2.8's MXFP8 tensors: both the tokens and the features multiples of 32 (MXFP8 block)."""
    return math.prod(t.shape[:-1]) % 32 == 0 and t.shape[-1] % 32 == 0


def te_block_quantizable(t: torch.Tensor) -> bool:
    """TE's 1x128 block quantizer (FP8 all-gather under SP): tokens and features multiples of 128."""
    return math.prod(t.shape[:-1]) % 128 == 0 and t.shape[-1] % 128 == 0


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, True), (8, True)])
def test_padded_sequences_pass_te_checks_on_every_rank(scaling, tp, sp):
    """For every T and microbatch size b: the padded T splits over the SP ranks, and each rank's [T_local,
    b, h] activation passes TE's checks for the recipe."""
    m = actor_mod.token_pad_multiple(tp, sp, scaling)
    for T in range(1, 300):
        Tp = -(-T // m) * m
        assert Tp - T < m
        local = Tp // tp if sp else Tp
        assert local * (tp if sp else 1) == Tp
        for b in (1, 2, 3, 5):
            act = torch.empty(local, b, 64, device="meta")
            te_assert_dim_for_fp8_exec(act)
            assert local % 16 == 0  # the wgrad GEMM's reduction (tokens) a multiple of 16
            if scaling == "mxfp8":
                assert te_mxfp8_quantizable(act)
            if scaling == "blockwise":
                assert te_block_quantizable(torch.empty(local, b, 128, device="meta"))
    assert actor_mod.token_pad_multiple(tp, sp, None) == (tp if sp else 1)  # no TE FP8: SP only


def test_te_stand_in_is_a_real_check():
    with pytest.raises(AssertionError, match="tokens % 8"):
        te_assert_dim_for_fp8_exec(torch.empty(13, 1, 64, device="meta"))
    with pytest.raises(AssertionError):
        te_assert_dim_for_fp8_exec(torch.empty(16, 1, 40, device="meta"))
    te_assert_dim_for_fp8_exec(torch.empty(13, 8, 64, device="meta"))


def _actor(fp8, mb):
    return build_actor(ModelConfig(vocab_size=VOCAB), ParallelConfig(micro_batch_size=mb), fp8_recipe=get_recipe(fp8),
                       seed=0, lr=1e-3, device="cpu")


def _as_te(actor):
    """Make a CPU actor follow the TE backend's padding and hook TE's input check onto every FP8 linear:
    the emulated linears see exactly the [T, b, h] activations TE's would."""
    actor.use_te = True
    seen = []

    def check(module, args):
        if getattr(module, "fp8_enabled", False):
            te_assert_dim_for_fp8_exec(args[0])
            seen.append(tuple(args[0].shape))

    handles = [m.register_forward_pre_hook(check) for m in actor.model.modules() if hasattr(m, "fp8_enabled")]
    assert handles, "no FP8 linears in the model"
    return seen


@pytest.mark.parametrize("T", [13, 17])
def test_odd_lengths_and_a_short_last_microbatch_on_te(T):
    actor = _actor("tensorwise", mb=2)
    batch = make_batch(VOCAB, B=5, T=T, seed=2)  # microbatches of 2, 2, 1 rows
    tokens = batch["tokens"]
    shadow_before = actor.get_shadow_logprobs(tokens)[0]  # FP8 off, not padded (use_te is False)
    seen = _as_te(actor)
    lp, ent = actor.get_logprobs(tokens, with_entropy=True)
    assert lp.shape == ent.shape == (5, T)
    assert seen and all(s[0] % 16 == 0 for s in seen) and {s[1] for s in seen} == {1, 2}
    # right-padding changes no real position (causal attention): the FP8-off forward agrees with the
    # unpadded one to float noise (GEMM shapes differ, so bitwise equality is not expected)
    shadow = actor.get_shadow_logprobs(tokens)[0]
    torch.testing.assert_close(shadow, shadow_before, atol=1e-5, rtol=1e-5)
    # the loss sees [b, T] log-probs, masks and entropies only: padded positions never count
    shapes = []

    def loss_fn(mb, logprobs, entropy, *, global_tokens, global_seqs):
        shapes.append((tuple(logprobs.shape), tuple(entropy.shape), tuple(mb["mask"].shape)))
        return pg_loss(mb, logprobs, entropy, global_tokens=global_tokens, global_seqs=global_seqs)

    seen.clear()
    metrics = actor.train_step(batch, loss_fn)
    assert seen and all(s[0] % 16 == 0 for s in seen)
    assert shapes == [((2, T), (2, T), (2, T)), ((2, T), (2, T), (2, T)), ((1, T), (1, T), (1, T))]
    assert float(metrics["train/global_tokens"][0]) == float(batch["mask"].sum())
    assert bool(torch.isfinite(metrics["train/loss"][0]))


def test_blockwise_on_te_pads_to_128():
    actor = _actor("blockwise", mb=3)
    seen = _as_te(actor)
    actor.get_logprobs(make_batch(VOCAB, B=4, T=21, seed=3)["tokens"])
    assert seen and {s[0] for s in seen} == {128}
