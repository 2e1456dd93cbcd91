"""Part (d), Qwen3-8B-shaped linear throughput: forward + backward of the four projections of one
decoder layer (qkv 4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096) at 4k, 8k and 16k
tokens, BF16 ``F.linear`` against each FP8 recipe through ``fp8_linear(..., backend="torch")``.

One timed call = y = linear(x) and ``torch.autograd.grad(y, (x, W), dy)`` (forward, dgrad, wgrad), BF16
operands; median of ``repeats`` CUDA-event timings after ``warmup`` calls. A recipe torch cannot run on
this GPU at a shape (``torch_gemm_support``) is not timed: its cell says why (it would run emulated).
Ratios are BF16 time / FP8 time (> 1: FP8 is faster), side by side in one table; the ``layer`` rows
sum the four projections. Targets (benchmarks, not tests; issue 38): tensorwise >= 1.45x at 16384 tokens
and >= 1.3x at 8192, blockwise >= 1.25x at 16384, blockwise_hybrid >= 0.95x blockwise.

The FP8 calls run as the trainer runs them: inside ``fp8_weight_cache`` (the weight's FP8 copies are made
once per optimizer step and reused by every micro-batch and the log-prob pass), so a timed call is one
micro-batch of a step. On the GPU ``fp8.backend=torch`` feeds tensorwise/delayed/rowwise/blockwise from the Triton
cast-transpose kernels (``fp8/kernels``; rowwise's since 2026-12-04, after the H200 records).

Peer rows: torchao's ``convert_to_float8_training`` (tensorwise and rowwise recipes) on the same BF16
linear, compiled with ``torch.compile`` (its intended use; the token dim marked dynamic, so one compile per
projection and recipe serves both token counts), at the token counts of :data:`PEER_TOKENS` (compile time is the part's budget).
A kernel table of one gate_up call per recipe (``torch.profiler``: the top kernels by GPU time) shows
where each recipe's time goes.

A recipe that raises (a kernel refusing its operands, out of memory) is recorded under ``errors`` with
the configuration and the exception, is not timed again, and the other recipes go on; the part is then
marked failed with what it measured kept.

Time: token counts run largest first (16384, 8192, 4096: issue 38's targets are at 16384 and 8192), so a part
short of time loses the 4096-token rows; a configuration is skipped (listed under ``skipped``) when less time
is left than the last configuration of the same label took plus 5 s (:func:`_estimate`). The derived rows
(``layer``, ``x_bf16``, ``auto``, ``targets``) are recomputed and saved after every token count, so a part
stopped by its timeout keeps them; tables list the rows in ascending token order, as in earlier records.
The operands are drawn on the device (a CUDA generator): drawing the 16384-token operands on the CPU took
several seconds of the part.
"""

from __future__ import annotations

import time

from common import RECIPES, free_memory, recipe, shapes, time_ms, token_counts

TARGETS = {"tensorwise": {16384: 1.45, 8192: 1.3}, "blockwise": {16384: 1.25}}
PEERS = {"torchao_tensorwise": "tensorwise", "torchao_rowwise": "rowwise"}
PEER_TOKENS = (8192, 16384)
PROFILE_SHAPE = ("gate_up", 8192)


def _fwd_bwd(f, x, w, dy):
    import torch

    def call():
        y = f(x, w)
        torch.autograd.grad(y, (x, w), dy)

    return call


