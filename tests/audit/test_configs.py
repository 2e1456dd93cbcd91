"""Configuration names -> what the audit scores, the overrides it recommends, and the errors for bad names."""

import pytest

from nemo_fp8rl.audit.configs import DEFAULT_LADDER, parse_config, parse_configs
from nemo_fp8rl.audit.recommend import recommend
from nemo_fp8rl.audit.settings import AuditRunConfig, check_audit_config
from nemo_fp8rl.config.schema import ConfigError


def _cfg(**rollout_fp8):
    cfg = AuditRunConfig()
    for k, v in rollout_fp8.items():
        setattr(cfg.rollout.fp8, k, v)
    return cfg


def test_ladder_and_modifiers():
    cfg = _cfg()
    lin, st, cal, edge = (parse_config(n, cfg, 30) for n in DEFAULT_LADDER)
    assert (lin.scheme, lin.kv_cache, lin.edge) == ("vllm_w8a8", "off", (0, 0))
    assert (st.kv_cache, st.kv_scales, cal.kv_scales, edge.kv_scales) == ("e4m3", "static", "calibrated", "calibrated")
    assert edge.edge == (1, 1) and edge.high_precision_layers(30) == (0, 29)
    assert parse_config("kv_static+edge:2", cfg, 30).high_precision_layers(30) == (0, 1, 28, 29)
    assert parse_config("kv_static+edge:0:3", cfg, 30).edge == (0, 3)
    c = parse_config("kvonly_calibrated+kv:e5m2+kernel:cpu", cfg, 30)
    assert (c.scheme, c.kv_cache, c.kv_scales, c.kv_kernel) == ("off", "e5m2", "calibrated", "cpu")
    assert parse_config("linear+scheme:vllm_block", cfg, 30).scheme == "vllm_block"
    assert cal.overrides() == ["rollout.fp8.scheme=vllm_w8a8", "rollout.fp8.kv_cache=e4m3",
                               "rollout.fp8.kv_scales=calibrated", "rollout.fp8.num_layers_at_start_in_bf16=0",
                               "rollout.fp8.num_layers_at_end_in_bf16=0"]
    # the command line's rollout.fp8 fills the defaults: edge from its edge keys, the scheme, the format
    cfg2 = _cfg(scheme="vllm_block", kv_cache="e5m2", kv_scales="calibrated", num_layers_at_start_in_bf16=2)
    assert parse_config("kv_static+edge", cfg2, 30).edge == (2, 0)
    assert parse_config("kv_static", cfg2, 30).kv_cache == "e5m2"
    r = parse_config("rollout", cfg2, 30)
    assert (r.scheme, r.kv_cache, r.kv_scales, r.edge) == ("vllm_block", "e5m2", "calibrated", (2, 0))


def test_training_configurations():
    cfg = _cfg()
    t = parse_config("train:blockwise", cfg, 30)
    assert (t.side, t.recipe, t.overrides()) == ("train", "blockwise", ["fp8=blockwise"])
    cfg.fp8.recipe = "tensorwise"
    assert parse_config("train", cfg, 30).recipe == "tensorwise"
    assert [c.name for c in parse_configs(cfg, 30)] == [*DEFAULT_LADDER, "train"]
    cfg.fp8.recipe = None
    assert [c.name for c in parse_configs(cfg, 30)] == list(DEFAULT_LADDER)


