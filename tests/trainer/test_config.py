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
    ({"calibration__interval": 4, "calibration__window": 5}, "calibration.window=5 must be an integer in [1, calibration.interval = 4]"),
    ({"parallel__tensor_model_parallel_size": 3}, "must divide model.num_attention_heads=4"),
    ({"parallel__pipeline_model_parallel_size": 2}, "must divide model.num_layers=3"),
    ({"model__num_query_groups": 3}, "multiple of model.num_query_groups=3"),
    ({"optim__lr": -1.0}, "optim.lr=-1.0"),
    ({"logger__progress": "fancy"}, "logger.progress"),
    ({"stability__action": "halt"}, "stability.action='halt'"),
    ({"stability__patience": 0}, "stability.patience=0"),
    ({"stability__invalid_threshold": 1.0}, "stability.invalid_threshold=1.0 must be in [0, 1)"),
    ({"trainer__profile__kind": "nvprof"}, "trainer.profile.kind='nvprof' is not valid"),
    ({"trainer__profile__kind": "torch", "trainer__profile__start_step": 3, "trainer__profile__end_step": 2},
     "trainer.profile.start_step=3 and end_step=2 must satisfy 0 <= start_step <= end_step"),
    ({"trainer__profile__kind": "torch", "trainer__profile__ranks": []}, "trainer.profile.ranks=[] must list"),
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


def _config_dataclasses() -> list[type]:
    """Every dataclass of the config schema, derived (a hand-kept list misses new classes): each one
    defined in a module of ``nemo_fp8rl.config``, and each one reachable from ``TrainConfig`` through its
    fields' types (``Optional[X]``, ``List[X]`` included), wherever it is defined."""
    import importlib
    import pkgutil
    import typing

    import nemo_fp8rl.config as config_pkg

    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(config_pkg.__path__):
        mod = importlib.import_module(f"{config_pkg.__name__}.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__:
                found[obj.__qualname__] = obj
    todo, walked = [TrainConfig], set()
    while todo:
        cls = todo.pop()
        if cls in walked:
            continue
        walked.add(cls)
        found[cls.__qualname__] = cls
        for hint in typing.get_type_hints(cls).values():
            todo += [t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and dataclasses.is_dataclass(t)]
    return [found[k] for k in sorted(found)]


def test_every_schema_field_has_a_docstring():
    """Defaults live in the schema, and each one says what it is: a docstring under every field (a
    section, a field whose type is a config dataclass, is documented by its class's docstring)."""
    import ast
    import inspect
    import textwrap
    import typing

    classes = _config_dataclasses()
    # the derivation finds the sections a hand-kept list had missed
    assert {"RolloutFp8Config", "ModelConfig", "ParallelConfig", "TrainConfig"} <= {c.__name__ for c in classes}
    missing = []
    for cls in classes:
        if not (cls.__doc__ or "").strip() or cls.__doc__.startswith(f"{cls.__name__}("):  # not dataclass's stand-in
            missing.append(f"{cls.__name__} (class docstring)")
        (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
        body = node.body  # a field's docstring is the string statement right after its annotated assignment
        doc_after = {s.target.id: isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                     and isinstance(nxt.value.value, str) and bool(nxt.value.value.strip())
                     for s, nxt in zip(body, [*body[1:], None]) if isinstance(s, ast.AnnAssign)}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a section: its class is checked too
            if not doc_after.get(f.name, False):
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, f"schema fields without a docstring under them: {missing}"
