"""Part (f), cost of Calibrated Clipping's BF16 shadow forwards at Qwen3-8B layer shapes.

A calibration step (every ``calibration.interval`` = 20 steps) runs two extra BF16 forwards of the same
weights with FP8 off (docs/design.md, Calibrated Clipping: one at the old-logprob pass, one before the
minibatch's update). Per decoder layer (the four projections of ``common.SHAPES_8B``) and per recipe:

    t_shadow = BF16 forward (no grad);   t_step = FP8 forward (no grad, old logprobs)
                                                  + FP8 forward + backward (the update)
    overhead of a calibration step = 2 t_shadow / t_step
    share of the mean step time     = 2 t_shadow / (interval * t_step)       (target < 3 %)

Linear layers only (attention scores, norms, the LM head and the optimizer are left out, which makes
t_step smaller than a real step's and the share an upper estimate for these layers).
"""

from __future__ import annotations

from common import free_memory, shapes, time_ms

INTERVAL = 20
RECIPES = ("tensorwise", "blockwise")


def run(ctx) -> dict:
    import torch
    import torch.nn.functional as F

    from nemo_fp8rl.fp8 import Fp8LinearState, fp8_linear, get_recipe
    from nemo_fp8rl.fp8.backends import torch_gemm_support

    tokens = 32 if ctx.dry else 8192
    warmup, repeats = (0, 1) if ctx.dry else (3, 10)
    res = ctx.res
    res.update(tokens=tokens, interval=INTERVAL, warmup=warmup, repeats=repeats, recipes={}, not_timed={})
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in shapes(ctx.dry).values():
        x = (torch.randn(tokens, k, generator=g) * 2).to(ctx.device, torch.bfloat16).requires_grad_(True)
        w = (torch.randn(n, k, generator=g) * 0.02).to(ctx.device, torch.bfloat16).requires_grad_(True)
        dy = (torch.randn(tokens, n, generator=g) * 1e-3).to(ctx.device, torch.bfloat16)
        layers.append((x, w, dy))

    def shadow():
        with torch.no_grad():
            for x, w, _ in layers:
                F.linear(x, w)

    res["shadow_ms"] = time_ms(shadow, ctx.device, warmup, repeats)
    for name in RECIPES:
        rec = get_recipe(name)
        why = [torch_gemm_support(rec, ctx.device, w.shape[0], w.shape[1]) for _, w, _ in layers]
        if any(why):
            res["not_timed"][name] = next(r for r in why if r)
            continue
        states = [Fp8LinearState(rec, track_stats=False) for _ in layers]

        def old_logp(rec=rec, states=states):
            with torch.no_grad():
                for (x, w, _), st in zip(layers, states):
                    fp8_linear(x, w, None, rec, st, backend="torch")

        def update(rec=rec, states=states):
            for (x, w, dy), st in zip(layers, states):
                y = fp8_linear(x, w, None, rec, st, backend="torch")
                torch.autograd.grad(y, (x, w), dy)

        try:
            fwd = time_ms(old_logp, ctx.device, warmup, repeats)
            fwd_bwd = time_ms(update, ctx.device, warmup, repeats)
        except Exception as e:  # noqa: BLE001  (one recipe failing must not end the part)
            import traceback

            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:500]
            res["traceback"] = res.get("traceback", "") + f"--- {name}\n{traceback.format_exc()[-3000:]}"
            free_memory()
            ctx.save()
            continue
        step = fwd + fwd_bwd
        res["recipes"][name] = {"fp8_forward_ms": fwd, "fp8_forward_backward_ms": fwd_bwd, "step_ms": step,
                                "calibration_step_overhead": 2 * res["shadow_ms"] / step,
                                "share_at_interval": 2 * res["shadow_ms"] / (INTERVAL * step)}
        ctx.save()
    layers = None
    free_memory()
    if res.get("errors"):
        res["failed"] = f"recipe(s) {sorted(res['errors'])} raised; the others were timed"
    return res


def headline(res: dict) -> str:
    parts = [f"shadow {res.get('shadow_ms', float('nan')):.2f} ms/layer at {res.get('tokens')} tokens"]
    for name, r in res.get("recipes", {}).items():
        parts.append(f"{name}: +{100 * r['calibration_step_overhead']:.1f}% on a calibration step, "
                     f"{100 * r['share_at_interval']:.2f}% of mean step time at interval {res.get('interval')}")
    parts += [f"{k} not timed ({v[:60]})" for k, v in res.get("not_timed", {}).items()]
    return "; ".join(parts)


def tables(res: dict) -> list[str]:
    if not res.get("recipes"):
        return []
    lines = [f"Shadow-forward cost per decoder layer's linears ({res['tokens']} tokens, BF16 shadow forward "
             f"{res['shadow_ms']:.2f} ms; target: share < 3%):", "",
             "| recipe | FP8 fwd ms | FP8 fwd+bwd ms | step ms | calibration step overhead | share at interval "
             f"{res['interval']} |", "|---|---|---|---|---|---|"]
    for name, r in res["recipes"].items():
        lines.append(f"| {name} | {r['fp8_forward_ms']:.2f} | {r['fp8_forward_backward_ms']:.2f} | {r['step_ms']:.2f} | "
                     f"{100 * r['calibration_step_overhead']:.1f}% | {100 * r['share_at_interval']:.2f}% |")
    return lines
