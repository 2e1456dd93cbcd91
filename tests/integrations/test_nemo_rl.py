"""The NeMo RL drop-in against golden values of NeMo RL's own ClippedPGLossFn (nemo_rl_golden.json, written
by make_nemo_rl_fixture.py from the pinned commit), plus the NeMo RL calling conventions."""

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_fp8rl.algorithms import CalibratedClipping, calibrate_bounds, rollout_correction
from nemo_fp8rl.integrations import nemo_rl
from nemo_fp8rl.integrations.nemo_rl import (
    NEMO_RL_COMMIT,
    ClippedPGLossFn,
    LossInputType,
    LossType,
    clipped_pg_loss,
)

FIXTURE = json.loads(Path(__file__).with_name("nemo_rl_golden.json").read_text())
F64 = torch.float64
# NeMo RL's GSPO sampling_importance_ratio broadcasts [B, 1] weights against the [B] sample mask (module
# docstring of nemo_fp8rl.integrations.nemo_rl); ours is the mean weight it names.
KNOWN_METRIC_DIFFERENCES = {
    ("gspo", "sampling_importance_ratio"),
    ("gspo_is_tis", "sampling_importance_ratio"),
}


def _inputs(requires_grad=True):
    inp = FIXTURE["inputs"]
    data = {k: torch.tensor(v, dtype=F64) for k, v in inp.items() if k != "next_token_logprobs"}
    lp = torch.tensor(inp["next_token_logprobs"], dtype=F64, requires_grad=requires_grad)
    return data, lp


def _globals():
    return torch.tensor(FIXTURE["global_valid_seqs"], dtype=F64), torch.tensor(
        FIXTURE["global_valid_toks"], dtype=F64
    )


def _run(loss_fn, data, lp, seqs=None, toks=None):
    if seqs is None:
        seqs, toks = _globals()
    return loss_fn(data=data, global_valid_seqs=seqs, global_valid_toks=toks, next_token_logprobs=lp)


def test_fixture_comes_from_the_pinned_commit():
    assert FIXTURE["nemo_rl_commit"] == NEMO_RL_COMMIT
    assert len(FIXTURE["cases"]) >= 20


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_matches_nemo_rl_golden(name):
    case = FIXTURE["cases"][name]
    loss_fn = ClippedPGLossFn(case["config"])
    data, lp = _inputs()
    loss, metrics = _run(loss_fn, data, lp)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(case["loss"], dtype=F64), rtol=1e-6, atol=0)
    g = torch.tensor(case["grad"], dtype=F64)
    assert (lp.grad - g).abs().max() <= 1e-6 * g.abs().max()
    assert loss_fn.loss_type.value == case["loss_type"] and loss_fn.input_type.value == case["input_type"]
    assert {
        k: v.value for k, v in loss_fn.metric_normalizations.items() if k in case["metric_normalizations"]
    } == (case["metric_normalizations"])
    assert set(case["metrics"]) <= set(metrics)
    for k, want in case["metrics"].items():
        assert isinstance(metrics[k], (int, float)), k
        if (name, k) not in KNOWN_METRIC_DIFFERENCES:
            assert metrics[k] == pytest.approx(want, rel=1e-6, abs=1e-9), k


def test_kl_gradient_carries_the_score_function_term():
    """d/d lp of beta exp(lp - sg(lp)) k3 is beta (k3 + dk3/dlp): without the weight the grad differs."""
    data, lp = _inputs()
    beta = 0.1
    loss_fn = ClippedPGLossFn(
        {"reference_policy_kl_penalty": beta, "kl_input_clamp_value": None, "kl_output_clamp_value": None}
    )
    no_kl = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    _, toks = _globals()
    (g_all,) = torch.autograd.grad(_run(loss_fn, data, lp)[0], lp)
    (g_pg,) = torch.autograd.grad(_run(no_kl, data, lp)[0], lp)
    ref = data["reference_policy_logprobs"][:, 1:]
    d = lp.detach() - ref
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    k3, dk3 = torch.exp(-d) - 1 + d, 1 - torch.exp(-d)
    torch.testing.assert_close(g_all - g_pg, beta * mask * (k3 + dk3) / toks, rtol=1e-9, atol=1e-12)


