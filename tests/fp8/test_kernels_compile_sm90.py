"""The GPU branches of the Triton kernels (``HW=True``: the FP8 conversions and tensor-core dots the interpreter
never runs) compiled ahead of time for Hopper (sm90) with the ptxas that ships in the triton wheel: no GPU
needed. Catches what would otherwise first fail on the GPU machine (a type Triton cannot lower, an FP8 dot the
target lacks), and shows that the block-scaled GEMM multiplies E5M2 x E4M3 on the FP8 tensor cores (``wgmma``
with those operand types), not through an upcast."""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the interpreter replaces @triton.jit functions: nothing to compile", allow_module_level=True)


def _compiled(fn, sig: dict, consts: dict, div16=(), **opts):
    """``fn`` compiled for sm90 (skips when this triton has no CUDA backend or ptxas). ``div16``: arguments
    Triton's launcher would mark divisible by 16 (it specializes them so at run time, and integer arguments
    equal to 1 into constants: pass those in ``consts``)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton cannot compile ahead of time: {e}")
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature={**{k: v for k, v in sig.items() if k not in consts},
                                      **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e).lower() or "backend" in str(e).lower():
            pytest.skip(f"no CUDA toolchain in this triton: {e}"[:200])
        raise


def _compile(fn, sig: dict, consts: dict, **opts) -> str:
    """PTX of ``fn`` for sm90."""
    return _compiled(fn, sig, consts, **opts).asm["ptx"]


def _i32(*names):
    return {n: "i32" for n in names}


@pytest.mark.parametrize("a_e4m3,b_tiles,out,config", [(False, True, 1, 0), (False, False, 0, 1), (True, True, 2, 0)])
def test_block_scaled_gemm_compiles_to_a_pipelined_fp8_wgmma(a_e4m3, b_tiles, out, config):
    """As launched on the cast kernels' prepared operands (unit strides along K, the scales' unit strides, sizes
    divisible by 16): FP8 wgmma with the operands' own types, loads pipelined through shared memory
    (cp.async), within the H200's 227 KiB of shared memory per block (the largest candidate tiling too)."""
    from nemo_fp8rl.fp8.kernels import block_gemm as bg

    sig = {"a_ptr": "*u8", "b_ptr": "*u8", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*fp32" if out == 0 else "*i16",
           **_i32("M", "N", "K", "sam", "sak", "sbn", "sbk", "ssam", "ssak", "ssbn", "ssbk", "scm", "scn")}
    bm, bn, warps, stages = bg.GEMM_CONFIGS[config]
    ones = {"sak": 1, "sbk": 1, "scn": 1, "ssam": 1, "ssbk": 1} if b_tiles else {"sak": 1, "sbk": 1, "scn": 1,
                                                                                  "ssam": 1, "ssbn": 1}
    consts = {"A_E4M3": a_e4m3, "B_E4M3": True, "B_TILES": b_tiles, "OUT": out, "BLOCK_M": bm, "BLOCK_N": bn,
              "BLOCK_K": bg.BLOCK_K, "GROUP_M": 8, "IMPRECISE": bg.IMPRECISE_K, "HW": True, **ones}
    k = _compiled(bg._block_mm_kernel, sig, consts, div16=("a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "c_ptr", "M", "N",
                                                           "K", "sam", "sbn", "ssak", "scm"),
                  num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    ptx = k.asm["ptx"]
    mma = set(re.findall(r"wgmma\.mma_async[.\w]*", ptx))
    want = f".f32.{'e4m3' if a_e4m3 else 'e5m2'}.e4m3"
    assert mma and all(m.endswith(want) for m in mma), mma
    assert "cp.async" in ptx and 2 * (bm + bn) * bg.BLOCK_K <= k.metadata.shared <= 227 * 1024, k.metadata.shared


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_kv_decode_attention_compiles(fmt):
    from nemo_fp8rl.fp8.kernels import kv_attention as kva

    sig = {"q_ptr": "*fp32", "k_ptr": "*u8", "v_ptr": "*u8", "pos_ptr": "*i64", "o_ptr": "*fp32",
           **{n: "i64" for n in ("sqb", "sqh", "sqd", "skb", "skg", "sks", "skd", "svb", "svg", "svs", "svd",
                                 "sob", "soh", "sod")},
           "k_scale": "fp32", "v_scale": "fp32", "sm_scale": "fp32"}
    consts = {"REP": 4, "HD": 128, "BLOCK_H": 16, "BLOCK_D": 128, "BLOCK_S": kva.BLOCK_S, "E4M3": fmt == "e4m3",
              "HW": True}
    assert ".entry" in _compile(kva._decode_kernel, sig, consts, num_warps=4)


@pytest.mark.parametrize("most_recent", [True, False])
def test_delayed_update_compiles(most_recent):
    from nemo_fp8rl.fp8.kernels import cast_transpose as ct

    sig = {"hist_ptr": "*fp32", "amax_ptr": "*fp32", "new_hist_ptr": "*fp32", "scale_ptr": "*fp32",
           "count_ptr": "*i64", "L": "i32"}
    consts = {"MOST_RECENT": most_recent, "TOP": 448.0, "EPS": 0.0, "INF_CAP": 3.4028234663852886e38,
              "POW2": True, "COUNT": True, "BLOCK_L": 1024}
    assert ".entry" in _compile(ct._delayed_update_kernel, sig, consts, num_warps=1, enable_fp_fusion=False)


@pytest.mark.parametrize("readback,out_bf16", [(False, False), (True, True)])
def test_rollout_activation_quantizers_compile(readback, out_bf16):
    from nemo_fp8rl.fp8.kernels import vllm_quant as vq

    common = {"READBACK": readback, "OUT_BF16": out_bf16, "IN_BF16": True, "FMAX": 448.0, "HW": True}
    out_t = ("*i16" if out_bf16 else "*fp32") if readback else "*u8"
    token = {"x_ptr": "*i16", **_i32("M", "K", "sxm", "sxk"), "out_ptr": out_t, "s_ptr": "*fp32"}
    assert ".entry" in _compile(vq._token_quant_kernel, token,
                                {**common, "MIN_SCALE": 1.0 / (448.0 * 512.0), "BLOCK_M": 8, "BLOCK_K": 512})
    group = {"x_ptr": "*i16", **_i32("M", "K", "sxm", "sxk"), "out_ptr": out_t, "s_ptr": "*fp32", "NG": "i32"}
    assert ".entry" in _compile(vq._group_quant_kernel, group, {**common, "EPS": 1e-10, "BLOCK_M": 16, "GROUP": 128})
