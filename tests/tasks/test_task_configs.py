"""conf/task/*.yaml: every key names a real constructor argument, its value is the default, and the task builds
(the comment on every key: tests/test_yaml_comments.py)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_fp8rl.tasks import get_task, task_class

CONF = Path(__file__).resolve().parents[2] / "conf" / "task"


@pytest.mark.parametrize("name", ["arithmetic", "math_jsonl"])
def test_task_yaml_matches_the_constructor(name, tmp_path):
    path = CONF / f"{name}.yaml"
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert cfg.pop("name") == name
    params = inspect.signature(task_class(name).__init__).parameters
    unknown = sorted(set(cfg) - set(params))
    assert not unknown, f"{path}: keys {unknown} are not arguments of the {name} task"
    for k, v in cfg.items():  # YAML values equal the constructor defaults (defaults live in one schema)
        if params[k].default is not inspect.Parameter.empty:
            assert v == params[k].default, (k, v, params[k].default)
    if name == "math_jsonl":
        assert cfg["path"] is None
        with pytest.raises(ValueError, match="task.path is required"):
            get_task(name, **cfg)
        data = tmp_path / "d.jsonl"
        data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
        cfg["path"] = str(data)
    task = get_task(name, **cfg)
    assert task.prompts(2)[0].ids[0] == task.tokenizer.bos_id
