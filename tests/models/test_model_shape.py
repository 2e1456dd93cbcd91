"""ModelConfig's derived shape (head dim, KV heads, projection widths, padded vocabulary): the one derivation
the model builder, the HF mapping, the rollout engine and the memory plan read."""

import pytest

from nemo_fp8rl.config.model import ModelConfig, padded_vocab_size


def test_gqa_config_with_kv_channels():
    """Qwen3-32B's shape: 64 query heads of 128 over 8 KV heads; the query width 8192 exceeds h = 5120."""
    m = ModelConfig(vocab_size=151936, hidden_size=5120, num_attention_heads=64, num_query_groups=8, kv_channels=128)
    assert (m.head_dim, m.num_kv_heads, m.q_width, m.kv_width) == (128, 8, 8192, 1024)


def test_defaults_derive_mha_and_hidden_over_heads():
    m = ModelConfig(hidden_size=128, num_attention_heads=4)  # kv_channels, num_query_groups unset
    assert (m.head_dim, m.num_kv_heads, m.q_width, m.kv_width) == (32, 4, 128, 128)
    # kv_channels, when set, wins over h / n_q
    m = ModelConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32)
    assert (m.head_dim, m.num_kv_heads, m.q_width, m.kv_width) == (32, 2, 128, 64)


def test_feature_flags():
    m = ModelConfig()
    assert (m.qkv_bias, m.gated_mlp, m.tied_embeddings) == (False, True, False)
    assert ModelConfig(add_qkv_bias=True).qkv_bias and ModelConfig(add_bias_linear=True).qkv_bias
    assert not ModelConfig(activation="gelu").gated_mlp
    assert ModelConfig(untie_embeddings_and_output_weights=False).tied_embeddings


def test_padded_vocab_is_megatrons_rule():
    """Rows padded to a multiple of make_vocab_size_divisible_by x TP (at least 1 x TP)."""
    m = ModelConfig(vocab_size=151936, make_vocab_size_divisible_by=128)
    assert (m.padded_vocab(1), m.padded_vocab(2)) == (151936, 152064)  # 1187 x 128; 594 x 256
    m = ModelConfig(vocab_size=19, make_vocab_size_divisible_by=4)
    assert (m.padded_vocab(1), m.padded_vocab(2)) == (20, 24)
    assert ModelConfig(vocab_size=19, make_vocab_size_divisible_by=0).padded_vocab(2) == 20
    assert padded_vocab_size(19, 4, 2) == 24
    with pytest.raises(ValueError, match="model.vocab_size"):
        ModelConfig().padded_vocab(1)


def test_every_consumer_reads_the_same_shape():
    """The HF tensor shapes, the rollout engine's shape and the megatron builder's padding agree with the
    derivation."""
    from nemo_fp8rl.models.gpt import padded_vocab_size as gpt_padded
    from nemo_fp8rl.models.hf_config import model_config_to_hf_config
    from nemo_fp8rl.models.hf_weights import hf_shape
    from nemo_fp8rl.rollout.model import ModelShape

    m = ModelConfig(vocab_size=21, make_vocab_size_divisible_by=8, hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, kv_channels=32, qk_layernorm=True)
    assert hf_shape(m, "model.layers.0.self_attn.q_proj.weight") == (m.q_width, 64) == (128, 64)
    assert hf_shape(m, "model.layers.0.self_attn.k_proj.weight") == (m.kv_width, 64) == (64, 64)
    assert hf_shape(m, "model.layers.0.self_attn.o_proj.weight") == (64, 128)
    s = ModelShape.from_config(m)
    assert (s.head_dim, s.num_groups, s.num_heads, s.qkv_bias, s.tied_embeddings) == (32, 2, 4, False, False)
    hf = model_config_to_hf_config(m)
    assert (hf["head_dim"], hf["num_key_value_heads"]) == (32, 2)
    assert gpt_padded(21, 8, 2) == m.padded_vocab(2) == 32
