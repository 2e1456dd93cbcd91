"""Hugging Face checkpoint -> our megatron policy -> Hugging Face checkpoint, one process (TP=1, PP=1).

For each architecture (tiny random ``transformers`` models, see ``_fixtures.py``):
- our megatron model's logits equal ``transformers``' logits (float32), and the actor's log-probs and
  entropies equal those of ``log_softmax`` of the transformers logits;
- export -> reload in ``transformers`` -> bitwise identical logits (float32 round trip);
- after one training step the exported weights differ, ``transformers`` loads them, and its logits
  equal our model's post-step logits.
"""

import json

import pytest
import torch

from ._fixtures import ARCHS, hf_logits, hf_model, make_tokens
from ._scenarios import run_policy


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor):
    ls = torch.log_softmax(logits.double(), -1)
    lp = torch.zeros(tokens.shape, dtype=torch.float64)
    lp[:, 1:] = ls[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    ent = torch.zeros(tokens.shape, dtype=torch.float64)
    ent[:, 1:] = -(ls.exp() * ls).sum(-1)[:, :-1]
    return lp.float(), ent.float()


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("hf_exports")
    for arch in ARCHS:
        ref = hf_model(checkpoints[arch])
        tokens = make_tokens(ref.config.vocab_size)
        res = run_policy(str(checkpoints[arch]), {"micro_batch_size": 2}, tokens, export_to=str(root / arch))
        out[arch] = dict(res, tokens=tokens, ref=ref, export=root / arch)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(runs, arch):
    r = runs[arch]
    ref = hf_logits(r["ref"], r["tokens"])
    assert ref.std() > 0.5  # a real test: logits of order 1, not ~0
    torch.testing.assert_close(r["logits0"], ref, atol=1e-5, rtol=1e-5)
    lp, ent = logprobs_and_entropy(ref, r["tokens"])
    torch.testing.assert_close(r["lp0"], lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r["ent0"], ent, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_before_training_reloads_identically(checkpoints, runs, arch, tmp_path):
    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.models import resolve_model_config, save_hf_state_dict

    r = runs[arch]
    cfg = resolve_model_config(ModelConfig(hf_path=str(checkpoints[arch])))
    out = save_hf_state_dict(r["weights0"], cfg, tmp_path / "export0")
    assert torch.equal(hf_logits(out, r["tokens"]), hf_logits(r["ref"], r["tokens"]))
    # the source's config.json is kept (dtype, rope settings, token ids) and generation_config copied
    src = json.loads((checkpoints[arch] / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == src
    assert (out / "generation_config.json").is_file()
    tied = arch == "qwen3"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in list(f.keys())) == (not tied)


@pytest.mark.parametrize("arch", ARCHS)
def test_trained_policy_exports_and_loads(runs, arch):
    r = runs[arch]
    changed = [n for n in r["weights0"] if not torch.equal(r["weights0"][n], r["weights1"][n])]
    assert len(changed) == len(r["weights0"]), sorted(set(r["weights0"]) - set(changed))
    reloaded = hf_model(r["export"])
    after = hf_logits(reloaded, r["tokens"])
    torch.testing.assert_close(after, r["logits1"], atol=1e-5, rtol=1e-5)
    assert (after - r["logits0"]).abs().max() > 1e-2  # the step moved the policy
    sd = {n: t for n, t in reloaded.state_dict().items()}
    for n, t in r["weights1"].items():
        if n in sd:
            assert torch.equal(sd[n], t), n


def test_export_from_scratch_model_config(tmp_path):
    """A model trained from scratch (no source checkpoint) exports as Llama/Qwen2/Qwen3 by its features."""
    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.models.hf_config import hf_architecture
    from nemo_fp8rl.models.hf_save import save_hf_state_dict
    from nemo_fp8rl.models.hf_weights import init_hf_state_dict

    for kw, arch in [({}, "llama"), ({"add_qkv_bias": True}, "qwen2"),
                     ({"qk_layernorm": True, "untie_embeddings_and_output_weights": False}, "qwen3"),
                     ({"rope_scaling_factor": 8.0, "rotary_base": 500000.0}, "llama")]:
        cfg = ModelConfig(vocab_size=37, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=48, **kw)
        assert hf_architecture(cfg) == arch
        sd = init_hf_state_dict(cfg, seed=1)
        out = save_hf_state_dict(sd, cfg, tmp_path / f"{arch}_{len(kw)}", max_shard_bytes=20_000)
        assert (out / "model.safetensors.index.json").is_file()  # sharded
        model = hf_model(out)
        assert model.config.model_type == arch
        assert model.config.vocab_size == 37 and model.config.num_key_value_heads == 2
        for n, p in model.state_dict().items():
            if n in sd:
                assert torch.equal(p, sd[n]), n
    with pytest.raises(ValueError, match="model.add_bias_linear=true"):
        hf_architecture(ModelConfig(add_bias_linear=True))


def test_export_overwrites_atomically(runs, tmp_path):
    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.models import resolve_model_config, save_hf_state_dict

    r = runs["qwen3"]
    cfg = resolve_model_config(ModelConfig(hf_path=str(r["ref"].name_or_path)))
    out = save_hf_state_dict(r["weights0"], cfg, tmp_path / "x", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    out = save_hf_state_dict(r["weights1"], cfg, tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no temporary or old directories left
    torch.testing.assert_close(hf_logits(out, r["tokens"]), r["logits1"], atol=1e-5, rtol=1e-5)


def test_bf16_checkpoint_loads_and_exports_in_bf16(tmp_path):
    """Published checkpoints are BF16: loaded into float32 master weights exactly (BF16 -> FP32 is
    lossless), exported back in the checkpoint's dtype by default."""
    from ._fixtures import make_checkpoint

    src = make_checkpoint("qwen2", tmp_path / "src", seed=4, shard=False)
    model = hf_model(src).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "bf16"))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    ref = hf_model(tmp_path / "bf16")  # upcast to float32 on load
    tokens = make_tokens(ref.config.vocab_size)
    r = run_policy(str(tmp_path / "bf16"), {"micro_batch_size": 4}, tokens, export_to=str(tmp_path / "out"))
    torch.testing.assert_close(r["logits0"], hf_logits(ref, tokens), atol=1e-5, rtol=1e-5)
    for n, t in ref.state_dict().items():
        assert torch.equal(r["weights0"][n], t), n
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