def test_nemo_rl_call_conventions_and_typed_config():
    # the loss_fn section of NeMo RL's examples/configs/grpo_math_1B.yaml at the pinned commit
    grpo_math_1b = {
        "reference_policy_kl_penalty": 0.01,
        "reference_policy_kl_type": "k3",
        "kl_input_clamp_value": 20.0,
        "kl_output_clamp_value": 10.0,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2,
        "ratio_clip_c": None,
        "use_on_policy_kl_approximation": False,
        "use_importance_sampling_correction": False,
        "truncated_importance_sampling_type": None,
        "truncated_importance_sampling_ratio": None,
        "truncated_importance_sampling_ratio_min": None,
        "sequence_level_importance_ratios": False,
        "token_level_loss": True,
        "force_on_policy_ratio": False,
        "use_kl_in_reward": False,
        "use_cispo": False,
        "disable_ppo_ratio": False,
        "positive_example_nll_weight": 0.0,
    }
    data, lp = _inputs()
    want = FIXTURE["cases"]["defaults"]["loss"]

    class Typed:  # NeMo RL passes its pydantic ClippedPGLossConfig
        def model_dump(self):
            return dict(grpo_math_1b)

    for cfg in (grpo_math_1b, Typed(), SimpleNamespace(**grpo_math_1b)):
        loss_fn = ClippedPGLossFn(cfg, use_fused_linear_logprobs=True)
        assert loss_fn.input_type == LossInputType.LOGPROB and loss_fn.loss_type == LossType.TOKEN_LEVEL
        assert loss_fn.use_fused_linear_logprobs and loss_fn.reference_policy_kl_penalty == 0.01
        assert _run(loss_fn, data, lp)[0].item() == pytest.approx(want, rel=1e-6)
    # picklable (NeMo RL ships the loss to its Ray workers)
    clone = pickle.loads(pickle.dumps(ClippedPGLossFn(grpo_math_1b)))
    assert _run(clone, data, lp)[0].item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", ["defaults", "sequence_level", "tis", "seq_mask_tis", "gspo_is_tis"])
def test_microbatch_metrics_sum_to_the_global_batch(name):
    """The NeMo RL loop sums each metric over microbatches: with global counts, two halves add up."""
    cfg = FIXTURE["cases"][name]["config"]
    loss_fn = ClippedPGLossFn(cfg)
    data, lp = _inputs(requires_grad=False)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    seqs, toks = data["sample_mask"].sum(), mask.sum()
    whole_loss, whole = _run(loss_fn, data, lp, seqs, toks)
    parts = [_run(loss_fn, {k: v[i] for k, v in data.items()}, lp[i], seqs, toks) for i in ([0, 1], [2, 3])]
    assert parts[0][0].item() + parts[1][0].item() == pytest.approx(whole_loss.item(), rel=1e-9)
    norm = loss_fn.metric_normalizations
    for k, v in whole.items():
        if norm.get(k) is not None and norm[k].value in ("tokens", "sequences") or k == "num_valid_samples":
            assert parts[0][1][k] + parts[1][1][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    lo, hi = loss_fn.bounds
    assert whole["clip/lower"] == pytest.approx(lo) and whole["clip/upper"] == pytest.approx(hi)


def test_calibrated_bounds_are_the_only_difference():
    """Bounds (0.8, 1.28) in force with ratio_clip_max 0.2 give NeMo RL's loss at ratio_clip_max 0.28."""
    golden = FIXTURE["cases"]["dapo_clip_higher"]
    ctrl = CalibratedClipping(eps_low=0.2, eps_high=0.2, init_upper=1.28)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0}, calibration=ctrl)
    data, lp = _inputs()
    loss, m = _run(loss_fn, data, lp)
    loss.backward()
    assert loss.item() == pytest.approx(golden["loss"], rel=1e-9)
    torch.testing.assert_close(lp.grad, torch.tensor(golden["grad"], dtype=F64), rtol=1e-9, atol=1e-12)
    assert m["probs_ratio_clamped_max"] == pytest.approx(
        golden["metrics"]["probs_ratio_clamped_max"], rel=1e-12
    )
    nominal = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    assert _run(nominal, data, lp)[0].item() != pytest.approx(golden["loss"], rel=1e-6)


