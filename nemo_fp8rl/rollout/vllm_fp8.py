"""The weight-sync format of FP8 rollout in vLLM: E4M3 weights plus per-block ``weight_scale_inv``.

vLLM loads block-FP8 checkpoints (``quantization_config = {"quant_method": "fp8", "weight_block_size":
[128, 128], "activation_scheme": "dynamic"}``, the DeepSeek-V3 / Qwen3-FP8 layout) as, for every linear
``W`` [N, K]: ``<name>.weight`` in ``float8_e4m3fn`` [N, K] and ``<name>.weight_scale_inv`` in float32
[ceil(N / 128), ceil(K / 128)]; it dequantizes tile (i, j) as ``W_hat = float(q) * weight_scale_inv[i, j]``.

Our rollout scheme ``vllm_block`` (:class:`nemo_fp8rl.fp8.rollout.VllmBlock`) emulates exactly that
weight: per 128x128 tile ``s = amax(tile) / 448`` (1 for an all-zero tile), ``q = sat_e4m3(tile / s)``,
``W_hat = float(q) * s``. :func:`vllm_block_fp8_weight` produces ``(q, s)`` with the same operations, so
the weights vLLM dequantizes from a sync equal our emulated weights bit for bit (tested on CPU; on GPU,
tests/rollout/test_vllm_gpu.py reads them back from the running engine). The vLLM engine sends every
sync of ``rollout.fp8.scheme=vllm_block`` through :func:`vllm_block_fp8_stream`, one tensor at a time.

Fused layers: vLLM concatenates q/k/v (and gate/up) with their scale rows; our torch engine quantizes the
fused weight. Both give the same tiles when every part's row count is a multiple of 128 (true for the
8B-32B presets), which a test checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from nemo_fp8rl.fp8.formats import E4M3, cast_to_fp8, divide_exact
from nemo_fp8rl.fp8.quantize import _blocks_2d, _unblocks_2d

__all__ = [
    "LINEAR_SUFFIXES", "dequantize_vllm_block", "ignored_linear_names", "vllm_block_fp8_state_dict", "vllm_block_fp8_stream",
    "vllm_block_fp8_weight",
]

BLOCK = 128
LINEAR_SUFFIXES = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
"""The weights vLLM's block-FP8 linears hold in FP8 (embeddings, norms, biases, LM head stay high precision)."""


def vllm_block_fp8_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> ``(q, weight_scale_inv)``: q float8_e4m3fn [N, K], scales float32 [ceil(N/b), ceil(K/b)].

    Per b x b tile (edge tiles zero padded): ``s = amax(|tile|) / 448`` (s = 1 when amax = 0),
    ``q = sat_e4m3(tile / s)``; ``weight_scale_inv = s`` (vLLM's name: the factor that dequantizes).
    """
    if w.dim() != 2:
        raise ValueError(f"vllm_block_fp8_weight expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    tiles = _blocks_2d(wf, block, block)  # [R, C, b, b]
    s = divide_exact(tiles.abs().amax(dim=(-2, -1), keepdim=True), 448.0)
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = cast_to_fp8(tiles / s, E4M3)
    # un-tile in float32 (padding and permutes are not implemented for float8 on every torch build)
    return _unblocks_2d(q.float(), *wf.shape).to(E4M3.dtype), s[..., 0, 0].contiguous()


def dequantize_vllm_block(q: torch.Tensor, weight_scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """vLLM's dequantization: ``W_hat[tile (i, j)] = float(q[tile]) * weight_scale_inv[i, j]`` -> float32 [N, K]."""
    n, k = q.shape
    tiles = _blocks_2d(q.float(), block, block)
    return _unblocks_2d(tiles * weight_scale_inv[:, :, None, None], n, k)


def vllm_block_fp8_stream(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None = None,
    high_precision_layers: Iterable[int] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The sync stream of ``rollout.fp8.scheme=vllm_block``: every linear weight as ``(name, q)`` followed by
    ``(name + "_scale_inv", s)`` (:func:`vllm_block_fp8_weight`); every other tensor (embeddings, norms,
    biases, LM head) unchanged, and so are the linears of ``high_precision_layers`` (BF16 edge layers: the
    engine's quantization config lists them in ``ignored_layers``, :func:`ignored_linear_names`).

    ``weights``: a state dict or a stream of ``(name, tensor)`` pairs; a stream is consumed one pair at a
    time (nothing is collected). ``device``: where to quantize (None: where the tensor is); the result is
    the same bit for bit on any device (amax, a correctly rounded division by 448 and by s, a
    round-to-nearest-even cast), so a GPU engine quantizes on the GPU.
    """
    keep = {f"model.layers.{int(i)}." for i in high_precision_layers}
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    for name, t in pairs:
        if name.endswith(LINEAR_SUFFIXES) and ".".join(name.split(".")[:3]) + "." not in keep:
            q, s = vllm_block_fp8_weight(t if device is None else t.to(device))
            del t
            yield name, q
            del q
            yield name + "_scale_inv", s
        else:
            yield name, t


def ignored_linear_names(high_precision_layers: Iterable[int]) -> list[str]:
    """vLLM module names of the linears of ``high_precision_layers``, for a quantization config's
    ``ignored_layers`` (block FP8) or ``ignore`` (online ``fp8_per_tensor``): one per Hugging Face linear
    (``model.layers.<i>.self_attn.q_proj``, ...); vLLM skips a fused module (``qkv_proj``, ``gate_up_proj``)
    when all of its parts are listed."""
    return [f"model.layers.{int(i)}.{suffix.removesuffix('.weight')}"
            for i in sorted({int(i) for i in high_precision_layers}) for suffix in LINEAR_SUFFIXES]


def vllm_block_fp8_state_dict(hf_state_dict: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`vllm_block_fp8_stream` of a state dict (kept for callers that hold a dict)."""
    return vllm_block_fp8_stream(hf_state_dict)
