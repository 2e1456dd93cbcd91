"""benchmarks/gpu_check.sh --dry-run runs its CPU parts (the GPU run itself needs a lent GPU)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run"],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["env"]["torch"] == __import__("torch").__version__
    parity = results["parity"]
    assert set(parity["max_abs_diff"]) == {"delayed", "tensorwise", "blockwise_1x128", "blockwise_128x128", "mxfp8"}
    assert all(v == 0.0 for v in parity["max_abs_diff"].values())
    # TE is not installed on CPU: the support probe answers with a reason instead of raising
    assert all(ok is False and reason for ok, reason in parity["te_support"].values())
    summary = (out / "summary.md").read_text()
    assert "| env | ok |" in summary and "| parity | ok |" in summary
    assert "## throughput: skipped" in summary and "## grpo: skipped" in summary
    assert [results[k]["status"] for k in ("env", "parity", "throughput", "grpo")] == ["ok", "ok", "skipped", "skipped"]
    # the vLLM parts run in a child process on a tiny float32 model with FP8 off (vLLM's FP8 needs a GPU)
    rollout, vparity = results["vllm_rollout"], results["vllm_parity"]
    if importlib.util.find_spec("vllm") is None:
        assert rollout["status"] == vparity["status"] == "skipped"
        assert "vLLM is not installed" in rollout["skipped"]
        return
    assert rollout["status"] == "ok", rollout
    assert rollout["arms"]["float32"]["decode_tokens_per_s"] > 0 and rollout["arms"]["float32"]["prefill_tokens_per_s"] > 0
    assert "UnquantizedLinearMethod" in rollout["arms"]["float32"]["quant_methods"]
    assert set(rollout["skipped"]) == {"fp8_w8a8", "fp8_block"}
    assert vparity["status"] == "ok", vparity
    off = vparity["schemes"]["off"]
    # FP8 off, float32 in both engines: the same function up to summation order
    assert off["tokens"] == vparity["prompts"] * vparity["new_tokens"]
    assert off["max_abs_diff"] < 1e-4 and off["argmax_agree"] == 1.0
    assert all("dry run" in vparity["schemes"][s]["skipped"] for s in ("vllm_w8a8", "vllm_block"))
    assert "| vllm_rollout | ok |" in summary and "| vllm_parity | ok |" in summary
    assert "| off | " in summary  # the parity table


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_tables_of_a_gpu_run(tmp_path):
    """The vLLM parts' GPU results (FP8 arms, a scheme that raised) render without a GPU: the summary of a
    lent machine's run must not fail after the measurements."""
    gc = _gpu_check_module()
    arm = {"build_s": 12.0, "decode_tokens_per_s": 4000.0, "prefill_tokens_per_s": 90000.0,
           "quant_methods": ["UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"]}
    fp8 = dict(arm, decode_tokens_per_s=5000.0, prefill_tokens_per_s=150000.0,
               quant_methods=["Fp8LinearMethod"], fp8_kernels=["CutlassFP8ScaledMMLinearKernel"], fp8_problems=[])
    rollout = {"vllm": "0.33.0", "shape": {"num_layers": 4, "hidden_size": 4096}, "dtype": "bfloat16",
               "decode": {"batch": 256, "prompt": 128, "new": 128}, "prefill": {"batch": 32, "prompt": 2048},
               "repeats": 2, "arms": {"bf16": arm, "fp8_block": fp8}, "skipped": {},
               "errors": {"fp8_w8a8": "RuntimeError: no kernel"}, "failed": "arm(s) ['fp8_w8a8'] failed",
               "vs_high_precision": {"bf16": {"decode": 1.0, "prefill": 1.0}, "fp8_block": {"decode": 1.25, "prefill": 1.67}}}
    row = {"tokens": 256, "max_abs_diff": 0.05, "mean_abs_diff": 0.004, "argmax_agree": 0.99,
           "bf16_emulation_max_abs_diff": 0.03, "bf16_emulation_mean_abs_diff": 0.002}
    parity = {"reference": "torch engine, float32 on cuda", "prompts": 8, "new_tokens": 32,
              "schemes": {"off": row, "vllm_block": dict(row, fp8_effect_mean=0.02, fp8_kernels=["K"]),
                          "vllm_w8a8": {"error": "ValueError: no FP8 here"}},
              "errors": {"vllm_w8a8": "ValueError: no FP8 here"}, "failed": "scheme(s) ['vllm_w8a8'] raised"}
    done = [("vllm_rollout", "FAILED", rollout), ("vllm_parity", "FAILED", parity)]
    gc._write_summary(tmp_path, "# GPU check", done, [])
    summary = (tmp_path / "summary.md").read_text()
    assert "| fp8_block | 5000 | 1.25 | 150000 | 1.67 | Fp8LinearMethod (CutlassFP8ScaledMMLinearKernel) |" in summary
    assert "| vllm_block | 256 | 0.05 | 0.004 | 0.03 | 0.002 | 0.990 | 0.02 | K |" in summary
    assert "| vllm_w8a8 | ValueError: no FP8 here |" in summary
    head = gc._headline("vllm_rollout", rollout)
    assert "fp8_block decode 5000 tok/s (1.25x), prefill 150000 tok/s (1.67x)" in head and "fp8_w8a8: RuntimeError" in head
    assert "vllm_w8a8: ValueError" in gc._headline("vllm_parity", parity)


def test_vllm_parts_skip_without_vllm(tmp_path, monkeypatch):
    gc = _gpu_check_module()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    res = gc.part_vllm_rollout(tmp_path, True, lambda: 400.0, layers=4, repeats=1)
    assert "vLLM is not installed" in res["skipped"]
    assert "vLLM is not installed" in gc.part_vllm_parity(tmp_path, True, lambda: 400.0)["skipped"]
