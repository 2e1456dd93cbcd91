"""``nemo-fp8rl-audit`` end to end on a tiny random Hugging Face checkpoint (with its tokenizer and a JSONL
prompts file): md, png and json written, every configuration kind scored (rollout ladder and a training recipe
through the trainer's model); bad input stops with exit code 2 and a message that names the key or file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf._fixtures import make_checkpoint, make_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit_model")
    tok = root / "tok"
    make_tokenizer(tok)
    ckpt = make_checkpoint("qwen3", root / "ckpt", seed=1)
    for f in tok.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 3?"}\n{"prompt": "Compute 12 * 7."}\n{"prompt": "Solve y - 3 = 10."}\n')
    return ckpt, prompts


def audit(*overrides, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "nemo_fp8rl.audit", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report(tiny_model, tmp_path_factory):
    ckpt, prompts = tiny_model
    out = tmp_path_factory.mktemp("audit_run")
    r = audit(f"model.hf_path={ckpt}", f"audit.prompts_file={prompts}", "audit.prompts=2", "audit.samples_per_prompt=2",
              "audit.response_len=12", "audit.position_buckets=[0,4,8]", "audit.rank_sequences=1",
              "audit.configs=[linear,kv_static,kv_calibrated,kv_calibrated+edge,train:tensorwise]",
              "fp8.compile=false", f"output_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "audit", r


def test_cli_writes_md_png_json_and_the_recommendation(report):
    d, r = report
    rep = json.loads((d / "audit.json").read_text())
    assert (d / "audit.png").stat().st_size > 10_000
    md = (d / "audit.md").read_text()
    names = ["linear", "kv_static", "kv_calibrated", "kv_calibrated+edge", "train:tensorwise"]
    assert [c["name"] for c in rep["configs"]] == names
    for n in names:
        assert f"| `{n}` |" in md
    assert rep["sequences"] == 4 and rep["response_tokens"] == 4 * 12  # audit.eos=ignore: every response 12 tokens
    for c in rep["configs"]:
        assert c["tokens"] == 48
        if c["name"] == "kv_calibrated+edge":  # 1 + 1 edge layers of a 2-layer model: all high precision
            assert c["mean_abs_dlogp"] == 0 and c["noise_clip"] == 0 and c["token_mult_prob_error"] == pytest.approx(1)
        else:
            assert c["mean_abs_dlogp"] > 0 and c["token_mult_prob_error"] > 1
        assert sum(b["tokens"] for b in c["by_position"]) == 48 == sum(b["tokens"] for b in c["by_prob_decile"])
        assert [b["positions"] for b in c["by_position"]] == ["0-3", "4-7", "8+"]
        assert set(c["calibration"]["lower_at_alpha"]) == {"0.001", "0.01", "0.05"}
    assert rep["configs"][-1]["side"] == "train" and rep["notes"]  # the implementation floor of the actor
    rk = rep["layer_ranking"]
    assert rk["config"] == "kv_calibrated" and sorted(x["layer"] for x in rk["layers"]) == [0, 1]
    line = rep["recommendation"]["line"]
    assert line.startswith("nemo-fp8rl-train fp8=tensorwise rollout.fp8.scheme=") and f"recommended: {line}" in r.stdout
    assert "## Recommendation" in md and line in md
    pair = rep["recommendation"]["pair"]  # the trainer's ratio of the recommended pair, both sides' noise
    assert pair["train"] == "train:tensorwise" and pair["tokens"] == 48 and "| `pair: train:tensorwise + " in md


@pytest.mark.parametrize("override, match", [
    ("audit.configs=[linear,kv_statik]", "invalid config: audit.configs: unknown configuration 'kv_statik'"),
    ("audit.prompts_file=/nonexistent/p.jsonl", "audit.prompts_file='/nonexistent/p.jsonl': no such file"),
    ("audit.response_len=0", "audit.response_len=0 must be an integer >= 1"),
    ("audit.rank_layers=[0,5]", "audit.rank_layers [5] are not layers of the model (0..1)"),
])
def test_bad_input_exits_2_naming_key_and_fix(tiny_model, tmp_path, override, match):
    ckpt, _ = tiny_model
    r = audit(f"model.hf_path={ckpt}", override, f"output_dir={tmp_path}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert match in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "audit").exists()


def test_malformed_jsonl_line_names_file_and_line(tiny_model, tmp_path):
    ckpt, _ = tiny_model
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    r = audit(f"model.hf_path={ckpt}", f"audit.prompts_file={bad}", f"output_dir={tmp_path}")
    assert r.returncode == 2 and f"{bad}:2: 'prompt' must be a non-empty string" in r.stderr, r.stderr[-2000:]
