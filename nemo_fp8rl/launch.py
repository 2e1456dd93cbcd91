"""``nemo-fp8rl-launch`` (= ``python -m nemo_fp8rl.launch``): launcher YAMLs -> sbatch script -> job.

    nemo-fp8rl-launch rl=tiny_grpo_blockwise                        # submit to the current cluster
    nemo-fp8rl-launch rl=tiny_grpo_blockwise launcher.dry_run=true  # write the files, submit nothing
    nemo-fp8rl-launch rl=tiny_grpo_blockwise cluster_type=local     # torchrun on this machine
    nemo-fp8rl-launch rl=qwen3_8b_grpo_blockwise cluster.partition=batch cluster.account=my_acct \\
        container=nvcr.io#nvidia/nemo:25.07 rl.model.hf_path=/models/Qwen3-8B rl.task.path=/data/math.jsonl

A Hydra app on ``nemo_fp8rl/launcher/conf/`` (``launchers/conf/`` in a checkout links to it; NeMo
Framework Launcher conventions): ``config.yaml`` picks the stages, ``cluster/`` and ``rl/`` are config
groups, and ``rl.<key>=<value>`` overrides a key of the stage config - ``rl.run.*`` shapes the job,
``rl.config_groups.<group>`` picks a training config group, any other ``rl.<key>`` is a training key (``rl.trainer.max_steps=500`` becomes
``trainer.max_steps=500``; keys the stage YAML does not list are added with ``+rl.<key>=<value>``).
Everything is checked before anything is written or submitted; a bad input exits with code 2 and one
message naming the key. Results go under ``launcher_scripts_path`` (default: ``launchers/`` in a checkout,
the current directory for a wheel install). See ``docs/launching.md``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from nemo_fp8rl.resources import default_launcher_scripts_dir, launcher_conf_dir, shown_path

LAUNCHER_CONF_DIR = launcher_conf_dir()
_PROG = "nemo-fp8rl-launch"


def compose_train_config(overrides: list[str]):
    """Compose the trainer's ``conf/config.yaml`` with config-group overrides (e.g. ``["fp8=blockwise"]``).

    Works inside a running Hydra app (the launcher's own): Hydra's global state is set aside for the
    composition and put back afterwards.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_fp8rl.train import CONF_DIR, register_schema

    conf = Path(CONF_DIR)
    groups = sorted(p.name for p in conf.iterdir() if p.is_dir())
    for item in overrides:
        group, _, name = item.partition("=")
        if group not in groups:
            raise ValueError(f"{group}: {shown_path(conf)}/ has no config group {group!r}; groups: {groups}")
        if not (conf / group / f"{name}.yaml").is_file():
            options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
            raise ValueError(f"{group}={name}: there is no {shown_path(conf / group / f'{name}.yaml')}; "
                             f"choose one of {options}")
    register_schema()
    outer = GlobalHydra.instance()
    outer_hydra = outer.hydra
    outer.clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None, job_name="train"):
            return compose(config_name="config", overrides=list(overrides))
    finally:
        GlobalHydra.set_instance(outer)
        outer.hydra = outer_hydra


def plan_stages(cfg, choices: Mapping[str, str]):
    """:func:`nemo_fp8rl.launcher.build_plans` with the package's training config; ``launcher_scripts_path``
    defaults to :func:`nemo_fp8rl.resources.default_launcher_scripts_dir` (never inside the package)."""
    from nemo_fp8rl.launcher import build_plans

    return build_plans(cfg, compose_train=compose_train_config, choices=choices, launcher_dir=default_launcher_scripts_dir())


