"""GPU (marker ``gpu``; also needs megatron-bridge): megatron-bridge's AutoBridge and our native loader
put identical weights into a Transformer Engine model, for each architecture.

``load_hf_weights(backend="auto")`` uses megatron-bridge on the TE spec when it is installed; this test
is what makes that choice safe. Skipped without CUDA, Transformer Engine or megatron-bridge.
"""

import dataclasses

import pytest
import torch

from ._fixtures import ARCHS, hf_logits, make_tokens
from ._scenarios import full_logits

pytestmark = pytest.mark.gpu


def _requirements() -> str:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"transformer_engine unavailable: {e}"
    try:
        from megatron.bridge import AutoBridge  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"megatron-bridge unavailable: {e}"
    return ""


@pytest.mark.parametrize("arch", ARCHS)
def test_bridge_and_native_load_the_same_weights(checkpoints, arch):
    why = _requirements()
    if why:
        pytest.skip(why)
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor, load_hf_weights, resolve_model_config

    cfg = resolve_model_config(ModelConfig(hf_path=str(checkpoints[arch])))
    actors = {}
    for backend in ("megatron-bridge", "native"):
        actor = build_actor(dataclasses.replace(cfg, hf_path=None), ParallelConfig(micro_batch_size=2), seed=1,
                            lr=1e-3, use_te=True)
        actor.model_cfg = cfg
        assert load_hf_weights(actor, checkpoints[arch], backend=backend) == backend
        actors[backend] = actor
    a, b = actors["megatron-bridge"].export_weights(), actors["native"].export_weights()
    for n in b:
        assert torch.equal(a[n], b[n]), n
    tokens = make_tokens(cfg.vocab_size).cuda()
    ours = full_logits(actors["native"], tokens).cpu()
    ref = hf_logits(checkpoints[arch], tokens.cpu())
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)  # BF16 autocast on the TE path
