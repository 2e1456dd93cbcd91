"""Part te_parity (needs Transformer Engine; skipped where it is not installed): TE's quantizers vs our
emulation on the same random CUDA tensors, max |difference| of the dequantized values for delayed (a
given scale, with saturation), tensorwise (current scaling), blockwise 1x128 and 128x128, and mxfp8
(only where TE reports MXFP8 support: Blackwell). Dry run: the emulation against
dequantize(quantize()) on the CPU, through the public API."""

from __future__ import annotations

import traceback

import torch


def _te_support() -> dict:
    """TE's own support checks: ``{"fp8" | "fp8_block_scaling" | "mxfp8": [ok, reason]}``.

    The checks live in ``transformer_engine.pytorch.quantization`` from TE 2.9 on (``fp8`` is kept as a
    deprecated alias) and in ``transformer_engine.pytorch.fp8`` before; the block-scaling check exists
    from TE 2.3 (it also needs CUDA >= 12.9 on Hopper), MXFP8 needs sm100 (not sm120).
    """
    from nemo_fp8rl.fp8.te import te_support

    return {key: list(te_support(scaling)) for key, scaling in
            (("fp8", "tensorwise"), ("fp8_block_scaling", "blockwise"), ("mxfp8", "mxfp8"))}


def run(ctx) -> dict:
    dry = ctx.dry
    from nemo_fp8rl.fp8 import E4M3, compute_scale, fake_quantize

    dev = "cpu" if dry else "cuda"
    torch.manual_seed(0)
    x = torch.randn(1024, 4096, device=dev) * 2
    x[5, 17] = 600.0
    # delayed scaling: a scale from an older, smaller amax (half the current one), so the top values saturate
    delayed_scale = compute_scale(x.abs().amax() * 0.5, E4M3).reshape(1).to(torch.float32)
    res = {}
    if dry:
        # CPU: check the comparison path itself (emulation vs dequantize(quantize)) so CI runs this code
        from nemo_fp8rl.fp8 import dequantize, quantize

        for name, g in (("delayed", "tensor"), ("tensorwise", "tensor"), ("blockwise_1x128", (1, 128)),
                        ("blockwise_128x128", (128, 128)), ("mxfp8", "mx")):
            kw = {"scale": delayed_scale} if name == "delayed" else {"pow2_scales": g != "tensor"}
            q, s = quantize(x, E4M3, g, **kw)
            res[name] = (dequantize(q, s, x, g) - fake_quantize(x, E4M3, g, **kw)).abs().max().item()
        return {"device": "cpu (dry run: emulation self-consistency only)", "max_abs_diff": res,
                "te_support": _te_support()}

    import transformer_engine.pytorch  # noqa: F401  (loads TE's extension before transformer_engine_torch)
    import transformer_engine_torch as tex

    e4m3 = tex.DType.kFloat8E4M3
    support = _te_support()
    cap = torch.cuda.get_device_capability()

    def delayed():
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        q = Float8Quantizer(scale=delayed_scale.clone(), amax=torch.zeros(1, device=x.device), fp8_dtype=e4m3,
                            rowwise=True, columnwise=False)
        return q(x).dequantize(), fake_quantize(x, E4M3, "tensor", scale=delayed_scale)

    def tensorwise():
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer  # TE >= 2.2

        q = Float8CurrentScalingQuantizer(fp8_dtype=e4m3, device=x.device, rowwise=True, columnwise=False)
        return q(x).dequantize(), fake_quantize(x, E4M3, "tensor")

    def blockwise(dim: int, g):
        # TE >= 2.3
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

        q = Float8BlockQuantizer(fp8_dtype=e4m3, rowwise=True, columnwise=False, force_pow_2_scales=True,
                                 block_scaling_dim=dim)
        return q(x).dequantize(), fake_quantize(x, E4M3, g, pow2_scales=True)

    def mxfp8():
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        q = MXFP8Quantizer(fp8_dtype=e4m3, rowwise=True, columnwise=False)
        return q(x).dequantize(), fake_quantize(x, E4M3, "mx")

    cases = [
        ("delayed", delayed, None),
        ("tensorwise", tensorwise, None),
        # quantization only (no GEMM): runs on sm90 even where TE's block-scaled GEMM check fails (CUDA < 12.9)
        ("blockwise_1x128", lambda: blockwise(1, (1, 128)),
         None if cap >= (9, 0) else "block-scaling quantization needs sm90+"),
        ("blockwise_128x128", lambda: blockwise(2, (128, 128)),
         None if cap >= (9, 0) else "block-scaling quantization needs sm90+"),
        # never launch MXFP8 kernels where TE says they are unsupported (Hopper): skip with TE's reason
        ("mxfp8", mxfp8, None if support["mxfp8"][0] else f"TE: {support['mxfp8'][1]}"),
    ]
    errors, tracebacks = {}, {}
    for name, fn, skip in cases:
        if skip:
            res[name] = f"skipped: {skip}"
            continue
        try:
            with torch.no_grad():
                te_val, ours = fn()
                res[name] = (te_val.float() - ours.float()).abs().max().item()
        except ImportError as e:  # a quantizer this TE release does not have yet
            res[name] = f"skipped: this Transformer Engine has no such quantizer ({e})"
        except Exception as e:  # noqa: BLE001  (one quantizer missing in this TE must not hide the others)
            res[name] = f"error: {type(e).__name__}: {e}"
            errors[name] = res[name]
            tracebacks[name] = traceback.format_exc()[-4000:]
    numbers = [v for v in res.values() if isinstance(v, float)]
    out_d = {"device": torch.cuda.get_device_name(), "max_abs_diff": res, "te_support": support,
             "all_exact": bool(numbers) and all(v == 0.0 for v in numbers)}
    if errors:
        out_d["failed"] = f"{len(errors)} quantizer(s) raised: {sorted(errors)}"
        out_d["traceback"] = "\n".join(f"--- {k}\n{v}" for k, v in tracebacks.items())
    return out_d


def headline(res: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}: {str(v)[:60]}"
                     for k, v in res.get("max_abs_diff", {}).items())
