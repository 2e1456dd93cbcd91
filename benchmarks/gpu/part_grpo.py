"""Part (e), a small GRPO run on the GPU through the real CLI (``python -m nemo_fp8rl.train``): the FP8
arm ``fp8=tensorwise fp8.backend=auto calibration=paper`` and the BF16 arm ``fp8=off calibration=off``.

Both arms decode ``rollout.max_new_tokens`` per response (``rollout.stop_on_eos=false``: equal work) and
write no final checkpoint (``trainer.save_final=false``).

Model: Qwen3-8B layer widths (``model=qwen3_8b``: hidden 4096, GQA 32/8 x 128, FFN 12288, QK norm) with
``LAYERS`` decoder layers and the task tokenizer's vocabulary (``model.vocab_size=null``), no supervised
warm-up. Calibration runs every 2nd step (steps 0, 2, 4: ten times the default interval's share, so the
FP8 arm's step time is a pessimistic one for the >= 1.2x target). Reported per arm: the median of each
``timing/<phase>`` (:data:`PHASES`: step, rollout, weight_sync, logprobs, train, shadow) over the steps after
step 0 (step 0 compiles and warms the kernels), FP8 / BF16 per phase, the weight sync's share of the step,
the converter's ``backend=torch: N on torch FP8 GEMMs`` line, and
whether every step's core metrics are finite (the logger writes non-finite values as null). After the arms,
in this process: the torch rollout engine's ``generate`` timed eager against ``rollout.cuda_graphs`` (the
decode steps replayed as CUDA graphs) at the same widths (:data:`DECODE`), with how many graphs each timed
call captured (a failed capture decodes eagerly and would read as a ratio near 1: the part then fails). The
dry run uses the tiny model on the CPU.

Time: the FP8 arm (the headline; it also calibrates and runs the FP8 rollout) gets :data:`ARM_SHARE` of what
is left for the arms, the BF16 arm the rest; every result is saved as it comes (arms, each decode config).
With ``GPU_CHECK_GRPO_PROFILE=1`` (:data:`PROFILE_ENV`; always in the dry run) each arm profiles one more step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS = 4
STEPS = 5
PHASES = ("step", "rollout", "weight_sync", "logprobs", "train", "shadow")
"""``timing/<phase>`` of the trainer (weight_sync is part of rollout), reported per arm and as FP8 / BF16."""
FINITE_KEYS = ("reward/mean", "policy/entropy", "train/loss", "train/grad_norm", "clip/lower", "clip/upper",
               "timing/step")
ARMS = {
    # fp8.backend=auto: what a user gets on a GPU without Transformer Engine (torch's FP8 GEMMs, the layers that
    # measured slower than BF16 at this micro-batch kept in BF16: fp8/layer_filter.py)
    "fp8_tensorwise_calibrated": ["fp8=tensorwise", "fp8.backend={backend}", "calibration=paper",
                                  "calibration.interval=2", "calibration.min_tokens=4"],
    "bf16": ["fp8=off", "calibration=off"],
}
ARM_SHARE = {"fp8_tensorwise_calibrated": 0.6, "bf16": 0.4}
"""Share of the arms' time each arm gets when it starts (of the arms still to run): the FP8 arm does more
work (FP8 rollout, calibration forwards, more first-step compiles: 37 s against BF16's 24 s on 2026-12-04,
run b)."""
REPO = Path(__file__).resolve().parents[2]
PROFILE_ENV = "GPU_CHECK_GRPO_PROFILE"
"""``GPU_CHECK_GRPO_PROFILE=1``: each arm runs one more step under ``trainer.profile.kind=torch`` (after the
timed steps, so the phase medians do not see the profiler) and the part keeps the top of its op table: where
the FP8 step's time goes, kernel by kernel. Off by default: it costs each arm one step, the trace's export
and its memory (the budget was sized without it); for a second device call, e.g.
``GPU_CHECK_PARTS=grpo GPU_CHECK_GRPO_PROFILE=1 bash benchmarks/gpu/run.sh``."""
PROFILE_LINES = 48
"""Lines of torch.profiler's table kept per arm (its header and the top ~40 ops)."""
DECODE = {"prompts": 256, "prompt_tokens": 16, "new_tokens": 64, "vocab": 4096}
"""The in-process decode timing (:func:`_decode_times`): the torch engine at Qwen3-8B widths with ``LAYERS``
layers, eager against ``rollout.cuda_graphs`` (captures included), BF16 and FP8 W8A8 on torch's FP8 GEMMs."""


