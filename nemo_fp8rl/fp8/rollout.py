"""FP8 schemes of the rollout (inference) engine, separate from the training recipe as in real stacks.

An inference engine quantizes the synced weights once per weight sync and the activations on the
fly. Its scales follow vLLM's FP8 (E4M3) kernels: the scale is ``s = amax / 448`` (the factor that
dequantizes), and each kernel either multiplies by its float32 reciprocal or divides by it, which
rounds ties differently, so each rule below says which (``tests/fp8/_vllm_reference.py`` ports them):

* ``vllm_w8a8`` (default): weight per tensor, ``s_w = amax(W) / 448``, ``W_hat = sat(W * fp32(1/s_w)) * s_w``
  (``scaled_fp8_quant(w, scale=None)``, run by ``Fp8PerTensorOnlineLinearMethod`` at every weight reload:
  the dynamic per-tensor kernel multiplies by the reciprocal); activations per token (row),
  ``s_x = max(amax(x_row) / 448, 1 / (448 * 512))``, ``x_hat = sat(x / s_x) * s_x`` (CUDA's
  ``dynamic_per_token_scaled_fp8_quant`` divides; vLLM's torch path ``QuantFP8.forward_native``, used on
  CPU and when the ``quant_fp8`` custom op is off, multiplies by the reciprocal instead; our vLLM
  engine runs with ``enforce_eager``, so the CUDA kernel).
* ``vllm_block``: weight in 128x128 tiles, ``s = amax(tile) / 448``, ``W_hat = sat(W / s) * s`` (our sync
  ships these tiles as a block-FP8 checkpoint, ``rollout/vllm_fp8.py``, and vLLM reads them as they are);
  activations in dynamic 1x128 groups along K, ``s = max(amax(group), 1e-10) / 448``, ``sat(x / s) * s``
  (``per_token_group_quant_8bit`` divides).
* ``same_as_train``: the training recipe's forward quantization (inputs and weights), so rollout and
  trainer differ only by what the trainer does after sampling (delayed scaling is replaced by
  current per-tensor scaling: an inference engine has no amax history).
* ``off``: high precision.

Rollout and trainer log-probs therefore disagree even at identical weights (docs/design.md, FP8).

Real FP8 GEMMs: ``weight_fp8`` / ``activation_fp8`` return the same values as FP8 data plus
scale-inverses (:class:`~nemo_fp8rl.fp8.backends.QuantizedOperand`, ``dequantize()`` equals
``quantize_weight`` / ``quantize_activation`` bit for bit), which the torch rollout engine hands to
torch's scaled GEMM on a GPU (``vllm_w8a8``: row-wise x row-wise, the per-tensor weight scale repeated
per output row, as vLLM's per-token kernel does; ``vllm_block``: 1x128 x 128x128).
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_fp8rl.fp8 import fused, kernels
from nemo_fp8rl.fp8.backends import QuantizedOperand, torch_gemm_support
from nemo_fp8rl.fp8.formats import E4M3, cast_to_fp8, divide_exact
from nemo_fp8rl.fp8.kernels import kernel_unavailable
from nemo_fp8rl.fp8.quantize import _blocks_1d, _blocks_2d, _unblocks_2d, fake_quantize
from nemo_fp8rl.fp8.recipes import Fp8Recipe, get_recipe

_VLLM_MIN_SCALE = 1.0 / (448.0 * 512.0)
_BLOCK_EPS = 1e-10


def _divide_quant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``sat_e4m3(x / s) * s``, float32 (vLLM's per-token and per-group activation kernels)."""
    return cast_to_fp8(x / s, E4M3).float() * s


# The activation quantizers run at every linear of every decode step. Each is one function of the tensor
# (its eager ops: upcast, amax, scale rule, divide, saturate, cast, read back), run through the training
# path's fused quantizer driver (:func:`nemo_fp8rl.fp8.fused.run`): under ``fp8.compile`` (always on a GPU)
# it is traced and compiled into an amax loop and one pointwise loop, with Inductor's exact division, so
# the bits are the eager ones (tests/rollout/test_rollout_fused_quant.py); eager otherwise. Where Triton runs
# (CUDA), the schemes call the kernels of ``kernels/vllm_quant.py`` instead: the same bits in one launch, with
# no Dynamo guards on the host (tests/fp8/_kernel_checks.py compares them with these functions). The training
# quantizer itself (``quantize._quantize_impl``) cannot stand in: it scales by ``x * (M / amax)``, while
# vLLM divides by ``amax / M``, which rounds differently.


def _token_scales(xf: torch.Tensor) -> torch.Tensor:
    """vLLM's per-token scales: ``max(amax(x_row) / 448, 1 / (448 * 512))``, [..., 1] float32."""
    return divide_exact(xf.abs().amax(dim=-1, keepdim=True), 448.0).clamp(min=_VLLM_MIN_SCALE)


def _token_fake(x: torch.Tensor) -> torch.Tensor:
    """Per-token ``sat(x / s) * s`` of x [..., K] (float32)."""
    xf = x.float()
    return _divide_quant(xf, _token_scales(xf))


