"""GPU (marker ``gpu``): the model on our linears with ``fp8.backend=torch`` (torch's FP8 GEMMs), per recipe.

- the conversion report says which linears run torch's GEMMs (every one on sm90 for tensorwise, delayed,
  rowwise, blockwise; mxfp8 falls back with the reason);
- log-probs on torch's GEMMs and on the emulation of the same recipe (same weights) agree to within the
  FP8 noise level, measured as the distance of the emulated FP8 log-probs from the high-precision shadow;
- one train step is finite (loss, grad norm, log-probs after the update).
"""

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig

from ._scenarios import make_batch, pg_loss

pytestmark = pytest.mark.gpu

# hidden 256, ffn 512, 2 heads of 128: every linear a multiple of 128 (blockwise runs on torch too)
SHAPE = dict(vocab_size=16, hidden_size=256, ffn_hidden_size=512, num_attention_heads=2, num_layers=2)
RECIPES = [("tensorwise", {}), ("delayed", {}), ("rowwise", {}), ("blockwise", {}),
           ("blockwise", {"fp8_format": "hybrid"}), ("mxfp8", {})]


def _build(recipe, backend, **kw):
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    return build_actor(ModelConfig(**SHAPE), ParallelConfig(micro_batch_size=8), fp8_recipe=get_recipe(recipe, **kw),
                       seed=0, lr=1e-4, fp8_backend=backend, device="cuda")


@pytest.mark.parametrize("recipe,kw", RECIPES, ids=[f"{r}-{k.get('fp8_format', 'default')}" for r, k in RECIPES])
def test_torch_backend_parity_and_train_step(recipe, kw):
    from nemo_fp8rl.fp8.backends import fp8_gpu

    if not (torch.cuda.is_available() and fp8_gpu("cuda")):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
    batch = {k: v.cuda() for k, v in make_batch(16, B=8, T=32).items()}
    real = _build(recipe, "torch", **kw)
    emu = _build(recipe, "emulate", **kw)
    rep = real.fp8_report
    assert rep.backend == "torch" and rep.converted > 0
    cap = torch.cuda.get_device_capability()
    if recipe == "mxfp8" and cap < (10, 0):
        assert rep.torch_gemm == 0 and all("sm100" in r for r in rep.fallback_reasons), rep
    elif recipe != "blockwise" or cap[0] == 9:
        assert rep.torch_gemm == rep.converted, rep  # every linear on torch's FP8 GEMM
    w_r, w_e = real.export_weights(), emu.export_weights()
    assert all(torch.equal(w_r[k], w_e[k]) for k in w_r)

    lp_real, _ = real.get_logprobs(batch["tokens"])
    lp_emu, _ = emu.get_logprobs(batch["tokens"])
    lp_hp, _ = emu.get_shadow_logprobs(batch["tokens"])
    m = batch["mask"].bool()
    noise = (lp_emu - lp_hp)[m].abs().mean().item()
    gap = (lp_real - lp_emu)[m].abs().mean().item()
    assert noise > 0
    assert gap <= 1.5 * noise, f"{recipe}: torch FP8 GEMMs vs emulation {gap:.4f} exceeds the FP8 noise {noise:.4f}"

    metrics = real.train_step(batch, pg_loss)
    assert torch.isfinite(metrics["train/loss"][0]) and metrics["train/skipped"][0] == 0
    assert torch.isfinite(metrics["train/grad_norm"][0])
    assert torch.isfinite(real.get_logprobs(batch["tokens"])[0]).all()
