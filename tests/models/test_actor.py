"""FP8Actor in one process (TP = PP = 1, gloo world of size 1, real megatron-core on CPU; device="cpu"
keeps these CPU tests on the CPU path on GPU machines too)."""

import io

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.fp8 import get_recipe
from nemo_fp8rl.models import build_actor

from ._hf_reference import hf_logprobs
from ._scenarios import make_batch, pg_loss

VOCAB = 16


def _actor(fp8=None, seed=0, lr=1e-3, mb=3, keep_reference=False, **model_kw):
    model_kw.setdefault("vocab_size", VOCAB)
    return build_actor(ModelConfig(**model_kw), ParallelConfig(micro_batch_size=mb),
                       fp8_recipe=get_recipe(fp8) if isinstance(fp8, str) else fp8, seed=seed, lr=lr,
                       keep_reference=keep_reference, device="cpu")


def _batch(B=6, T=14, seed=1):
    return make_batch(VOCAB, B=B, T=T, seed=seed)


def test_logprobs_equal_log_softmax_of_gathered_logits():
    actor = _actor(mb=4)
    tokens = _batch(B=5)["tokens"]  # 5 rows in microbatches of 4 + 1
    lp, ent = actor.get_logprobs(tokens, with_entropy=True)
    lp_t, ent_t = actor.get_logprobs(tokens, temperature=0.6, with_entropy=True)
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = actor.model(tokens, pos, None)[..., :VOCAB]  # TP = 1: the full (padded) vocabulary
    for temp, (got_lp, got_ent) in ((1.0, (lp, ent)), (0.6, (lp_t, ent_t))):
        lsm = torch.log_softmax(logits[:, :-1] / temp, -1)
        ref_lp = lsm.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        ref_ent = -(lsm.exp() * lsm).sum(-1)
        torch.testing.assert_close(got_lp[:, 1:], ref_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_ent[:, 1:], ref_ent, atol=1e-5, rtol=1e-5)
        assert torch.all(got_lp[:, 0] == 0) and torch.all(got_ent[:, 0] == 0)
    assert actor.get_logprobs(tokens)[1] is None


@pytest.mark.parametrize("extra", [
    {},  # tiny default (Llama-like, MHA, untied)
    dict(num_query_groups=2, add_qkv_bias=True, rotary_base=1e6, norm_epsilon=1e-6),  # Qwen2.5-like
    dict(num_query_groups=2, qk_layernorm=True, untie_embeddings_and_output_weights=False,
         norm_epsilon=1e-6),  # Qwen3-like, tied
    dict(num_query_groups=1, rotary_base=500000.0, rope_scaling_factor=8.0, seq_length=64),  # Llama-3.1
])
def test_exported_weights_reproduce_logprobs_in_an_hf_style_forward(extra):
    cfg = ModelConfig(vocab_size=VOCAB, **extra)
    actor = _actor(**extra)
    tokens = _batch(T=40)["tokens"]
    sd = actor.export_weights()
    if not cfg.untie_embeddings_and_output_weights:
        assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    ours, _ = actor.get_logprobs(tokens)
    torch.testing.assert_close(ours, hf_logprobs(sd, cfg, tokens), atol=2e-5, rtol=1e-5)


