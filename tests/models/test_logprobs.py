"""Vocab-parallel log-probs/entropy (single rank) against a plain log_softmax, values and gradients."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_fp8rl.models.logprobs import token_logprobs_from_logits, vocab_parallel_logprobs


def _reference(logits, target, vocab_size):
    lsm = torch.log_softmax(logits[..., :vocab_size].double(), -1)
    lp = lsm.gather(-1, target[..., None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    return lp, ent


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), v=st.integers(2, 40), pad=st.integers(0, 7), scale=st.floats(0.1, 30.0),
       seed=st.integers(0, 10_000))
def test_matches_log_softmax_with_padding(n, v, pad, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v + pad, generator=g) * scale
    logits[:, v:] = 50.0  # padded columns must not leak into the softmax even when large
    target = torch.randint(0, v, (n,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, target, vocab_size=v, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, target, v)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5 * scale, rtol=1e-5)


def test_gradients_match_autograd_of_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 7, 11, generator=g) * 2).requires_grad_(True)
    target = torch.randint(0, 9, (4, 7), generator=g)
    w1, w2 = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    lp, ent = vocab_parallel_logprobs(logits, target, vocab_size=9, with_entropy=True)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref_lp, ref_ent = _reference(logits, target, 9)
    ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()
    torch.testing.assert_close(ours, logits.grad.float(), atol=1e-5, rtol=1e-5)
    assert ours[..., 9:].abs().max() == 0  # padded columns get no gradient


def test_gradcheck_float64():
    logits = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 3, 5])

    def f(z):
        lp, ent = vocab_parallel_logprobs(z, target, vocab_size=6, with_entropy=True)
        return lp, ent

    # The function computes in float32 internally, so use a loose gradcheck tolerance.
    assert torch.autograd.gradcheck(f, (logits,), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_token_alignment_temperature_and_column_zero():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 8, generator=g)
    tokens = torch.randint(0, 8, (2, 5), generator=g)
    lp, ent = token_logprobs_from_logits(logits, tokens, temperature=0.5, with_entropy=True)
    assert lp.shape == ent.shape == (2, 5)
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    ref = torch.log_softmax(logits / 0.5, -1)
    for b in range(2):
        for t in range(1, 5):
            assert lp[b, t].item() == pytest.approx(ref[b, t - 1, tokens[b, t]].item(), abs=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_logits(logits, tokens, temperature=0.0)


def test_uniform_logits_without_padding():
    # vocab_size=None on an unsplit vocabulary: every column counts; uniform logits give -log V.
    lp, ent = vocab_parallel_logprobs(torch.zeros(2, 4), torch.tensor([1, 2]), with_entropy=True)
    torch.testing.assert_close(lp, torch.full((2,), -torch.log(torch.tensor(4.0)).item()))
    torch.testing.assert_close(ent, torch.full((2,), torch.log(torch.tensor(4.0)).item()))