def run(ctx) -> dict:
    import torch
    import torch.nn.functional as F

    from nemo_fp8rl.fp8 import Fp8LinearState, fp8_linear
    from nemo_fp8rl.fp8.backends import gemm_fallbacks, torch_gemm_support

    warmup, repeats = (0, 1) if ctx.dry else (3, 10)
    labels = [lab for lab, _, _ in RECIPES]
    res = ctx.res
    res.update(shapes={k: list(v) for k, v in shapes(ctx.dry).items()}, tokens=list(token_counts(ctx.dry)),
               dtype="bfloat16", warmup=warmup, repeats=repeats, ms={}, not_timed={}, skipped=[], errors={},
               what="median ms of forward + dgrad + wgrad (torch.autograd.grad), CUDA events")
    broken: set = set()  # recipes that raised: not timed again
    peer_cache: dict = {}
    torchao_ok = _torchao_available()
    g = torch.Generator(device=ctx.device).manual_seed(0)
    seconds: dict = {}  # label -> seconds of each of its configurations so far (first: compile / tuning)
    for tokens in sorted(token_counts(ctx.dry), reverse=True):  # the targets' token counts first
        for name, (n, k) in shapes(ctx.dry).items():
            key = f"{name}@{tokens}"
            res["ms"][key] = {}
            x = _randn((tokens, k), 2.0, g, ctx.device).requires_grad_(True)
            w = _randn((n, k), 0.02, g, ctx.device).requires_grad_(True)
            dy = _randn((tokens, n), 1e-3, g, ctx.device)
            peers = [p for p in PEERS if tokens in PEER_TOKENS] if not ctx.dry or torchao_ok else []
            for label in ["bf16", *labels, *peers]:
                if label in broken:
                    continue
                est = _estimate(label, seconds)
                if ctx.left() < est + 5:
                    why = f"out of time ({ctx.left():.0f}s left, ~{est:.0f}s needed)"
                    res["skipped"].append(f"{key} {label}: {why}")
                    continue
                t0 = time.monotonic()
                if label == "bf16":
                    f = F.linear
                elif label in PEERS:
                    f = _torchao_linear(PEERS[label], name, n, k, ctx.device, peer_cache)
                    if f is None:
                        res["not_timed"].setdefault(label, peer_cache.get("error", "torchao unavailable"))
                        continue
                else:
                    rec = recipe(label)
                    why = torch_gemm_support(rec, ctx.device, n, k)
                    if why:
                        res["not_timed"].setdefault(label, why)
                        continue
                    state = Fp8LinearState(rec, track_stats=False)
                    state.weight_cache.active = True  # one optimizer step: W quantized once, as the trainer does

                    def f(x, w, rec=rec, state=state):
                        return fp8_linear(x, w, None, rec, state, backend="torch")

                try:
                    res["ms"][key][label] = time_ms(_fwd_bwd(f, x, w, dy), ctx.device, warmup, repeats)
                except Exception as e:  # noqa: BLE001  (one recipe failing must not end the part)
                    import traceback

                    broken.add(label)
                    res["errors"][label] = f"{key}: {type(e).__name__}: {e}"[:500]
                    res["not_timed"][label] = f"raised at {key} (see errors)"
                    res["traceback"] = res.get("traceback", "") + f"--- {key} {label}\n{traceback.format_exc()[-3000:]}"
                    free_memory()
                    ctx.save()
                    continue
                seconds.setdefault(label, []).append(time.monotonic() - t0)
            x = w = dy = None
            free_memory()
            ctx.save()
        _derive(res, labels, ctx.dry)  # a part stopped later keeps the rows and targets of what it timed
        ctx.save()
    res["kernel_configs"] = _kernel_configs(ctx.device)
    if ctx.left() > 15:
        try:
            res["profile"] = _profile(ctx, labels, broken)
        except Exception as e:  # noqa: BLE001  (the table is extra: its failure must not lose the timings)
            res["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    ctx.save()
    if ctx.left() > 10:
        try:
            res["kv_decode"] = _kv_decode_times(ctx.device, ctx.dry)
        except Exception as e:  # noqa: BLE001  (extra as well)
            res["kv_decode"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        ctx.save()
    # GEMMs torch's kernels refuse (blockwise + hybrid: dgrad and wgrad) were timed as float32 GEMMs
    res["gemm_fallbacks"] = gemm_fallbacks()
    if res["errors"]:
        res["failed"] = f"recipe(s) {sorted(res['errors'])} raised; the others were timed"
    return res


FIRST_CONFIG_S = 5.0
"""Seconds expected of a label's first configuration before any configuration was timed."""


def _estimate(label: str, seconds: dict) -> float:
    """Seconds the next configuration of ``label`` is expected to take: its own last one (its first includes
    its compiles and launch tuning; later ones only the timed calls), else the slowest first configuration of
    any label so far (a torchao compile, blockwise_hybrid's GEMM tuning), at least :data:`FIRST_CONFIG_S`."""
    if seconds.get(label):
        return seconds[label][-1]
    return max([FIRST_CONFIG_S, *(v[0] for v in seconds.values() if v)])


def _randn(shape: tuple, std: float, g, device: str):
    """N(0, std^2) BF16 of ``shape`` drawn on ``device`` with generator ``g`` (of the same device)."""
    import torch

    return (torch.randn(shape, generator=g, device=device) * std).to(torch.bfloat16)


def _derive(res: dict, labels: list, dry: bool) -> None:
    """The rows computed from the timings: ``layer@tokens`` (the four projections summed, where every one of
    them was timed for a label), ``x_bf16``, ``auto`` and ``targets``; ``ms`` reordered projections first,
    then layers, each in ascending token order (the order of the tables in earlier records)."""
    ms = res["ms"]
    for tokens in token_counts(dry):
        keys = [f"{name}@{tokens}" for name in shapes(dry)]
        common_labels = set.intersection(*(set(ms.get(k, {})) for k in keys))
        ms[f"layer@{tokens}"] = {lab: sum(ms[k][lab] for k in keys) for lab in ["bf16", *labels, *PEERS]
                                 if lab in common_labels}
    order = [f"{name}@{t}" for t in token_counts(dry) for name in [*shapes(dry), "layer"]]
    order = [k for k in order if not k.startswith("layer@")] + [k for k in order if k.startswith("layer@")]
    res["ms"] = {k: ms[k] for k in order if k in ms}
    res["x_bf16"] = {key: {lab: row["bf16"] / v for lab, v in row.items() if lab != "bf16"}
                     for key, row in res["ms"].items() if "bf16" in row}
    res["auto"] = _auto_rows(res, labels, dry)
    res["targets"] = _targets(res, dry)


KV_DECODE = {"batch": 64, "heads": 32, "kv_heads": 8, "head_dim": 128, "positions": (1024, 4096)}
"""One decode step's attention of a Qwen3-8B-shaped layer over an E4M3 KV cache (the torch rollout engine)."""


def _kv_decode_times(device: str, dry: bool) -> dict:
    """ms of one layer's decode attention over an E4M3 cache: the Triton kernel that reads the codes
    (``kernels/kv_attention.py``) against what the engine runs without it (read the prefix back as float32,
    ``dequantize_kv``, then the engine's SDPA call with the ragged mask), at :data:`KV_DECODE`'s prefix lengths."""
    import torch

    from nemo_fp8rl.fp8 import kernels
    from nemo_fp8rl.fp8.kv_cache import dequantize_kv
    from nemo_fp8rl.rollout.model import ModelShape, _attend

    why = kernels.kernel_unavailable(device)
    if why:
        return {"skipped": why}
    c = KV_DECODE
    B, H, G, hd = (2, 4, 2, 16) if dry else (c["batch"], c["heads"], c["kv_heads"], c["head_dim"])
    shape = ModelShape(num_layers=1, hidden_size=H * hd, num_heads=H, num_groups=G, head_dim=hd, ffn_hidden_size=1,
                       vocab_size=None, norm_epsilon=1e-6, rotary_base=1e6, rope_scaling_factor=None,
                       qk_layernorm=False, qkv_bias=False, linear_bias=False, tied_embeddings=False, seq_length=1)
    out = {}
    kv = kernels.kv_ops()
    for S in ((64,) if dry else c["positions"]):
        g = torch.Generator(device=device).manual_seed(S)
        codes = [torch.randint(0, 0x7E, (B, G, S, hd), device=device, dtype=torch.uint8, generator=g) for _ in range(2)]
        q = torch.randn(B, H, hd, device=device, generator=g)
        positions = torch.randint(S // 2, S, (B,), device=device, generator=g)
        mask = (torch.arange(S, device=device)[None, :] <= positions[:, None]).view(B, 1, 1, S)

        # the engine's read-back path: its scales are float32 tensors on the device, made once (a Python float
        # would add an upload and a stream sync to every call), and its float32 masked attention repeats K/V on
        # CUDA (FlashAttention, the one CUDA kernel with grouped heads, takes no mask and no float32)
        ks, vs = (torch.tensor(x, dtype=torch.float32).to(device) for x in (0.02, 0.03))

        def readback():
            k = dequantize_kv(codes[0].view(torch.float8_e4m3fn), ks)
            v = dequantize_kv(codes[1].view(torch.float8_e4m3fn), vs)
            return _attend(shape, q.unsqueeze(2), k, v, mask)

        def kernel():
            return kv.decode_attention(q, codes[0], codes[1], positions, 0.02, 0.03, "e4m3")

        warm, reps = (0, 1) if dry else (3, 20)
        t_k, t_r = time_ms(kernel, device, warm, reps), time_ms(readback, device, warm, reps)
        out[f"S={S}"] = {"kernel_ms": t_k, "readback_sdpa_ms": t_r, "speedup": t_r / t_k}
    return out


def _torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or incompatible with this torch
        return False
    return True


def _torchao_linear(recipe_name: str, shape_name: str, n: int, k: int, device: str, cache: dict):
    """``f(x, w)`` running torchao's compiled float8 linear for recipe ``tensorwise``/``rowwise`` with weight
    ``w`` (the same BF16 tensor the other rows use; swapped into the converted module), or None when
    torchao cannot run here (reason in ``cache["error"]``). One compile per (recipe, projection)."""
    import torch

    key = (recipe_name, shape_name)
    if key in cache:
        return cache[key]
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
        convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe_name))
        mod = lin[0]
        compiled = torch.compile(mod)

        # torchao reads the module's own weight; give it the row's weight tensor itself (no copy), so
        # autograd.grad(y, (x, w)) reaches it
        def call(x, w, mod=mod, compiled=compiled):
            if mod._parameters["weight"] is not w:
                mod._parameters["weight"] = w
            torch._dynamo.mark_dynamic(x, 0)  # one compile per projection serves every token count
            return compiled(x)

        cache[key] = call
    except Exception as e:  # noqa: BLE001 - an incompatible torchao: report, do not fail the part
        cache["error"] = f"torchao: {type(e).__name__}: {e}"[:200]
        cache[key] = None
    return cache[key]


def _kernel_configs(device: str) -> dict:
    """The launch configurations the Triton kernels picked in this process (``cast_transpose._config``,
    ``block_gemm._gemm_config``) and blockwise_hybrid's backward GEMMs (``block_gemm.hybrid_uses_fp8_gemm``)."""
    from nemo_fp8rl.fp8 import kernels

    if kernels.kernel_unavailable(device):
        return {}
    out = {f"{kind}@{dev}": list(c) if isinstance(c, tuple) else c
           for (kind, dev), c in kernels.ops().tuned_configs().items()}
    bg = kernels.block_gemm_ops()
    out.update({f"block_gemm@{dev}": list(c) for dev, c in bg.tuned_configs().items()})
    # blockwise_hybrid's backward: the FP8 block GEMM or bf16 GEMMs, with both times
    out.update({f"hybrid_backward@{dev}": v for dev, v in bg.hybrid_choice().items()})
    return out


def _auto_rows(res: dict, labels: list, dry: bool) -> dict:
    """``fp8.backend=auto`` per recipe: each projection@tokens runs what ``fp8/layer_filter.py`` picks for it
    (FP8 or BF16, both timed above), so its x BF16 is BF16 ms / the picked path's ms; layer rows sum them.
    ``{recipe: {"x_bf16": {key: ratio}, "fp8_rows": [keys run in FP8], "min": lowest ratio}}``."""
    from nemo_fp8rl.fp8.layer_filter import keep_bf16_reason

    out = {}
    sh = shapes(dry)
    for lab in labels:
        rec = recipe(lab)
        per, fp8_rows = {}, []
        for tokens in token_counts(dry):
            total_auto = total_bf16 = 0.0
            complete = True
            for name, (n, k) in sh.items():
                row = res["ms"].get(f"{name}@{tokens}", {})
                use_fp8 = keep_bf16_reason(rec, tokens, n, k, "cuda") is None
                ms = row.get(lab) if use_fp8 else row.get("bf16")
                if ms is None or "bf16" not in row:
                    complete = False
                    continue
                per[f"{name}@{tokens}"] = row["bf16"] / ms
                if use_fp8:
                    fp8_rows.append(f"{name}@{tokens}")
                total_auto += ms
                total_bf16 += row["bf16"]
            if complete and total_auto:
                per[f"layer@{tokens}"] = total_bf16 / total_auto
        out[lab] = {"x_bf16": per, "fp8_rows": fp8_rows, "min": min(per.values()) if per else None}
    return out


def _targets(res: dict, dry: bool) -> dict:
    """Issue 38's throughput targets against what was measured (layer rows); hybrid vs blockwise and the
    peers vs ours are ratios of the same run."""
    out = {}
    xb = res.get("x_bf16", {})
    for lab, per_tokens in TARGETS.items():
        for tokens, target in per_tokens.items():
            t = tokens if not dry else max(token_counts(dry))
            out[f"{lab} layer@{t} >= {target}x BF16"] = xb.get(f"layer@{t}", {}).get(lab)
    mins = [a["min"] for a in res.get("auto", {}).values() if a.get("min") is not None]
    if mins:
        out["fp8.backend=auto: lowest row of any recipe >= 1.0 (minus timing noise)"] = min(mins)
    for tokens in (PEER_TOKENS if not dry else token_counts(dry)):
        row = xb.get(f"layer@{tokens}", {})
        if "blockwise" in row and "blockwise_hybrid" in row:
            out[f"blockwise_hybrid / blockwise layer@{tokens} >= 0.95"] = row["blockwise_hybrid"] / row["blockwise"]
        peer_best = max((row[p] for p in PEERS if p in row), default=None)
        if peer_best is not None:
            ours = [lab for lab, _, _ in RECIPES if lab in row]
            out[f"every recipe >= best torchao row layer@{tokens} ({peer_best:.2f}x)"] = (
                min(row[lab] for lab in ours) / peer_best if ours else None)
    return out


def _profile(ctx, labels: list, broken: set) -> dict:
    """Top GPU kernels of one gate_up forward+backward per recipe (and BF16), torch.profiler, 3 calls."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from nemo_fp8rl.fp8 import Fp8LinearState, fp8_linear
    from nemo_fp8rl.fp8.backends import torch_gemm_support

    name, tokens = PROFILE_SHAPE if not ctx.dry else ("gate_up", max(token_counts(ctx.dry)))
    n, k = shapes(ctx.dry)[name]
    g = torch.Generator(device=ctx.device).manual_seed(1)
    x = _randn((tokens, k), 2.0, g, ctx.device).requires_grad_(True)
    w = _randn((n, k), 0.02, g, ctx.device).requires_grad_(True)
    dy = _randn((tokens, n), 1e-3, g, ctx.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    out = {"shape": f"{name}@{tokens}", "calls": 3, "recipes": {}}
    for label in ["bf16", *labels]:
        if ctx.left() < 10 or label in broken:
            break
        if label == "bf16":
            f = F.linear
        else:
            rec = recipe(label)
            if torch_gemm_support(rec, ctx.device, n, k):
                continue
            state = Fp8LinearState(rec, track_stats=False)
            state.weight_cache.active = True

            def f(x, w, rec=rec, state=state):
                return fp8_linear(x, w, None, rec, state, backend="torch")
        call = _fwd_bwd(f, x, w, dy)
        call()
        call()
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            for _ in range(3):
                call()
            if ctx.device == "cuda":
                torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            dev_us = getattr(ev, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(ev, "self_cuda_time_total", 0)
            if ctx.device != "cuda":
                dev_us = ev.self_cpu_time_total
            if dev_us > 0 and (ctx.device != "cuda" or not ev.key.startswith(("aten::", "autograd", "_Fp8"))):
                rows.append((ev.key, dev_us / 3 / 1000.0, ev.count // 3))
        rows.sort(key=lambda r: -r[1])
        out["recipes"][label] = {"total_ms": round(sum(r[1] for r in rows), 3),
                                 "kernels": [[kname[:90], round(ms, 3), cnt] for kname, ms, cnt in rows[:8]],
                                 "launches_per_call": sum(r[2] for r in rows)}
        ctx.save()
    return out


def headline(res: dict) -> str:
    big = max(res.get("tokens", [0]))
    row = res.get("x_bf16", {}).get(f"layer@{big}", {})
    parts = [f"layer@{big} x BF16: " + ", ".join(f"{k} {v:.2f}x" for k, v in row.items())]
    parts += [f"{k} not timed ({v[:60]})" for k, v in res.get("not_timed", {}).items()]
    if res.get("skipped"):
        parts.append(f"{len(res['skipped'])} configs out of time")
    return "; ".join(parts)


def tables(res: dict) -> list[str]:
    order = [r[0] for r in RECIPES] + list(PEERS)
    labels = sorted({lab for row in res.get("ms", {}).values() for lab in row if lab != "bf16"},
                    key=lambda s: order.index(s) if s in order else len(order))
    lines = [f"Linear forward+backward ({res.get('what')}; warm-up {res.get('warmup')}, {res.get('repeats')} timed), "
             "x BF16 = BF16 ms / FP8 ms:", "",
             "| projection@tokens | BF16 ms | " + " | ".join(f"{lab} ms | x BF16" for lab in labels) + " |",
             "|---|---|" + "---|---|" * len(labels)]
    for key, row in res.get("ms", {}).items():
        if "bf16" not in row:
            continue
        cells = []
        for lab in labels:
            v = row.get(lab)
            cells.append(f"{v:.2f} | {row['bf16'] / v:.2f}" if v else "- | -")
        lines.append(f"| {key} | {row['bf16']:.2f} | " + " | ".join(cells) + " |")
    for lab, why in res.get("not_timed", {}).items():
        if lab in res.get("errors", {}):
            lines.append(f"\n{lab}: raised, not timed further ({res['errors'][lab]})")
        else:
            lines.append(f"\n{lab}: not timed, it would run emulated ({why})")
    for why, count in res.get("gemm_fallbacks", {}).items():
        lines.append(f"\n{count} GEMMs timed as float32 GEMMs of the dequantized operands: {why}")
    tg = res.get("targets", {})
    if tg:
        lines += ["", "Targets (layer = the four projections summed; FP8 with the weight cached per step):", ""]
        for what, v in tg.items():
            if isinstance(v, dict):  # an older results.json
                continue
            lines.append(f"- {what}: {'-' if v is None else f'{v:.2f}'}")
    if res.get("kernel_configs"):
        lines.append(f"\nTriton kernel launch configs picked in this run: {res['kernel_configs']}")
    kd = res.get("kv_decode") or {}
    if kd and "skipped" not in kd and "error" not in kd:
        c = KV_DECODE
        lines.append(f"\nDecode attention over an E4M3 KV cache, one layer ({c['batch']} rows, {c['heads']} heads on "
                     f"{c['kv_heads']} KV heads, head size {c['head_dim']}): Triton kernel vs read-back + SDPA, ms: "
                     + "; ".join(f"{k} {v['kernel_ms']:.3f} vs {v['readback_sdpa_ms']:.3f} ({v['speedup']:.2f}x)"
                                 for k, v in kd.items()))
    elif kd:
        lines.append(f"\nDecode attention over an E4M3 KV cache: {kd.get('skipped') or kd.get('error')}")
    auto = res.get("auto") or {}
    if auto:
        keys = [f"layer@{t}" for t in res.get("tokens", [])]
        lines += ["", "fp8.backend=auto (nemo_fp8rl/fp8/layer_filter.py picks FP8 or BF16 per projection and token "
                      "count; the picked path's time from the table above), x BF16:", "",
                  "| recipe | " + " | ".join(keys) + " | lowest row | rows in FP8 |", "|---|" + "---|" * (len(keys) + 2)]
        for lab, a in auto.items():
            cells = [f"{a['x_bf16'][k]:.2f}" if k in a["x_bf16"] else "-" for k in keys]
            low = "-" if a.get("min") is None else f"{a['min']:.2f}"
            lines.append(f"| {lab} | " + " | ".join(cells) + f" | {low} | {len(a['fp8_rows'])} |")
    prof = res.get("profile") or {}
    if prof.get("recipes"):
        lines += ["", f"Kernel profile of one {prof.get('shape')} forward+backward (torch.profiler, mean of "
                      f"{prof.get('calls')} calls; GPU ms per call; launches = device kernels per call):", "",
                  "| recipe | GPU ms | launches | top kernels (ms) |", "|---|---|---|---|"]
        for lab, r in prof["recipes"].items():
            top = "; ".join(f"{kname.replace('|', '/')} {ms:.3f}" + (f" x{cnt}" if cnt > 1 else "")
                            for kname, ms, cnt in r["kernels"][:6])
            lines.append(f"| {lab} | {r['total_ms']:.3f} | {r['launches_per_call']} | {top} |")
    if res.get("profile_error"):
        lines.append(f"\nprofile failed: {res['profile_error']}")
    return lines