def compose_launcher_config(overrides: list[str]) -> tuple[object, dict[str, str]]:
    """The launcher config for ``overrides`` without running the app: ``(cfg, config-group choices)``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    with initialize_config_dir(config_dir=str(LAUNCHER_CONF_DIR), version_base=None, job_name="launch"):
        full = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    choices = {k: v for k, v in OmegaConf.to_container(full.hydra.runtime.choices).items()
               if v is not None and not k.startswith("hydra")}
    with open_dict(full):
        del full["hydra"]
    return full, choices


def plans_from_overrides(overrides: list[str]):
    """Library entry point: the checked stage plans for a list of launcher overrides."""
    cfg, choices = compose_launcher_config(overrides)
    return plan_stages(cfg, choices)


def plan_main(argv: "list[str] | None" = None) -> int:
    """``nemo-fp8rl-plan``: per-GPU memory of a training config or launcher stage
    (:mod:`nemo_fp8rl.launcher.memory`, docs/megatron.md "Memory plan"). Returns the exit code."""
    from nemo_fp8rl.launcher.memory_cli import main as memory_main

    return memory_main(sys.argv[1:] if argv is None else list(argv), compose_train=compose_train_config,
                       compose_launcher=compose_launcher_config, plan_stages=plan_stages)


def launch(plans, *, out=print) -> int:
    """Write every stage's files, then submit them (``slurm``) or run them (``local``). Returns an exit code."""
    from nemo_fp8rl.launcher import SubmitError, run_local, submit, write_stage

    for plan in plans:
        paths = write_stage(plan)
        out(f"{_PROG}: {plan.describe()}")
        out(f"  results dir:       {plan.results_dir}")
        out(f"  training config:   {paths['train_config']}")
        label = "submission script:" if plan.cluster_type == "slurm" else "local script:"
        out(f"  {label:<19}{paths['script']}")
        if "nsys_wrapper" in paths:
            out(f"  nsys wrapper:      {paths['nsys_wrapper']} (ranks {list(plan.nsys_ranks)} under nsys profile; "
                f"reports in {plan.results_dir / 'profile'})")
        if plan.memory is not None:
            out(f"  memory plan:       {plan.memory.summary()}")
        if plan.dry_run:
            how = "sbatch" if plan.cluster_type == "slurm" else "bash"
            out(f"  dry run: nothing was started; start it with: {how} {paths['script']}")
            continue
        if plan.cluster_type == "slurm":
            try:
                job_id = submit(paths["script"], cwd=plan.results_dir)
            except SubmitError as e:
                print(f"{_PROG}: {e}", file=sys.stderr)
                return 1
            out(f"  logs:              {plan.log_path('out')} and .err (%j = {job_id})")
            out(f"Submitted batch job {job_id}")
        else:
            if plan.container:
                out(f"  note: container={plan.container} is not used by cluster_type=local")
            rc = run_local(paths["script"], cwd=plan.results_dir)
            if rc != 0:
                print(f"{_PROG}: local run of {plan.stage}/{plan.config_name} exited with code {rc}", file=sys.stderr)
                return rc
    return 0


def _unknown_group_choice(argv: list[str]) -> str | None:
    """``rl=<name>``/``cluster=<name>`` naming no file: one clear message before Hydra composes anything."""
    groups = sorted(p.name for p in LAUNCHER_CONF_DIR.iterdir() if p.is_dir())
    for arg in argv:
        m = re.match(r"^([A-Za-z_]+)=([^,\s]+)$", arg)
        if not m or m.group(1) not in groups:
            continue
        group, name = m.groups()
        if not (LAUNCHER_CONF_DIR / group / f"{name}.yaml").is_file():
            options = sorted(p.stem for p in (LAUNCHER_CONF_DIR / group).glob("*.yaml"))
            return (f"{group}={name}: there is no {shown_path(LAUNCHER_CONF_DIR / group / f'{name}.yaml')}; "
                    f"choose one of {options} (or add a YAML file there)")
    return None


def main() -> None:
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    problem = _unknown_group_choice(sys.argv[1:])
    if problem:
        print(f"{_PROG}: {problem}", file=sys.stderr)
        sys.exit(2)

    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base=None, config_path=str(LAUNCHER_CONF_DIR), config_name="config")
    def _app(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        from nemo_fp8rl.launcher import LaunchError

        choices = {k: v for k, v in HydraConfig.get().runtime.choices.items()
                   if v is not None and not k.startswith("hydra")}
        try:
            plans = plan_stages(cfg, choices)
        except LaunchError as e:
            print(f"{_PROG}: invalid launch config: {e}", file=sys.stderr)
            sys.exit(2)
        rc = launch(plans)
        if rc:
            sys.exit(rc)

    _app()


if __name__ == "__main__":
    main()