def _no_final_checkpoint() -> list[str]:
    """``trainer.save_final=false`` where this checkout has the key (a final checkpoint of the 8B-wide model
    with its optimizer is ~5 GB and ~25 s of hashing: it timed the FP8 arm out on 2026-12-04)."""
    from dataclasses import fields

    from nemo_fp8rl.config.schema import TrainerConfig

    return ["trainer.save_final=false"] if any(f.name == "save_final" for f in fields(TrainerConfig)) else []


def profiling(dry: bool) -> bool:
    """Whether each arm profiles one extra step (:data:`PROFILE_ENV`; always in the dry run, which checks the
    path on the CPU)."""
    return dry or os.environ.get(PROFILE_ENV, "0") == "1"


def timed_steps(dry: bool) -> int:
    """Steps whose phase times are reported (step 0 compiles; their medians skip it)."""
    return 3 if dry else STEPS


def _overrides(dry: bool) -> list[str]:
    # rollout.stop_on_eos=false: both arms decode max_new_tokens per response (on 2026-12-04 the FP8 policy
    # never stopped and BF16 stopped after 2-3 tokens, so the arms compared unequal decode work)
    common = ["warmup.steps=0", "logger.tensorboard=false", "logger.progress=lines", "trainer.checkpoint_interval=0",
              "task.format_reward=0.5", "algorithm.old_logprobs=recompute", "rollout.stop_on_eos=false",
              *_no_final_checkpoint()]
    n = timed_steps(dry)
    if profiling(dry):  # one more step, profiled after the timed ones (its times are not in the medians)
        common += [f"trainer.max_steps={n + 1}", "trainer.profile.kind=torch", f"trainer.profile.start_step={n}",
                   f"trainer.profile.end_step={n}"]
    else:
        common += [f"trainer.max_steps={n}"]
    if dry:
        return common + ["algorithm.prompts_per_step=4", "algorithm.group_size=4",
                         "algorithm.minibatches_per_step=1", "parallel.micro_batch_size=16", "rollout.max_new_tokens=6"]
    # 64 prompts x 8 responses x 64 new tokens: decode batches of 512, train micro-batches of 64 x 128 tokens
    return common + ["model=qwen3_8b", f"model.num_layers={LAYERS}",
                     "model.vocab_size=null", "model.seq_length=128", "algorithm.prompts_per_step=64",
                     "algorithm.group_size=8", "algorithm.minibatches_per_step=2", "parallel.micro_batch_size=64",
                     "rollout.max_new_tokens=64"]


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _arm(name: str, overrides: list[str], timeout: float, tmp: Path, n_timed: int = STEPS,
         profiled: bool = False) -> dict:
    run = tmp / name
    cmd = [sys.executable, "-m", "nemo_fp8rl.train", *overrides, f"output_dir={run}",
           f"warmup.cache_dir={tmp / 'warmup_cache'}"]
    arm = {"cmd": " ".join(cmd[2:]), "timeout_s": round(timeout)}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO)
        arm["rc"], out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # the child is killed; keep what it printed and logged
        arm["rc"], out = None, _text(e.stdout) + _text(e.stderr)
        arm["failed"] = f"timed out after {timeout:.0f}s"
    arm["seconds"] = round(time.time() - t0, 1)
    m = re.search(r"backend=(\w+): (\d+) on torch FP8 GEMMs, (\d+) emulated", out)
    if m:
        arm["conversion"] = {"backend": m.group(1), "torch_gemm": int(m.group(2)), "emulated": int(m.group(3))}
    rollout = _rollout_engine(out)
    if rollout:
        arm["rollout_engine"] = rollout
    recs = []
    mpath = run / "metrics.jsonl"
    if mpath.is_file():
        for line in mpath.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the kill
                pass
    arm["steps"] = len(recs)
    arm["all_finite"] = bool(recs) and all(isinstance(r.get(k), (int, float)) for r in recs for k in FINITE_KEYS)
    timed = [r for r in recs if not isinstance(r.get("step"), int) or r["step"] < n_timed]
    later = timed[1:] or timed
    if profiled:
        # the profiled step runs after the timed ones: torch.profiler's table of it (top ops by device time)
        table = run / "profile" / f"rank0_steps{n_timed}-{n_timed}.txt"
        if table.is_file():
            arm["profile_top"] = table.read_text().splitlines()[:PROFILE_LINES]
        elif len(timed) >= n_timed and str(arm.get("failed", "")).startswith("timed out"):
            # every timed step finished: only the extra, profiled step was cut
            arm["profile_error"] = arm.pop("failed") + " in the profiled step"
            arm["rc"] = 0
        else:
            arm["profile_error"] = f"no profile table ({table.name} not written)"
    for phase in PHASES:
        vals = [r[f"timing/{phase}"] for r in later if isinstance(r.get(f"timing/{phase}"), (int, float))]
        if vals:
            arm[f"median_{phase}_s"] = statistics.median(vals)
    arm["records"] = recs
    if arm.get("rc") not in (0, None) and "failed" not in arm:
        arm["failed"] = f"exit code {arm['rc']}"
    elif "failed" not in arm and not arm["all_finite"]:
        arm["failed"] = "missing or non-finite metrics"
    if "failed" in arm:
        arm["output_tail"] = out[-3000:]
    return arm


