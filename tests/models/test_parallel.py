"""TP=2, PP=2 and DP=2 (2 gloo processes, real megatron schedules) against TP=PP=DP=1.

One launch runs every 2-process scenario of ``_scenarios.LAYOUTS``; the single-process references
run here. Same seed -> identical initial weights (exactly), then log-probs, entropies, losses, grad
norms and the weights after two AdamW steps agree within float32 tolerance.
"""

import pytest
import torch

from tests._fp8_bounds import assert_fp8_paths_agree, fp8_noise_bound

from . import _scenarios as S
from ._dist import run_ranks


@pytest.fixture(scope="module")
def runs():
    from nemo_fp8rl.models import destroy_distributed

    # The references use 1 intra-op thread, as every rank of run_ranks does: another thread count may
    # sum a float32 GEMM in another order and flip an FP8 rounding (tests/_fp8_bounds.py), and the PP
    # comparison below is exact only because both sides compute the same GEMMs the same way.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {name: S.run_actor(cfg, par, fp8=fp8) for name, (cfg, par, fp8) in S.REFERENCES.items()}
    finally:
        torch.set_num_threads(threads)
    destroy_distributed()
    return refs, run_ranks("all_layouts")


def _ref_for(name):
    return {"A_pp2_fp8": "A_fp8", "A_tp2_mxfp8": "A_mxfp8"}.get(name, name[0])


def _fp8_tp_matches(out, ref, hp, name):
    """FP8 under TP against FP8 at TP=1: the row-parallel GEMMs sum their halves in another order, so
    float noise can flip a rare FP8 rounding. Bounds that hold whatever the CPU (tests/_fp8_bounds.py):
    tensors agree to float noise but for a few elements, each within the FP8 noise of the same quantity
    (``hp``: the high-precision run of the same initial weights); scalar metrics differ by less than
    their FP8 noise; the weights move as at TP=1 (difference of the updates well below the updates)."""
    for key in ("lp0", "ent0", "lp0_t"):
        assert_fp8_paths_agree(out[key], ref[key], float_tol=5e-5, fp8_noise=fp8_noise_bound(ref[key], hp[key]),
                               what=f"{name} {key}")
    for step in range(len(ref["metrics"])):
        assert_fp8_paths_agree(out["logprobs"][step], ref["logprobs"][step], float_tol=5e-5,
                               fp8_noise=fp8_noise_bound(ref["logprobs"][step], hp["logprobs"][step]),
                               what=f"{name} logprobs after step {step}")
        for key, val in ref["metrics"][step].items():
            noise = abs(val - hp["metrics"][step][key])
            assert abs(out["metrics"][step][key] - val) <= 1e-4 * abs(val) + 1e-5 + noise, (name, step, key)
    upd_ref = torch.cat([(ref["final"][k] - ref["init"][k]).flatten() for k in ref["final"]])
    upd_out = torch.cat([(out["final"][k] - ref["init"][k]).flatten() for k in ref["final"]])
    assert float((upd_out - upd_ref).norm()) < 0.1 * float(upd_ref.norm()), name


@pytest.mark.parametrize("name", list(S.LAYOUTS))
def test_layout_matches_single_process(runs, name):
    refs, ranks = runs
    ref = refs[_ref_for(name)]
    exact_fp8 = name == "A_pp2_fp8"  # PP does not change what each FP8 GEMM sees
    fp8_tp = name == "A_tp2_mxfp8"
    for rank, res in enumerate(ranks):
        out = res[name]
        tp, pp, dp, _ = out["layout"]
        assert tp * pp * dp == 2
        # Same seed -> bit-identical initial weights in every layout (TP-gathered, all stages).
        assert out["init"].keys() == ref["init"].keys()
        for k in ref["init"]:
            assert torch.equal(out["init"][k], ref["init"][k]), (name, rank, k)
        if fp8_tp:
            _fp8_tp_matches(out, ref, refs["A"], name)
            continue
        tol = dict(atol=1e-6, rtol=0) if exact_fp8 else dict(atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out["lp0"], ref["lp0"], **tol)
        torch.testing.assert_close(out["ent0"], ref["ent0"], **tol)
        torch.testing.assert_close(out["lp0_t"], ref["lp0_t"], **tol)
        for step in range(len(ref["metrics"])):
            for key, val in ref["metrics"][step].items():
                assert out["metrics"][step][key] == pytest.approx(val, rel=1e-4, abs=1e-5), (name, step, key)
            torch.testing.assert_close(out["logprobs"][step], ref["logprobs"][step], atol=5e-5, rtol=1e-5)
        for k in ref["final"]:
            torch.testing.assert_close(out["final"][k], ref["final"][k], atol=1e-4, rtol=1e-4)


def test_training_moved_the_model(runs):
    # Guard against a vacuous comparison: the steps change log-probs well beyond the tolerances.
    refs, _ = runs
    for ref in refs.values():
        assert (ref["logprobs"][-1] - ref["lp0"]).abs().max() > 1e-2
        assert ref["metrics"][0]["train/grad_norm"] > 0.1


def test_vocab_parallel_logprobs_two_ranks(runs):
    _, ranks = runs
    for res in ranks:
        vp = res["vocab_parallel"]
        full = vp["full"].clone().requires_grad_(True)
        lsm = torch.log_softmax(full[..., : vp["V"]], -1)
        lp = lsm.gather(-1, vp["target"][..., None]).squeeze(-1)
        ent = -(lsm.exp() * lsm).sum(-1)
        ((lp * vp["w_lp"]).sum() + (ent * vp["w_ent"]).sum()).backward()
        torch.testing.assert_close(vp["lp"], lp.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vp["ent"], ent.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vp["grad"], full.grad, atol=1e-5, rtol=1e-5)


def test_bf16_weight_stream_is_the_export_in_bf16_on_every_layout(runs):
    """``iter_weights(dtype=bf16)`` (the colocated engine's sync, pipeline stages included: one manifest
    broadcast per stage, then the tensors in BF16) is the float32 export rounded to BF16, name for name, on
    every rank; and so in the references."""
    refs, ranks = runs
    for out in [*refs.values(), *(res[name] for res in ranks for name in S.LAYOUTS)]:
        stream, full = out["stream_bf16"], out["final"]
        assert set(stream) <= set(full) and set(full) - set(stream) <= {"lm_head.weight"}  # tied: one copy
        for k, t in stream.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, full[k].to(torch.bfloat16)), k


def test_stage_manifest_is_what_the_stage_stream_yields():
    """stage_hf_manifest (names and shapes from the structure, no collective) lists exactly what
    iter_stage_hf yields, in order, for the model variants the exports cover."""
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.models.hf_weights import iter_stage_hf, stage_hf_manifest

    for kw in (dict(vocab_size=19, qk_layernorm=True, untie_embeddings_and_output_weights=False), S.CFG_A, S.CFG_B):
        actor = build_actor(ModelConfig(**kw), ParallelConfig(), seed=0, lr=1e-4, device="cpu")
        got = [(n, tuple(t.shape)) for n, t in iter_stage_hf(actor.model, actor.model_cfg, None)]
        assert stage_hf_manifest(actor.model, actor.model_cfg) == got, kw
