"""One-shot GPU check (driven by ``benchmarks/gpu_check.sh``): everything a single Hopper GPU can tell us.

Parts (each writes a JSON file under ``--out`` and a line to ``summary.md``; a failing part is recorded
and the next one still runs):

1. ``env``: torch / Transformer Engine / megatron-core versions, GPU name and capability.
2. ``parity``: TE's quantizers vs our emulation on the same random CUDA tensors, max |difference| of the
   dequantized values for tensorwise (current scaling), blockwise 1x128 and 128x128, mxfp8 (sm100+).
3. ``throughput``: a megatron ``GPTModel`` with Llama-3-8B layer shapes (``--layers`` layers, TP=1),
   train-step time in BF16 and under each TE FP8 recipe the GPU supports (median of ``--repeats``
   after warm-up, all arms in one process), plus the BF16 shadow forward relative to an FP8 train step.
4. ``grpo``: the tiny GRPO run on GPU with TE FP8 + Calibrated Clipping for a few steps (finite metrics).

``--dry-run`` runs only what needs no GPU (environment, and the parity comparison on CPU of our
emulation against itself through the public API) so CI exercises this file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch


def part_env(out: Path, dry: bool) -> dict:
    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0]}
    for mod in ("transformer_engine", "megatron.core"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod] = getattr(m, "__version__", "present")
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable: {type(e).__name__}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["cuda"] = torch.version.cuda
    return info


def part_parity(out: Path, dry: bool) -> dict:
    from nemo_fp8rl.fp8 import E4M3, fake_quantize

    dev = "cpu" if dry else "cuda"
    torch.manual_seed(0)
    x = torch.randn(1024, 4096, device=dev) * 2
    x[5, 17] = 600.0
    res = {}
    if dry:
        # CPU: check the comparison path itself (emulation vs dequantize(quantize)) so CI runs this code
        from nemo_fp8rl.fp8 import dequantize, quantize

        for name, g in (("tensorwise", "tensor"), ("blockwise_1x128", (1, 128)), ("blockwise_128x128", (128, 128)),
                        ("mxfp8", "mx")):
            q, s = quantize(x, E4M3, g, pow2_scales=g != "tensor")
            res[name] = (dequantize(q, s, x, g) - fake_quantize(x, E4M3, g, pow2_scales=g != "tensor")).abs().max().item()
        return {"device": "cpu (dry run: emulation self-consistency only)", "max_abs_diff": res}
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, device=x.device)
    res["tensorwise"] = (q(x).dequantize().float() - fake_quantize(x, E4M3, "tensor")).abs().max().item()
    for dim, g in ((1, (1, 128)), (2, (128, 128))):
        bq = Float8BlockQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                  force_pow_2_scales=True, block_scaling_dim=dim)
        res[f"blockwise_{g[0]}x{g[1]}"] = (bq(x).dequantize().float() - fake_quantize(x, E4M3, g, pow2_scales=True)).abs().max().item()
    if torch.cuda.get_device_capability()[0] >= 10:
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        mq = MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
        res["mxfp8"] = (mq(x).dequantize().float() - fake_quantize(x, E4M3, "mx")).abs().max().item()
    else:
        res["mxfp8"] = "not supported on this GPU (needs sm100+)"
    return {"device": torch.cuda.get_device_name(), "max_abs_diff": res}


def _time_steps(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def part_throughput(out: Path, dry: bool, layers: int, repeats: int, seq: int, mbs: int) -> dict:
    if dry:
        return {"skipped": "dry run"}
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    shape = dict(vocab_size=128256, num_layers=layers, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                 ffn_hidden_size=14336, seq_length=seq, rotary_base=500000.0)
    recipes = ["bf16", "delayed", "tensorwise", "blockwise"]
    if torch.cuda.get_device_capability()[0] >= 10:
        recipes.append("mxfp8")
    tokens = torch.randint(0, 128256, (mbs, seq), device="cuda")
    batch = {"tokens": tokens, "mask": torch.ones(mbs, seq, device="cuda")}

    def loss_fn(mb, logprobs, entropy, *, global_tokens, global_seqs):
        return -(logprobs * mb["mask"]).sum() / global_tokens, {}

    res = {"shape": shape, "tokens_per_step": mbs * seq, "median_s": {}, "errors": {}}
    for name in recipes:
        try:
            actor = build_actor(ModelConfig(**shape), ParallelConfig(micro_batch_size=mbs),
                                fp8_recipe=None if name == "bf16" else get_recipe(name), seed=1, lr=1e-5, use_te=True)
            res["median_s"][name] = _time_steps(lambda: actor.train_step(batch, loss_fn), repeats)
            if name != "bf16" and "shadow_over_step" not in res:
                shadow = _time_steps(lambda: actor.get_shadow_logprobs(tokens), repeats)
                res["shadow_forward_s"] = shadow
                res["shadow_over_step"] = shadow / res["median_s"][name]
            actor = None  # free the GPU memory before the next recipe
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            res["errors"][name] = f"{type(e).__name__}: {e}"
    base = res["median_s"].get("bf16")
    if base:
        res["speedup_vs_bf16"] = {k: base / v for k, v in res["median_s"].items()}
    return res


def part_grpo(out: Path, dry: bool, steps: int) -> dict:
    if dry:
        return {"skipped": "dry run"}
    run = out / "grpo_tiny"
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", "fp8=tensorwise", "calibration=paper", "calibration.interval=2",
           "fp8.use_te=true", f"trainer.max_steps={steps}", "warmup.steps=300", f"output_dir={run}",
           f"warmup.cache_dir={out / 'warmup_cache'}", "logger.tensorboard=false", "logger.progress=lines"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    res = {"cmd": " ".join(cmd[1:]), "rc": proc.returncode, "seconds": time.time() - t0,
           "stderr_tail": proc.stderr[-2000:]}
    mpath = run / "metrics.jsonl"
    if mpath.is_file():
        recs = [json.loads(line) for line in mpath.read_text().splitlines()]
        res["steps"] = len(recs)
        keys = ["reward/mean", "policy/entropy", "train/loss", "clip/lower", "clip/upper", "calib/alpha_bf16",
                "calib/alpha_fp8_nominal", "timing/step"]
        res["last"] = {k: recs[-1].get(k) for k in keys}
        res["all_finite"] = all(isinstance(r.get(k), (int, float)) for r in recs for k in keys[:5])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_results")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--grpo-steps", type=int, default=6)
    ap.add_argument("--parts", default="env,parity,throughput,grpo")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --dry-run on CPU")
    parts = {
        "env": lambda: part_env(out, args.dry_run),
        "parity": lambda: part_parity(out, args.dry_run),
        "throughput": lambda: part_throughput(out, args.dry_run, args.layers, args.repeats, args.seq, args.mbs),
        "grpo": lambda: part_grpo(out, args.dry_run, args.grpo_steps),
    }
    summary = [f"# GPU check {time.strftime('%Y-%m-%d %H:%M:%S')}{' (dry run)' if args.dry_run else ''}", ""]
    for name in args.parts.split(","):
        t0 = time.time()
        try:
            res = parts[name]()
            status = "ok"
        except Exception as e:  # noqa: BLE001  (record and go on: GPU time is scarce)
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            status = "FAILED"
        res["part_seconds"] = time.time() - t0
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        summary.append(f"## {name}: {status} ({res['part_seconds']:.1f}s)\n\n```json\n"
                       f"{json.dumps({k: v for k, v in res.items() if k != 'traceback'}, indent=1, default=str)[:3000]}\n```\n")
        print(summary[-1], flush=True)
    (out / "summary.md").write_text("\n".join(summary))


if __name__ == "__main__":
    main()