def _rollout_engine(out: str) -> dict:
    """What the torch rollout engine logged at its first sync (``rollout engine 'torch': FP8 scheme S quantizes
    N linear weights per sync (...; G)``): the line, the scheme, and where its FP8 linears ran
    (``torch_gemm`` / ``emulated`` counts; a BF16 arm's line says ``off``). Empty when no such line was printed."""
    m = re.search(r"rollout engine 'torch': (.*)", out)
    if not m:
        return {}
    line = m.group(1).strip()
    res: dict = {"line": line[:400]}
    s = re.search(r"FP8 scheme (\w+)", line)
    if s:
        res["scheme"] = s.group(1)
    g = re.search(r"(\d+) on torch FP8 GEMMs, (\d+) emulated", line)
    if g:
        res["torch_gemm"], res["emulated"] = int(g.group(1)), int(g.group(2))
    elif "emulated GEMMs" in line:
        n = re.search(r"quantizes (\d+) linear weights", line)
        res["torch_gemm"], res["emulated"] = 0, int(n.group(1)) if n else None
    return res


DECODE_RESERVE_S = 20


def _random_hf_weights(cfg, device: str) -> dict:
    """HF-named random weights for ``cfg`` on ``device`` in BF16: linears ~ N(0, 1/fan_in), norms 1."""
    import torch

    from nemo_fp8rl.rollout.model import ModelShape, expected_hf_shapes

    g = torch.Generator(device=device).manual_seed(0)
    sd = {}
    for k, s in expected_hf_shapes(ModelShape.from_config(cfg), cfg.vocab_size).items():
        if len(s) == 1:
            sd[k] = torch.ones(s, device=device, dtype=torch.bfloat16)
        else:
            sd[k] = (torch.randn(s, device=device, generator=g) / s[-1] ** 0.5).to(torch.bfloat16)
    return sd


