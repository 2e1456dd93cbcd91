import math

import pytest
import torch

from nemo_fp8rl.algorithms import (
    AGG_MODES,
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    list_policy_losses,
    register_policy_loss,
)

L, H = 0.8, 1.28


def _hand_batch():
    # row 0: A = -1, ratios 0.5 (below L), 0.9, padding; row 1: A = +2, ratios 1.5 (above H), 1.1, 0.7
    r = torch.tensor([[0.5, 0.9, 1.0], [1.5, 1.1, 0.7]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]], dtype=torch.float64)
    logp = (old + r.log()).requires_grad_(True)
    adv = torch.tensor([-1.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logp, old, adv, mask


def test_registry_has_required_losses_and_rejects_unknown_and_duplicates():
    assert {"ppo_clip", "reinforce", "gspo"} <= set(list_policy_losses())
    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'.*ppo_clip"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo_clip")(lambda *a, **k: None)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", -4.46 / 5),
        ("seq-mean-token-mean", (1.7 / 2 - 6.16 / 3) / 2),
        ("seq-mean-token-sum", (1.7 - 6.16) / 2),
        ("seq-mean-token-sum-norm", (1.7 / 3 - 6.16 / 3) / 2),
    ],
)
def test_ppo_clip_hand_computed_values(mode, expected):
    # per token: max(-A r, -A clip(r)) = 0.8, 0.9 | -2.56, -2.2, -1.4
    logp, old, adv, mask = _hand_batch()
    loss, _metrics = get_policy_loss("ppo_clip")(logp, old, adv, mask, lower=L, upper=H, agg_mode=mode)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_ppo_clip_gradient_zero_exactly_on_clipped_tokens_and_metrics():
    logp, old, adv, mask = _hand_batch()
    loss, metrics = get_policy_loss("ppo_clip")(logp, old, adv, mask, lower=L, upper=H)
    loss.backward()
    # d l_t / d logp_t = -A r_t on unclipped tokens, / 5 valid tokens; 0 when clipped or padding
    expected = torch.tensor([[0.0, 0.9 / 5, 0.0], [0.0, -2 * 1.1 / 5, -2 * 0.7 / 5]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=0)
    f = {k: v[0].item() for k, v in metrics.items()}
    assert f["clip/low_frac"] == pytest.approx(1 / 2)
    assert f["clip/high_frac"] == pytest.approx(1 / 3)
    assert f["clip/dual_frac"] == 0.0
    assert f["policy/ratio_min"] == pytest.approx(0.5) and f["policy/ratio_max"] == pytest.approx(1.5)
    assert f["policy/ratio_mean"] == pytest.approx((0.5 + 0.9 + 1.5 + 1.1 + 0.7) / 5)
    k3 = sum(r - 1 - math.log(r) for r in (0.5, 0.9, 1.5, 1.1, 0.7)) / 5
    assert f["policy/approx_kl"] == pytest.approx(k3, rel=1e-5)
    assert (f["clip/lower"], f["clip/upper"]) == pytest.approx((L, H))
    assert {v[1] for k, v in metrics.items() if k.endswith("_min")} == {"min"}
    assert {v[1] for k, v in metrics.items() if k.endswith("_max")} == {"max"}


def test_dual_clip_caps_negative_advantage_loss():
    r = torch.tensor([[4.0, 2.0, 0.5]], dtype=torch.float64)
    logp = r.log().requires_grad_(True)
    old = torch.zeros_like(r)
    adv = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, metrics = get_policy_loss("ppo_clip")(
        logp, old, adv, None, lower=L, upper=H, dual_clip=3.0, agg_mode="seq-mean-token-sum"
    )
    # per token: min(max(4, 1.28), 3) = 3 ; min(2, 3) = 2 ; max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx(3.0 + 2.0 + 0.8)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=torch.float64))
    assert metrics["clip/dual_frac"][0].item() == pytest.approx(1 / 3)
    assert metrics["clip/low_frac"][0].item() == pytest.approx(1 / 3)


def _loop_reference(logp, old, adv, mask, lower, upper, c, weights, mode):
    """Readable per-token implementation of ppo_clip + agg_loss."""
    B, T = len(logp), len(logp[0])
    seq_losses, total, n_tok, n_seq = [], 0.0, 0, 0
    for b in range(B):
        s, cnt = 0.0, 0
        for t in range(T):
            if not mask[b][t]:
                continue
            r = math.exp(logp[b][t] - old[b][t])
            a = adv[b][t]
            lt = max(-a * r, -a * min(max(r, lower), upper))
            if c is not None and a < 0:
                lt = min(lt, -c * a)
            lt *= weights[b][t]
            s += lt
            cnt += 1
        total += s
        n_tok += cnt
        if cnt:
            n_seq += 1
            seq_losses.append(
                {
                    "seq-mean-token-mean": s / cnt,
                    "seq-mean-token-sum": s,
                    "seq-mean-token-sum-norm": s / T,
                }.get(mode, 0.0)
            )
    if mode == "token-mean":
        return total / n_tok
    return sum(seq_losses) / n_seq


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_ppo_clip_matches_readable_loop(mode, dual_clip):
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False  # a sequence without valid tokens
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    loss, _ = get_policy_loss("ppo_clip")(
        logp, old, adv, mask, lower=0.7, upper=1.3, dual_clip=dual_clip, weights=weights, agg_mode=mode
    )
    ref = _loop_reference(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.7, 1.3, dual_clip, weights.tolist(), mode
    )
    assert loss.item() == pytest.approx(ref, rel=1e-10)


def test_agg_loss_hand_values():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(0.5)
    # NaN in padding must not leak
    nan_mat = loss_mat.clone()
    nan_mat[1, 2] = float("nan")
    assert agg_loss(nan_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss_mat, torch.zeros_like(mask), "token-mean").item() == 0.0


def _layout_batch():
    g = torch.Generator().manual_seed(7)
    B, T = 8, 6
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 0])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logp, old, adv, mask


