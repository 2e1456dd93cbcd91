"""Our recipe -> Transformer Engine recipe mapping (nemo_fp8rl/fp8/te.py) on CPU.

TE cannot be installed without CUDA, so a stand-in ``transformer_engine`` package with the same recipe
dataclass shapes as TE 2.x (``Float8BlockScaling`` takes its ``QParams`` defaults from
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` once, when the class is defined) checks what we pass to it.
The real classes are exercised by the ``gpu`` tests and benchmarks/gpu/run.sh.
"""

import dataclasses
import enum
import sys
import types

import pytest

from nemo_fp8rl.fp8 import get_recipe


def _fake_te(fp32_scales_env: bool):
    class Format(enum.Enum):
        E4M3 = "e4m3"
        HYBRID = "hybrid"

    @dataclasses.dataclass(frozen=True)
    class QParams:
        power_2_scale: bool = False
        amax_epsilon: float = 0.0

    @dataclasses.dataclass
    class Float8BlockScaling:  # as in TE 2.x: the QParams are un-annotated class attributes, not fields
        use_f32_scales: bool = fp32_scales_env
        fp8_format: Format = Format.E4M3
        fp8_quant_fwd_inp = QParams(power_2_scale=not fp32_scales_env)
        fp8_quant_fwd_weight = QParams(power_2_scale=not fp32_scales_env)
        fp8_quant_bwd_grad = QParams(power_2_scale=not fp32_scales_env)

    @dataclasses.dataclass
    class Float8CurrentScaling:
        fp8_format: Format = Format.HYBRID

    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.QParams, recipe.Float8BlockScaling = Format, QParams, Float8BlockScaling
    recipe.Float8CurrentScaling = Float8CurrentScaling
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    te = types.ModuleType("transformer_engine")
    te.common, te.pytorch = common, types.ModuleType("transformer_engine.pytorch")
    return {"transformer_engine": te, "transformer_engine.common": common,
            "transformer_engine.common.recipe": recipe, "transformer_engine.pytorch": te.pytorch}


@pytest.fixture
def fake_te(monkeypatch):
    def install(fp32_scales_env: bool = False):
        for name, mod in _fake_te(fp32_scales_env).items():
            monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    return install


@pytest.mark.parametrize("pow2", [True, False])
def test_blockwise_scale_type_is_passed_not_left_to_te_defaults(fake_te, pow2):
    from nemo_fp8rl.fp8.te import te_recipe

    fake_te(fp32_scales_env=False)  # TE imported with power-of-two defaults
    r = te_recipe(get_recipe("blockwise").replace(pow2_scales=pow2))
    assert [q.power_2_scale for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad)] == [pow2] * 3
    assert r.use_f32_scales is (not pow2)
    # the class defaults (what Megatron's own Float8BlockScaling(fp8_format) gets) are untouched
    assert sys.modules["transformer_engine.common.recipe"].Float8BlockScaling.fp8_quant_fwd_inp.power_2_scale


def test_e5m2_is_refused_for_te(fake_te):
    from nemo_fp8rl.fp8.te import te_recipe

    fake_te()
    with pytest.raises(ValueError, match="emulation-only"):
        te_recipe(get_recipe("tensorwise").replace(fp8_format="e5m2"))


def test_megatron_path_refuses_a_scale_type_te_will_not_use(fake_te):
    from nemo_fp8rl.fp8.te import check_block_scale_env

    fake_te(fp32_scales_env=False)
    check_block_scale_env(get_recipe("blockwise"))  # pow2 recipe, pow2 defaults: fine
    check_block_scale_env(get_recipe("tensorwise"))  # not blockwise: nothing to check
    with pytest.raises(ValueError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 before the process starts"):
        check_block_scale_env(get_recipe("blockwise").replace(pow2_scales=False))
    fake_te(fp32_scales_env=True)
    with pytest.raises(ValueError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0"):
        check_block_scale_env(get_recipe("blockwise"))


@pytest.mark.parametrize("module", ["quantization", "fp8"])  # TE >= 2.9 / TE 2.0-2.8
def test_te_support_asks_te_where_this_version_keeps_its_checks(fake_te, monkeypatch, module):
    from nemo_fp8rl.fp8.te import te_support

    fake_te()
    checks = types.ModuleType(f"transformer_engine.pytorch.{module}")
    checks.check_fp8_support = lambda: (True, "")
    checks.check_mxfp8_support = lambda: (False, "MXFP8 (for all gemms) is only supported on Blackwell")
    monkeypatch.setitem(sys.modules, f"transformer_engine.pytorch.{module}", checks)
    assert te_support("tensorwise") == (True, "")
    assert te_support("mxfp8") == (False, "MXFP8 (for all gemms) is only supported on Blackwell")
    assert te_support("blockwise") == (False, "this Transformer Engine has no check_fp8_block_scaling_support")
    assert te_support("rowwise")[0] is False
