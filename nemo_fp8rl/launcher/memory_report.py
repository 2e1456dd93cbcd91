"""The memory plan as text: the header, the components x arms table, the verdict and the knobs that would fit.

:func:`report` prints what ``nemo-fp8rl-plan`` shows for one config; the bytes come from
:mod:`nemo_fp8rl.launcher.memory` (the byte model), the command line is :mod:`nemo_fp8rl.launcher.memory_cli`.
"""

from __future__ import annotations

from typing import Optional

from nemo_fp8rl.launcher.memory import (
    GIB,
    OPTIMIZERS,
    MemoryPlan,
    PlanOptions,
    megatron_reference,
    plan_arm,
    plan_config,
    plan_table,
    rollout_share,
    stage_parameters,
    suggest_fixes,
)

_ROWS = ("weights", "weight copies", "grads", "optimizer", "activations", "logits")


def format_table(plans: list[MemoryPlan], own: Optional[tuple[Optional[str], str]] = None) -> str:
    """Components (rows) x arms (columns) in GiB, one block per optimizer; ``own`` marks the config's arm."""
    lines = []
    unit, scale = ("GiB", GIB) if max(pl.train_total for pl in plans) >= GIB else ("MiB", 2**20)
    per = "GPU" if plans[0].capacity is not None else "rank"
    for optimizer in dict.fromkeys(pl.optimizer for pl in plans):
        block = [pl for pl in plans if pl.optimizer == optimizer]
        names = [pl.arm + ("*" if own == (pl.recipe, pl.optimizer) else "") for pl in block]
        width = max(11, *(len(n) + 1 for n in names))
        title = {"adamw": "optimizer adamw (torch AdamW, float32 parameters and state on every DP rank)",
                 "distributed": ("optimizer distributed (BF16 params, float32 main params/moments sharded over DP)"
                                 if per == "GPU" else "optimizer distributed (Adam moments sharded over DP)")}
        lines.append(title[optimizer])
        lines.append(f"  {unit + ' per ' + per:<26}" + "".join(f"{n:>{width}}" for n in names))

        def row(label, values, fmt="{:.2f}"):
            lines.append(f"  {label:<26}" + "".join(f"{fmt.format(v):>{width}}" for v in values))

        for name in _ROWS:
            row(name, [pl.components[name] / scale for pl in block])
        row("= training total", [pl.train_total / scale for pl in block])
        if block[0].capacity is not None:
            row("  activations, recompute", [pl.recompute_activations / scale for pl in block])  # not in total
            if block[0].rollout is not None:
                row("rollout engine reserved", [pl.rollout.reserved / scale for pl in block])
                if block[0].rollout.sleeps:
                    row("  + resident, generating", [(pl.resident + pl.rollout.reserved) / scale for pl in block])
            row("available for training", [pl.available / scale for pl in block])
            row("fits", ["yes" if pl.fits else "NO" for pl in block], fmt="{}")
        lines.append("")
    return "\n".join(lines)


