"""GPU: our emulated FP8 values equal Transformer Engine's quantizers (dequantized tensors)."""

import pytest
import torch

from nemo_fp8rl.fp8 import E4M3, fake_quantize

pytestmark = pytest.mark.gpu


def _te():
    te = pytest.importorskip("transformer_engine.pytorch")
    import transformer_engine_torch as tex

    return te, tex


def _require(scaling: str) -> None:
    from nemo_fp8rl.fp8.te import te_support

    ok, reason = te_support(scaling)
    if not ok:
        pytest.skip(f"{scaling}: {reason}")


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda") * 3
    x[3, 7] = 300.0  # an outlier row/block
    return x


def test_tensorwise_matches_te_current_scaling():
    te, tex = _te()
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    x = _inputs()
    q = Float8CurrentScalingQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, device=x.device)
    ours = fake_quantize(x, E4M3, "tensor")
    assert torch.equal(q(x).dequantize().float(), ours)


@pytest.mark.parametrize("dim2", [False, True])
def test_blockwise_matches_te_block_scaling(dim2):
    te, tex = _te()
    _require("blockwise")
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    x = _inputs()
    q = Float8BlockQuantizer(
        fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
        force_pow_2_scales=True, block_scaling_dim=2 if dim2 else 1,
    )
    ours = fake_quantize(x, E4M3, (128, 128) if dim2 else (1, 128), pow2_scales=True)
    assert torch.equal(q(x).dequantize().float(), ours)


def test_mxfp8_matches_te():
    te, tex = _te()
    _require("mxfp8")  # Blackwell sm100 (TE reports sm120 and Hopper as unsupported)
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    x = _inputs()
    q = MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
    assert torch.equal(q(x).dequantize().float(), fake_quantize(x, E4M3, "mx"))