class _CaptureLog:
    """The :class:`~nemo_fp8rl.rollout.decode_graphs.StaticDecode` of each ``generate`` call while active,
    so a config records how many CUDA graphs its timed call captured and why it fell back to eager
    (``fallback``).

    Why from here: a failed capture only logs a warning and decodes eagerly, and ``generate`` does not expose
    its ``StaticDecode``; the engine is left as it is, and this process wraps ``StaticDecode.__init__`` (as
    tests/rollout/test_decode_graphs.py does) and restores it on exit. The warnings of ``decode_graphs``'s
    logger are kept too, in case the engine stops building a ``StaticDecode``."""

    def __init__(self) -> None:
        self.made: list = []
        self.warnings: list = []

    def __enter__(self) -> "_CaptureLog":
        import logging

        from nemo_fp8rl.rollout import decode_graphs

        self._cls, self._init = decode_graphs.StaticDecode, decode_graphs.StaticDecode.__init__
        made, orig = self.made, self._init

        def record(obj, *args, **kwargs):
            orig(obj, *args, **kwargs)
            made.append(obj)

        self._cls.__init__ = record
        warnings = self.warnings

        class _Keep(logging.Handler):
            def emit(self, record):
                warnings.append(record.getMessage()[:300])

        self._handler, self._logger = _Keep(level=logging.WARNING), logging.getLogger(decode_graphs.__name__)
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self._cls.__init__ = self._init
        self._logger.removeHandler(self._handler)

    def summary(self, since: int, warned: int) -> dict:
        """What the calls since ``len(made) == since`` (and warnings since ``warned``) did: the last call's
        ``capture`` flag, ``graphs`` captured and ``fallback`` reason; ``calls`` = StaticDecodes built."""
        new = self.made[since:]
        out: dict = {"calls": len(new), "warnings": self.warnings[warned:]}
        if new:
            last = new[-1]
            out.update(capture=bool(getattr(last, "capture", False)),
                       graphs=len(getattr(last, "graphs", {}) or {}),
                       fallback=getattr(last, "fallback", None))
        return out


def _decode_problems(d: dict, device: str) -> list:
    """Configs with ``cuda_graphs=True`` on CUDA whose timed call captured no graph (or built no static
    decode): their graphs/eager ratio would not measure CUDA graphs."""
    if not str(device).startswith("cuda"):
        return []
    out = []
    for key, g in (d.get("graphs") or {}).items():
        if not key.endswith("cuda_graphs=True"):
            continue
        if not g.get("calls"):
            out.append(f"decode {key}: no static decode was built (rollout.cuda_graphs not honoured)")
        elif not g.get("graphs"):
            why = g.get("fallback") or (g.get("warnings") or ["no capture and no reason logged"])[0]
            out.append(f"decode {key}: no CUDA graph captured ({why[:200]}); its time is eager")
    return out


def _decode_times(ctx) -> dict:
    """Seconds of one ``generate`` (:data:`DECODE`: every row decodes ``new_tokens``) of the torch engine,
    eager and with ``cuda_graphs=True`` (its captures included: graphs live for one call), per rollout scheme
    (``off`` = BF16, ``vllm_w8a8`` on torch's FP8 GEMMs), each after one untimed call of the same shapes.

    Written to ``ctx.res["decode"]`` and saved after every config (a timeout keeps what was measured):
    ``seconds[config]``, ``graphs[config]`` (:meth:`_CaptureLog.summary` of the timed call) and the
    ``<scheme>_graphs_x_eager`` ratios."""
    import torch

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.rollout import SamplingParams
    from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine

    c = dict(DECODE)
    if ctx.dry:
        c.update(prompts=4, prompt_tokens=3, new_tokens=4, vocab=16)
        cfg = ModelConfig(name="tiny", vocab_size=16, num_layers=2, hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=128, qk_layernorm=True)
    else:
        cfg = ModelConfig(name="qwen3_8b_widths", vocab_size=c["vocab"], num_layers=LAYERS, hidden_size=4096,
                          num_attention_heads=32, num_query_groups=8, kv_channels=128, ffn_hidden_size=12288,
                          qk_layernorm=True, seq_length=256, rotary_base=1000000.0)
    out: dict = {"shape": c, "model": "tiny" if ctx.dry else f"{LAYERS} layers at Qwen3-8B widths",
                 "seconds": {}, "graphs": {}}
    ctx.res["decode"] = out
    sd = _random_hf_weights(cfg, ctx.device)
    prompts = [[(7 * i + j) % (c["vocab"] - 1) + 1 for j in range(c["prompt_tokens"])] for i in range(c["prompts"])]
    params = SamplingParams(max_new_tokens=c["new_tokens"], stop_on_eos=False, temperature=1.0)
    with _CaptureLog() as captures:
        for scheme in ("off", "vllm_w8a8"):
            for graphs in (False, True):
                if ctx.left() < 8:
                    out["skipped"] = f"out of time at {scheme}, cuda_graphs={graphs}"
                    ctx.save()
                    return out
                key = f"{scheme}, cuda_graphs={graphs}"
                eng = TorchRolloutEngine(cfg, fp8_scheme=scheme, eos_id=0, pad_id=0, device=ctx.device,
                                         fp8_gemm="torch", cuda_graphs=graphs)
                eng.update_weights(sd)
                # first-use kernels, launch configs
                eng.generate(prompts, params, torch.Generator().manual_seed(0))
                if ctx.device == "cuda":
                    torch.cuda.synchronize()
                since, warned = len(captures.made), len(captures.warnings)
                t0 = time.perf_counter()
                eng.generate(prompts, params, torch.Generator().manual_seed(1))
                if ctx.device == "cuda":
                    torch.cuda.synchronize()
                out["seconds"][key] = time.perf_counter() - t0
                out["graphs"][key] = captures.summary(since, warned)
                eng.close()
                ratio = f"{scheme}, cuda_graphs=False"
                if graphs and ratio in out["seconds"]:
                    out[f"{scheme}_graphs_x_eager"] = out["seconds"][ratio] / out["seconds"][key]
                ctx.save()
    return out


