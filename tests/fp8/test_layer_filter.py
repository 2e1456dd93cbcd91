"""fp8.backend=auto's per-layer rule (fp8/layer_filter.py) against the H200 measurement it is taken from."""

import json
from pathlib import Path

import pytest
import torch

from nemo_fp8rl.fp8 import convert_to_fp8, get_recipe, layer_filter
from nemo_fp8rl.fp8.backends import resolve_fp8_backend

RECORD = Path(__file__).parents[2] / "benchmarks" / "gpu" / "records" / "2026-12-04" / "results.json"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LABELS = {"delayed": ("delayed", {}), "tensorwise": ("tensorwise", {}), "rowwise": ("rowwise", {}),
          "blockwise": ("blockwise", {}), "blockwise_hybrid": ("blockwise", {"fp8_format": "hybrid"})}


def test_the_rule_picks_fp8_only_where_the_h200_measured_it_faster():
    """Every timed projection@tokens of the committed H200 record: FP8 is picked exactly where it measured
    >= 1.0x BF16 (within 3% timing noise around 1.0), for every recipe; so no auto row falls below 1.0x
    there, and no layer that was faster is kept in BF16 by more than that noise."""
    ms = json.loads(RECORD.read_text())["throughput"]["ms"]
    checked = 0
    for key, row in ms.items():
        name, tokens = key.split("@")
        if name not in SHAPES:
            continue
        n, k = SHAPES[name]
        for label, (rname, overrides) in LABELS.items():
            if label not in row:
                continue
            ratio = row["bf16"] / row[label]
            picks_fp8 = layer_filter.keep_bf16_reason(get_recipe(rname, **overrides), int(tokens), n, k, "cuda") is None
            if picks_fp8:
                assert ratio >= 0.97, f"{label} {key}: FP8 picked at {ratio:.2f}x BF16"
            else:
                assert ratio < 1.10, f"{label} {key}: kept BF16 although FP8 measured {ratio:.2f}x"
            checked += 1
    assert checked == 60  # 12 projection@tokens x 5 recipes


def test_cpu_and_emulated_layers_are_never_filtered():
    rec = get_recipe("tensorwise")
    assert layer_filter.keep_bf16_reason(rec, 16, 64, 64, "cpu") is None
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    convert_to_fp8(model, rec, backend="torch", auto_tokens=16)
    assert model.fp8_conversion["converted"] == 2 and model.fp8_conversion["auto_kept"] == {}


def test_auto_keeps_small_gpu_layers_high_precision_and_says_why(monkeypatch, caplog):
    """The converter's branch for a GPU layer, on CPU: layer_backend says torch and the rule judges as on CUDA."""
    from nemo_fp8rl.fp8 import linear

    monkeypatch.setattr(linear, "layer_backend", lambda *a, **k: ("torch", None))
    real = layer_filter.keep_bf16_reason
    monkeypatch.setattr(layer_filter, "keep_bf16_reason", lambda r, t, n, k, d: real(r, t, n, k, "cuda"))
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 24576))
    with caplog.at_level("WARNING"):
        convert_to_fp8(model, get_recipe("tensorwise"), backend="torch", auto_tokens=4096)
    assert type(model[0]) is torch.nn.Linear  # 4096 x 4096 x 4096 = 6.9e10 < 1.6e11: BF16
    assert model[1].__class__.__name__ == "Fp8Linear"  # 4.1e11: FP8
    assert sum(model.fp8_conversion["auto_kept"].values()) == 1
    assert "kept in high precision" in caplog.text and "1.6e+11" in caplog.text
    hybrid = get_recipe("blockwise", fp8_format="hybrid")
    assert "every measured shape" in real(hybrid, 1 << 20, 24576, 4096, "cuda")


def test_auto_is_a_backend_value():
    assert resolve_fp8_backend("auto", "cpu") == "emulate"
    from nemo_fp8rl.config.schema import Fp8Config, _resolve_fp8_backend_key

    f = Fp8Config(backend="auto")
    _resolve_fp8_backend_key(f)
    with pytest.raises(Exception, match="fp8.backend"):
        _resolve_fp8_backend_key(Fp8Config(backend="fastest"))