def _token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(sat(x / s) as E4M3, s)`` of x [M, K]."""
    xf = x.float()
    s = _token_scales(xf)
    return cast_to_fp8(xf / s, E4M3), s


def _group_scales(groups: torch.Tensor) -> torch.Tensor:
    """vLLM's 1xB group scales: ``max(amax, 1e-10) / 448``, [..., n_groups, 1] float32."""
    return divide_exact(groups.abs().amax(dim=-1, keepdim=True).clamp(min=_BLOCK_EPS), 448.0)


def _group_fake(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per 1x``block`` group along K: ``sat(x / s) * s`` of x [..., K] (float32)."""
    xf = x.float()
    groups, k = _blocks_1d(xf, block)
    return _divide_quant(groups, _group_scales(groups)).reshape(*xf.shape[:-1], -1)[..., :k]


def _group_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of ``block``) -> E4M3 data [M, K] and group scales [M, K/block]."""
    xf = x.float()
    groups, _ = _blocks_1d(xf, block)
    s = _group_scales(groups)
    return cast_to_fp8(groups / s, E4M3).reshape(xf.shape[0], -1), s[..., 0]


def _run(tag: str, fn, x: torch.Tensor, *static):
    """``fn(x, *static)`` through :func:`fused.run` (one compiled graph per tag, rank, dtype and static args)."""
    return fused.run(("rollout_activation", tag, x.dim(), x.dtype, *static), lambda: (lambda t: fn(t, *static)), x)


def _kernel_ops(x: torch.Tensor):
    """The Triton activation quantizers (``kernels/vllm_quant.py``: one launch per call, the same bits as the
    functions above) where they run for ``x`` (CUDA with Triton; never on a plain CPU install), else None:
    the compiled or eager functions above then run, whose Dynamo guards cost ~0.6 ms of host per call on a GPU
    (issue 38's profile), which decode pays at every linear of every step."""
    if x.dim() < 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or kernel_unavailable(x.device):
        return None
    return kernels.vllm_ops()


def _kernel_readback(quant, x: torch.Tensor, *args) -> torch.Tensor:
    """``quant``'s read-back values of x [..., K] (float32, x's shape)."""
    q, _ = quant(x.reshape(-1, x.shape[-1]), *args, readback=True)
    return q.reshape(x.shape)


def _per_tensor_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``scaled_fp8_quant(w, scale=None)``: ``(sat_e4m3(w * fp32(1/s)), s)``, ``s = amax(w) / 448``.

    The kernel computes the reciprocal once and multiplies each element by it; ``w / s`` would round
    ~1.5% of the codes of some bf16 weights the other way. An all-zero w gets s = 1 here (vLLM's kernel
    writes 448 with s = 0; both read back 0).
    """
    wf = w.float()
    s = divide_exact(wf.abs().amax(), 448.0)  # the CUDA kernel divides, as the CPU one
    s = torch.where(s > 0, s, torch.ones_like(s))
    return cast_to_fp8(wf * (1.0 / s), E4M3), s


class RolloutScheme:
    """Base: high precision (``off``). ``quantize_weight`` once per sync, ``quantize_activation`` per call."""

    name = "off"

    def quantize_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Weight [N, K] -> its FP8 read-back value [N, K] (float32)."""
        return w.float()

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor:
        """Activation [..., K] -> its FP8 read-back value (float32)."""
        return x.float()

    def torch_gemm_support(self, device, out_features: int, in_features: int) -> Optional[str]:
        """Why torch's FP8 GEMM cannot run this scheme for a [out, in] linear on ``device`` (None = it can)."""
        return f"rollout FP8 scheme {self.name!r} has no FP8 GEMM (it runs emulated)"

    @property
    def enabled(self) -> bool:
        return self.name != "off"

    def __repr__(self) -> str:
        return f"RolloutScheme({self.name})"


class VllmW8A8(RolloutScheme):
    """Per-tensor weight scale, dynamic per-token activation scales (module docstring)."""

    name = "vllm_w8a8"

    def quantize_weight(self, w: torch.Tensor) -> torch.Tensor:
        """``s_w = amax(W)/448``; ``W_hat = sat(W * fp32(1/s_w)) * s_w``; W [N, K]."""
        q, s = _per_tensor_weight(w)
        return q.float() * s

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor:
        """Per token: ``s = max(amax(x_row)/448, 1/(448*512))``, ``sat(x / s) * s``; x [..., K]."""
        ops = _kernel_ops(x)
        if ops is not None:
            return _kernel_readback(ops.quantize_per_token, x)
        return _run("token_fake", _token_fake, x)

    def weight_fp8(self, w: torch.Tensor) -> QuantizedOperand:
        """W [N, K] -> E4M3 ``sat(W * fp32(1/s_w))``, s_w repeated per row ([N, 1]: row-wise GEMM layout)."""
        q, s = _per_tensor_weight(w)
        return QuantizedOperand(q.contiguous(), s.expand(w.shape[0], 1).contiguous(), "row")

    def activation_fp8(self, x: torch.Tensor) -> QuantizedOperand:
        """x [M, K] -> E4M3 ``sat(x / s_x)`` with per-token s_x [M, 1]."""
        ops = _kernel_ops(x)
        data, s = ops.quantize_per_token(x) if ops is not None else _run("token_fp8", _token_fp8, x)
        return QuantizedOperand(data.contiguous(), s, "row")

    def torch_gemm_support(self, device, out_features: int, in_features: int) -> Optional[str]:
        return torch_gemm_support(get_recipe("rowwise"), device, out_features, in_features)


class VllmBlock(RolloutScheme):
    """128x128 weight tiles, dynamic 1x128 activation groups (DeepSeek-style block FP8)."""

    name = "vllm_block"

    def __init__(self, block: int = 128) -> None:
        self.block = block

    def quantize_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Per tile: ``s = amax(tile)/448``; W [N, K] -> [N, K]."""
        wf = w.float()
        tiles = _blocks_2d(wf, self.block, self.block)
        s = divide_exact(tiles.abs().amax(dim=(-2, -1), keepdim=True), 448.0)
        s = torch.where(s > 0, s, torch.ones_like(s))
        return _unblocks_2d(_divide_quant(tiles, s), *wf.shape)

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor:
        """Per 1x128 group along K: ``s = max(amax, 1e-10)/448``; x [..., K]."""
        ops = _kernel_ops(x) if self.block & (self.block - 1) == 0 else None
        if ops is not None:
            return _kernel_readback(ops.quantize_per_group, x, self.block)
        return _run("group_fake", _group_fake, x, self.block)

    def weight_fp8(self, w: torch.Tensor) -> QuantizedOperand:
        """W [N, K] (multiples of the block) -> E4M3 data [N, K] and tile scales [N/B, K/B]."""
        wf = w.float()
        tiles = _blocks_2d(wf, self.block, self.block)
        s = divide_exact(tiles.abs().amax(dim=(-2, -1), keepdim=True), 448.0)
        s = torch.where(s > 0, s, torch.ones_like(s))
        data = _unblocks_2d(cast_to_fp8(tiles / s, E4M3), *wf.shape)
        return QuantizedOperand(data.contiguous(), s[..., 0, 0].contiguous(), (self.block, self.block))

    def activation_fp8(self, x: torch.Tensor) -> QuantizedOperand:
        """x [M, K] (K a multiple of the block) -> E4M3 data [M, K] and group scales [M, K/B]."""
        ops = _kernel_ops(x) if self.block & (self.block - 1) == 0 else None
        data, s = ops.quantize_per_group(x, self.block) if ops is not None else _run("group_fp8", _group_fp8, x, self.block)
        return QuantizedOperand(data.contiguous(), s.contiguous(), (1, self.block))

    def torch_gemm_support(self, device, out_features: int, in_features: int) -> Optional[str]:
        if self.block != 128:
            return f"vllm_block with {self.block}-blocks: torch runs 128 only"
        return torch_gemm_support(get_recipe("blockwise"), device, out_features, in_features)


class SameAsTrain(RolloutScheme):
    """The training recipe's forward quantization of inputs and weights."""

    name = "same_as_train"

    def __init__(self, recipe: Fp8Recipe) -> None:
        # An inference engine has no amax history: delayed scaling becomes current per-tensor scaling.
        self.recipe = recipe.replace(scaling="tensorwise") if recipe.scaling == "delayed" else recipe

    def _q(self, t: torch.Tensor, role: str) -> torch.Tensor:
        r = self.recipe
        return fake_quantize(
            t.float(), r.format_for(role), r.granularity_for(role), dim=-1, pow2_scales=r.pow2_scales,
            eps=r.amax_epsilon, block=r.mx_block, divide=r.dequant == "divide",
        )

    def quantize_weight(self, w: torch.Tensor) -> torch.Tensor:
        return self._q(w, "weight")

    def quantize_activation(self, x: torch.Tensor) -> torch.Tensor:
        return self._q(x, "input")


ROLLOUT_SCHEMES = ("off", "vllm_w8a8", "vllm_block", "same_as_train")


def get_rollout_scheme(name: Optional[str], train_recipe: Optional[Fp8Recipe] = None) -> RolloutScheme:
    """Rollout FP8 scheme by name: ``off``, ``vllm_w8a8``, ``vllm_block``, ``same_as_train``.

    ``same_as_train`` needs the training recipe (and falls back to ``off`` when training FP8 is off).
    """
    if name is None or name == "off":
        return RolloutScheme()
    if name == "vllm_w8a8":
        return VllmW8A8()
    if name == "vllm_block":
        return VllmBlock()
    if name == "same_as_train":
        if train_recipe is None:
            return RolloutScheme()
        return SameAsTrain(train_recipe)
    raise ValueError(f"unknown rollout FP8 scheme {name!r} (rollout.fp8.scheme); valid: {list(ROLLOUT_SCHEMES)}")

