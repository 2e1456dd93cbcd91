"""One-shot GPU check (driven by ``benchmarks/gpu_check.sh``): everything a single Hopper GPU can tell us.

Parts (each writes a row of the table in ``summary.md`` and its entry in ``results.json`` under ``--out``,
both rewritten after every part; a failing part is recorded, its traceback in ``results.json`` and
``tracebacks.txt``, and the next one still runs; few files, so all of it comes back from a lent machine):

1. ``env``: torch / Transformer Engine / megatron-core versions, GPU name and capability, and TE's own
   support checks (FP8, FP8 block scaling, MXFP8) with their reasons.
2. ``parity``: TE's quantizers vs our emulation on the same random CUDA tensors, max |difference| of the
   dequantized values for delayed (given scale, with saturation), tensorwise (current scaling),
   blockwise 1x128 and 128x128, mxfp8 (only where TE reports MXFP8 support: Blackwell).
3. ``throughput``: a megatron ``GPTModel`` with Llama-3-8B layer shapes (``--layers`` layers, TP=1, TE
   spec, float32 master weights with BF16 autocast as the actor trains), train-step time in BF16 and
   under each TE FP8 recipe the GPU supports (median of ``--repeats`` after warm-up, all arms in one
   process), plus the BF16 shadow forward relative to an FP8 train step.
4. ``distopt``: ``optim.distributed=true`` on the GPU (TE spec, NCCL): BF16 parameters with float32
   main-parameter shards, 3 train steps against torch AdamW on float32 master weights (loss and
   log-prob gaps), Adam state bytes, a per-rank and a dist_checkpointing (format 2) checkpoint round
   trip (TE's FusedAdam counts steps per group), and the CPU shims refusing to
   activate in the NCCL process (``--dry-run``: the same on CPU with float32 parameters).
5. ``grpo``: the tiny GRPO run on GPU with TE FP8 + Calibrated Clipping for a few steps (finite metrics).

The whole run respects a deadline (``--deadline-at``, set by the shell driver): parts and throughput
arms that would not fit are skipped with the reason recorded. Exit code 0 when no part failed, 2 when
one did, 1 without a GPU.

``--dry-run`` runs only what needs no GPU (environment, and the parity comparison on CPU of our
emulation against itself through the public API) so CI exercises this file.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

# TE's check that a recipe can run on this GPU, by recipe name (see _te_support)
RECIPE_SUPPORT = {"delayed": "fp8", "tensorwise": "fp8", "blockwise": "fp8_block_scaling", "mxfp8": "mxfp8"}


class _Terminated(BaseException):
    """SIGTERM (the driver's timeout): record the running part and write the summary before exiting."""


def _te_support() -> dict:
    """TE's own support checks: ``{"fp8" | "fp8_block_scaling" | "mxfp8": [ok, reason]}``.

    The checks live in ``transformer_engine.pytorch.quantization`` from TE 2.9 on (``fp8`` is kept as a
    deprecated alias) and in ``transformer_engine.pytorch.fp8`` before; the block-scaling check exists
    from TE 2.3 (it also needs CUDA >= 12.9 on Hopper), MXFP8 needs sm100 (not sm120).
    """
    from nemo_fp8rl.fp8.te import te_support

    return {key: list(te_support(scaling)) for key, scaling in
            (("fp8", "tensorwise"), ("fp8_block_scaling", "blockwise"), ("mxfp8", "mxfp8"))}


def part_env(out: Path, dry: bool, left) -> dict:
    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0],
            "executable": sys.executable}
    for mod in ("transformer_engine", "megatron.core"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod] = getattr(m, "__version__", "present")
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable: {type(e).__name__}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001
            info["nccl"] = f"unavailable: {type(e).__name__}"
        info["te_support"] = _te_support()
    else:
        info["te_support"] = "no CUDA"
    return info


def part_parity(out: Path, dry: bool, left) -> dict:
    from nemo_fp8rl.fp8 import E4M3, compute_scale, fake_quantize

    dev = "cpu" if dry else "cuda"
    torch.manual_seed(0)
    x = torch.randn(1024, 4096, device=dev) * 2
    x[5, 17] = 600.0
    # delayed scaling: a scale from an older, smaller amax (half of today's), so the top values saturate
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


