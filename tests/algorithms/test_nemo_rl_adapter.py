import pytest
import torch

from nemo_fp8rl.algorithms import CalibratedClipping, ClippedPGLoss, metrics_to_floats

CFG = {
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "ratio_clip_c": None,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_ratio": None,
    "reference_policy_kl_penalty": 0.0,
    "reference_policy_kl_type": "k3",
    "token_level_loss": True,
}


def _data(seed=0, B=4, S=7):
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    gen = prev + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ref = prev + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    logp = prev + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone()
    token_mask = (torch.arange(S)[None] < torch.tensor([7, 4, 6, 2])[:, None]).long()
    token_mask[:, 0] = 0  # prompt token
    sample_mask = torch.tensor([1, 1, 0, 1])
    data = {
        "advantages": adv,
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_policy_logprobs": ref,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
    }
    return logp, data


def _nemo_rl_reference(logp, data, cfg, global_toks=None, global_seqs=None):
    """NeMo RL ClippedPGLossFn's documented formula, written out for the test."""
    sl = slice(1, None)
    lp, prev, gen, ref = (
        x[:, sl]
        for x in (logp, data["prev_logprobs"], data["generation_logprobs"], data["reference_policy_logprobs"])
    )
    adv = data["advantages"][:, sl]
    mask = data["token_mask"][:, sl] * data["sample_mask"][:, None]
    r = torch.exp(lp - prev)
    loss_tok = torch.max(-adv * r, -adv * r.clamp(1 - cfg["ratio_clip_min"], 1 + cfg["ratio_clip_max"]))
    if cfg.get("ratio_clip_c") is not None:
        loss_tok = torch.where(adv < 0, torch.min(loss_tok, -adv * cfg["ratio_clip_c"]), loss_tok)
    w = torch.ones_like(r)
    if cfg.get("use_importance_sampling_correction"):
        w = torch.exp(prev - gen)
        if cfg.get("truncated_importance_sampling_ratio") is not None:
            w = w.clamp(max=cfg["truncated_importance_sampling_ratio"])
    kl = torch.exp(ref - lp) - (ref - lp) - 1

    def agg(x):
        if cfg["token_level_loss"]:
            return (x * mask).sum() / (global_toks if global_toks is not None else mask.sum())
        per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return (per_seq * data["sample_mask"]).sum() / (
            global_seqs if global_seqs is not None else data["sample_mask"].sum()
        )

    return agg(w * loss_tok) + cfg["reference_policy_kl_penalty"] * agg(kl)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "ratio_clip_c": 3.0,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_ratio": 2.0,
            "reference_policy_kl_penalty": 0.05,
        },
    ],
)
def test_matches_nemo_rl_formula(token_level, extra):
    cfg = {**CFG, **extra, "token_level_loss": token_level}
    logp, data = _data()
    loss_fn = ClippedPGLoss(cfg)
    loss, metrics = loss_fn(logp, data)
    torch.testing.assert_close(loss, _nemo_rl_reference(logp, data, cfg), rtol=1e-10, atol=1e-12)
    assert loss_fn.loss_type == ("token_level" if token_level else "sequence_level")
    f = metrics_to_floats(metrics)
    assert {"clip/low_frac", "policy/ratio_mean", "mismatch/token_mult_prob_error", "policy/loss"} <= set(f)
    assert ("mismatch/is_ratio_max" in f) == bool(extra) and ("policy/ref_kl" in f) == bool(extra)


def test_global_counts_make_microbatches_sum_to_the_batch():
    cfg = {**CFG, "reference_policy_kl_penalty": 0.1}
    logp, data = _data(1)
    loss_fn = ClippedPGLoss(cfg)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    toks, seqs = mask.sum(), data["sample_mask"].sum()
    whole, _ = loss_fn(logp, data, global_valid_seqs=seqs, global_valid_toks=toks)
    parts = [loss_fn(logp[i], {k: v[i] for k, v in data.items()}, seqs, toks) for i in ([0, 1], [2, 3])]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole)
    torch.testing.assert_close(whole, _nemo_rl_reference(logp, data, cfg, global_toks=toks))
    assert parts[0][1]["policy/loss"][1] == "sum"