@pytest.mark.parametrize("loss_name", ["ppo_clip", "reinforce", "gspo"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_normalisation_makes_loss_and_grad_independent_of_split(loss_name, mode):
    logp, old, adv, mask = _layout_batch()
    fn = get_policy_loss(loss_name)
    kw = {
        "lower": 0.8,
        "upper": 1.28,
        "agg_mode": mode,
        "norm_len": 6,
        "global_tokens": int(mask.sum()),
        "global_seqs": int((mask.sum(-1) > 0).sum()),
    }
    results = []
    for n_chunks in (1, 2, 8):  # 1x8 == 2x4 == 8x1 (chunks = microbatches x DP ranks)
        lp = logp.clone().requires_grad_(True)
        total = 0.0
        for idx in torch.arange(8).chunk(n_chunks):
            loss, _ = fn(lp[idx], old[idx], adv[idx], mask[idx], **kw)
            total = total + loss
        total.backward()
        results.append((total.detach(), lp.grad))
    for tot, grad in results[1:]:
        torch.testing.assert_close(tot, results[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-12, atol=1e-12)
    # without the global counts the split changes the result (so the check above is not vacuous)
    if mode in ("token-mean", "seq-mean-token-mean"):
        local = (
            sum(
                fn(logp[i], old[i], adv[i], mask[i], lower=0.8, upper=1.28, agg_mode=mode)[0]
                for i in torch.arange(8).chunk(2)
            )
            / 2
        )
        assert not torch.isclose(local, results[0][0])


def test_weights_scale_per_token_and_are_detached():
    logp, old, adv, mask = _hand_batch()
    w = torch.tensor([[2.0, 0.5, 1.0], [0.0, 1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = get_policy_loss("ppo_clip")(
        logp, old, adv, mask, lower=L, upper=H, weights=w, agg_mode="seq-mean-token-sum"
    )
    assert loss.item() == pytest.approx(((2 * 0.8 + 0.5 * 0.9) + (0.0 - 2.2 - 3 * 1.4)) / 2)
    loss.backward()
    assert w.grad is None


def test_reinforce_is_minus_advantage_times_logp():
    logp, old, adv, mask = _hand_batch()
    loss, metrics = get_policy_loss("reinforce")(logp, old, adv, mask, lower=L, upper=H)
    lp = logp.detach()
    expected = (1 * (lp[0, 0] + lp[0, 1]) - 2 * (lp[1].sum())) / 5
    assert loss.item() == pytest.approx(expected.item())
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.2, 0.2, 0], [-0.4, -0.4, -0.4]], dtype=torch.float64)
    )
    assert metrics["clip/low_frac"][0].item() == 0 and metrics["policy/ratio_max"][0].item() == pytest.approx(
        1.5
    )


def test_gspo_matches_sequence_level_objective():
    logp, old, adv, mask = _layout_batch()
    eps_l, eps_h = 0.05, 0.06
    lp1 = logp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("gspo")(
        lp1, old, adv, mask, lower=1 - eps_l, upper=1 + eps_h, agg_mode="seq-mean-token-mean"
    )
    loss.backward()
    # direct sequence-level GSPO: s_i = exp(mean_t(logp - old)), l_i = max(-A s, -A clip(s)), mean over seqs
    lp2 = logp.clone().requires_grad_(True)
    valid = mask.sum(-1) > 0
    s = torch.exp(((lp2 - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    li = torch.maximum(-adv * s, -adv * s.clamp(1 - eps_l, 1 + eps_h))
    ref = li[valid].mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-8, atol=1e-12)
    # the ratio metrics are the sequence ratios
    assert metrics["policy/ratio_max"][0].item() == pytest.approx(s[valid].max().item())


def test_kl_penalty_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.1])
    ref = torch.tensor([-1.5, -1.0, -0.1])
    d = logp - ref
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(-d) - 1 + d)
    assert (kl_penalty(logp, ref, "k3") >= 0).all() and kl_penalty(logp, ref, "k3")[2] == 0
    torch.testing.assert_close(kl_penalty(logp, ref, "k1", input_clamp=0.4), d.clamp(-0.4, 0.4))
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3", output_clamp=10.0).item() == 10.0
    # k3 is an unbiased estimator of KL(p || q) when sampling from p
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.4, 0.4])
    exact = (p * (p / q).log()).sum()
    est = (p * kl_penalty(p.log(), q.log(), "k3")).sum()
    assert est.item() == pytest.approx(exact.item(), rel=1e-5)
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k4")


