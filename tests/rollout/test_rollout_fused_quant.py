"""The rollout schemes' activation quantizers through the fused driver (``fp8.compile``): the same bits as eager.

vLLM's activation rules (per token, per 1x128 group; divide by ``amax / 448``) run at every linear of every
decode step. Under ``fp8.compile`` (always on a GPU) each is one compiled function of the tensor instead of
~6 eager passes; here the compiled C++ (Inductor on the CPU) must give the eager bits, read-back values and
FP8 data with scales alike, for float32 and BF16 inputs, edge rows included.
"""

from __future__ import annotations

import pytest
import torch

from nemo_fp8rl.fp8 import fused
from nemo_fp8rl.fp8.rollout import VllmBlock, VllmW8A8


def _inputs(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])  # outlier channels
    x = x.reshape(-1, shape[-1])
    x[0] = 0.0  # all-zero token: the scale floor
    x[1] = 1e-30  # below the floor
    x[2, 0] = 3e4  # one huge value
    return x.reshape(shape).to(dtype)


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                              b.view(torch.uint8) if b.element_size() == 1 else b)


CASES = [
    ("w8a8 fake", lambda s, x: s.quantize_activation(x), VllmW8A8, (3, 5, 256)),
    ("w8a8 fp8", lambda s, x: (s.activation_fp8(x).data, s.activation_fp8(x).scale_inv), VllmW8A8, (9, 256)),
    ("block fake", lambda s, x: s.quantize_activation(x), VllmBlock, (2, 6, 320)),  # K not a multiple of 128
    ("block fp8", lambda s, x: (s.activation_fp8(x).data, s.activation_fp8(x).scale_inv), VllmBlock, (7, 384)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_compiled_activation_quantizer_gives_the_eager_bits(case, dtype):
    _, call, cls, shape = case
    scheme = cls()
    x = _inputs(dtype, shape)
    with fused.compile_mode_set("false"):
        ref = call(scheme, x)
    fused.reset()
    with fused.compile_mode_set("true"):
        got = call(scheme, x)
        if fused.compile_unavailable():
            pytest.skip(f"torch.compile unavailable here: {fused.compile_unavailable()}")
        other = call(scheme, _inputs(dtype, (shape[0] + 3, *shape[1:])))  # a new token count: no recompile needed
    assert any(isinstance(k, tuple) and k and k[0] == "rollout_activation" for k in fused._cache)  # it compiled
    assert _same(got, ref)
    with fused.compile_mode_set("false"):
        assert _same(other, call(scheme, _inputs(dtype, (shape[0] + 3, *shape[1:]))))