def describe(cfg, options: PlanOptions, plan: MemoryPlan) -> str:
    """Header lines: the model, layout, batch and assumptions of a plan."""
    p, m = cfg.parallel, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    total = sum(stage_parameters(m, tp, pp, s).total for s in range(pp)) * tp
    count = f"{total / 1e9:.3f}B" if total >= 1e9 else f"{total / 1e6:.3f}M"
    where = options.gpu_label if options.device == "gpu" else "CPU (emulated FP8, float32)"
    lines = [
        f"model {m.name}: {count} parameters over the TP x PP ranks of one replica (vocabulary padded "
        f"to {m.padded_vocab(tp)}), {m.num_layers} layers, seq_length {m.seq_length}",
        f"layout TP={tp} x PP={pp} x DP={options.dp}, sequence_parallel={str(p.sequence_parallel).lower()}, "
        f"micro_batch_size={p.micro_batch_size}: {plan.microbatches} microbatches per update, "
        f"{plan.in_flight} in flight on stage {plan.stage} (the most loaded, shown)",
        f"device {where}" + (f", headroom {options.headroom:.0%} (assumed)" if options.device == "gpu" else ""),
    ]
    if options.device == "gpu" and cfg.fp8.backend in ("emulate", "torch") and cfg.fp8.recipe not in (None, "off"):
        lines.append(f"fp8.backend={cfg.fp8.backend}: our FP8 linears, not Transformer Engine's; this GPU profile "
                     "models TE's layers (FP8 weight copies, workspaces), so read it as an estimate for this run")
    if options.device == "gpu":
        if plan.rollout is None:
            lines.append(f"rollout engine {cfg.rollout.engine!r}: runs on the host today (no GPU memory); "
                         "--rollout-share F plans a colocated GPU engine taking F of each GPU")
        else:
            r = plan.rollout
            src = (f"--rollout-share {options.rollout_share:g}" if options.rollout_share is not None
                   else f"rollout.gpu_memory_utilization={rollout_share(cfg, options):g}, "
                        f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}, "
                        + ("sleeps while training" if r.sleeps else "keeps its memory while training"))
            lines.append(
                f"rollout engine {cfg.rollout.engine!r} (GPU, {r.scheme}, {src}): weights "
                f"{r.weights / GIB:.2f} GiB, KV{'' if r.kv_cache == 'off' else ' (FP8 ' + r.kv_cache.upper() + ')'} "
                f"{r.kv_per_sequence / 2**20:.1f} MiB per {m.seq_length}-token "
                f"sequence: room for {r.concurrent} sequences at once, the engine's rollout batch is {r.sequences}"
                + ("" if r.fits else ": NOT EVEN ONE SEQUENCE FITS"))
    return "\n".join(lines)


def report(cfg, options: PlanOptions, *, label: str, world: Optional[int] = None, gpus_per_node: int = 8,
           compare_megatron: bool = False, out=print) -> bool:
    """Print the plan of ``cfg`` (header, table, verdict, fixes); True when the config's own arm fits."""
    own = plan_config(cfg, options)
    table = plan_table(cfg, options)
    if (own.recipe, own.optimizer) not in [(pl.recipe, pl.optimizer) for pl in table]:
        table = [*table, own]
    out(f"== {label}")
    out(describe(cfg, options, own))
    out("")
    out(format_table(table, own=(own.recipe, own.optimizer)))
    if compare_megatron and options.device == "gpu":
        for opt in OPTIMIZERS:
            ref = megatron_reference(cfg, options.dp, opt)
            ours = plan_arm(cfg, options, recipe_name=None, optimizer=opt)
            state = sum(ours.components[k] for k in ("weights", "grads", "optimizer"))
            out(f"Megatron-LM theoretical memory ({opt}, BF16): weights+optimizer "
                f"{ref['weights+optimizer'] / GIB:.2f} GiB (this plan: {state / GIB:.2f}), activations "
                f"{ref['activations'] / GIB:.2f} GiB (this plan: activations + logits "
                f"{(ours.components['activations'] + ours.components['logits']) / GIB:.2f})")
        out("")
    out(f"this config ({own.arm}, optimizer {own.optimizer}): {own.summary()}")
    if not own.fits:
        fixes = suggest_fixes(cfg, options, world=world, gpus_per_node=gpus_per_node)
        if fixes:
            out("  would fit with: " + "; or ".join(fixes))
        else:
            out("  " + no_fix_hint(own))
    return own.fits


def no_fix_hint(plan: MemoryPlan) -> str:
    """What to do when :func:`suggest_fixes` finds no single knob: depends on what does not fit."""
    r = plan.rollout
    if r is not None and plan.train_total <= plan.available and not (r.fits and plan.generation_fits):
        fp8 = ("FP8 rollout (rollout.fp8.scheme=vllm_block) stores its linears in 1 byte and an FP8 KV cache "
               "(rollout.fp8.kv_cache=e4m3) its keys and values, or " if plan.recipe
               else "the BF16 arm generates in BF16; or ")
        return ("training fits, the rollout engine does not: each vllm engine holds the whole model on "
                f"rollout.tensor_parallel_size GPUs ({r.weights / GIB:.1f} GiB of weights per GPU here); a larger "
                f"rollout.tensor_parallel_size splits it, {fp8}use a GPU with more memory (--gpu h200; "
                "launcher: +launcher.memory_plan=h200)")
    return ("no single knob tried here makes it fit (micro batch, TP, PP, optimizer): use more GPUs per replica "
            "or a GPU with more memory")


__all__ = ["describe", "format_table", "no_fix_hint", "report"]
