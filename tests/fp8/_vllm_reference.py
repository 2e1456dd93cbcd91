"""vLLM's FP8 (E4M3) quantization rules, rewritten as plain torch for bit-exact checks of our rollout schemes.

Read from vLLM's CUDA kernels (``csrc/quantization/w8a8/fp8/common.cu`` and ``common.cuh``, moved to
``csrc/libtorch_stable/quantization/w8a8/fp8/`` in later releases; ``per_token_group_quant.cu``) and
from vLLM's test references (``tests/kernels/quant_utils.py``: ``ref_dynamic_per_tensor_fp8_quant``,
``ref_dynamic_per_token_quant``, ``native_per_token_group_quant_fp8``), which were written to match
those kernels:

* ``ops.scaled_fp8_quant(w, scale=None)``: what ``Fp8PerTensorOnlineLinearMethod`` (``quantization=
  "fp8_per_tensor"``, our ``vllm_w8a8``) runs on every weight reload. One scale s = fp32(amax / 448);
  each element is *multiplied by the reciprocal* computed once, ``q = sat(x * fp32(1 / s))``.
* ``dynamic_per_token_scaled_fp8_quant``: activations of ``vllm_w8a8`` (CUTLASS path, per token).
  s = max(fp32(amax_row / 448), fp32(1 / (448 * 512))), each element *divided*: ``q = sat(x / s)``.
* ``per_token_group_quant_8bit`` (1 x 128 groups, activations of ``vllm_block``): the group amax starts
  from eps = fp32(1e-10), s = fp32(amax / 448), ``q = sat(x / s)``.

All reductions use ``fmaxf`` from 0 (a NaN element is skipped), and the saturation is
``fmaxf(-448, fminf(v, 448))``, which turns a NaN into +448. Those two NaN details differ from ours on
purpose (formats.py keeps NaN so the trainer's non-finite checks see it); the tests pin them down.

Not ported as a rule of ours: vLLM's own online 128 x 128 weight quantizer (``per_block_cast_to_fp8`` in
``vllm/utils/deep_gemm.py``, used by ``Fp8PerBlockOnlineLinearMethod``) computes s = max(amax, 1e-4) / 448
and ``x * fp32(1 / s)``. Our ``vllm_block`` sync does not use it: it ships block-FP8 checkpoint tensors
quantized by us (``nemo_fp8rl/rollout/vllm_fp8.py``), which vLLM loads as they are.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
MIN_TOKEN_SCALE = 1.0 / (448.0 * 512.0)  # the kernel's min_scaling_factor, 1.0f / (448.0f * 512.0f)
GROUP_EPS = 1e-10


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def amax_like_kernel(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| in float32 with ``fmaxf`` from 0: NaN elements are skipped."""
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)


def saturate_cast(v: torch.Tensor) -> torch.Tensor:
    """``fmaxf(-448, fminf(v, 448))``, then the E4M3 conversion: NaN becomes +448 (fminf keeps the number)."""
    m = _f32(E4M3_MAX)
    clamped = torch.where(torch.isnan(v), m, torch.minimum(torch.maximum(v, -m), m))
    return clamped.to(torch.float8_e4m3fn)


def quantize_weight_per_tensor(w: torch.Tensor):
    """``scaled_fp8_quant(w, scale=None)`` -> (E4M3 data shaped like w, scale s []).

    s = fp32(amax / 448); the kernel computes r = fp32(1 / s) once and writes sat(x * r). An all-zero w
    gets s = 0, r = inf, 0 * inf = NaN, saturated to +448: data 448 that still dequantizes to 0.
    """
    s = amax_like_kernel(w) / _f32(E4M3_MAX)
    r = _f32(1.0) / s
    return saturate_cast(w.float() * r), s


def quantize_activation_per_token(x: torch.Tensor):
    """``dynamic_per_token_scaled_fp8_quant`` on x [..., K] -> (E4M3 data, scales [..., 1])."""
    s = torch.maximum(amax_like_kernel(x, dim=-1, keepdim=True) / _f32(E4M3_MAX), _f32(MIN_TOKEN_SCALE))
    return saturate_cast(x.float() / s), s


def quantize_activation_per_group(x: torch.Tensor, group: int = 128):
    """``per_token_group_quant_8bit`` on x [..., K] -> (E4M3 data [..., K], scales [..., ceil(K / group)]).

    The kernel needs K % group == 0; a partial last group is zero padded here (what vLLM's torch path
    ``QuantFP8._quantize_group_native`` does), which leaves its amax unchanged.
    """
    k = x.shape[-1]
    pad = (-k) % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    groups = xf.reshape(*xf.shape[:-1], -1, group)
    amax = torch.maximum(amax_like_kernel(groups, dim=-1, keepdim=True), _f32(GROUP_EPS))
    s = amax / _f32(E4M3_MAX)
    q = saturate_cast(groups / s).view(torch.uint8).reshape(*xf.shape[:-1], -1)[..., :k]
    return q.view(torch.float8_e4m3fn), s[..., 0]


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's scaled GEMMs read ``float32(q) * s``."""
    return data.float() * scale
