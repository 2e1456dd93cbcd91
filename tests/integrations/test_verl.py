"""The verl plugin against the real verl 0.9.1 (installed by `make install`, core_algos import deps only)."""

import copy

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

import nemo_fp8rl.integrations.verl as plugin
from nemo_fp8rl.algorithms import CalibratedClipping, calibrate_bounds
from nemo_fp8rl.fp8 import convert_to_fp8, disable_fp8, get_recipe

AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


@pytest.fixture(autouse=True)
def _fresh_controller(monkeypatch):
    monkeypatch.setattr(plugin, "_controller", plugin._UNSET)


def _config(mode="token-mean", low=0.2, high=0.28, **kw):
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=low,
        clip_ratio_high=high,
        loss_agg_mode=mode,
        policy_loss=PolicyLossConfig(loss_mode=plugin.LOSS_MODE),
        **kw,
    )
    return cfg


def _inputs(seed=0, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.35 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    adv[0, :3], logp[0, :3] = -4.0, old[0, :3] + 1.5  # ratio 4.5 > c = 3 with A < 0: the dual clip binds
    logp.requires_grad_(True)
    lengths = torch.tensor([9, 7, 1, 5, 9, 3])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    mask[2] = 0  # a fully masked sequence
    w = torch.rand(B, T, generator=g) * 2
    return old, logp, adv, mask, w


def _call(name, mode, cfg, old, logp, adv, mask, w):
    fn = get_policy_loss_fn(name)
    return fn(
        old_log_prob=old,
        log_prob=logp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        config=cfg,
        rollout_is_weights=w,
    )


def test_registered_in_verls_registry():
    cfg = _config()
    assert get_policy_loss_fn(cfg.policy_loss.loss_mode) is plugin.compute_policy_loss_calibrated_clip
    assert plugin.LOSS_MODE == "calibrated_clip"


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("calibration", ["off", "default"])
@pytest.mark.parametrize(
    "batch_info",
    [{}, {"dp_size": 2, "batch_num_tokens": 60, "global_batch_size": 11, "loss_scale_factor": 16}],
)
def test_calibration_off_equals_vanilla(mode, with_weights, calibration, batch_info):
    """No controller, or one never updated (nominal bounds): loss, gradient, verl's metrics are vanilla's."""
    if calibration == "off":
        plugin.set_calibration(None)
    old, logp, adv, mask, w = _inputs()
    w = w if with_weights else None
    out = {}
    for name in ("vanilla", plugin.LOSS_MODE):
        cfg = _config(mode)
        cfg.global_batch_info.update(batch_info)
        loss, metrics = _call(name, mode, cfg, old, logp, adv, mask, w)
        (grad,) = torch.autograd.grad(loss, logp)
        out[name] = (loss, grad, metrics)
    (l0, g0, m0), (l1, g1, m1) = out["vanilla"], out[plugin.LOSS_MODE]
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    torch.testing.assert_close(g1, g0, rtol=0, atol=0)
    for k, v in m0.items():
        assert m1[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert m0["actor/pg_clipfrac"] > 0 and m0["actor/pg_clipfrac_lower"] > 0  # the clips do bind here
    assert (m1["actor/clip_lower"], m1["actor/clip_upper"]) == pytest.approx((0.8, 1.28))


def _toy_policy(V=32, d=48, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(V, d),
        torch.nn.Linear(d, d),
        torch.nn.GELU(),
        torch.nn.Linear(d, d),
        torch.nn.GELU(),
        torch.nn.Linear(d, V),
    )


def _logprob_fn(model):
    def fn(tokens):
        with torch.no_grad():
            logits = model(tokens[:, :-1]).float()
            return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    return fn


def test_calibration_on_uses_calibrate_bounds_of_the_same_tokens():
    g = torch.Generator().manual_seed(3)
    B, T, V = 16, 25, 32
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T - 1).clone()
    mask = torch.ones(B, T - 1)
    mask[::3, 15:] = 0
    bf16 = _toy_policy(V)
    fp8 = convert_to_fp8(copy.deepcopy(bf16), get_recipe("tensorwise"))
    ctrl = CalibratedClipping(eps_low=0.2, eps_high=0.28, min_tokens=16, upper_mode="balance")
    plugin.set_calibration(ctrl)
    hook = plugin.ShadowRatioHook(ctrl, fp8)
    step = 0
    assert hook.should_calibrate(step)

    lp_fn = _logprob_fn(fp8)
    old = lp_fn(tokens)  # verl's old_log_prob pass (FP8)
    hp_old = hook.old_pass(lp_fn, tokens)
    torch.testing.assert_close(
        hp_old, _logprob_fn(bf16)(tokens), rtol=1e-6, atol=1e-6
    )  # FP8 off, same weights
    assert not torch.allclose(hp_old, old, atol=1e-3)  # and the FP8 forward does differ
    rs, rhos = [], []
    for k, rows in enumerate((slice(0, 8), slice(8, 16))):
        with torch.no_grad():  # the "update" of the previous minibatch, applied to both copies
            for p_bf16, p_fp8 in zip(bf16.parameters(), fp8.parameters()):
                step_k = 0.05 * torch.randn(p_bf16.shape, generator=g)
                p_bf16.add_(step_k)
                p_fp8.add_(step_k)
        hook.observe_minibatch(
            lp_fn,
            tokens[rows],
            old_log_prob=old[rows],
            hp_old_log_prob=hp_old[rows],
            advantages=adv[rows],
            response_mask=mask[rows],
            step=step,
        )
        rs.append(torch.exp(lp_fn(tokens[rows]) - old[rows]))
        with disable_fp8(fp8):
            rhos.append(torch.exp(lp_fn(tokens[rows]) - hp_old[rows]))
    metrics = hook.update(step)
    want = calibrate_bounds(
        torch.cat(rs),
        torch.cat(rhos),
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.28,
        upper_mode="balance",
        min_tokens=16,
    )
    assert not want.skipped and (want.lower, want.upper) != pytest.approx((0.8, 1.28))  # bounds moved
    assert ctrl.bounds == (want.lower, want.upper)
    assert metrics["calib/tokens"][0].item() == int(mask.sum())

    # the loss now clips at the calibrated bounds: equal to vanilla with those epsilons
    old2, logp, adv2, mask2, w = _inputs(seed=1)
    mine, m = _call(plugin.LOSS_MODE, "token-mean", _config(), old2, logp, adv2, mask2, w)
    ref, _ = _call(
        "vanilla", "token-mean", _config(low=1 - want.lower, high=want.upper - 1), old2, logp, adv2, mask2, w
    )
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0)
    assert (m["actor/clip_lower"], m["actor/clip_upper"]) == (want.lower, want.upper)
    nominal, _ = _call("vanilla", "token-mean", _config(), old2, logp, adv2, mask2, w)
    assert abs(mine.item() - nominal.item()) > 1e-6


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="CalibratedClipping or None"):
        plugin.set_calibration(object())
    plugin.set_calibration(CalibratedClipping(eps_low=0.2, eps_high=0.2))
    old, logp, adv, mask, w = _inputs()
    with pytest.raises(ValueError, match="clip_ratio_low/high"):
        _call(plugin.LOSS_MODE, "token-mean", _config(high=0.28), old, logp, adv, mask, w)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        _call(plugin.LOSS_MODE, "token-mean", _config(high=0.2, clip_ratio_c=1.0), old, logp, adv, mask, w)
    with pytest.raises(ValueError, match="modules is empty"):
        plugin.ShadowRatioHook(CalibratedClipping(eps_low=0.2, eps_high=0.2), [])


def test_example_runs_with_the_real_verl_registry():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "verl_calibrated_clip.py"
    spec = importlib.util.spec_from_file_location("verl_calibrated_clip", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    history = ex.run(steps=2, interval=1, verbose=False)
    assert history[0]["calib/tokens"] > 0 and history[1]["calib/skipped"] == 0
    assert (history[0]["actor/clip_lower"], history[0]["actor/clip_upper"]) == pytest.approx((0.8, 1.28))
    # step 1 trains with the bounds step 0's calibration set
    ctrl = plugin.get_calibration()
    assert ctrl.last_result is not None
    assert history[1]["actor/clip_lower"] != pytest.approx(0.8) or history[1][
        "actor/clip_upper"
    ] != pytest.approx(1.28)
