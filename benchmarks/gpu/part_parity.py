"""Part (c), real vs emulated FP8 per recipe: the same quantizer on the GPU and on the CPU, and torch's
FP8 GEMMs against the emulation.

For each recipe (:data:`common.RECIPES`) on the same inputs x [M, K] (activations with an outlier),
W [N, K] and dy [M, N] (small output gradients), all BF16 (float32 in the dry run, as CPU models are):

1. Quantized operands: ``quantize`` of every operand along every reduction dimension a linear uses
   (x and W along K, dy and W along N, dy and x along the tokens M), fused (``fp8.compile=true``: Triton)
   on the device and eager on the CPU, must give the same FP8 bytes and the same float32 scale-inverses
   (``torch.equal`` of the bytes).
2. GEMMs: one ``Fp8Linear`` per backend converted from the same BF16 linear with ``convert_to_fp8``
   (``backend="torch"`` and ``backend="emulate"``; a layer torch cannot run falls back and says why),
   forward y = Q(x) Q(W)^T, dgrad dx = Q(dy) Q(W), wgrad dW = Q(dy)^T Q(x). Each output of each
   backend is checked against the float64 product of the same dequantized operands (``a_hat``,
   ``b_hat`` from ``quantize_operand``, the emulation's FP8 values):
   ``|C - a_hat b_hat^T| <= gemm_error_bound(a_hat, b_hat, dtype, fast)`` per element, reported as the
   largest ratio |error| / bound (must be <= 1), and the largest |torch - emulate|.
   Delayed scaling runs one step first, so the checked step uses scales from an amax history.

mxfp8 has no Hopper (or CPU) kernel: it must run emulated on sm90 and is reported "emulated: <reason>".

Before the recipes, the checks that have not run on a GPU yet (a part that runs out of time loses its last
checks, and the recipes' operands and GEMMs were bit-equal / in bound on the H200 in both 2026-12-04 runs):

- ``rollout_weights``: the rollout's weight quantizers (``vllm_w8a8``'s per-tensor codes and scale,
  ``vllm_block``'s tiles and tile scales, ``rollout/vllm_fp8.py``'s block-FP8 sync) give the same bits on the
  device as on the CPU (:func:`_rollout_weights_equal`; the dry run compares the CPU with itself, to run the
  code path);
- ``rollout_kernels``: the rollout activation kernels against their CPU reference
  (:func:`_rollout_kernels_equal`);
- ``kv_decode``: the FP8 KV decode attention kernel within its error bound (:func:`_kv_decode_within_bound`).

Then the recipes in :data:`common.RECIPES`' order (mxfp8, which compiles its quantizer with Inductor, last); a
recipe that no longer fits the part's time is recorded as skipped with the reason (:func:`_recipe_estimate`).
Results are saved after every check and recipe, so a timeout keeps what was measured.
"""

from __future__ import annotations

import copy
import time

from common import RECIPES, recipe

# (name, role, reduction dim) of every quantization a linear step makes
OPERANDS = [("x_fwd", "input", 1), ("w_fwd", "weight", 1), ("dy_dgrad", "grad_output", 1),
            ("w_dgrad", "weight", 0), ("dy_wgrad", "grad_output", 0), ("x_wgrad", "input", 0)]

RECIPE_LEAST_S = {"mxfp8": 25.0}
"""Seconds a recipe is expected to take at least on a fresh GPU, where more than :data:`RECIPE_DEFAULT_S`:
mxfp8 compiles its quantizer graphs with Inductor (about 12 keys; the slowest recipe of run a, 2026-12-04)."""
RECIPE_DEFAULT_S = 10.0
"""A recipe's expected seconds before any has been timed (run b's four recipes took 26 s in all, cold)."""
RECIPE_MARGIN_S = 3.0
"""Seconds kept after a recipe for saving and the part's own end."""
WEIGHT_SHAPES = ((768, 1000), (256, 384))
"""Rollout weight shapes [N, K] of :func:`_rollout_weights_equal`: K = 1000 is not a multiple of the 128-tiles
(zero-padded edge tiles), 256 x 384 is."""