def test_export_load_round_trip_and_errors():
    a, b = _actor(seed=0), _actor(seed=1)
    tokens = _batch()["tokens"]
    assert not torch.equal(a.get_logprobs(tokens)[0], b.get_logprobs(tokens)[0])
    sd = a.export_weights()
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in sd.values())
    assert sd["model.embed_tokens.weight"].shape == (VOCAB, 128)  # vocabulary un-padded
    b.load_weights(sd)
    assert torch.equal(a.get_logprobs(tokens)[0], b.get_logprobs(tokens)[0])
    for k, v in b.export_weights().items():
        assert torch.equal(v, sd[k]), k
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        b.load_weights(bad)
    bad = dict(sd, **{"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 128)})
    with pytest.raises(ValueError, match="q_proj.*expects"):
        b.load_weights(bad)
    # export returns copies: training must not change an earlier export
    before = {k: v.clone() for k, v in sd.items()}
    a.train_step(_batch(), pg_loss)
    assert all(torch.equal(sd[k], before[k]) for k in sd)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_fp8_logprobs_differ_plausibly_from_shadow(recipe):
    fp8, off = _actor(fp8=recipe), _actor()
    assert fp8.fp8_report.converted == 12 and fp8.fp8_report.total == 12  # 4 linears x 3 layers
    tokens = _batch()["tokens"]
    lp_fp8, _ = fp8.get_logprobs(tokens)
    lp_shadow, _ = fp8.get_shadow_logprobs(tokens)
    lp_off, _ = off.get_logprobs(tokens)
    assert torch.equal(lp_shadow, lp_off)  # shadow = the same weights with FP8 off, bit for bit
    diff = (lp_fp8 - lp_shadow)[:, 1:].abs()
    # Not zero (FP8 is on), not huge (E4M3/E5M2 noise on a 3-layer model with log-probs ~ -2.8).
    assert 1e-4 < diff.mean().item() < 0.2, diff.mean().item()
    assert diff.max().item() < 1.0
    # Log-prob passes run under no_grad: delayed-scaling state does not move, so they repeat exactly.
    assert torch.equal(fp8.get_logprobs(tokens)[0], lp_fp8)


def test_fp8_training_step_and_shadow_after_update():
    fp8, off = _actor(fp8="delayed"), _actor()
    batch = _batch()
    for actor in (fp8, off):
        m = actor.train_step(batch, pg_loss)
        assert torch.isfinite(m["train/loss"][0]) and m["train/skipped"][0] == 0
    # After one step the weights differ (FP8 gradients), but the shadow pass is still the FP8-off
    # forward of *its own* weights: loading them into the FP8-off actor reproduces it exactly.
    off.load_weights(fp8.export_weights())
    assert torch.equal(fp8.get_shadow_logprobs(batch["tokens"])[0], off.get_logprobs(batch["tokens"])[0])


def test_first_last_layers_bf16_keeps_those_layers_high_precision():
    recipe = get_recipe("tensorwise", first_last_layers_bf16=True)
    actor = _actor(fp8=recipe, num_layers=4)
    assert actor.fp8_report.converted == 8 and actor.fp8_report.kept_high_precision == 8
    enabled = {layer.layer_number - 1: [m.fp8_enabled for m in layer.modules() if hasattr(m, "fp8_enabled")]
               for layer in actor.model.decoder.layers}
    assert enabled == {0: [False] * 4, 1: [True] * 4, 2: [True] * 4, 3: [False] * 4}
    assert actor.model.output_layer.__class__.__name__ == "ColumnParallelLinear"  # LM head stays high precision


@pytest.mark.parametrize("fp8", [None, "delayed"])
def test_reference_swap_returns_initial_policy_and_keeps_trained_weights(fp8):
    actor = _actor(fp8=fp8, lr=5e-3, keep_reference=True)
    batch = _batch()
    lp_init, ent_init = actor.get_logprobs(batch["tokens"], with_entropy=True)
    for _ in range(3):
        actor.train_step(batch, pg_loss)
    trained = actor.export_weights()
    lp_trained, _ = actor.get_logprobs(batch["tokens"])
    assert (lp_trained - lp_init).abs().max() > 1e-2
    lp_ref, ent_ref = actor.get_reference_logprobs(batch["tokens"], with_entropy=True)
    assert torch.equal(lp_ref, lp_init) and torch.equal(ent_ref, ent_init)
    after = actor.export_weights()
    assert all(torch.equal(after[k], trained[k]) for k in trained)
    assert torch.equal(actor.get_logprobs(batch["tokens"])[0], lp_trained)
    if fp8:
        shadow_ref, _ = actor.get_reference_logprobs(batch["tokens"], high_precision=True)
        assert not torch.equal(shadow_ref, lp_ref)


def test_reference_needs_keep_reference():
    with pytest.raises(RuntimeError, match="keep_reference=True"):
        _actor().get_reference_logprobs(_batch()["tokens"])


def test_same_seed_is_bitwise_deterministic():
    batch = _batch()
    runs = []
    for _ in range(2):
        actor = _actor(fp8="tensorwise", seed=7)
        metrics = [actor.train_step(batch, pg_loss) for _ in range(2)]
        runs.append((actor.get_logprobs(batch["tokens"])[0], actor.export_weights(), metrics))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    for m0, m1 in zip(runs[0][2], runs[1][2]):
        assert all(torch.equal(m0[k][0], m1[k][0]) for k in m0)
    other = _actor(fp8="tensorwise", seed=8)
    assert not torch.equal(other.get_logprobs(batch["tokens"])[0], runs[0][0])


def test_loss_normalisation_is_independent_of_microbatching():
    batch = _batch(B=6)
    out = []
    for mb in (1, 4, 6):
        actor = _actor(mb=mb)
        m = actor.train_step(batch, pg_loss)
        out.append((m, actor.get_logprobs(batch["tokens"])[0]))
    for m, lp in out[1:]:
        for key in ("train/loss", "train/grad_norm", "loss/pg", "loss/entropy", "train/global_tokens"):
            assert m[key][0].item() == pytest.approx(out[0][0][key][0].item(), rel=1e-5, abs=1e-6), key
        torch.testing.assert_close(lp, out[0][1], atol=2e-5, rtol=1e-5)
    assert out[0][0]["train/global_tokens"][0].item() == batch["mask"].sum().item()
    assert out[0][0]["train/global_seqs"][0].item() == 6


def test_metrics_follow_the_reduction_convention():
    actor = _actor(mb=2)
    batch = _batch(B=6)
    m = actor.train_step(batch, pg_loss)
    assert all(isinstance(v, tuple) and v[0].dim() == 0 and v[1] in ("mean", "sum", "min", "max")
               for v in m.values())
    assert m["train/loss"][1] == "sum" and m["train/grad_norm"][1] == "max"
    assert m["loss/max_adv"][0].item() == pytest.approx(batch["advantages"].max().item())


def test_grad_clip_bounds_the_update():
    batch = _batch()
    clipped = build_actor(ModelConfig(vocab_size=VOCAB), ParallelConfig(micro_batch_size=6), seed=0,
                          lr=1e-3, grad_clip=1e-3, device="cpu")
    free = build_actor(ModelConfig(vocab_size=VOCAB), ParallelConfig(micro_batch_size=6), seed=0,
                       lr=1e-3, grad_clip=0.0, device="cpu")
    w0 = clipped.export_weights()
    mc, mf = clipped.train_step(batch, pg_loss), free.train_step(batch, pg_loss)
    assert mc["train/grad_norm"][0].item() == pytest.approx(mf["train/grad_norm"][0].item())
    # AdamW's first step moves every weight by ~lr regardless of scale, except that clipping to
    # 1e-3 shrinks gradients below eps-dominated size for many entries: the update is smaller.
    d_clip = sum((clipped.export_weights()[k] - w0[k]).abs().sum() for k in w0)
    d_free = sum((free.export_weights()[k] - w0[k]).abs().sum() for k in w0)
    assert d_clip < 0.9 * d_free


def test_non_finite_loss_skips_the_update():
    actor = _actor()
    batch = _batch()
    w0 = actor.export_weights()

    def bad_loss(mb, logprobs, entropy, *, global_tokens, global_seqs):
        loss, metrics = pg_loss(mb, logprobs, entropy, global_tokens=global_tokens, global_seqs=global_seqs)
        return loss * float("nan"), metrics

    m = actor.train_step(batch, bad_loss)
    assert m["train/skipped"][0].item() == 1.0 and not torch.isfinite(m["train/loss"][0])
    assert all(torch.equal(actor.export_weights()[k], w0[k]) for k in w0)
    assert all(p.grad is None for p in actor.model.parameters())
    m = actor.train_step(batch, pg_loss)  # the next good step proceeds
    assert m["train/skipped"][0].item() == 0.0
    assert any(not torch.equal(actor.export_weights()[k], w0[k]) for k in w0)


def test_checkpoint_round_trip_resumes_exactly():
    batch = _batch()
    a = _actor(fp8="delayed", keep_reference=True)
    a.train_step(batch, pg_loss)
    buf = io.BytesIO()
    torch.save(a.state_dict_for_checkpoint(), buf)
    a.train_step(batch, pg_loss)
    expected = a.get_logprobs(batch["tokens"])[0]
    expected_ref = a.get_reference_logprobs(batch["tokens"])[0]

    b = _actor(fp8="delayed", seed=123)
    buf.seek(0)
    b.load_checkpoint_state(torch.load(buf, weights_only=False))
    b.train_step(batch, pg_loss)
    assert torch.equal(b.get_logprobs(batch["tokens"])[0], expected)
    assert torch.equal(b.get_reference_logprobs(batch["tokens"])[0], expected_ref)

    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    sd["layout"] = dict(sd["layout"], tp=2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        b.load_checkpoint_state(sd)
    buf.seek(0)
    with pytest.raises(ValueError, match="fp8"):
        _actor(fp8="tensorwise").load_checkpoint_state(torch.load(buf, weights_only=False))


def test_batch_validation():
    actor = _actor()
    batch = _batch()
    with pytest.raises(ValueError, match="'tokens' and 'mask'"):
        actor.train_step({"tokens": batch["tokens"]}, pg_loss)
    with pytest.raises(ValueError, match="rows"):
        actor.train_step(dict(batch, advantages=batch["advantages"][:2]), pg_loss)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        actor.get_logprobs(batch["tokens"][0])


def test_num_parameters_counts_the_unpadded_model():
    actor = _actor()
    local = sum(p.numel() for p in actor.model.parameters())
    padded_rows = 2 * (actor._padded_vocab - VOCAB) * 128  # embedding + head padding
    assert actor.num_parameters() == local - padded_rows
    assert actor.num_parameters() == sum(t.numel() for t in actor.export_weights().values())
    tied = _actor(untie_embeddings_and_output_weights=False)
    assert tied.num_parameters() == actor.num_parameters() - VOCAB * 128


def test_fp8_health_metrics():
    actor = _actor(fp8="tensorwise")
    assert actor.fp8_metrics()["fp8/quantized"][0].item() == 0  # nothing quantized yet
    actor.train_step(_batch(), pg_loss)
    m = actor.fp8_metrics()
    assert m["fp8/quantized"][0].item() > 0
    assert 0 <= m["fp8/saturation_frac"][0].item() < 1e-3  # current scaling: amax maps to 448, no clamping
    assert m["fp8/nonfinite_amax"][0].item() == 0
    assert actor.fp8_metrics()["fp8/quantized"][0].item() == 0  # reset by the previous call
    assert _actor().fp8_metrics()["fp8/quantized"][0].item() == 0  # FP8 off: nothing counted


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    _actor(seed=5)
    assert torch.equal(torch.rand(3), expected)