def run(ctx) -> dict:
    res = ctx.res
    res.update(model="tiny" if ctx.dry else f"qwen3_8b widths, {LAYERS} layers, task vocabulary",
               overrides=_overrides(ctx.dry), arms={})
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_grpo_"))
    try:
        names = list(ARMS)
        for i, name in enumerate(names):
            # what is left, shared by the arms still to run in proportion to ARM_SHARE (less DECODE_RESERVE_S
            # for the decode timing, when there is room for it: the arms come first)
            reserve = DECODE_RESERVE_S if ctx.left() > 100 else 0
            share = ARM_SHARE[name] / sum(ARM_SHARE[n] for n in names[i:])
            timeout = (ctx.left() - 5 - reserve) * share
            if timeout < 20:
                res["arms"][name] = {"failed": f"out of time ({ctx.left():.0f}s left)"}
                continue
            # the dry run keeps fp8.backend=torch: auto is the emulation on a CPU, and the dry run is there to
            # run the GPU path's code (torch's CPU FP8 GEMM)
            arm_args = [a.format(backend="torch" if ctx.dry else "auto") for a in ARMS[name]]
            res["arms"][name] = _arm(name, [*_overrides(ctx.dry), *arm_args], timeout, tmp, timed_steps(ctx.dry),
                                     profiling(ctx.dry))
            ctx.save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fp8, bf16 = res["arms"].get("fp8_tensorwise_calibrated", {}), res["arms"].get("bf16", {})
    for k in PHASES:
        if fp8.get(f"median_{k}_s") and bf16.get(f"median_{k}_s"):
            res[f"{k}_x_bf16"] = bf16[f"median_{k}_s"] / fp8[f"median_{k}_s"]
    for name, arm in res["arms"].items():
        if arm.get("median_weight_sync_s") is not None and arm.get("median_step_s"):
            arm["sync_share"] = arm["median_weight_sync_s"] / arm["median_step_s"]
    problems = [f"{n}: {a['failed']}" for n, a in res["arms"].items() if "failed" in a]
    if not ctx.dry and fp8.get("conversion", {}).get("torch_gemm", 0) == 0 and "failed" not in fp8:
        problems.append("the FP8 arm ran no layer on torch's FP8 GEMMs (see its conversion line)")
    ro = fp8.get("rollout_engine", {})
    if not ctx.dry and "failed" not in fp8 and ro.get("scheme") not in (None, "off") and not ro.get("torch_gemm"):
        # an FP8 rollout that emulates (fake-quantizes, then a BF16 GEMM) is slower than BF16 by construction
        problems.append(f"the FP8 arm's rollout ran no linear on torch's FP8 GEMMs ({ro.get('line', '')[:200]})")
    if ctx.left() > 20:  # extra: its failure must not lose the arms
        try:
            _decode_times(ctx)
        except Exception as e:  # noqa: BLE001
            res.setdefault("decode", {})["error"] = f"{type(e).__name__}: {e}"[:300]
        problems += _decode_problems(res.get("decode", {}), ctx.device)
        ctx.save()
    if problems:
        res["failed"] = "; ".join(problems)
    return res


