"""Part (d), Qwen3-8B-shaped linear throughput: forward + backward of the four projections of one
decoder layer (qkv 4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096) at 4k, 8k and 16k
tokens, BF16 ``F.linear`` against each FP8 recipe through ``fp8_linear(..., backend="torch")``.

One timed call = y = linear(x) and ``torch.autograd.grad(y, (x, W), dy)`` (forward, dgrad, wgrad), BF16
operands; median of ``repeats`` CUDA-event timings after ``warmup`` calls. A recipe torch cannot run on
this GPU at a shape (``torch_gemm_support``) is not timed: its cell says why (it would run emulated).
Ratios are BF16 time / FP8 time (> 1: FP8 is faster), side by side in one table; the ``layer`` rows
sum the four projections. Targets (benchmarks, not tests): tensorwise >= 1.5x, blockwise >= 1.3x.

A recipe that raises (a kernel refusing its operands, out of memory) is recorded under ``errors`` with
the configuration and the exception, is not timed again, and the other recipes go on; the part is then
marked failed with what it measured kept.
"""

from __future__ import annotations

import time

from common import RECIPES, free_memory, recipe, shapes, time_ms, token_counts

TARGETS = {"tensorwise": 1.5, "blockwise": 1.3}


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
    g = torch.Generator().manual_seed(0)
    per_config: list[float] = []
    for tokens in token_counts(ctx.dry):
        for name, (n, k) in shapes(ctx.dry).items():
            key = f"{name}@{tokens}"
            res["ms"][key] = {}
            x = (torch.randn(tokens, k, generator=g) * 2).to(ctx.device, torch.bfloat16).requires_grad_(True)
            w = (torch.randn(n, k, generator=g) * 0.02).to(ctx.device, torch.bfloat16).requires_grad_(True)
            dy = (torch.randn(tokens, n, generator=g) * 1e-3).to(ctx.device, torch.bfloat16)
            for label in ["bf16", *labels]:
                est = max(per_config, default=5.0)
                if label in broken:
                    continue
                if ctx.left() < est + 5:
                    res["skipped"].append(f"{key} {label}: out of time")
                    continue
                t0 = time.monotonic()
                if label == "bf16":
                    f = F.linear
                else:
                    rec = recipe(label)
                    why = torch_gemm_support(rec, ctx.device, n, k)
                    if why:
                        res["not_timed"].setdefault(label, why)
                        continue
                    state = Fp8LinearState(rec, track_stats=False)

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
                per_config.append(time.monotonic() - t0)
            x = w = dy = None
            free_memory()
            ctx.save()
    # the whole layer: the four projections summed, where every one of them was timed
    for tokens in token_counts(ctx.dry):
        keys = [f"{name}@{tokens}" for name in shapes(ctx.dry)]
        common_labels = set.intersection(*(set(res["ms"].get(k, {})) for k in keys))
        res["ms"][f"layer@{tokens}"] = {lab: sum(res["ms"][k][lab] for k in keys) for lab in ["bf16", *labels]
                                        if lab in common_labels}
    res["x_bf16"] = {key: {lab: row["bf16"] / v for lab, v in row.items() if lab != "bf16"}
                     for key, row in res["ms"].items() if "bf16" in row}
    res["targets"] = {lab: {"target": t, **{f"layer@{n}": res["x_bf16"].get(f"layer@{n}", {}).get(lab)
                                            for n in token_counts(ctx.dry)}} for lab, t in TARGETS.items()}
    # GEMMs torch's kernels refuse (blockwise + hybrid: dgrad and wgrad) were timed as float32 GEMMs
    res["gemm_fallbacks"] = gemm_fallbacks()
    if res["errors"]:
        res["failed"] = f"recipe(s) {sorted(res['errors'])} raised; the others were timed"
    return res


def headline(res: dict) -> str:
    big = max(res.get("tokens", [0]))
    row = res.get("x_bf16", {}).get(f"layer@{big}", {})
    parts = [f"layer@{big} x BF16: " + ", ".join(f"{k} {v:.2f}x" for k, v in row.items())]
    parts += [f"{k} not timed ({v[:60]})" for k, v in res.get("not_timed", {}).items()]
    if res.get("skipped"):
        parts.append(f"{len(res['skipped'])} configs out of time")
    return "; ".join(parts)


def tables(res: dict) -> list[str]:
    labels = sorted({lab for row in res.get("ms", {}).values() for lab in row if lab != "bf16"},
                    key=lambda s: [r[0] for r in RECIPES].index(s))
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
        lines += ["", "Targets (layer = the four projections summed):", ""]
        for lab, t in tg.items():
            got = ", ".join(f"{k} {v:.2f}x" if v else f"{k} -" for k, v in t.items() if k != "target")
            lines.append(f"- {lab} >= {t['target']}x BF16: {got}")
    return lines