def _inputs(dry: bool):
    import torch

    m, k, n = (72, 256, 128) if dry else (1000, 1024, 768)  # M not a multiple of 16: the wgrad padding path
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * 2
    x[5, 17] = 600.0  # saturates E4M3 under a delayed scale from a smaller amax
    w = torch.randn(n, k, generator=g) * 0.02
    dy = torch.randn(m, n, generator=g) * 1e-3
    # BF16 as a GPU model trains; the dry run keeps the CPU models' float32
    dtype = torch.float32 if dry else torch.bfloat16
    return x.to(dtype), w.to(dtype), dy.to(dtype)


def _quantizers_equal(rec, x, w, dy, device) -> dict:
    """Operand name -> True when the device's fused quantizer and the CPU's eager one give identical FP8
    bytes and scales."""
    import torch

    from nemo_fp8rl.fp8 import compute_scale, fused, quantize

    tensors = {"input": x, "weight": w, "grad_output": dy}
    out = {}
    for name, role, dim in OPERANDS:
        t = tensors[role]
        fmt = rec.format_for(role)
        scale = None
        if rec.scaling == "delayed":  # scale of an older amax, half the current one: top values saturate
            scale = compute_scale(t.float().abs().amax() * 0.5, fmt)
        kw = dict(dim=dim, pow2_scales=rec.pow2_scales, eps=rec.amax_epsilon, block=rec.mx_block)
        # the device's fused (compiled: Triton on a GPU) quantizer against the CPU's eager one, the readable
        # reference: equal bytes pin both the fused path and the device's arithmetic (the CPU dry run keeps
        # eager on both sides: tests/fp8/test_fused.py pins the CPU's compiled quantizer)
        with fused.compile_mode_set("true" if torch.device(device).type == "cuda" else "false"):
            qd, sd = quantize(t.to(device), fmt, rec.granularity_for(role),
                              scale=None if scale is None else scale.to(device), **kw)
        with fused.compile_mode_set("false"):
            qc, sc = quantize(t, fmt, rec.granularity_for(role), scale=scale, **kw)
        out[name] = bool(torch.equal(qd.cpu().view(torch.uint8), qc.view(torch.uint8))
                         and torch.equal(sd.cpu(), sc))
    return out


def _kernels_equal(rec, x, w, dy, device) -> dict:
    """Layout name -> True when the device's Triton cast-transpose kernels (what ``fp8.backend=torch`` runs
    for this recipe on this device) write the same bytes as ``kernels/reference.py`` on the CPU: every
    FP8 layout, scale layout and padding of x, W and dy; the bf16 layouts of ``fp8_format=hybrid``."""
    import torch

    from nemo_fp8rl.fp8 import compute_scale, fused, kernels
    from nemo_fp8rl.fp8.kernels import reference as ref

    ops = kernels.ops()
    out = {}
    kw = dict(pow2=rec.pow2_scales, eps=rec.amax_epsilon)
    with fused.compile_mode_set("false"):  # the reference is eager
        for role, t in (("input", x), ("weight", w), ("grad_output", dy)):
            fmt = rec.format_for(role).name
            d = t.to(device)
            if rec.scaling == "blockwise":
                if role == "weight":
                    hyb = rec.block_e5m2_grads
                    out["w_tiles"] = ref.same_bytes(ops.cast_weight_tiles(d, fmt, transpose_bf16=hyb, **kw),
                                                    ref.weight_tile_layouts(t, fmt, transpose_bf16=hyb, **kw))
                else:
                    bf16 = role == "grad_output" and fmt == "e5m2"
                    col_bf16 = bf16 or (role == "input" and rec.block_e5m2_grads)  # hybrid's bf16 wgrad operands
                    got = ops.cast_transpose_blockwise(d, fmt, row_bf16=bf16, col_bf16=col_bf16, **kw)
                    want = ref.blockwise_layouts(t, fmt, row_bf16=bf16, col_bf16=col_bf16, **kw)
                    out[f"{role}_row"] = ref.same_bytes(got[0], want[0])
                    out[f"{role}_col"] = ref.same_bytes(got[1], want[1])
                    if bf16 or col_bf16:  # hybrid's FP8 layouts too (its backward on the FP8 block GEMM)
                        got = ops.cast_transpose_blockwise(d, fmt, **kw)
                        want = ref.blockwise_layouts(t, fmt, **kw)
                        out[f"{role}_row_fp8"] = ref.same_bytes(got[0], want[0])
                        out[f"{role}_col_fp8"] = ref.same_bytes(got[1], want[1])
            elif rec.scaling == "rowwise":  # the weight's W^T unpadded (col_pad 1), x^T / dy^T padded to 16
                pad = 1 if role == "weight" else 16
                got = ops.cast_transpose_rowwise(d, fmt, col_pad=pad, **kw)
                want = ref.rowwise_layouts(t, fmt, col_pad=pad, **kw)
                out[f"{role}_row"] = ref.same_bytes(got[0], want[0])
                out[f"{role}_col"] = ref.same_bytes(got[1], want[1])
            else:
                scale = compute_scale(t.float().abs().amax() * 0.5, fmt) if rec.scaling == "delayed" else None
                got = ops.cast_transpose_tensorwise(d, fmt, scale=None if scale is None else scale.to(device), **kw)
                out[f"{role}_both"] = ref.same_bytes(got, ref.tensorwise_layouts(t, fmt, scale=scale, **kw))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return out