def headline(res: dict) -> str:
    parts = []
    for name, a in res.get("arms", {}).items():
        parts.append(f"{name}: rc {a.get('rc')}, {a.get('steps', 0)} steps, finite {a.get('all_finite')}, "
                     f"step {a.get('median_step_s', float('nan')):.3f}s")
    if "step_x_bf16" in res:
        nan = float("nan")
        parts.append(f"step x BF16 {res['step_x_bf16']:.2f} (rollout {res.get('rollout_x_bf16', nan):.2f}, train "
                     f"{res.get('train_x_bf16', nan):.2f}; targets 1.2 / 1.3 / 1.3)")
    return "; ".join(parts)


def tables(res: dict) -> list[str]:
    nan = float("nan")
    lines = [f"GRPO through the CLI ({res.get('model')}; median over steps after step 0; seconds per phase, "
             "weight_sync is part of rollout):", "",
             "| arm | rc | steps | finite | " + " | ".join(f"{p} s" for p in PHASES)
             + " | sync share | FP8 layers on torch / emulated | rollout: scheme, FP8 linears on torch / emulated |",
             "|---|---|---|---|" + "---|" * (len(PHASES) + 3)]
    for name, a in res.get("arms", {}).items():
        c, ro = a.get("conversion", {}), a.get("rollout_engine", {})
        lines.append(f"| {name} | {a.get('rc')} | {a.get('steps', 0)} | {a.get('all_finite')} | "
                     + " | ".join(f"{a.get(f'median_{p}_s', nan):.3f}" for p in PHASES)
                     + f" | {a.get('sync_share', nan):.1%} | {c.get('torch_gemm', '-')} / {c.get('emulated', '-')} | "
                     f"{ro.get('scheme', '-')}, {ro.get('torch_gemm', '-')} / {ro.get('emulated', '-')} |")
    ratios = [f"{p} {res[f'{p}_x_bf16']:.2f}" for p in PHASES if f"{p}_x_bf16" in res]
    if ratios:
        lines.append("\nFP8 x BF16 per phase (BF16 s / FP8 s): " + ", ".join(ratios)
                     + "; targets (issue 39): step >= 1.2, train >= 1.3, rollout >= 1.3, sync < 10% of the step")
    for name, a in res.get("arms", {}).items():
        if a.get("profile_top"):
            lines += ["", f"Profiled step of {name} (torch.profiler, after the timed steps; top ops by device time):",
                      "", "```", *a["profile_top"], "```"]
        elif a.get("profile_error"):
            lines.append(f"\nProfiled step of {name}: {a['profile_error']}")
    d = res.get("decode") or {}
    if d.get("seconds"):
        c = d["shape"]
        lines.append(f"\nTorch engine decode in-process ({c['prompts']} prompts of {c['prompt_tokens']} tokens, "
                     f"{c['new_tokens']} new tokens each, {d['model']}, vocabulary "
                     f"{c['vocab']}), seconds per generate (rollout.cuda_graphs: captures included): "
                     + "; ".join(f"{k} {v:.3f}" for k, v in d["seconds"].items())
                     + "".join(f"; {k} {d[k]:.2f}" for k in ("off_graphs_x_eager", "vllm_w8a8_graphs_x_eager") if k in d))
        caps = [f"{k}: {g.get('graphs')} graphs"
                + (f" (fell back: {g['fallback'][:120]})" if g.get("fallback") else "")
                for k, g in (d.get("graphs") or {}).items() if k.endswith("cuda_graphs=True")]
        if caps:
            lines.append("CUDA graphs captured by the timed call (0 on a CPU: the static steps run eagerly): "
                         + "; ".join(caps))
    if d and (d.get("error") or d.get("skipped")):
        lines.append(f"\nTorch engine decode in-process: {d.get('error') or d.get('skipped')}")
    return lines
