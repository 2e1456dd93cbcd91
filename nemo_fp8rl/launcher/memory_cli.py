"""``nemo-fp8rl-plan``: the memory plan of a training config or of launcher stages, printed.

Training overrides are composed and validated as ``nemo-fp8rl-train`` does; launcher overrides go through
the launcher's own checks (``plan_stages``). The model is resolved as the ranks will build it
(:func:`resolve_for_plan`), the bytes come from :mod:`nemo_fp8rl.launcher.memory` and the text from
:mod:`nemo_fp8rl.launcher.memory_report`. The Hydra composition functions are passed in by
``nemo_fp8rl.launch.plan_main`` (this package imports no Hydra at module import).
"""

from __future__ import annotations

import dataclasses

from nemo_fp8rl.launcher.memory import DEVICES, GPUS_MIB, PlanError, PlanOptions, memory_plan_setting
from nemo_fp8rl.launcher.memory_report import report

_PROG = "nemo-fp8rl-plan"
_USAGE = f"""{_PROG} [options] OVERRIDE...

Per-GPU memory of a training config, by component, for BF16 and each FP8 recipe side by side, with both
optimizer paths, and whether it fits a GPU. OVERRIDEs are either training overrides, as for
nemo-fp8rl-train (config groups and keys of nemo_fp8rl/conf/: model=qwen3_32b parallel=tp8_pp2
fp8=blockwise parallel.micro_batch_size=1 ...; data-parallel size from --world-size), or launcher overrides, as for
nemo-fp8rl-launch (rl=<stage> rl.<key>=... ; the job shape gives DP; required paths may be omitted).
Exit code 0: the config's own arm fits; 1: it does not (the message names knobs that would fit); 2: bad input.

examples:
  {_PROG} model=qwen3_32b parallel=tp8_pp2 fp8=blockwise --world-size 32
  {_PROG} rl=qwen3_8b_grpo_blockwise --gpu h200 --rollout-share 0.4
  {_PROG} model=tiny --device cpu
"""


def _is_launcher_override(arg: str) -> bool:
    key = arg.lstrip("+").split("=", 1)[0]
    return key.split(".", 1)[0] in ("rl", "cluster", "stages", "cluster_type", "launcher", "base_results_dir",
                                    "container", "container_mounts", "env_vars", "launcher_scripts_path")


def train_config_from_overrides(overrides: list[str], compose_train):
    """``conf/`` config groups (``model=qwen3_8b``) and keys (``parallel.micro_batch_size=1``, with an
    optional ``+``) -> a validated TrainConfig. ``compose_train(group_overrides)`` composes the groups."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from nemo_fp8rl.config.schema import ConfigError
    from nemo_fp8rl.validation import validate

    groups, keys = [], []
    for o in overrides:
        if "=" not in o:
            raise PlanError(f"{o!r} is not an override; write key=value (e.g. model=qwen3_8b or "
                            "parallel.micro_batch_size=1)")
        key = o.split("=", 1)[0]
        (keys if ("." in key or key.startswith("+")) else groups).append(o)
    try:
        base = compose_train(groups)
    except ValueError as e:
        raise PlanError(str(e)) from None
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist([k.lstrip("+") for k in keys]))
        return validate(OmegaConf.to_object(merged))
    except ConfigError as e:
        raise PlanError(str(e)) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).strip().splitlines()[0]
        raise PlanError(f"{key}: {first}; the training keys are in nemo_fp8rl/config/schema.py") from None


def resolve_for_plan(cfg):
    """The model shape the ranks will build: ``model.hf_path``'s config.json when it is readable here
    (:func:`~nemo_fp8rl.models.hf_config.resolve_readable_model_config`, as the launcher's checks resolve
    it), and ``model.vocab_size`` from the task's tokenizer when it is null (as the trainer does)."""
    from nemo_fp8rl.models.hf_config import resolve_readable_model_config

    model = resolve_readable_model_config(cfg.model)
    if model.vocab_size is None:
        try:
            from nemo_fp8rl.tasks import get_task, task_class, task_kwargs

            task = get_task(cfg.task.name, **task_kwargs(cfg, task_class(cfg.task.name), seed=0))
            model = dataclasses.replace(model, vocab_size=task.tokenizer.vocab_size)
        except Exception as e:  # noqa: BLE001 - any task failure means: the plan needs the size given
            raise PlanError(f"model.vocab_size is null and the task {cfg.task.name!r} could not give its "
                            f"tokenizer's size here ({e}); set model.vocab_size=<size>") from None
    return dataclasses.replace(cfg, model=model)