def test_entropy_from_logits_matches_categorical_and_handles_masked_vocab():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g)
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.distributions.Categorical(logits=logits).entropy()
    )
    masked = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert entropy_from_logits(masked).item() == pytest.approx(math.log(2))
    assert entropy_from_logits(torch.tensor([[100.0, 0.0]], dtype=torch.bfloat16)).dtype == torch.float32


def test_bad_inputs_raise_clear_errors():
    logp, old, adv, mask = _hand_batch()
    fn = get_policy_loss("ppo_clip")
    with pytest.raises(ValueError, match="lower"):
        fn(logp, old, adv, mask, lower=1.2, upper=H)
    with pytest.raises(ValueError, match="upper"):
        fn(logp, old, adv, mask, lower=L, upper=0.9)
    with pytest.raises(ValueError, match="dual_clip"):
        fn(logp, old, adv, mask, lower=L, upper=H, dual_clip=0.5)
    with pytest.raises(ValueError, match="old_logp has shape"):
        fn(logp, old[:, :2], adv, mask, lower=L, upper=H)
    with pytest.raises(ValueError, match="advantages"):
        fn(logp, old, adv[:1], mask, lower=L, upper=H)
    with pytest.raises(ValueError, match="mask"):
        fn(logp, old, adv, mask[:, :2], lower=L, upper=H)
    with pytest.raises(ValueError, match="agg_mode.*token-mean"):
        fn(logp, old, adv, mask, lower=L, upper=H, agg_mode="sum")
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        fn(logp[0], old[0], adv, mask[0], lower=L, upper=H)
    with pytest.raises(ValueError, match="global_tokens"):
        fn(logp, old, adv, mask, lower=L, upper=H, global_tokens=-3)


@pytest.mark.parametrize("name", ["ppo_clip", "reinforce", "gspo"])
def test_losses_never_sync_with_host(name, monkeypatch):
    logp, old, adv, mask = _hand_batch()

    def boom(*a, **k):
        raise AssertionError("host sync inside a loss")

    for attr in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, attr, boom)
    loss, metrics = get_policy_loss(name)(
        logp,
        old,
        adv,
        mask,
        lower=L,
        upper=H,
        dual_clip=3.0,
        global_tokens=torch.tensor(5),
        global_seqs=torch.tensor(2),
    )
    loss.backward()
    monkeypatch.undo()
    assert all(v[0].dim() == 0 and not v[0].requires_grad for v in metrics.values())