def part_throughput(out: Path, dry: bool, left, layers: int, repeats: int, seq: int, mbs: int,
                    reserve_s: float = 0.0) -> dict:
    if dry:
        return {"skipped": "dry run"}
    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.fp8 import get_recipe
    from nemo_fp8rl.models import build_actor

    shape = dict(vocab_size=128256, num_layers=layers, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                 ffn_hidden_size=14336, seq_length=seq, rotary_base=500000.0)
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

            def step():
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
                shadow, _ = _time_steps(lambda: actor.get_shadow_logprobs(tokens), repeats)
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


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def part_distopt(out: Path, dry: bool, left) -> dict:
    import io

    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.models.cpu_schedules import cpu_megatron
    from nemo_fp8rl.models.optim import chained

    dev = "cpu" if dry else "cuda"
    mc, pc = ModelConfig(vocab_size=16), ParallelConfig(micro_batch_size=8)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (8, 32), generator=g)
    mask = torch.zeros(8, 32)
    mask[:, 8:] = 1
    batch = {"tokens": tokens.to(dev), "mask": mask.to(dev), "advantages": torch.randn(8, generator=g).to(dev)}

    def loss_fn(mb, logprobs, entropy, *, global_tokens, global_seqs):
        loss = -(mb["advantages"][:, None] * logprobs * mb["mask"]).sum() / global_tokens
        return loss, {}

    d = build_actor(mc, pc, seed=0, lr=1e-4, device=dev, distributed_optimizer=True)
    r = build_actor(mc, pc, seed=0, lr=1e-4, device=dev, distributed_optimizer=False)
    res = {"param_dtype": str(next(d.model.parameters()).dtype),
           "main_param_dtypes": sorted({str(p.dtype) for o in chained(d.optimizer)
                                        for grp in getattr(o, "shard_fp32_from_float16_groups", []) for p in grp}),
           "optimizer_bytes": {}, "loss": {"distributed": [], "adamw": []}}
    for _ in range(3):
        res["loss"]["distributed"].append(float(d.train_step(batch, loss_fn)["train/loss"][0]))
        res["loss"]["adamw"].append(float(r.train_step(batch, loss_fn)["train/loss"][0]))
    res["optimizer_bytes"] = {"distributed": d.optimizer_state_bytes(), "adamw": r.optimizer_state_bytes()}
    m = batch["mask"].bool()
    res["logprob_gap_vs_adamw"] = float((d.get_logprobs(tokens.to(dev))[0] - r.get_logprobs(tokens.to(dev))[0])[m]
                                        .abs().mean())
    buf = io.BytesIO()
    torch.save(d.state_dict_for_checkpoint(), buf)
    d.train_step(batch, loss_fn)
    want = d.get_logprobs(tokens.to(dev))[0]
    e = build_actor(mc, pc, seed=5, lr=1e-4, device=dev, distributed_optimizer=True)
    buf.seek(0)
    e.load_checkpoint_state(torch.load(buf, weights_only=False))
    e.train_step(batch, loss_fn)
    res["resume_max_abs_diff"] = float((e.get_logprobs(tokens.to(dev))[0] - want).abs().max())
    # the layout-free (dist_checkpointing, format 2) checkpoint of the same state
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    ckdir = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt_"))
    try:
        buf.seek(0)
        f = build_actor(mc, pc, seed=0, lr=1e-4, device=dev, distributed_optimizer=True)
        f.load_checkpoint_state(torch.load(buf, weights_only=False))
        sharded, local = f.sharded_checkpoint_state()
        mgr = CheckpointManager(str(ckdir), device=dev)
        mgr.save(1, {"actor_local": local}, {}, sharded=sharded)
        g = build_actor(mc, pc, seed=6, lr=1e-4, device=dev, distributed_optimizer=True)
        ck = mgr.load(1, {})
        g.load_sharded_checkpoint([x["actor_local"] for x in ck.rank_states], ck.load_sharded)
        g.train_step(batch, loss_fn)
        res["dist_checkpoint_resume_max_abs_diff"] = float((g.get_logprobs(tokens.to(dev))[0] - want).abs().max())
    finally:
        shutil.rmtree(ckdir, ignore_errors=True)
    try:
        with cpu_megatron("optimizer", device="cpu"):
            pass
        res["cpu_shim_refused_on_nccl"] = False
    except RuntimeError:
        res["cpu_shim_refused_on_nccl"] = True
    problems = []
    if not dry and (res["param_dtype"] != "torch.bfloat16" or res["main_param_dtypes"] != ["torch.float32"]):
        problems.append("expected BF16 parameters with float32 main parameters")
    if not all(map(torch.isfinite, map(torch.tensor, res["loss"]["distributed"]))):
        problems.append("non-finite loss")
    if res["resume_max_abs_diff"] > 1e-3:
        problems.append(f"resume differs by {res['resume_max_abs_diff']:.3g}")
    if res["dist_checkpoint_resume_max_abs_diff"] > 1e-3:
        problems.append(f"dist_checkpointing resume differs by {res['dist_checkpoint_resume_max_abs_diff']:.3g}")
    if not dry and not res["cpu_shim_refused_on_nccl"]:
        problems.append("the CPU shims activated in an NCCL process")
    if problems:
        res["failed"] = "; ".join(problems)
    return res