@pytest.mark.parametrize("name, match", [
    ("kv_statik", r"audit.configs: unknown configuration 'kv_statik'.*rollout bases.*e\.g\. audit.configs=\["),
    ("kv_static+edgy", r"unknown modifier 'edgy'"),
    ("kv_static+edge:x", r"edge:N must be an integer"),
    ("linear+kv:e5m2", r"keeps the cache in high precision; use kv_static\+kv:e5m2"),
    ("linear+scheme:fp4", r"unknown rollout scheme 'fp4'"),
    ("kv_static+edge:20", r"exceed the model's 30 layers"),
    ("train:fp4", r"unknown training recipe 'fp4'.*train:blockwise"),
    ("train:delayed", r"delayed scaling .* audit train:tensorwise"),
    ("train", r"fp8=off; pass fp8=RECIPE"),
    ("train:blockwise+edge", r"takes no modifiers"),
])
def test_bad_names_are_refused_naming_the_key_and_the_fix(name, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(name, _cfg(), 30)


def test_duplicates_and_bad_audit_keys():
    cfg = _cfg()
    cfg.audit.configs = ["linear", "linear"]
    with pytest.raises(ConfigError, match=r"audit.configs names \['linear'\] twice"):
        parse_configs(cfg, 30)
    cfg.audit.position_buckets = [5, 10]
    with pytest.raises(ConfigError, match="audit.position_buckets"):
        check_audit_config(cfg.audit)
    cfg.audit.position_buckets = [0, 10]
    cfg.audit.eos = "skip"
    with pytest.raises(ConfigError, match=r"audit.eos='skip' is not valid; choose one of \['ignore', 'suppress', 'stop'\]"):
        check_audit_config(cfg.audit)


def _res(clip, low):
    return {"tokens": 100, "noise_clip": clip, "noise_clip_low": low}


def test_recommendation_rule():
    cfg = _cfg()
    cfg.fp8.recipe = "tensorwise"
    cs = [parse_config(n, cfg, 30) for n in (*DEFAULT_LADDER, "train:blockwise", "train")]
    res = [_res(0.010, 0.004), _res(0.030, 0.015), _res(0.013, 0.006), _res(0.012, 0.002), _res(0.02, 0.01),
           _res(0.01, 0.005)]
    rec = recommend(res, cs, max_extra_clip=0.005, calibrate_above=0.001, fp8_recipe="tensorwise")
    # within 0.010 + 0.005: linear, kv_calibrated, kv_calibrated+edge; most FP8: kv_calibrated (KV on, no edges)
    assert rec["rollout"] == "kv_calibrated" and rec["train"] == "train"
    assert rec["overrides"][0] == "fp8=tensorwise" and rec["overrides"][-1] == "calibration=paper"
    rec = recommend(res, cs, max_extra_clip=0.0, calibrate_above=0.01, fp8_recipe="tensorwise")
    assert rec["rollout"] == "linear" and rec["overrides"][-1] == "calibration=off"
    # with a training recipe audited, calibration follows the chosen pair's ratio (both sides' noise)
    rec = recommend(res, cs, max_extra_clip=0.005, calibrate_above=0.001, fp8_recipe="tensorwise",
                    pair=lambda t, r: {"train": t, "rollout": r, "noise_clip_low": 0.0005})
    assert rec["pair"]["rollout"] == "kv_calibrated" and rec["overrides"][-1] == "calibration=off"
    # fp8=off and no recipe audited: the rollout's FP8 needs training FP8, so fp8=auto leads the line
    rec = recommend(res[:4], cs[:4], max_extra_clip=0.005, calibrate_above=0.001, fp8_recipe=None)
    assert rec["overrides"][0] == "fp8=auto" and rec["train"] is None


def test_layer_ranking_target():
    """Default: the rollout configuration with the most in FP8 and no edge layers (the last of ties)."""
    from nemo_fp8rl.audit.run import _rank_target

    cfg = _cfg()
    cs = [parse_config(n, cfg, 30) for n in ("linear", "kv_static", "kv_calibrated+edge", "kvonly_static",
                                             "kv_calibrated", "train:blockwise")]
    assert _rank_target(cs, None).name == "kv_calibrated"
    assert _rank_target(cs, "linear").name == "linear"
    with pytest.raises(ConfigError, match="audit.rank_config='train:blockwise' is a training configuration"):
        _rank_target(cs, "train:blockwise")
    with pytest.raises(ConfigError, match=r"audit.rank_config='nope' is not in audit.configs"):
        _rank_target(cs, "nope")
    assert _rank_target(cs[-1:], None) is None


def test_the_audit_samples_with_the_runs_stop_strings_only_where_it_stops():
    """audit.eos=stop samples as training does: at the end-of-turn token and at rollout.stop's strings; ignore and
    suppress run to audit.response_len, so no stop string applies."""
    from nemo_fp8rl.audit.run import audit_sampling_params
    from nemo_fp8rl.audit.settings import AuditRunConfig

    cfg = AuditRunConfig()
    cfg.rollout.stop = ["</answer>"]
    got = {}
    for eos in ("ignore", "suppress", "stop"):
        cfg.audit.eos = eos
        got[eos] = audit_sampling_params(cfg)
    assert got["stop"].stop == ("</answer>",) and got["stop"].stop_on_eos
    assert got["ignore"].stop == got["suppress"].stop == () and not got["ignore"].stop_on_eos
    assert got["stop"].max_new_tokens == cfg.audit.response_len
