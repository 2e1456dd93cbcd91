"""fp8.backend=auto's per-layer rule (fp8/layer_filter.py) against the H200 measurement it is taken from."""

import json
from pathlib import Path

import pytest
import torch

from nemo_fp8rl.fp8 import convert_to_fp8, get_recipe, layer_filter
from nemo_fp8rl.fp8.backends import resolve_fp8_backend

# the run of the current kernels (the morning's record predates the GPU's own FP8 conversions)
RECORDS = [Path(__file__).parents[2] / "benchmarks" / "gpu" / "records" / "2026-12-04-b" / "results.json"]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LABELS = {"delayed": ("delayed", {}), "tensorwise": ("tensorwise", {}), "rowwise": ("rowwise", {}),
          "blockwise": ("blockwise", {}), "blockwise_hybrid": ("blockwise", {"fp8_format": "hybrid"})}


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.parent.name)
def test_the_rule_picks_fp8_only_where_the_h200_measured_it_faster(record):
    """Every timed projection@tokens of the committed H200 record of the current kernels: FP8 is picked only
    where it measured >= 0.97x BF16, and a layer kept in BF16 measured below 1.10x, for every recipe; so no
    auto row falls below 1.0x by more than timing noise (qkv@8192 tensorwise: 1.12x in the morning run,
    0.98x in run b), and no layer that was clearly faster is kept in BF16."""
    ms = json.loads(record.read_text())["throughput"]["ms"]
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
    assert "every measured shape" in real(get_recipe("mxfp8"), 1 << 20, 24576, 4096, "cuda")
    hybrid = get_recipe("blockwise", fp8_format="hybrid")
    assert real(hybrid, 8192, 24576, 4096, "cuda") and real(hybrid, 16384, 24576, 4096, "cuda") is None


def test_auto_is_a_backend_value():
    assert resolve_fp8_backend("auto", "cpu") == "emulate"
    from nemo_fp8rl.config.schema import Fp8Config, _resolve_fp8_backend_key

    f = Fp8Config(backend="auto")
    _resolve_fp8_backend_key(f)
    with pytest.raises(Exception, match="fp8.backend"):
        _resolve_fp8_backend_key(Fp8Config(backend="fastest"))