def part_grpo(out: Path, dry: bool, left, steps: int) -> dict:
    if dry:
        return {"skipped": "dry run"}
    # a fresh run directory (the trainer refuses one with metrics of an earlier run); what matters of it
    # (metrics, output tails) goes into the result
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_grpo_"))
    run = tmp / "run"
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", "fp8=tensorwise", "calibration=paper", "calibration.interval=2",
           "fp8.use_te=true", f"trainer.max_steps={steps}", "warmup.steps=300", f"output_dir={run}",
           f"warmup.cache_dir={tmp / 'warmup_cache'}", "logger.tensorboard=false", "logger.progress=lines"]
    budget = min(300.0, left() - 5)
    res = {"cmd": " ".join(cmd[1:]), "timeout_s": round(budget)}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget)
        res["rc"] = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:  # the child is killed; keep what it printed
        res["rc"] = None
        res["failed"] = f"timed out after {budget:.0f}s"
        stdout, stderr = _text(e.stdout), _text(e.stderr)
    res["seconds"] = time.time() - t0
    res["stdout_tail"] = stdout[-1500:]
    res["stderr_tail"] = stderr[-2000:]
    mpath = run / "metrics.jsonl"
    if mpath.is_file():
        recs = []
        for line in mpath.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the kill
                pass
        res["steps"] = len(recs)
        keys = ["reward/mean", "policy/entropy", "train/loss", "clip/lower", "clip/upper", "calib/alpha_bf16",
                "calib/alpha_fp8_nominal", "timing/step"]
        if recs:
            res["last"] = {k: recs[-1].get(k) for k in keys}
        # the logger writes non-finite values as null
        res["all_finite"] = bool(recs) and all(isinstance(r.get(k), (int, float)) for r in recs for k in keys[:5])
        res["records"] = recs
    shutil.rmtree(tmp, ignore_errors=True)
    if res.get("rc") not in (0, None) and "failed" not in res:
        res["failed"] = f"exit code {res['rc']}"
    elif "failed" not in res and not res.get("all_finite"):
        res["failed"] = "missing or non-finite metrics"
    return res


def _headline(name: str, res: dict) -> str:
    """One line of the summary table for a part's result (never raises: the summary must be written)."""
    try:
        return _headline_impl(name, res)
    except Exception as e:  # noqa: BLE001
        return f"(no headline: {type(e).__name__}: {e}; see results.json)"


def _headline_impl(name: str, res: dict) -> str:
    if "error" in res:
        return res["error"][:200]
    if "skipped" in res and isinstance(res["skipped"], str):
        return f"skipped: {res['skipped']}"
    if name == "env":
        return (f"{res.get('gpu', 'no GPU')} {res.get('capability', '')}, torch {res.get('torch')}, "
                f"CUDA {res.get('cuda')}, TE {res.get('transformer_engine')}, mcore {res.get('megatron.core')}")
    if name == "parity":
        return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}: {str(v)[:60]}"
                         for k, v in res.get("max_abs_diff", {}).items())
    if name == "throughput":
        sp = res.get("speedup_vs_bf16", {})
        parts = [f"{k} {v * 1e3:.0f} ms" + (f" ({sp[k]:.2f}x)" if k in sp else "") for k, v in res["median_s"].items()]
        if "shadow_over_step" in res:
            parts.append(f"shadow/step {res['shadow_over_step']:.2f}")
        parts += [f"{k}: {v[:80]}" for k, v in res.get("errors", {}).items()]
        parts += [f"{k} skipped" for k in res.get("skipped", {})]
        return "; ".join(parts)
    if name == "distopt":
        return (f"params {res.get('param_dtype')}, main {res.get('main_param_dtypes')}, "
                f"logprob gap vs AdamW {res.get('logprob_gap_vs_adamw', float('nan')):.3g}, "
                f"resume diff {res.get('resume_max_abs_diff', float('nan')):.3g} "
                f"(dist_checkpointing {res.get('dist_checkpoint_resume_max_abs_diff', float('nan')):.3g}), "
                f"bytes {res.get('optimizer_bytes')}, shim refused {res.get('cpu_shim_refused_on_nccl')}")
    if name == "grpo":
        return (f"rc {res.get('rc')}, {res.get('steps', 0)} steps, finite {res.get('all_finite')}, "
                f"{res.get('seconds', 0):.0f}s")
    return ""


def _pytest_tail(out: Path) -> str | None:
    p = out / "pytest_gpu.txt"
    if not p.is_file():
        return None
    lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-2:])


