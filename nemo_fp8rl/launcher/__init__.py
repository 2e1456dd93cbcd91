"""SLURM and local launchers: a launcher YAML tree -> resolved training config -> sbatch script -> job.

NeMo Framework Launcher conventions (docs/launching.md): ``launchers/conf/config.yaml`` picks the
stages, the cluster type, a container and its mounts, exported variables and the results root;
``launchers/conf/cluster/slurm.yaml`` holds the cluster settings; each stage config
``launchers/conf/rl/<model>_<algo>_<fp8>.yaml`` has a ``run:`` block and the training overrides.

The pieces, in the order ``nemo-fp8rl-launch`` uses them:

- :func:`build_plans` checks the launcher config (required keys, stage names, job shape), builds
  each stage's training config through the same schema and validation as ``nemo-fp8rl-train`` and
  checks the parallel layout against the job (nodes x tasks = TP x PP x DP) - all before anything
  is written or submitted;
- :func:`write_stage` writes ``<results_dir>/<job>_train_config.yaml`` (the resolved training
  config, a Hydra primary config) and ``<job>_submission.sh`` (SLURM) or ``<job>_local.sh``
  (torchrun on this machine);
- :func:`submit` runs ``sbatch`` and returns the job id; :func:`run_local` runs the local script.

:mod:`nemo_fp8rl.launcher.memory` is the memory plan (``nemo-fp8rl-plan``): per-GPU bytes of a config by
component, BF16 vs each FP8 recipe, both optimizer paths; :func:`build_plans` refuses a GPU stage that
cannot fit (``launcher.memory_plan``).

This package imports no Hydra: composing config groups is passed in as a function (``launch.py``).
"""

from nemo_fp8rl.launcher.memory import MemoryPlan, PlanError, PlanOptions, plan_config, plan_table
from nemo_fp8rl.launcher.plan import (
    CLUSTER_TYPES,
    STAGES,
    ClusterSettings,
    LaunchError,
    RunSettings,
    StagePlan,
    build_plans,
    parse_time_limit,
)
from nemo_fp8rl.launcher.scripts import (
    render_local_script,
    render_nsys_wrapper,
    render_sbatch_script,
    render_train_config,
    sbatch_directives,
    srun_command,
)
from nemo_fp8rl.launcher.submit import SubmitError, run_local, submit, write_stage

__all__ = [
    "CLUSTER_TYPES",
    "STAGES",
    "ClusterSettings",
    "LaunchError",
    "MemoryPlan",
    "PlanError",
    "PlanOptions",
    "RunSettings",
    "StagePlan",
    "SubmitError",
    "build_plans",
    "parse_time_limit",
    "plan_config",
    "plan_table",
    "render_local_script",
    "render_nsys_wrapper",
    "render_sbatch_script",
    "render_train_config",
    "run_local",
    "sbatch_directives",
    "srun_command",
    "submit",
    "write_stage",
]
