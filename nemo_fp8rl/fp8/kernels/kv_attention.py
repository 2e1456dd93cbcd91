"""Triton decode attention over an FP8 KV cache: the codes are dequantized per block inside the kernel.

The torch rollout engine stores a quantized layer's keys and values as FP8 codes (``rollout/model.py``,
``KVCache``; vLLM's cache rules in ``fp8/kv_cache.py``). Its reference decode step reads the whole attended
prefix back as float32 (``float32(code) * s``) and runs SDPA on it: per layer and step that writes and reads
4 bytes per cached element on top of the 1 byte stored, O(prefix) extra traffic at every token. This kernel
reads the 1-byte codes once, block by block, and computes, for one decode query per row,

    o[b, h] = sum_{s <= pos[b]} softmax_s(sm_scale * q[b, h] . k_hat[b, g(h), s]) v_hat[b, g(h), s]
    k_hat = float32(k_code) * k_scale,  v_hat = float32(v_code) * v_scale,  g(h) = h // (H / G)

Shapes: q [B, H, hd] (float32, bf16 or fp16: the query as the attention sees it, already quantized and read
back where vLLM quantizes it), k_codes / v_codes [B, G, S_max, hd] uint8 (E4M3 or E5M2 codes; positions past
pos[b] are stale and never read), pos [B] int (the row's last attended position), -> o [B, H, hd] float32.

One program per (row, KV head): it holds the H / G query heads of that group (padded to 16 rows for
``tl.dot``), walks the row's positions in blocks of ``BLOCK_S`` with the online softmax (running max and
normaliser, float32 throughout, ``tl.dot`` in IEEE float32), so K and V are read once per group, not per
query head. The result equals the reference's within float32 rounding, not bit for bit (another summation
order): :func:`decode_reference` gives the float64 value and a bound on the difference from an error
analysis, which ``tests/fp8/_kernel_checks.py`` (interpreter) and the GPU check (device) hold it to.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nemo_fp8rl.fp8.kernels.cast_transpose import _HW, _OPTS, _fp8_value

BLOCK_S = 64
"""Cache positions per block of the online softmax."""


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr,
                   sqb, sqh, sqd, skb, skg, sks, skd, svb, svg, svs, svd, sob, soh, sod,
                   k_scale, v_scale, sm_scale,
                   REP: tl.constexpr, HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, E4M3: tl.constexpr, HW: tl.constexpr):
    """o[b, g*REP:(g+1)*REP] for b = program 0, g = program 1 (module docstring)."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    hmask = hs < REP
    dmask = ds < HD
    heads = g * REP + hs
    qm = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + ds[None, :] * sqd, mask=qm, other=0.0).to(tl.float32)
    n = tl.load(pos_ptr + b).to(tl.int64) + 1
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    for s0 in range(0, n, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        smask = ss < n
        km = smask[:, None] & dmask[None, :]
        kc = tl.load(k_base + ss[:, None] * sks + ds[None, :] * skd, mask=km, other=0).to(tl.int32)
        k = _fp8_value(kc, E4M3, HW) * k_scale  # [BLOCK_S, BLOCK_D]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # [BLOCK_H, BLOCK_S]
        scores = tl.where(smask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vc = tl.load(v_base + ss[:, None] * svs + ds[None, :] * svd, mask=km, other=0).to(tl.int32)
        v = _fp8_value(vc, E4M3, HW) * v_scale
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + b * sob + heads[:, None] * soh + ds[None, :] * sod, o, mask=qm)


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, positions: torch.Tensor,
                     k_scale: float, v_scale: float, fmt: str = "e4m3", sm_scale: float | None = None) -> torch.Tensor:
    """One decode step's attention over an FP8 cache (module docstring): ``o [B, H, hd]`` float32.

    Args:
        q: [B, H, hd] query (any float dtype, any strides; read as float32).
        k_codes, v_codes: [B, G, S_max, hd] uint8 (or FP8) codes of the cache, H a multiple of G.
        positions: [B] integer tensor on q's device; row b attends to cache positions 0..positions[b]
            (stays on the device: no host sync).
        k_scale, v_scale: the layer's dequantization scales (Python floats).
        fmt: ``e4m3`` or ``e5m2``, the codes' format.
        sm_scale: softmax scale, default 1 / sqrt(hd) (SDPA's).
    """
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"FP8 KV cache format {fmt!r}: e4m3 or e5m2")
    B, H, hd = q.shape
    if k_codes.dim() != 4 or k_codes.shape != v_codes.shape or k_codes.shape[0] != B or k_codes.shape[3] != hd:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k_codes.shape)}, v {tuple(v_codes.shape)}: "
                         "need q [B, H, hd] and k, v [B, G, S, hd]")
    G = k_codes.shape[1]
    if H % G:
        raise ValueError(f"decode_attention: {H} query heads are not a multiple of {G} KV heads")
    k8 = k_codes.view(torch.uint8) if k_codes.dtype != torch.uint8 else k_codes
    v8 = v_codes.view(torch.uint8) if v_codes.dtype != torch.uint8 else v_codes
    q = q.float()  # [B, H, hd]: small; the kernel reads float32 (bf16 loads misread subnormals when interpreted)
    out = torch.empty(B, H, hd, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    rep = H // G
    block_h = max(16, triton.next_power_of_2(rep))
    block_d = max(16, triton.next_power_of_2(hd))
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else float(sm_scale)
    _decode_kernel[(B, G)](
        q, k8, v8, positions, out,
        q.stride(0), q.stride(1), q.stride(2), *k8.stride(), *v8.stride(), *out.stride(),
        float(k_scale), float(v_scale), scale,
        REP=rep, HD=hd, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_S=BLOCK_S, E4M3=fmt == "e4m3", HW=_HW,
        num_warps=4, **_OPTS)
    return out


# ---------------------------------------------------------------- the float64 reference and the error bound

_U32 = 2.0**-24
"""float32 unit roundoff."""


def _gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of an n-term float32 sum or dot product."""
    return n * _U32 / (1 - n * _U32)


def decode_reference(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, positions: torch.Tensor,
                     k_scale: float, v_scale: float, fmt: str = "e4m3", sm_scale: float | None = None):
    """The decode attention in float64 from the read-back values the SDPA path attends to
    (``dequantize_kv``: float32(code) * s), and per (row, head) the bound on :func:`decode_attention`'s error
    (on any device: the tests check it in Triton's interpreter, the GPU check on the device).

    Shapes (any device; computed on the CPU): q [B, H, hd], codes [B, G, S, hd] uint8, positions [B] ->
    (o [B, H, hd] float64, bound [B, H] float64). The bound, for row b with n = positions[b] + 1 positions in
    nb blocks of ``BLOCK_S`` = 64:
    * scores s = sm q.k_hat: the float32 dot and the two float32 products (sm itself rounded to float32,
      then the product) give |s_hat - s| <= E = gamma_hd sm max_s sum_d |q_d k_d| + 2u max|s|;
    * each unnormalised weight exp(s - m) passes through at most nb + 1 exponentials (3u each, the GPU's
      approximate exp2 included), the roundings of their arguments (|argument| <= R, the range of the
      scores widened by 2E; times log2(e) for exp2: 2.5 u R together) and nb rescaling products, so
      its log-error is at most T = E + (nb + 1)(4u + 2.5 u R); the normalised weights then differ from the
      exact ones by at most sum_s |w_hat_s - w_s| <= e^{2T} - 1;
    * the sums of p v and of p (per block of 64 and across nb blocks) and the final division add
      2.1 gamma_{64 + nb + 1} max|v| + 2u |o|.
    So |o_hat - o| <= max|v| (e^{2T} - 1 + 2.1 gamma_{64+nb+1}) + 2u |o| per element."""
    from nemo_fp8rl.fp8.formats import get_format
    from nemo_fp8rl.fp8.kv_cache import dequantize_kv

    dt = get_format(fmt).dtype
    q, k_codes, v_codes, positions = q.float().cpu(), k_codes.cpu(), v_codes.cpu(), positions.cpu()
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    ks, vs = k_scale, v_scale
    B, H, hd = q.shape
    G = k_codes.shape[1]
    rep = H // G
    o = torch.zeros(B, H, hd, dtype=torch.float64)
    bound = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        n = int(positions[b]) + 1
        nb = -(-n // BLOCK_S)
        k = dequantize_kv(k_codes[b, :, :n].view(dt), ks).double()  # [G, n, hd]
        v = dequantize_kv(v_codes[b, :, :n].view(dt), vs).double()
        for h in range(H):
            qd = q[b, h].double()
            kg, vg = k[h // rep], v[h // rep]
            s = sm_scale * (kg @ qd)  # [n]
            w = torch.softmax(s, 0)
            o[b, h] = w @ vg
            E = _gamma(hd) * sm_scale * float((kg.abs() @ qd.abs()).max()) + 2 * _U32 * float(s.abs().max())
            R = float(s.max() - s.min()) + 2 * E
            T = E + (nb + 1) * (4 * _U32 + 2.5 * _U32 * R)
            vmax = float(vg.abs().max())
            bound[b, h] = vmax * (math.expm1(2 * T) + 2.1 * _gamma(BLOCK_S + nb + 1))
    return o, bound + 2 * _U32 * o.abs().amax(-1)