def test_observe_shadow_then_update_sets_calibrate_bounds():
    data, _ = _inputs()
    g = torch.Generator().manual_seed(5)
    prev = data["prev_logprobs"]
    drift = 0.2 * torch.randn(prev.shape, generator=g, dtype=F64)  # the true update, seen by both
    lp_fp8 = prev + drift + 0.2 * torch.randn(prev.shape, generator=g, dtype=F64)  # plus FP8 noise
    hp_prev = prev + 0.01 * torch.randn(prev.shape, generator=g, dtype=F64)
    hp = hp_prev + drift + 0.01 * torch.randn(prev.shape, generator=g, dtype=F64)
    loss_fn = ClippedPGLossFn({"calibration": {"min_tokens": 4, "upper_mode": "quantile"}})
    assert loss_fn.bounds == pytest.approx((0.8, 1.2))
    loss_fn.observe_shadow(data, logprobs=lp_fp8, hp_logprobs=hp, hp_prev_logprobs=hp_prev, step=0)
    loss_fn.calibration.update(0)
    mask = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]) != 0
    want = calibrate_bounds(
        torch.exp(lp_fp8 - prev)[:, 1:],
        torch.exp(hp - hp_prev)[:, 1:],
        data["advantages"][:, 1:],
        mask,
        eps_low=0.2,
        eps_high=0.2,
        upper_mode="quantile",
        min_tokens=4,
    )
    assert not want.skipped and (want.lower, want.upper) != (0.8, 1.2)
    assert loss_fn.bounds == (want.lower, want.upper)
    _, m = _run(loss_fn, data, _inputs()[1])
    share = mask.sum().item() / FIXTURE["global_valid_toks"]
    assert m["clip/lower"] == pytest.approx(want.lower * share) and m["clip/upper"] == pytest.approx(
        want.upper * share
    )


def test_calibration_off_and_not_for_sequence_or_unclipped_losses():
    assert ClippedPGLossFn({"calibration": False}).calibration is None
    assert ClippedPGLossFn({}).calibration is not None
    for cfg in (
        {"disable_ppo_ratio": True},
        {"force_on_policy_ratio": True},
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
    ):
        assert ClippedPGLossFn(cfg).calibration is None
        with pytest.raises(ValueError, match="loss_fn.calibration: this loss clips no token ratio"):
            ClippedPGLossFn({**cfg, "calibration": {"interval": 10}})


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"ratio_clip": 0.2}, r"unknown loss_fn keys \['ratio_clip'\]"),
        (
            {"truncated_importance_sampling_ratio": 2.0},
            "loss_fn.truncated_importance_sampling_type: .*set the type",
        ),
        (
            {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
            "loss_fn.use_importance_sampling_correction",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 2.0,
            },
            "loss_fn.truncated_importance_sampling_ratio_min",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis2",
                "truncated_importance_sampling_ratio": 2.0,
            },
            "must be one of",
        ),
        (
            {"use_cispo": True, "ratio_clip_c": 3.0},
            "loss_fn.ratio_clip_c: use_cispo: true needs ratio_clip_c: null",
        ),
        ({"use_cispo": True, "token_level_loss": False}, "loss_fn.token_level_loss"),
        ({"sequence_level_importance_ratios": True}, "loss_fn.sequence_level_importance_ratios: GSPO needs"),
        ({"ratio_clip_c": 0.5}, "loss_fn.ratio_clip_c"),
        ({"reference_policy_kl_type": "k9"}, "loss_fn.reference_policy_kl_type"),
        ({"calibration": {"eps_low": 0.1}}, "loss_fn.calibration.eps_low"),
        ({"calibration": {"intervall": 3}}, "loss_fn.calibration: .*intervall"),
        ({"calibration": {"ema": 2.0}}, "loss_fn.calibration: ema"),
    ],
)
def test_config_errors_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        ClippedPGLossFn(cfg)


def test_controller_eps_must_match_and_shapes_are_checked():
    with pytest.raises(ValueError, match="differ from ratio_clip_min/max"):
        ClippedPGLossFn({}, calibration=CalibratedClipping(eps_low=0.2, eps_high=0.28))
    data, lp = _inputs()
    with pytest.raises(ValueError, match="next_token_logprobs has shape"):
        _run(ClippedPGLossFn({}), data, lp[:, 1:])