def test_logits_and_shifted_logprobs_inputs():
    g = torch.Generator().manual_seed(2)
    B, S, V = 4, 7, 11
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, S), generator=g)
    _, data = _data(2)
    data["input_ids"] = ids
    shifted = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss_fn = ClippedPGLoss(CFG)
    a, _ = loss_fn(logits, data)
    b, _ = loss_fn(shifted, data)
    c, _ = loss_fn(torch.cat([torch.zeros(B, 1, dtype=torch.float64), shifted], 1), data)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(b, c)
    with pytest.raises(ValueError, match="first argument has shape"):
        loss_fn(shifted[:, :3], data)


def test_loss_variants_map_to_registry():
    assert ClippedPGLoss({**CFG, "disable_ppo_ratio": True}).loss_name == "reinforce"
    gspo = ClippedPGLoss({**CFG, "sequence_level_importance_ratios": True, "token_level_loss": False})
    assert gspo.loss_name == "gspo" and gspo.agg_mode == "seq-mean-token-mean"
    icepop = ClippedPGLoss(
        {
            **CFG,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_ratio": 5.0,
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio_min": 0.5,
        }
    )
    assert icepop.correction == "icepop" and icepop.correction_kw == {"lo": 0.5, "hi": 5.0}
    assert ClippedPGLoss({**CFG, "use_importance_sampling_correction": True}).correction == "is"
    assert ClippedPGLoss({**CFG, "reference_policy_kl_penalty": 0.1, "use_kl_in_reward": True}).kl_coef == 0.0


def test_config_errors():
    with pytest.raises(ValueError, match="unknown ClippedPGLoss config keys"):
        ClippedPGLoss({**CFG, "ratio_clip": 0.2})
    with pytest.raises(ValueError, match="ratio_clip_min"):
        ClippedPGLoss({"ratio_clip_max": 0.2})
    with pytest.raises(ValueError, match="force_on_policy_ratio"):
        ClippedPGLoss({**CFG, "force_on_policy_ratio": True})
    with pytest.raises(ValueError, match="token_level_loss=False"):
        ClippedPGLoss({**CFG, "sequence_level_importance_ratios": True})
    with pytest.raises(ValueError, match="use_importance_sampling_correction=True"):
        ClippedPGLoss({**CFG, "truncated_importance_sampling_ratio": 2.0})
    with pytest.raises(ValueError, match="ratio_clip_c"):
        ClippedPGLoss({**CFG, "ratio_clip_c": 0.5})
    with pytest.raises(ValueError, match="reference_policy_kl_type"):
        ClippedPGLoss({**CFG, "reference_policy_kl_type": "k9"})
    with pytest.raises(ValueError, match="differ from ratio_clip_min"):
        ClippedPGLoss(CFG, calibration=CalibratedClipping(eps_low=0.2, eps_high=0.2))
    logp, data = _data()
    del data["sample_mask"]
    with pytest.raises(ValueError, match="sample_mask"):
        ClippedPGLoss(CFG)(logp, data)


def test_calibration_bounds_are_used_and_shadow_logprobs_observed():
    ctrl = CalibratedClipping(eps_low=0.2, eps_high=0.28, init_lower=0.7, init_upper=1.5, min_tokens=1)
    loss_fn = ClippedPGLoss(CFG, calibration=ctrl)
    logp, data = _data(3)
    _, m = loss_fn(logp, data)
    assert m["clip/lower"][0].item() == pytest.approx(0.7) and m["clip/upper"][0].item() == pytest.approx(1.5)
    assert ctrl._data is None  # no shadow log-probs: nothing observed
    data["hp_prev_logprobs"] = data["prev_logprobs"] + 0.01
    data["hp_logprobs"] = logp + 0.01
    loss_fn(logp, data)
    mask = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).bool()
    assert ctrl._data.shape[1] == int(mask.sum())
    out = metrics_to_floats(ctrl.update(0))
    assert out["calib/tokens"] == int(mask.sum()) and out["calib/false_clip_rate"] == 0.0