def main(argv: list[str], *, compose_train, compose_launcher, plan_stages, out=print, err=None) -> int:
    """``nemo-fp8rl-plan``; the Hydra composition functions come from ``nemo_fp8rl.launch``. Returns the exit code."""
    import argparse
    import sys

    err = err or (lambda msg: print(msg, file=sys.stderr))
    parser = argparse.ArgumentParser(prog=_PROG, usage=_USAGE, add_help=True)
    parser.add_argument("--gpu", default=None, help=f"GPU type: {sorted(GPUS_MIB)} (default h100)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="GPU memory in GiB (instead of --gpu)")
    parser.add_argument("--headroom", type=float, default=PlanOptions.headroom,
                        help="share of the GPU kept free for CUDA context, NCCL and fragmentation (assumed 0.10)")
    parser.add_argument("--rollout-share", type=float, default=None,
                        help="plan a colocated GPU rollout engine reserving this share of each GPU")
    parser.add_argument("--world-size", type=int, default=None,
                        help="GPUs of the training job (training overrides; default TP x PP, i.e. DP=1)")
    parser.add_argument("--device", default="gpu", choices=list(DEVICES),
                        help="gpu: TE spec, BF16 activations, capacity check; cpu: the emulated float32 spec")
    parser.add_argument("--compare-megatron", action="store_true",
                        help="also print Megatron-LM's theoretical memory formulas for the BF16 arm")
    parser.add_argument("overrides", nargs="*")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        if not args.overrides:
            raise PlanError("give a config: training overrides (model=qwen3_8b ...) or a launcher stage "
                            "(rl=qwen3_8b_grpo_blockwise)")
        runs = []  # (label, cfg, dp, world, gpus_per_node, launcher gpu setting)
        if any(_is_launcher_override(a) for a in args.overrides):
            runs = _launcher_runs(args.overrides, compose_launcher, plan_stages)
        else:
            cfg = resolve_for_plan(train_config_from_overrides(args.overrides, compose_train))
            tp = cfg.parallel.tensor_model_parallel_size
            pp = cfg.parallel.pipeline_model_parallel_size
            world = args.world_size or tp * pp
            if world % (tp * pp):
                raise PlanError(f"--world-size {world} is not a multiple of TP x PP = {tp * pp}")
            runs = [(f"{cfg.model.name} (training config)", cfg, world // (tp * pp), world, 8, None)]
        ok = True
        for label, cfg, dp, world, gpn, gpu_setting in runs:
            gpu, gib = args.gpu, args.gpu_memory_gib
            if gpu is None and gib is None and gpu_setting is not None:
                gpu, gib = gpu_setting
            options = PlanOptions(dp=dp, device=args.device, gpu=gpu or "h100", gpu_memory_gib=gib,
                                  headroom=args.headroom, rollout_share=args.rollout_share)
            options.check()
            ok &= report(cfg, options, label=label, world=world, gpus_per_node=gpn,
                         compare_megatron=args.compare_megatron, out=out)
        return 0 if ok else 1
    except (ValueError, HydraException, OmegaConfBaseException) as e:  # PlanError, LaunchError, ConfigError too
        # Hydra's composition errors name the override and the fix ("use +rl.rollout.engine=..."): no traceback
        err(f"{_PROG}: {e}")
        return 2


def _launcher_runs(overrides, compose_launcher, plan_stages):
    """Launcher overrides -> one (label, cfg, dp, world, gpus_per_node, gpu) per stage. Required keys that
    the plan does not read (``model.hf_path`` without a readable directory, ``task.path``) may be left out."""
    from omegaconf import OmegaConf, open_dict

    cfg, choices = compose_launcher(overrides)
    for key in OmegaConf.missing_keys(cfg):
        if key.endswith("model.hf_path"):
            OmegaConf.update(cfg, key, None, force_add=True)
        elif key.endswith("task.path"):
            OmegaConf.update(cfg, key, "<not read by the memory plan>", force_add=True)
    with open_dict(cfg):
        setting = OmegaConf.select(cfg, "launcher.memory_plan", default=True)
        cfg.launcher.memory_plan = "off"  # the plan prints; the launcher's refusal is not wanted here
    gpu = memory_plan_setting(setting) if setting is not True else None
    runs = []
    for plan in plan_stages(cfg, choices):
        train = resolve_for_plan(plan.train)
        runs.append((f"{plan.stage}/{plan.config_name}: {plan.world_size} ranks", train, plan.dp, plan.world_size,
                     plan.run.gpus_per_node or 8, gpu))
    return runs


__all__ = ["main", "resolve_for_plan", "train_config_from_overrides"]
