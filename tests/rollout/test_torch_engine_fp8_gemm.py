"""The torch rollout engine's FP8 schemes on torch's FP8 GEMMs (``fp8_gemm="torch"``, a GPU with real FP8).

On this CPU torch has no row-wise or block-scaled FP8 kernel, so: (1) the engine falls back to emulated
GEMMs per linear and says so; (2) with torch's kernel replaced by the readable reference of
tests/_scaled_mm_reference.py, the FP8 data + scale layout the engine builds reproduces the emulated
engine's log-probs (up to GEMM rounding) for both vLLM schemes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.fp8 import backends
from nemo_fp8rl.fp8.rollout import RolloutScheme
from nemo_fp8rl.rollout import get_rollout_engine
from nemo_fp8rl.fp8.backends import gemm_error_bound
from nemo_fp8rl.rollout.model import Fp8Weight, _linear

from tests._fp8_bounds import assert_fp8_paths_agree, fp8_noise_bound
from tests._scaled_mm_reference import reference_kernel
from .conftest import random_hf_weights

# every fused linear a multiple of 128 (vllm_block's 128x128 tiles): qkv (4 + 2*2) * 32 = 256, o 128, gate_up 512
CFG = dict(vocab_size=16, num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=256)
TOKENS = torch.tensor([[1, 3, 4, 5, 6, 7, 8, 9], [1, 7, 2, 11, 12, 13, 14, 15]])


def _engine(scheme: str, fp8_gemm: str):
    cfg = ModelConfig(**CFG)
    eng = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=2, pad_id=0, fp8_gemm=fp8_gemm)
    eng.update_weights(random_hf_weights(cfg, seed=0, logit_scale=4.0))
    return eng


def test_cpu_falls_back_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="nemo_fp8rl.rollout.torch_engine"):
        eng = _engine("vllm_w8a8", "torch")
    stats = eng.weights.linear_stats
    assert {r["gemm"] for r in stats.values()} == {"emulate"}
    assert all("per-tensor scales only" in r["fallback"] for r in stats.values())
    assert "0 on torch FP8 GEMMs, 8 emulated" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)  # FP8 linears that fell back: a warning
    ref = _engine("vllm_w8a8", "emulate")
    assert torch.equal(eng.logprobs(TOKENS), ref.logprobs(TOKENS))  # the fallback is the emulated engine
    with pytest.raises(ValueError, match="fp8_gemm"):
        _engine("vllm_w8a8", "cuda")


@pytest.mark.parametrize("scheme", ["vllm_w8a8", "vllm_block"])
def test_fp8_gemm_layout_reproduces_the_emulated_engine(scheme, monkeypatch):
    if not hasattr(torch.nn.functional, "ScalingType"):
        pytest.skip("this torch has no torch.nn.functional.ScalingType")
    calls = []
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel(calls))
    cls = type(_engine(scheme, "emulate").scheme)
    monkeypatch.setattr(cls, "torch_gemm_support", lambda self, device, n, k: None)  # as on an sm90 GPU
    real = _engine(scheme, "torch")
    assert all(isinstance(getattr(lw, f), Fp8Weight) for lw in real.weights.layers
               for f in ("w_qkv", "w_o", "w_gate_up", "w_down"))
    assert {r["gemm"] for r in real.weights.linear_stats.values()} == {"torch"}
    emulated, hp = _engine(scheme, "emulate"), _engine("off", "emulate")
    # per linear: the FP8 weight read back is the emulated engine's weight bit for bit, and the GEMM of the
    # FP8 data agrees with the emulated GEMM within the rounding bound of the kernel's bf16 output
    g = torch.Generator().manual_seed(4)
    for lw_real, lw_emu in zip(real.weights.layers, emulated.weights.layers):
        for f in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            fw, we = getattr(lw_real, f), getattr(lw_emu, f)
            assert torch.equal(fw.q.dequantize(), we), f
            x = torch.randn(9, we.shape[1], generator=g) * torch.logspace(-2, 1, we.shape[1])  # outlier channels
            got = _linear(real.scheme, x, fw, None)
            xq = real.scheme.quantize_activation(x)
            want = torch.nn.functional.linear(xq, we)
            bound = gemm_error_bound(xq, we, torch.float32) + gemm_error_bound(xq, we, torch.bfloat16)
            assert bool(((got.double() - want.double()).abs() <= bound).all()), (scheme, f)
    assert calls, "the FP8 GEMM path was not taken"
    # Whole model, with the kernel's output kept in float32 (a real row/block kernel rounds it to bf16, which
    # moves later FP8 roundings by a machine-dependent amount): the FP8 GEMM path is the emulated engine up to
    # summation order, i.e. float noise and a few FP8 rounding flips, never beyond the FP8 noise.
    monkeypatch.setattr(backends, "scaled_mm_kernel", reference_kernel([], exact_output=True))
    got, want, high = real.logprobs(TOKENS), emulated.logprobs(TOKENS), hp.logprobs(TOKENS)
    assert_fp8_paths_agree(got, want, fp8_noise=fp8_noise_bound(want, high), float_tol=1e-4,
                           what=f"{scheme}: FP8 GEMM engine vs emulated engine")


def test_base_scheme_has_no_fp8_gemm():
    assert "no FP8 GEMM" in RolloutScheme().torch_gemm_support("cpu", 128, 128)


def test_scheme_off_logs_its_engine_line_without_a_warning(caplog):
    """A BF16 engine (scheme off) has no FP8 GEMM to fall back from: its first-sync line is information, not
    a warning in every BF16 run's log."""
    with caplog.at_level(logging.INFO, logger="nemo_fp8rl.rollout.torch_engine"):
        _engine("off", "torch")
    lines = [r for r in caplog.records if "rollout engine 'torch'" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