def _write_summary(out: Path, title: str, done: list, pending: list) -> None:
    lines = [title, "", "| part | status | seconds | result |", "|---|---|---|---|"]
    pt = _pytest_tail(out)
    if pt is not None:
        lines.append(f"| pytest -m gpu | see pytest_gpu.txt | | {pt.replace('|', '/')} |")
    for name, status, res in done:
        lines.append(f"| {name} | {status} | {res.get('part_seconds', 0):.1f} | "
                     f"{_headline(name, res).replace('|', '/').replace(chr(10), ' ')} |")
    for name in pending:
        lines.append(f"| {name} | not run | | |")
    thr = next((r for n, _, r in done if n == "throughput" and r.get("median_s")), None)
    if thr:
        lines += ["", f"Throughput ({thr['tokens_per_step']} tokens/step, median of {thr['repeats']}):", "",
                  "| recipe | step ms | tokens/s | x BF16 | peak GiB |", "|---|---|---|---|---|"]
        for k, v in thr["median_s"].items():
            speedup = thr.get("speedup_vs_bf16", {}).get(k, float("nan"))
            lines.append(f"| {k} | {v * 1e3:.1f} | {thr['tokens_per_s'][k]:.0f} | {speedup:.2f} | "
                         f"{thr['peak_memory_gib'].get(k, '')} |")
    lines.append("")
    for name, status, res in done:
        body = json.dumps({k: v for k, v in res.items() if k not in ("traceback", "records")}, indent=1,
                          default=str)[:3000]
        lines.append(f"## {name}: {status} ({res.get('part_seconds', 0):.1f}s)\n\n```json\n{body}\n```\n")
    (out / "summary.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({n: {"status": s, **r} for n, s, r in done}, indent=1, default=str))
    tbs = [f"===== {n}\n{r['traceback']}" for n, _, r in done if r.get("traceback")]
    if tbs:
        (out / "tracebacks.txt").write_text("\n".join(tbs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_results")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--grpo-steps", type=int, default=6)
    ap.add_argument("--parts", default="env,parity,distopt,throughput,grpo")
    ap.add_argument("--deadline-at", type=float, default=None,
                    help="Unix time by which everything must be done (default: now + 420 s)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tracebacks.txt").unlink(missing_ok=True)  # of an earlier run in the same directory
    deadline = args.deadline_at if args.deadline_at is not None else time.time() + 420

    def left() -> float:
        return deadline - time.time()

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # timeout signals the process and its group: once is enough
        raise _Terminated(f"signal {signum} (driver timeout)")

    signal.signal(signal.SIGTERM, on_term)
    names = [n for n in args.parts.split(",") if n]
    no_gpu = not args.dry_run and not torch.cuda.is_available()
    if no_gpu:
        names = [n for n in names if n == "env"]
    parts = {
        "env": lambda: part_env(out, args.dry_run, left),
        "parity": lambda: part_parity(out, args.dry_run, left),
        "throughput": lambda: part_throughput(out, args.dry_run, left, args.layers, args.repeats, args.seq,
                                              args.mbs, reserve_s=90.0 if "grpo" in names else 0.0),
        "distopt": lambda: part_distopt(out, args.dry_run, left),
        "grpo": lambda: part_grpo(out, args.dry_run, left, args.grpo_steps),
    }
    # least time a part needs to be worth starting
    min_s = {"env": 5, "parity": 15, "distopt": 20, "throughput": 60, "grpo": 40}
    title = f"# GPU check {time.strftime('%Y-%m-%d %H:%M:%S')}{' (dry run)' if args.dry_run else ''}"
    if no_gpu:
        title += "\n\nno CUDA GPU: only env ran (use --dry-run on CPU)"
    done: list = []
    terminated = False
    for i, name in enumerate(names):
        t0 = time.time()
        try:
            if name not in parts:
                raise ValueError(f"unknown part {name!r}; valid: {sorted(parts)}")
            if terminated:
                res = {"skipped": "run terminated"}
            elif left() < min_s[name]:
                res = {"skipped": f"out of time ({left():.0f}s left before the deadline)"}
            else:
                res = parts[name]()
        except (Exception, _Terminated) as e:  # noqa: BLE001  (record and go on: GPU time is scarce)
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            terminated = terminated or isinstance(e, _Terminated)
        status = "FAILED" if ("error" in res or "failed" in res) else "skipped" if "skipped" in res and \
            isinstance(res["skipped"], str) else "ok"
        res["part_seconds"] = time.time() - t0
        done.append((name, status, res))
        _write_summary(out, title, done, names[i + 1:])
        print(f"## {name}: {status} ({res['part_seconds']:.1f}s) {_headline(name, res)}", flush=True)
    print("\n" + (out / "summary.md").read_text().split("\n## ")[0], flush=True)
    if no_gpu:
        sys.exit("no CUDA GPU: run with --dry-run on CPU")
    if terminated:
        sys.exit(124)
    sys.exit(2 if any(s == "FAILED" for _, s, _ in done) else 0)


if __name__ == "__main__":
    main()