def test_imports_no_framework():
    """Pure torch (NeMo RL only for its enums, when installed): usable from any NeMo RL environment."""
    import subprocess
    import sys

    code = (
        "import sys, nemo_fp8rl.integrations.nemo_rl\n"
        "bad = {m.split('.')[0] for m in sys.modules} & {'megatron', 'transformer_engine', 'hydra', 'verl'}\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_loss_function_never_syncs_to_the_host(name, monkeypatch):
    """clipped_pg_loss returns detached 0-dim metric tensors; .item()/float()/bool() on a tensor would raise."""
    loss_fn = ClippedPGLossFn(FIXTURE["cases"][name]["config"])
    data, lp = _inputs()
    seqs, toks = _globals()
    lower, upper = loss_fn.bounds

    def sync(*_args, **_kwargs):
        raise AssertionError("host sync inside the loss")

    for attr in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, attr, sync)
    loss, metrics = clipped_pg_loss(loss_fn.config, lp, data, seqs, toks, lower=lower, upper=upper)
    monkeypatch.undo()
    assert loss.requires_grad and loss.dim() == 0
    assert set(metrics) == set(_run(loss_fn, data, lp)[1])
    for k, (t, red) in metrics.items():
        assert t.dim() == 0 and not t.requires_grad, k
        assert red == ("min" if k.endswith("_min") else "max" if k.endswith("_max") else "sum"), k


def test_nemo_rl_attributes_read_the_parsed_config():
    loss_fn = ClippedPGLossFn({"ratio_clip_max": 0.28, "use_kl_in_reward": True, "token_level_loss": False})
    assert (loss_fn.ratio_clip_min, loss_fn.ratio_clip_max, loss_fn.ratio_clip_c) == (0.2, 0.28, None)
    assert loss_fn.reference_policy_kl_penalty == 0.0 and loss_fn.loss_type == LossType.SEQUENCE_LEVEL
    with pytest.raises(AttributeError):
        loss_fn.ratio_clip_max = 0.3  # validated once at construction: build a new loss instead


@pytest.mark.parametrize(
    ("ttype", "kw", "rc_kw"),
    [
        (None, {}, {"mode": "is"}),
        ("tis", {"truncated_importance_sampling_ratio": 1.2}, {"mode": "tis", "cap": 1.2}),
        (
            "icepop",
            {"truncated_importance_sampling_ratio": 1.3, "truncated_importance_sampling_ratio_min": 0.8},
            {"mode": "icepop", "lo": 0.8, "hi": 1.3},
        ),
    ],
)
def test_importance_weights_are_rollout_correction_where_nemo_rl_agrees(ttype, kw, rc_kw):
    """With finite log-ratios inside +-20, NeMo RL's token weights equal algorithms.rollout_correction's
    bit for bit; the plug-in keeps its own because NeMo RL differs outside (module docstring)."""
    cfg = ClippedPGLossFn(
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": ttype, **kw}
    ).config
    data, _ = _inputs(requires_grad=False)
    prev, gen = data["prev_logprobs"][:, 1:], data["generation_logprobs"][:, 1:]
    tm, sm = data["token_mask"][:, 1:], data["sample_mask"]
    valid = (tm * sm[:, None]) != 0

    def ours(prev, gen):
        return nemo_rl._importance_weights(cfg, prev, gen, valid, tm, sm, None, None)[0]

    want, _ = rollout_correction(prev, gen, valid, **rc_kw)
    assert torch.equal(torch.where(valid, ours(prev, gen), 0.0), want)
    # outside: the rollout engine gave the token probability 0 (NeMo RL: weight 0; rollout_correction
    # clamps the log-ratio to 20), and the trainer finds it e^-25 times less likely (no clamp in NeMo RL)
    gen2, prev2 = gen.clone(), prev.clone()
    gen2[0, 2], prev2[0, 3] = float("-inf"), gen[0, 3] - 25.0
    w = ours(prev2, gen2)
    assert w[0, 2] == 0.0
    if ttype != "icepop":
        assert w[0, 3] == pytest.approx(torch.exp(torch.tensor(-25.0, dtype=F64)).item(), rel=1e-9)
