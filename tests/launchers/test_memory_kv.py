"""The memory plan counts an FP8 KV cache (``rollout.fp8.kv_cache``) at 1 byte per element and BF16 edge
layers (``rollout.fp8.num_layers_at_start/end_in_bf16``) at 2 bytes, for the engine's weights and cache."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_fp8rl.launcher.memory import PlanError, PlanOptions, plan_arm, rollout_plan


def _vllm_cfg(**fp8):
    from nemo_fp8rl.launch import compose_train_config
    from nemo_fp8rl.launcher.memory_cli import train_config_from_overrides

    cfg = train_config_from_overrides(["model=qwen3_8b", "parallel.tensor_model_parallel_size=4", "fp8=blockwise",
                                       "rollout.engine=vllm", "rollout.fp8.scheme=vllm_block",
                                       *(f"rollout.fp8.{k}={v}" for k, v in fp8.items())], compose_train_config)
    return cfg, PlanOptions(dp=2)


def test_fp8_kv_cache_is_one_byte_per_element():
    bf16_cfg, options = _vllm_cfg()
    fp8_cfg, _ = _vllm_cfg(kv_cache="e4m3")
    bf16 = plan_arm(bf16_cfg, options, recipe_name="blockwise", optimizer="distributed").rollout
    fp8 = plan_arm(fp8_cfg, options, recipe_name="blockwise", optimizer="distributed").rollout
    m = fp8_cfg.model  # Qwen3-8B: 36 layers, 8 KV heads of 128; one whole-model engine per GPU (TP 1)
    assert bf16.kv_per_sequence == 2 * 2 * 36 * 8 * 128 * m.seq_length
    assert fp8.kv_per_sequence == 2 * 1 * 36 * 8 * 128 * m.seq_length and fp8.kv_cache == "e4m3"
    assert fp8.weights == bf16.weights and fp8.concurrent >= 2 * bf16.concurrent
    # the BF16 arm generates in BF16, whatever rollout.fp8 says
    assert plan_arm(fp8_cfg, options, recipe_name=None, optimizer="distributed").rollout.kv_cache == "off"


def test_edge_layers_keep_two_bytes():
    cfg, options = _vllm_cfg(kv_cache="e5m2", num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=2)
    r = plan_arm(cfg, options, recipe_name="blockwise", optimizer="distributed").rollout
    plain = rollout_plan(cfg.model, 1, 1, cfg.model.seq_length, r.sequences, "vllm_block", r.reserved,
                         vocab_rows=cfg.model.padded_vocab(4), kv_cache="e5m2")
    assert r.kv_per_sequence == (32 * 1 + 4 * 2) * 2 * 8 * 128 * cfg.model.seq_length
    assert plain.kv_per_sequence == 36 * 1 * 2 * 8 * 128 * cfg.model.seq_length
    m = cfg.model
    per_layer = m.hidden_size * (m.q_width + 2 * m.kv_width) + m.q_width * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size
    assert r.weights - plain.weights == round(4 * per_layer * (2.0 - (1.0 + 4.0 / 128**2)))


def test_bad_kv_cache_value_is_named():
    cfg, _ = _vllm_cfg()
    with pytest.raises(PlanError, match="rollout.fp8.kv_cache='fp8'"):
        rollout_plan(cfg.model, 1, 1, 4096, 8, "off", 10**10, vocab_rows=1000, kv_cache="fp8")


def test_the_plan_cli_shows_the_fp8_cache(capsys):
    from nemo_fp8rl.launch import plan_main

    plan_main(["model=qwen3_8b", "parallel.tensor_model_parallel_size=4", "fp8=blockwise", "rollout.engine=vllm",
               "rollout.fp8.scheme=vllm_block", "rollout.fp8.kv_cache=e4m3", "--world", "8"])
    assert "KV (FP8 E4M3)" in capsys.readouterr().out
    assert dataclasses.is_dataclass(PlanOptions)
