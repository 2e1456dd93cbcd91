"""Part vllm_parity (needs vLLM's CUDA build; skipped where vLLM is not installed): vLLM's FP8
log-probs vs our emulated scheme on the same weights and tokens, ``rollout.fp8.scheme`` off / vllm_w8a8
/ vllm_block. A scheme the vllm engine cannot run is recorded as an error and the others still run.
Dry run (``GPU_CHECK_DRY_VLLM=1``): a tiny float32 model on the CPU, FP8 off only.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from vllm_common import _VLLM_CHILD_ENV, _close_llm

VLLM_PARITY_SCHEMES = ("off", "vllm_w8a8", "vllm_block")


def run(ctx) -> None:
    """vLLM's FP8 log-probs vs our emulated scheme on the same weights and tokens (and with FP8 off).

    Per scheme: the vllm engine (``rollout.engine=vllm``) greedily generates from fixed prompts after a
    weight sync of random weights; the torch engine with the same ``rollout.fp8.scheme`` (the emulation,
    float32) scores the same tokens teacher-forced. Reported over the response tokens: max and mean
    |rollout_logp - emulated logp|, how often the emulation's argmax is vLLM's greedy token, and the size
    of FP8's own effect (mean |emulated scheme logp - emulated off logp|) for scale. vLLM computes in
    BF16 on GPU, so the ``off`` row is the BF16-vs-float32 floor the FP8 rows are read against.
    """
    res, save, dry, deadline = ctx.res, ctx.save, ctx.dry, ctx.deadline
    for k, v in _VLLM_CHILD_ENV.items():
        os.environ.setdefault(k, v)
    import vllm

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/bench_rollout.py
    from bench_rollout import random_weights

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine

    if dry:  # CPU: tiny, vLLM in float32, FP8 off only
        cfg = ModelConfig(name="parity", vocab_size=512, num_layers=2, hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, seq_length=64)
        new, dev, extra = 8, "cpu", {}
    else:
        # every linear dimension a multiple of 128: block FP8's tiles and 1x128 groups are whole
        cfg = ModelConfig(name="parity", vocab_size=8192, num_layers=2, hidden_size=1024, num_attention_heads=8,
                          num_query_groups=4, kv_channels=128, ffn_hidden_size=3072, qk_layernorm=True,
                          seq_length=128)
        new, dev, extra = 32, "cuda", {"gpu_memory_utilization": 0.25}
    eos, pad = 2, 0
    # BF16-representable weights: vLLM's BF16 copy (what vllm_w8a8 quantizes) equals what our emulation quantizes
    sd = {k: v.bfloat16().float() for k, v in random_weights(cfg, seed=0, logit_scale=4.0).items()}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (int(n),), generator=g).tolist() for n in (5, 9, 16, 24, 7, 12, 20, 31)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new, stop_on_eos=False)
    res.update(vllm=vllm.__version__, shape={k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
        "vocab_size")}, prompts=len(prompts), new_tokens=new, reference=f"torch engine, float32 on {dev}",
        schemes={}, errors={})

    def torch_engine(scheme, dtype=torch.float32):
        e = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=eos, pad_id=pad, device=dev, dtype=dtype)
        e.update_weights(sd)
        return e

    ref_off = torch_engine("off")

    def teacher_forced(eng, tokens):
        logits = eng.forward(tokens)[:, :-1].double()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return lp, logits.argmax(-1)

    scheme_times: list[float] = []
    for scheme in VLLM_PARITY_SCHEMES:
        if dry and scheme != "off":
            res["schemes"][scheme] = {"skipped": "dry run: vLLM's FP8 needs a GPU"}
            continue
        est = max(scheme_times, default=30.0)
        if deadline - time.time() < est:
            res["schemes"][scheme] = {"skipped": f"out of time ({deadline - time.time():.0f}s left)"}
            continue
        t_s = time.monotonic()
        eng = None
        try:
            t0 = time.perf_counter()
            eng = get_rollout_engine("vllm", cfg, fp8_scheme=scheme, eos_id=eos, pad_id=pad, **extra)
            row = {"build_s": round(time.perf_counter() - t0, 1)}
            if getattr(eng, "fp8_kernels", None):
                row["fp8_kernels"] = list(eng.fp8_kernels)
            eng.update_weights(sd)
            row["sync_s"] = round(float(getattr(eng, "last_sync_seconds", float("nan"))), 3)
            out = eng.generate(prompts, params, torch.Generator().manual_seed(0))
            out.validate()
            emu = ref_off if scheme == "off" else torch_engine(scheme)
            lp, argmax = teacher_forced(emu, out.tokens)
            m = out.mask[:, 1:].bool()
            d = (out.rollout_logp[:, 1:].double() - lp)[m].abs()
            row.update(tokens=int(m.sum()), max_abs_diff=float(d.max()), mean_abs_diff=float(d.mean()),
                       argmax_agree=float((argmax == out.tokens[:, 1:])[m].float().mean()),
                       mean_logp=float(lp[m].mean()))
            if scheme != "off":
                lp_off, _ = teacher_forced(ref_off, out.tokens)
                row["fp8_effect_mean"] = float((lp - lp_off)[m].abs().mean())
            if not dry:  # the same scheme emulated in BF16 (vLLM's compute dtype) on the GPU
                lp16, _ = teacher_forced(torch_engine(scheme, torch.bfloat16), out.tokens)
                d16 = (out.rollout_logp[:, 1:].double() - lp16)[m].abs()
                row.update(bf16_emulation_max_abs_diff=float(d16.max()), bf16_emulation_mean_abs_diff=float(d16.mean()))
            res["schemes"][scheme] = row
        except Exception as e:  # noqa: BLE001  (the vllm engine's FP8 path may not exist yet: record, go on)
            res["schemes"][scheme] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            res["errors"][scheme] = res["schemes"][scheme]["error"]
            res.setdefault("traceback", "")
            res["traceback"] += f"--- {scheme}\n{traceback.format_exc()[-4000:]}\n"
        finally:
            if eng is not None and callable(getattr(eng, "close", None)):
                eng.close()  # frees vLLM's memory before the next scheme's engine
            elif eng is not None and getattr(eng, "llm", None) is not None:
                llm, eng.llm = eng.llm, None
                _close_llm(llm)
            eng = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            scheme_times.append(time.monotonic() - t_s)
            save()
    if res["errors"]:
        res["failed"] = f"scheme(s) {sorted(res['errors'])} raised"


def headline(res: dict) -> str:
    parts = []
    for k, r in res.get("schemes", {}).items():
        if "max_abs_diff" in r:
            parts.append(f"{k} max {r['max_abs_diff']:.3g} mean {r['mean_abs_diff']:.3g} argmax {r['argmax_agree']:.3f}"
                         + (f" (FP8 effect {r['fp8_effect_mean']:.3g})" if "fp8_effect_mean" in r else ""))
        else:
            parts.append(f"{k}: {str(r.get('error') or r.get('skipped'))[:80]}")
    return "; ".join(parts)


def tables(res: dict) -> list[str]:
    if not res.get("schemes"):
        return []
    vp = res
    lines = [(f"vLLM log-probs vs our emulation ({vp.get('reference')}), greedy, {vp.get('prompts')} "
              f"prompts x {vp.get('new_tokens')} tokens, same weights and tokens:"), "",
             ("| rollout.fp8.scheme | tokens | max abs diff | mean abs diff | BF16 emulation: max | mean | "
              "argmax agrees | FP8 effect (mean) | vLLM FP8 kernels |"),
             "|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for k, r in vp["schemes"].items():
        if "max_abs_diff" in r:
            lines.append(f"| {k} | {r['tokens']} | {r['max_abs_diff']:.3g} | {r['mean_abs_diff']:.3g} | "
                         f"{r.get('bf16_emulation_max_abs_diff', nan):.3g} | "
                         f"{r.get('bf16_emulation_mean_abs_diff', nan):.3g} | {r['argmax_agree']:.3f} | "
                         f"{r.get('fp8_effect_mean', nan):.3g} | {', '.join(r.get('fp8_kernels', []))} |")
        else:
            lines.append(f"| {k} | {str(r.get('error') or r.get('skipped'))[:120].replace('|', '/')} "
                         "| | | | | | | |")
    return lines