def _reciprocal_sensitive_amax() -> float:
    """The smallest BF16 value a in [0.125, 0.25) whose float32 ``a / 448`` (a correctly rounded division,
    what vLLM's kernels and the CPU compute) differs from ``a * fp32(1 / 448)``.

    Why: ATen's CUDA division of a tensor by a Python scalar multiplies by the scalar's float32 reciprocal
    (``div_true_kernel_cuda``), which is 1 ulp off the division for about half of all amaxes; the CPU divides.
    A weight whose amax is this value turns such a rounding into a certain scale difference instead of a coin
    toss (the per-tensor scheme has one scale per weight). 0.125 lies above every element of the N(0, 0.02^2)
    weights here, so the planted value is the amax."""
    import torch

    cand = torch.arange(0x3E00, 0x3E80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    differs = cand / torch.full_like(cand, 448.0) != cand * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    if not bool(differs.any()):  # impossible in IEEE float32; said rather than assumed
        raise RuntimeError("no BF16 value in [0.125, 0.25) separates a / 448 from a * fp32(1/448)")
    return float(cand[differs.nonzero()[0, 0]])


def _rollout_weights_equal(device) -> dict:
    """Quantizer@shape -> True when the rollout's weight quantizers give the same bits for a BF16 weight on
    ``device`` as on the CPU (the readable reference the CPU tests pin to vLLM's rules), else False, or the
    error it raised as a string. Per shape of :data:`WEIGHT_SHAPES`:

    - ``w8a8_codes_scale``: ``fp8/rollout.py``'s ``_per_tensor_weight`` (vllm_w8a8: E4M3 codes,
      ``s = amax / 448``);
    - ``w8a8_weight_fp8`` / ``w8a8_quantize_weight``: ``VllmW8A8``'s FP8 operand (codes, per-row scales) and
      read-back weight;
    - ``block_weight_fp8`` / ``block_quantize_weight``: ``VllmBlock``'s 128x128 tiles (data, tile scales) and
      read-back weight;
    - ``vllm_block_sync``: ``rollout/vllm_fp8.py``'s ``vllm_block_fp8_weight`` (what a vLLM engine is sent).

    Each weight's amax is :func:`_reciprocal_sensitive_amax`, so a device that divides by 448 through a
    float32 reciprocal gets a different per-tensor scale (and the tiles' scales differ for about half the
    tiles)."""
    import torch

    from nemo_fp8rl.fp8 import rollout as ro
    from nemo_fp8rl.fp8.kernels.reference import same_bytes
    from nemo_fp8rl.rollout import vllm_fp8

    def pair(op):
        return (op.data, op.scale_inv)

    quantizers = {
        "w8a8_codes_scale": lambda w: ro._per_tensor_weight(w),
        "w8a8_weight_fp8": lambda w: pair(ro.VllmW8A8().weight_fp8(w)),
        "w8a8_quantize_weight": lambda w: (ro.VllmW8A8().quantize_weight(w),),
        "block_weight_fp8": lambda w: pair(ro.VllmBlock().weight_fp8(w)),
        "block_quantize_weight": lambda w: (ro.VllmBlock().quantize_weight(w),),
        "vllm_block_sync": lambda w: vllm_fp8.vllm_block_fp8_weight(w),
    }
    amax = _reciprocal_sensitive_amax()
    g = torch.Generator().manual_seed(11)
    out: dict = {}
    for n, k in WEIGHT_SHAPES:
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        w[n // 3, k // 2] = amax
        d = w.to(device)
        for name, fn in quantizers.items():
            key = f"{name}@{n}x{k}"
            try:
                got, want = fn(d), fn(w)
                out[key] = same_bytes(tuple(got), tuple(want))
            except Exception as e:  # noqa: BLE001  (one quantizer raising must not hide the others)
                out[key] = f"{type(e).__name__}: {e}"[:300]
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return out


def _rollout_kernels_equal(x, device) -> dict:
    """Input name -> True when the device's rollout activation kernels (``kernels/vllm_quant.py``: vLLM's per-token
    and 1x128-group E4M3, what the torch rollout engine runs on a GPU) write the same FP8 bytes, scales and
    read-back values as ``fp8/rollout.py``'s eager functions on the CPU. Inputs: x, every bf16 bit pattern, and
    exact ties of the E4M3 grid (x / s on a midpoint, where dividing and multiplying by 1/s differ)."""
    import torch

    from nemo_fp8rl.fp8 import fused, kernels
    from nemo_fp8rl.fp8 import rollout as ro
    from nemo_fp8rl.fp8.kernels.reference import same_bytes

    vq = kernels.vllm_ops()
    sig = 1.0 + torch.arange(128) / 128.0
    ties = torch.stack([torch.cat([torch.cat([sig[j:j + 1], sig[1:] / 2]) * 2.0**-g for g in range(4)])
                        for j in range(128)]).to(torch.bfloat16)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)

    out = {}
    with fused.compile_mode_set("false"):
        for name, t in (("x", x[:, : x.shape[1] // 128 * 128]), ("every_bf16_pattern", every), ("ties", ties)):
            d = t.to(device)
            q, s = vq.quantize_per_token(d)
            rq, rs = ro._token_fp8(t)
            fake = ro._token_fake(t)
            out[f"token_{name}"] = (same_bytes(q, rq) and same_bytes(s, rs)
                                    and same_bytes(vq.quantize_per_token(d, readback=True)[0], fake)
                                    and same_bytes(vq.quantize_per_token(d, readback=True,
                                                                         out_dtype=torch.bfloat16)[0],
                                                   fake.to(torch.bfloat16)))
            q, s = vq.quantize_per_group(d, 128)
            rq, rs = ro._group_fp8(t, 128)
            out[f"group_{name}"] = (same_bytes(q, rq) and same_bytes(s, rs)
                                    and same_bytes(vq.quantize_per_group(d, 128, readback=True)[0],
                                                   ro._group_fake(t, 128)))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return out


def _kv_decode_within_bound(device) -> dict:
    """Format -> max over elements of |decode_attention - float64| / bound (``kernels/kv_attention.py``'s
    ``decode_reference``; <= 1 passes) for one decode step of a Qwen3-8B-shaped layer (32 query heads on 8 KV
    heads, head size 128) over an FP8 cache, ragged rows of 1, 64, 65 and 1500 positions (stale positions hold
    NaN codes, never read), scores spread over ~20 nats."""
    import torch

    from nemo_fp8rl.fp8 import kernels
    from nemo_fp8rl.fp8.formats import get_format

    kv = kernels.kv_ops()
    out = {}
    for fmt, ks, vs in (("e4m3", 0.013, 0.7), ("e5m2", 2.0**-12, 0.0093)):
        g = torch.Generator().manual_seed(5)
        B, H, G, hd, S = 4, 32, 8, 128, 1536
        positions = torch.tensor([0, 63, 64, 1499])
        codes = []
        for _ in range(2):
            c = torch.randint(0, 256, (B, G, S, hd), generator=g, dtype=torch.int32).to(torch.uint8)
            c[~torch.isfinite(c.view(get_format(fmt).dtype).float())] = 0
            for b in range(B):
                c[b, :, int(positions[b]) + 1:] = 0x7F if fmt == "e4m3" else 0x7E  # NaN codes
            codes.append(c)
        q = torch.randn(B, H, hd, generator=g) * (6.0 / (float(get_format(fmt).max) * ks))
        got = kv.decode_attention(q.to(device), codes[0].to(device), codes[1].to(device), positions.to(device),
                                  ks, vs, fmt).cpu()
        want, bound = kv.decode_reference(q, codes[0], codes[1], positions, ks, vs, fmt)
        ratio = (got.double() - want).abs().amax(-1) / bound
        out[fmt] = float(ratio.max()) if bool(torch.isfinite(got).all()) else float("inf")
    return out


def _layer(rec, w, backend: str, device):
    import torch

    from nemo_fp8rl.fp8 import convert_to_fp8

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    seq = convert_to_fp8(torch.nn.Sequential(lin), rec, backend=backend)
    return seq, seq[0]


def _step(layer, x, dy):
    x = x.clone().requires_grad_(True)
    layer.weight.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad.detach(), layer.weight.grad.detach()


def _hats(rec, state, x, w, dy):
    """The dequantized FP8 operands of forward, dgrad and wgrad (float32 ``data * scale_inv``, quantized
    from the float32 value of each tensor): GEMM -> (a, b) with C = a @ b^T, a [rows, red], b [cols, red]."""
    from nemo_fp8rl.fp8 import quantize_operand

    def q(t, role, dim):
        return quantize_operand(t.float(), role, dim, rec, state, record=False)

    return {"forward": (q(x, "input", 1), q(w, "weight", 1)),
            "dgrad": (q(dy, "grad_output", 1), q(w, "weight", 0).t()),
            "wgrad": (q(dy, "grad_output", 0).t(), q(x, "input", 0).t())}


def _compare(rec, label: str, x, w, dy, device) -> dict:
    import torch

    from nemo_fp8rl.fp8 import fused
    from nemo_fp8rl.fp8.backends import gemm_error_bound, gemm_fallbacks
    from nemo_fp8rl.fp8.torch_linear import forward_fast_accum

    row: dict = {}
    x, w, dy = x.to(device), w.to(device), dy.to(device)
    seq_t, lt = _layer(rec, w, "torch", device)
    seq_e, le = _layer(rec, w, "emulate", device)
    conv = seq_t.fp8_conversion
    row["conversion"] = {k: conv.get(k) for k in ("converted", "emulated_fallback", "fallback_reasons", "backend")}
    row["layer_backend"] = lt.fp8_backend
    reason = next(iter(conv.get("fallback_reasons") or {}), None)
    row["gemm"] = "torch._scaled_mm" if lt.fp8_backend == "torch" else f"emulated: {reason}"
    if rec.scaling == "delayed":  # one step first: the checked step's scales come from an amax history
        _step(lt, x, dy)
        with fused.compile_mode_set("false"):
            _step(le, x, dy)
    state = copy.deepcopy(le.fp8_state)
    before = gemm_fallbacks()
    outs = {"torch": _step(lt, x, dy)}
    with fused.compile_mode_set("false"):  # the emulation is the reference here: eager, no compile to wait for
        outs["emulate"] = _step(le, x, dy)
    # GEMMs the torch backend ran in float32 because torch's kernel refuses their operands
    fell_back = {k: v - before.get(k, 0) for k, v in gemm_fallbacks().items() if v != before.get(k, 0)}
    if fell_back and lt.fp8_backend == "torch":
        row["gemm"] += f" ({sum(fell_back.values())} GEMMs in float32: {next(iter(fell_back))[:80]})"
    fast = forward_fast_accum(rec)  # the torch backend's forward GEMM accumulates fast only then
    with fused.compile_mode_set("false"):
        hats = _hats(rec, state, x, w, dy)
    # blockwise + hybrid's dgrad and wgrad on the Triton block GEMM (run() sets NEMO_FP8RL_HYBRID_GEMM=fp8): its
    # FP8 MMA adds 32 products in reduced precision, so its own bound applies to the torch backend's result
    block_bound = None
    if rec.block_e5m2_grads and lt.fp8_backend == "torch" and not fell_back:
        from nemo_fp8rl.fp8 import kernels

        block_bound = kernels.block_gemm_ops().block_gemm_error_bound
        row["gemm"] += " (dgrad, wgrad: Triton block-scaled E5M2 x E4M3)"
    for i, (gemm, (a, b)) in enumerate(hats.items()):
        exact = a.double() @ b.double().t()
        bound = gemm_error_bound(a, b, x.dtype, fast_accum=fast and gemm == "forward")
        if block_bound is not None and gemm != "forward":
            bound = torch.maximum(bound, block_bound(a, b, x.dtype))
        entry = {}
        for backend, res in outs.items():
            err = (res[i].double() - exact).abs()
            entry[f"{backend}_err_over_bound"] = float((err / bound).max())
            entry[f"{backend}_finite"] = bool(torch.isfinite(res[i]).all())
        entry["max_abs_torch_minus_emulate"] = float((outs["torch"][i].double() - outs["emulate"][i].double()).abs().max())
        entry["max_abs_output"] = float(exact.abs().max())
        row[gemm] = entry
    return row


def _recipe_estimate(label: str, seconds: list) -> float:
    """Seconds ``label`` is expected to take: the slowest recipe so far (the first one compiles the cast
    kernels cold), at least :data:`RECIPE_LEAST_S` (mxfp8's Inductor compiles) or :data:`RECIPE_DEFAULT_S`."""
    return max(RECIPE_LEAST_S.get(label, RECIPE_DEFAULT_S), max(seconds, default=0.0))


def _device_checks(ctx, x) -> None:
    """The checks that have not run on a GPU yet, each saved as it ends (module docstring): the rollout
    weight quantizers on every device, the rollout activation kernels and the FP8 KV decode kernel where
    Triton runs."""
    from nemo_fp8rl.fp8.kernels import kernel_unavailable

    res = ctx.res
    # each check: its result dict, the failing entries, and how a problem reads
    checks = [("rollout_weights", lambda: _rollout_weights_equal(ctx.device),
               lambda r: {k: ok for k, ok in r.items() if ok is not True},
               "rollout weight quantizers give other bits on the device than on the CPU")]
    why = kernel_unavailable(ctx.device)
    if why:
        res["rollout_kernels"] = {"skipped": why}
    else:
        checks += [("rollout_kernels", lambda: _rollout_kernels_equal(x, ctx.device),
                    lambda r: [k for k, ok in r.items() if not ok],
                    "rollout activation kernels differ from the CPU's rollout quantizer"),
                   ("kv_decode", lambda: _kv_decode_within_bound(ctx.device),
                    lambda r: {k: v for k, v in r.items() if not v <= 1.0},
                    "FP8 KV decode attention kernel outside its error bound")]
    for key, check, failing, what in checks:
        t0 = time.monotonic()
        try:
            res[key] = check()
            bad = failing(res[key])
            if bad:
                res["problems"].append(f"{what}: {bad}")
        except Exception as e:  # noqa: BLE001
            res[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
            res["problems"].append(f"{key}: {res[key]['error']}")
        res["seconds"][key] = round(time.monotonic() - t0, 1)
        ctx.save()


def run(ctx) -> dict:
    import os

    import torch

    # every launch configuration writes the same bits (tests/fp8/_kernel_checks.py runs them all): the
    # parity part checks the default one and spends no time timing the others
    os.environ.setdefault("NEMO_FP8RL_KERNEL_TUNE", "0")
    # blockwise_hybrid's backward on the FP8 block GEMM (what auto picks where it is faster), checked here
    os.environ.setdefault("NEMO_FP8RL_HYBRID_GEMM", "fp8")

    res = ctx.res
    x, w, dy = _inputs(ctx.dry)
    res.update(device=ctx.device if ctx.device == "cpu" else torch.cuda.get_device_name(),
               shapes={"x": list(x.shape), "weight": list(w.shape), "dy": list(dy.shape)}, dtype=str(x.dtype),
               recipes={}, skipped_recipes=[], problems=[], seconds={})
    if ctx.dry:
        res["note"] = "dry run: the 'GPU' quantizer is the CPU's (code path only)"
    cap = tuple(torch.cuda.get_device_capability()) if ctx.device == "cuda" else None
    from nemo_fp8rl.fp8.torch_linear import kernel_path_refusal

    _device_checks(ctx, x)  # first: never run on a GPU, so a timeout must not be what loses them
    only = [r for r in os.environ.get("GPU_CHECK_PARITY_RECIPES", "").split(",") if r]
    took: list = []  # seconds of each recipe checked so far
    for label, _, _ in RECIPES:
        if only and label not in only:  # a short run re-checking what changed (GPU_CHECK_PARITY_RECIPES)
            continue
        est = _recipe_estimate(label, took)
        if ctx.left() < est + RECIPE_MARGIN_S:  # skipped, not failed: the recipes before it are kept
            why = f"out of time ({ctx.left():.0f}s left, the recipe takes ~{est:.0f}s)"
            res["recipes"][label] = {"skipped": why}
            res["skipped_recipes"].append(label)
            ctx.save()
            continue
        t0 = time.monotonic()
        rec = recipe(label)
        try:
            # the quantizer fp8.backend=torch runs here: the Triton kernels where they run (no Inductor
            # compile needed), else the compiled quantizer
            kernel = kernel_path_refusal(rec, ctx.device) is None
            row = {"quantizer": "triton cast-transpose kernels" if kernel else "compiled quantizer",
                   "quantized_equal": (_kernels_equal if kernel else _quantizers_equal)(rec, x, w, dy, ctx.device)}
            row.update(_compare(rec, label, x, w, dy, ctx.device))
        except Exception as e:  # noqa: BLE001  (one recipe failing must not hide the others)
            import traceback

            row = {"error": f"{type(e).__name__}: {e}"[:1000]}
            res["traceback"] = res.get("traceback", "") + f"--- {label}\n{traceback.format_exc()[-3000:]}"
            res["problems"].append(f"{label}: {row['error']}")
            res["recipes"][label] = row
            res["seconds"][label] = round(time.monotonic() - t0, 1)
            ctx.save()
            continue
        took.append(time.monotonic() - t0)
        res["seconds"][label] = round(took[-1], 1)
        bad = [k for k, ok in row["quantized_equal"].items() if not ok]
        if bad:
            res["problems"].append(f"{label}: device and CPU quantization differ for {bad}")
        for gemm in ("forward", "dgrad", "wgrad"):
            e = row[gemm]
            for b in ("torch", "emulate"):
                if not e[f"{b}_finite"] or not e[f"{b}_err_over_bound"] <= 1.0:
                    res["problems"].append(f"{label} {gemm} {b}: |error| / bound = {e[f'{b}_err_over_bound']:.3g}")
        if label == "mxfp8" and row["layer_backend"] == "torch" and cap is not None and cap[0] == 9:
            res["problems"].append("mxfp8 claims a torch GEMM on Hopper, which has no MX kernel")
        if label == "mxfp8" and cap is not None and cap[0] == 9:
            row["gemm"] = f"emulated: no Hopper kernel ({row['gemm'].removeprefix('emulated: ')})"
        res["recipes"][label] = row
        ctx.save()
    if res["problems"]:
        res["failed"] = f"{len(res['problems'])} problem(s): {res['problems'][:3]}"
    return res


def headline(res: dict) -> str:
    parts = []
    rw = res.get("rollout_weights")
    if rw:
        parts.append(f"rollout weights: {rw['error'][:60]}" if set(rw) == {"error"} else
                     f"rollout weights device = CPU {sum(ok is True for ok in rw.values())}/{len(rw)}")
    for label, r in res.get("recipes", {}).items():
        if "error" in r or "skipped" in r:
            parts.append(f"{label}: {(r.get('error') or 'skipped, ' + r['skipped'])[:60]}")
            continue
        worst = max(r[g][f"{b}_err_over_bound"] for g in ("forward", "dgrad", "wgrad") for b in ("torch", "emulate"))
        parts.append(f"{label} {'bytes equal' if all(r['quantized_equal'].values()) else 'BYTES DIFFER'}, "
                     f"err/bound {worst:.2g} ({'torch' if r['layer_backend'] == 'torch' else 'emulated'})")
    return "; ".join(parts)


def tables(res: dict) -> list[str]:
    lines = [f"Parity on {res.get('device')} (x {res.get('shapes', {}).get('x')}, W {res.get('shapes', {}).get('weight')}, "
             f"{res.get('dtype')}): quantized operands device vs CPU, and max |error| / gemm_error_bound of each backend "
             "against the float64 product of the same FP8 operands (<= 1 passes):", "",
             "| recipe | GEMM | operands bit-equal | fwd torch | fwd emulate | dgrad torch | dgrad emulate | "
             "wgrad torch | wgrad emulate | max abs torch-emulate (fwd/dgrad/wgrad) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in res.get("recipes", {}).items():
        if "error" in r or "skipped" in r:
            why = r.get("error") or f"skipped: {r['skipped']}"
            lines.append(f"| {label} | {why[:100].replace('|', '/')} | | | | | | | | |")
            continue
        eq = r["quantized_equal"]
        cells = [f"{r[g][f'{b}_err_over_bound']:.3g}" for g in ("forward", "dgrad", "wgrad") for b in ("torch", "emulate")]
        diffs = "/".join(f"{r[g]['max_abs_torch_minus_emulate']:.2g}" for g in ("forward", "dgrad", "wgrad"))
        quantizer = f"; {r['quantizer']}" if r.get("quantizer") else ""
        lines.append(f"| {label} | {r['gemm'].replace('|', '/')}{quantizer} | "
                     f"{sum(eq.values())}/{len(eq)} | "
                     + " | ".join(cells) + f" | {diffs} |")
    rw = res.get("rollout_weights")
    if rw:
        what = ("\nRollout weight quantizers (fp8/rollout.py, rollout/vllm_fp8.py; BF16 weights, amax where "
                "a / 448 and a * fp32(1/448) differ) device vs CPU bit-equal: ")
        if set(rw) == {"error"}:
            lines.append(what + rw["error"])
        else:
            bad = [f"{k} ({ok})" if isinstance(ok, str) else k for k, ok in rw.items() if ok is not True]
            equal = sum(ok is True for ok in rw.values())
            lines.append(what + f"{equal}/{len(rw)} (differ: {', '.join(bad) or 'none'})")
    rk = res.get("rollout_kernels")
    if rk:
        if "skipped" in rk or "error" in rk:
            lines.append(f"\nRollout activation kernels (kernels/vllm_quant.py): {rk.get('skipped') or rk.get('error')}")
        else:
            lines.append(f"\nRollout activation kernels (kernels/vllm_quant.py) device vs CPU bit-equal: "
                         f"{sum(rk.values())}/{len(rk)} ({', '.join(k for k, ok in rk.items() if not ok) or 'all'})")
    kd = res.get("kv_decode")
    if kd:
        if "error" in kd:
            lines.append(f"\nFP8 KV decode attention kernel (kernels/kv_attention.py): {kd['error']}")
        else:
            lines.append("\nFP8 KV decode attention kernel (kernels/kv_attention.py), max |error| / bound against "
                         "float64 (<= 1 passes): " + ", ".join(f"{k} {v:.3g}" for k, v in kd.items()))
    return lines
