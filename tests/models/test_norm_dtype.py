"""With BF16 parameters every parameter of the local spec's model is BF16, norm weights included (issue 39:
on the H200 megatron's torch norms stayed float32, so ``torch.rms_norm`` ran its unfused composite and
the distributed optimizer got a float32 buffer beside the BF16 one).

The CPU path refuses BF16 parameters (it runs float32, FP8 emulated on top), so the test builds the GPU's
BF16 ``TransformerConfig`` on CPU: ``build_gpt_model`` runs as is, with ``make_transformer_config``'s
result switched to BF16.
"""

from __future__ import annotations

import dataclasses

import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig

from . import _scenarios as S


def _bf16_model(monkeypatch, cfg: dict):
    from nemo_fp8rl.models import gpt
    from nemo_fp8rl.models.parallel import init_distributed

    real = gpt.make_transformer_config

    def bf16_config(*args, **kwargs):
        c = real(*args, **kwargs)
        return dataclasses.replace(c, params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16)

    monkeypatch.setattr(gpt, "make_transformer_config", bf16_config)
    mc, pc = ModelConfig(**cfg), ParallelConfig()
    init_distributed(pc, mc, device="cpu")
    model, _ = gpt.build_gpt_model(mc, pc, device="cpu")
    return model


def test_bf16_params_include_the_norm_weights(monkeypatch):
    cfg = dict(S.CFG_B, normalization="RMSNorm")  # QK norms, final norm
    model = _bf16_model(monkeypatch, cfg)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    norms = [n for n in dtypes if "layernorm" in n]
    assert "decoder.final_layernorm.weight" in norms and "decoder.layers.0.self_attention.q_layernorm.weight" in norms
    assert {n: d for n, d in dtypes.items() if d != torch.bfloat16} == {}
    # the norm runs without promoting: BF16 in, BF16 out (the weight no longer float32)
    x = torch.randn(3, 1, cfg["hidden_size"], dtype=torch.bfloat16)
    assert model.decoder.final_layernorm(x).dtype == torch.bfloat16


def test_layernorm_weight_and_bias_follow_params_dtype(monkeypatch):
    model = _bf16_model(monkeypatch, dict(S.CFG_A, normalization="LayerNorm"))
    ln = model.decoder.layers[0].input_layernorm
    assert isinstance(ln, torch.nn.LayerNorm) and ln.weight.dtype == ln.bias.dtype == torch.bfloat16


def test_float32_params_keep_float32_norms():
    from nemo_fp8rl.models import gpt
    from nemo_fp8rl.models.parallel import init_distributed

    mc, pc = ModelConfig(**S.CFG_B), ParallelConfig()
    init_distributed(pc, mc, device="cpu")
    model, _ = gpt.build_gpt_model(mc, pc, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)
