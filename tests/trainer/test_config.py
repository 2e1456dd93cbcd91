"""Config schema validation: bad values are rejected with the key and the fix."""

import dataclasses

import pytest

from nemo_fp8rl.config.schema import ConfigError, TrainConfig
from nemo_fp8rl.fp8.recipes import build_fp8_recipe
from nemo_fp8rl.validation import validate


def cfg_with(**changes):
    cfg = TrainConfig()
    for dotted, value in changes.items():
        obj = cfg
        *path, leaf = dotted.split("__")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


@pytest.mark.parametrize("changes,needle", [
    ({"algorithm__eps_low": 1.0}, "algorithm.eps_low=1.0"),
    ({"algorithm__eps_high": 0.0}, "algorithm.eps_high"),
    ({"algorithm__group_size": 1}, "algorithm.group_size=1"),
    ({"algorithm__minibatches_per_step": 3}, "minibatches_per_step=3 must divide"),
    ({"algorithm__dual_clip": 0.5}, "algorithm.dual_clip"),
    ({"algorithm__agg_mode": "mean"}, "algorithm.agg_mode='mean'"),
    ({"fp8__recipe": "fp4"}, "fp8.recipe='fp4' is unknown"),
    ({"fp8__recipe": "delayed", "fp8__first_last_layers_bf16": True}, "set fp8.first_last_layers_bf16=false"),
    ({"fp8__recipe": "tensorwise", "fp8__amax_compute_algo": "avg"}, "fp8.amax_compute_algo='avg'"),
    ({"fp8__recipe": "blockwise", "fp8__accumulation": "tf32"}, "fp8.accumulation='tf32'"),
    ({"rollout__fp8__scheme": "int8"}, "rollout.fp8.scheme"),
    ({"calibration__enabled": True}, "calibration is on but training FP8 is off"),
    ({"calibration__upper_mode": "up"}, "calibration.upper_mode"),
    ({"calibration__lower_min": 0.9}, "calibration.lower_min=0.9"),
    ({"parallel__tensor_model_parallel_size": 3}, "must divide model.num_attention_heads=4"),
    ({"parallel__pipeline_model_parallel_size": 2}, "must divide model.num_layers=3"),
    ({"model__num_query_groups": 3}, "multiple of model.num_query_groups=3"),
    ({"optim__lr": -1.0}, "optim.lr=-1.0"),
    ({"logger__progress": "fancy"}, "logger.progress"),
    ({"stability__action": "halt"}, "stability.action='halt'"),
    ({"stability__patience": 0}, "stability.patience=0"),
    ({"stability__invalid_threshold": 1.0}, "stability.invalid_threshold=1.0 must be in [0, 1)"),
])
def test_rejects_with_key_and_fix(changes, needle):
    with pytest.raises(ConfigError, match=None) as e:
        validate(cfg_with(**changes))
    assert needle in str(e.value)


def test_defaults_validate_and_build_recipe():
    cfg = validate(TrainConfig())
    assert build_fp8_recipe(cfg) is None
    cfg = validate(cfg_with(fp8__recipe="bf16_with_fp8_subchannel_scaling_mixed", fp8__pow2_scales=False))
    r = build_fp8_recipe(cfg)
    assert r.scaling == "blockwise" and r.pow2_scales is False


def test_every_schema_field_has_a_docstring():
    """Defaults live in the schema, and each one says what it is (source docstring under the field)."""
    import inspect

    from nemo_fp8rl.config import schema

    src = inspect.getsource(schema)
    for cls in (schema.TrainConfig, schema.AlgorithmConfig, schema.CalibrationConfig, schema.Fp8Config,
                schema.RolloutConfig, schema.OptimConfig, schema.TaskConfig, schema.WarmupConfig,
                schema.TrainerConfig, schema.LoggerConfig, schema.StabilityConfig):
        block = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.default_factory is not dataclasses.MISSING:
                continue
            after = block.split(f"    {f.name}:", 1)[1].split("\n", 2)[1].strip()
            assert after.startswith('"""'), f"{cls.__name__}.{f.name} has no docstring"
    assert src
