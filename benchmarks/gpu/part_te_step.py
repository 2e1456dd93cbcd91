"""Part te_step (needs Transformer Engine; skipped where it is not installed): a megatron ``GPTModel``
with Llama-3-8B layer shapes (``layers`` layers, TP=1, TE spec, float32 master weights with BF16
autocast as the actor trains), train-step time in BF16 and under each TE FP8 recipe the GPU supports
(median of ``repeats`` after warm-up, all arms in one process), plus the BF16 shadow forward relative
to an FP8 train step."""

from __future__ import annotations

import gc
import statistics
import time
import traceback

import torch

from part_te_parity import _te_support

# TE's check that a recipe can run on this GPU, by recipe name
RECIPE_SUPPORT = {"delayed": "fp8", "tensorwise": "fp8", "blockwise": "fp8_block_scaling", "mxfp8": "mxfp8"}


def _time_steps(fn, repeats: int, warmup: int = 3) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def run(ctx, layers: int = 4, repeats: int = 10, seq: int = 2048, mbs: int = 2) -> dict:
    dry, left, reserve_s = ctx.dry, ctx.left, 0.0
    if dry:
        return {"skipped": "dry run"}
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    shape = {"vocab_size": 128256, "num_layers": layers, "hidden_size": 4096, "num_attention_heads": 32,
             "num_query_groups": 8, "ffn_hidden_size": 14336, "seq_length": seq, "rotary_base": 500000.0}
    support = _te_support()
    # most informative first, so a short deadline drops the least useful arms
    recipes = ["bf16", "tensorwise", "blockwise", "delayed", "mxfp8"]
    tokens = torch.randint(0, 128256, (mbs, seq), device="cuda")
    batch = {"tokens": tokens, "mask": torch.ones(mbs, seq, device="cuda")}

    def loss_fn(mb, logprobs, entropy, *, global_tokens, global_seqs):
        return -(logprobs * mb["mask"]).sum() / global_tokens, {}

    res = {"shape": shape, "params": "float32 master weights, BF16 autocast, TE layer spec (the actor's setup)",
           "tokens_per_step": mbs * seq, "warmup_steps": 3, "repeats": repeats, "median_s": {}, "tokens_per_s": {},
           "last_step": {}, "peak_memory_gib": {}, "arm_seconds": {}, "skipped": {}, "errors": {}}
    tracebacks = {}
    arm_times: list[float] = []
    for name in recipes:
        if name != "bf16":
            ok, reason = support[RECIPE_SUPPORT[name]]
            if not ok:
                res["skipped"][name] = f"TE: {reason}"
                continue
        est = max(arm_times, default=60.0)
        if left() - reserve_s < est:
            res["skipped"][name] = (f"out of time ({left():.0f}s left, {reserve_s:.0f}s kept for later parts, "
                                    f"~{est:.0f}s per arm)")
            continue
        t_arm = time.monotonic()
        actor = last = None
        try:
            torch.cuda.reset_peak_memory_stats()
            actor = build_actor(ModelConfig(**shape), ParallelConfig(micro_batch_size=mbs),
                                fp8_recipe=None if name == "bf16" else get_recipe(name), seed=1, lr=1e-5, use_te=True)
            last = {}

            def step(actor=actor, last=last):
                last["m"] = actor.train_step(batch, loss_fn)

            med, _ = _time_steps(step, repeats)
            res["median_s"][name] = med
            res["tokens_per_s"][name] = mbs * seq / med
            m = last["m"]
            res["last_step"][name] = {k: float(m[k][0]) for k in ("train/loss", "train/grad_norm", "train/skipped")}
            if res["last_step"][name]["train/skipped"]:
                # a skipped update (non-finite loss) leaves out the optimizer: the time is not a train step
                res["errors"][name] = "non-finite loss/grad norm: updates were skipped, time not comparable"
            if name != "bf16" and "shadow_forward_s" not in res:
                shadow, _ = _time_steps(lambda actor=actor: actor.get_shadow_logprobs(tokens), repeats)
                res["shadow_forward_s"] = shadow
                res["shadow_vs_recipe"] = name
                res["shadow_over_step"] = shadow / med
            res["peak_memory_gib"][name] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        except Exception as e:  # noqa: BLE001
            res["errors"][name] = f"{type(e).__name__}: {e}"
            tracebacks[name] = traceback.format_exc()[-4000:]
        finally:
            # free the GPU memory before the next recipe (modules hold reference cycles: collect them)
            actor = last = step = None
            gc.collect()
            torch.cuda.empty_cache()
            arm_times.append(time.monotonic() - t_arm)
            res["arm_seconds"][name] = round(arm_times[-1], 1)
    res["memory_after_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    base = res["median_s"].get("bf16")
    if base:
        res["speedup_vs_bf16"] = {k: base / v for k, v in res["median_s"].items()}
    if tracebacks:
        res["traceback"] = "\n".join(f"--- {k}\n{v}" for k, v in tracebacks.items())
    if res["errors"]:
        res["failed"] = f"arm(s) {sorted(res['errors'])} failed"
    return res


def headline(res: dict) -> str:
    sp = res.get("speedup_vs_bf16", {})
    parts = [f"{k} {v * 1e3:.0f} ms" + (f" ({sp[k]:.2f}x)" if k in sp else "") for k, v in res.get("median_s", {}).items()]
    if "shadow_over_step" in res:
        parts.append(f"shadow/step {res['shadow_over_step']:.2f}")
    parts += [f"{k}: {v[:80]}" for k, v in res.get("errors", {}).items()]
    parts += [f"{k} skipped" for k in res.get("skipped", {})]
    return "; ".join(parts)
