"""Launcher config -> one checked :class:`StagePlan` per stage. Nothing is written or submitted here.

Every check that can fail runs here, so a bad input stops the launcher before a file is written or a
job is queued (a job that fails its own config check after an hour in the queue wastes the hour):

- required keys (``???`` in a YAML) are listed together with the file that should set them;
- ``stages`` names known stages, ``cluster_type`` is ``slurm`` or ``local``, names and paths are
  usable in ``#SBATCH`` lines, ``run.time_limit`` parses and is longer than ``run.signal_time``;
- the stage's training config is composed from its ``config_groups`` and overrides through the
  training schema and ``validate`` - exactly what ``nemo-fp8rl-train`` will run;
- the job shape fits the parallel layout: ``nodes x ntasks_per_node`` processes = TP x PP x DP
  (:func:`nemo_fp8rl.models.parallel.validate_layout`), ``algorithm.prompts_per_step`` splits over DP,
  and GPU stages start one task per GPU;
- GPU stages fit the GPU: the memory plan (:mod:`nemo_fp8rl.launcher.memory`) of the stage's config,
  recipe and optimizer on ``launcher.memory_plan`` (a GPU name, default h100, or its GiB; ``off`` skips);
- ``trainer.profile.ranks`` are ranks of the job, and ``trainer.profile.kind=nsys`` is a GPU stage (its
  ranks then run under Nsight Systems: :func:`nemo_fp8rl.launcher.scripts.render_nsys_wrapper`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nemo_fp8rl.resources import PACKAGE_DIR, conf_dir, launcher_conf_dir, shown_path

#: Stages the launcher knows: name -> what it runs. A stage's config group has the same name.
STAGES: dict[str, str] = {
    "rl": "RL training with nemo_fp8rl.train (configs: nemo_fp8rl/launcher/conf/rl/<model>_<algo>_<fp8>.yaml)",
}
#: ``slurm``: write a submission script and sbatch it; ``local``: torchrun on this machine.
CLUSTER_TYPES = ("slurm", "local")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_TOP_KEYS = ("stages", "cluster_type", "container", "container_mounts", "env_vars", "base_results_dir",
             "launcher_scripts_path", "launcher", "cluster")
# Keys of the training config that belong to the launcher: the run directory is the stage's
# results_dir, and every launch resumes (a fresh results_dir starts fresh).
_OWNED = {
    "output_dir": "the run directory is the stage's results directory: set {stage}.run.results_dir instead",
    "resume": "the launcher always runs with resume=true (a requeued or relaunched job continues from "
              "<results_dir>/checkpoints/latest; a results_dir without checkpoints starts fresh)",
}


class LaunchError(ValueError):
    """Launcher input that cannot work. The message names the key (and the file) and the fix."""


@dataclass(frozen=True)
class ClusterSettings:
    """``launchers/conf/cluster/slurm.yaml``: how jobs are placed on the cluster."""

    partition: str | None = None
    """--partition; null = the cluster's default partition."""
    account: str | None = None
    """--account; null = the user's default account."""
    exclusive: bool = False
    """--exclusive: whole nodes."""
    gpus_per_node: int | None = None
    """GPUs of a node; GPU stages take theirs from here (``run.gpus_per_node: ${cluster.gpus_per_node}``)."""
    mem: str | None = None
    """--mem per node ("0" = all of it); null = no --mem line."""
    job_name_prefix: str = ""
    """Job name = prefix + run.name."""
    nodelist: str | None = None
    """--nodelist; null = any nodes."""
    srun_args: tuple[str, ...] = ()
    """Extra srun arguments, e.g. ``--mpi=pmix``."""


@dataclass(frozen=True)
class RunSettings:
    """The ``run:`` block of a stage config: the job's name, place, shape and time."""

    name: str
    """Stage run name: job name suffix and file-name stem."""
    results_dir: Path
    """Everything of this stage: scripts, logs, resolved config, metrics, checkpoints."""
    time_limit: str
    """SLURM --time of one run (a requeued run gets the full limit again)."""
    nodes: int
    """--nodes."""
    ntasks_per_node: int
    """--ntasks-per-node: processes (ranks) per node; one per GPU on GPU stages."""
    time_limit_s: int = 0
    """time_limit in seconds (parsed)."""
    signal_time: int = 120
    """Seconds before time_limit at which every task gets SIGUSR1 (--signal=USR1@<s>): finish the step,
    checkpoint, requeue. Must exceed one training step plus one checkpoint write."""
    dependency: str | None = None
    """--dependency (e.g. singleton, afterok:<id>); null = none."""
    gpus_per_node: int = 0
    """GPUs used per node; 0 = CPU job (no --gpus-per-node line)."""


@dataclass(frozen=True)
class StagePlan:
    """One stage, checked and resolved: what :func:`write_stage` writes and :func:`submit` queues."""

    stage: str
    config_name: str
    cluster_type: str
    run: RunSettings
    cluster: ClusterSettings
    container: str | None
    container_mounts: tuple[str, ...]
    env_vars: tuple[tuple[str, str], ...]
    python: str
    dry_run: bool
    train: Any = field(repr=False)  # nemo_fp8rl.config.schema.TrainConfig (validated)
    memory: Any = field(default=None, repr=False)  # nemo_fp8rl.launcher.memory.MemoryPlan (GPU stages)
    nsys: str = "nsys"
    """``launcher.nsys``: the Nsight Systems command on the compute nodes (``trainer.profile.kind=nsys``)."""
    nsys_args: tuple[str, ...] = ()
    """``launcher.nsys_args``: options added to ``nsys profile`` after the launcher's own."""

    @property
    def job_name(self) -> str:
        return f"{self.cluster.job_name_prefix}{self.run.name}"

    @property
    def world_size(self) -> int:
        return self.run.nodes * self.run.ntasks_per_node

    @property
    def tp(self) -> int:
        return self.train.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.train.parallel.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def results_dir(self) -> Path:
        return self.run.results_dir

    @property
    def train_config_name(self) -> str:
        """Hydra config name of the resolved training config (file stem)."""
        return f"{self.job_name}_train_config"

    @property
    def train_config_path(self) -> Path:
        return self.results_dir / f"{self.train_config_name}.yaml"

    @property
    def submission_script_path(self) -> Path:
        return self.results_dir / f"{self.job_name}_submission.sh"

    @property
    def local_script_path(self) -> Path:
        return self.results_dir / f"{self.job_name}_local.sh"

    @property
    def nsys_ranks(self) -> tuple[int, ...]:
        """Ranks that run under Nsight Systems: ``trainer.profile.ranks`` with ``kind=nsys``, else none."""
        prof = self.train.trainer.profile
        return tuple(sorted(set(prof.ranks))) if prof.kind == "nsys" else ()

    @property
    def nsys_wrapper_path(self) -> Path:
        """The per-rank wrapper that starts the profiled ranks under ``nsys profile`` (written only then)."""
        return self.results_dir / f"{self.job_name}_nsys.sh"

    def log_path(self, ext: str) -> Path:
        """SLURM log file pattern (``%j`` = job id; a requeued run appends to the same files)."""
        return self.results_dir / f"log-{self.job_name}_%j.{ext}"

    def describe(self) -> str:
        gpus = f"{self.run.gpus_per_node} GPUs/node" if self.run.gpus_per_node else "CPU"
        nodes = f"{self.run.nodes} node{'s' if self.run.nodes > 1 else ''}"
        return (f"{self.stage}/{self.config_name} -> job {self.job_name}: {nodes} x {self.run.ntasks_per_node} "
                f"tasks = {self.world_size} ranks (TP={self.tp} x PP={self.pp} x DP={self.dp}), {gpus}")


def parse_time_limit(value: Any, key: str = "run.time_limit") -> int:
    """A SLURM ``--time`` value in seconds.

    Accepts SLURM's forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S`` (an integer is
    minutes). Unlimited times are refused: preemption safety needs a signal before a known end.

    Raises:
        LaunchError: naming ``key`` and the accepted forms.
    """
    forms = "write minutes, \"HH:MM:SS\" or \"D-HH:MM:SS\" (quoted in YAML)"
    if isinstance(value, bool) or value is None:
        raise LaunchError(f"{key}={value!r} is not a time limit; {forms}")
    if isinstance(value, int):
        secs = value * 60
    else:
        m = _TIME_RE.match(str(value).strip())
        if not m:
            raise LaunchError(f"{key}={value!r} is not a SLURM time limit; {forms}")
        days, a, b, c = m.groups()
        if days is not None:
            secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
        elif b is None:
            secs = int(a) * 60
        elif c is None:
            secs = int(a) * 60 + int(b)
        else:
            secs = int(a) * 3600 + int(b) * 60 + int(c)
    if secs <= 0:
        raise LaunchError(f"{key}={value!r} must be a positive time; {forms}")
    return secs


def _stage_file(stage: str, config_name: str) -> str:
    """The stage YAML as messages name it (:func:`nemo_fp8rl.resources.shown_path`)."""
    return _launcher_file(stage, f"{config_name}.yaml")


def _launcher_file(*parts: str) -> str:
    """A file or directory of the launcher's config tree as messages name it."""
    return shown_path(launcher_conf_dir().joinpath(*parts))


def _int(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LaunchError(f"{key}={value!r} must be an integer >= {minimum}")
    return value


def _opt_str(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LaunchError(f"{key}={value!r} must be a string (or null)")
    s = str(value).strip()
    if not s or any(ch.isspace() for ch in s):
        raise LaunchError(f"{key}={value!r} must be non-empty and free of whitespace (it goes into #SBATCH lines)")
    return s


def _path(value: Any, key: str) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise LaunchError(f"{key}={value!r} must be a directory path")
    p = Path(os.path.abspath(os.path.expanduser(value)))
    if any(ch.isspace() for ch in str(p)):
        raise LaunchError(f"{key}={str(p)!r} contains whitespace, which #SBATCH lines cannot hold; choose a path "
                          "without spaces")
    return p


def _unknown_keys(block: Mapping, known, key: str, where: str) -> None:
    extra = sorted(set(block) - set(known))
    if extra:
        raise LaunchError(f"{key}: unknown key(s) {extra} in {where}; valid keys: {sorted(known)}")


def _check_missing(cfg, choices: Mapping[str, str]) -> None:
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if not missing:
        return
    lines = []
    for k in missing:
        top = k.split(".", 1)[0].split("[", 1)[0]
        where = _stage_file(top, choices.get(top, "<name>")) if top in STAGES else (
            _launcher_file("cluster", f"{choices.get('cluster', 'slurm')}.yaml") if top == "cluster"
            else _launcher_file("config.yaml"))
        lines.append(f"{k} (from {where})")
    example = missing[0]
    raise LaunchError(
        "missing required key(s): " + ", ".join(lines)
        + f"; set them in that file or on the command line, e.g. {example}=<value>"
    )


def _resolve(cfg) -> dict:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise LaunchError(f"{key}: cannot resolve the value ({getattr(e, 'msg', None) or e})") from None


def _cluster(raw: Any) -> ClusterSettings:
    if raw is None:
        return ClusterSettings()
    if not isinstance(raw, dict):
        raise LaunchError(f"cluster={raw!r} must be a mapping ({_launcher_file('cluster', 'slurm.yaml')})")
    known = [f.name for f in fields(ClusterSettings)]
    _unknown_keys(raw, known, "cluster", f"the cluster config ({_launcher_file('cluster')}/)")
    srun_args = raw.get("srun_args") or []
    if isinstance(srun_args, str) or not isinstance(srun_args, list) or not all(isinstance(a, str) for a in srun_args):
        raise LaunchError(f"cluster.srun_args={srun_args!r} must be a list of strings, e.g. ['--mpi=pmix']")
    exclusive = raw.get("exclusive", False)
    if not isinstance(exclusive, bool):
        raise LaunchError(f"cluster.exclusive={exclusive!r} must be true or false")
    gpus = raw.get("gpus_per_node")
    if gpus is not None:
        _int(gpus, "cluster.gpus_per_node", 0)
    prefix = raw.get("job_name_prefix") or ""
    if prefix and not _NAME_RE.match(str(prefix)):
        raise LaunchError(f"cluster.job_name_prefix={prefix!r} may hold only letters, digits and _.+-")
    return ClusterSettings(
        partition=_opt_str(raw.get("partition"), "cluster.partition"),
        account=_opt_str(raw.get("account"), "cluster.account"),
        exclusive=exclusive,
        gpus_per_node=gpus,
        mem=_opt_str(raw.get("mem"), "cluster.mem"),
        job_name_prefix=str(prefix),
        nodelist=_opt_str(raw.get("nodelist"), "cluster.nodelist"),
        srun_args=tuple(srun_args),
    )


def _run(raw: Any, stage: str, where: str) -> RunSettings:
    key = f"{stage}.run"
    if not isinstance(raw, dict):
        raise LaunchError(f"{key} is missing or not a mapping in {where}; every stage config needs a run: block "
                          "(name, results_dir, time_limit, nodes, ntasks_per_node)")
    known = [f.name for f in fields(RunSettings) if f.name != "time_limit_s"]
    _unknown_keys(raw, known, key, where)
    for req in ("name", "results_dir", "time_limit", "nodes", "ntasks_per_node"):
        if raw.get(req) is None:
            raise LaunchError(f"{key}.{req} is required; set it in {where} or on the command line "
                              f"({key}.{req}=<value>)")
    name = raw["name"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise LaunchError(f"{key}.name={name!r} must start with a letter or digit and hold only letters, digits "
                          "and _.+- (it names the job and its files)")
    limit_s = parse_time_limit(raw["time_limit"], f"{key}.time_limit")
    signal_time = _int(raw.get("signal_time", RunSettings.signal_time), f"{key}.signal_time", 1)
    if signal_time > 65535:
        raise LaunchError(f"{key}.signal_time={signal_time}: SLURM's --signal takes at most 65535 seconds")
    if signal_time >= limit_s:
        raise LaunchError(
            f"{key}.signal_time={signal_time}s is not shorter than {key}.time_limit={raw['time_limit']!r} "
            f"({limit_s}s): the checkpoint signal would come before the run starts; lower signal_time or "
            "raise time_limit"
        )
    gpus = raw.get("gpus_per_node")
    return RunSettings(
        name=name,
        results_dir=_path(raw["results_dir"], f"{key}.results_dir"),
        time_limit=str(raw["time_limit"]),
        time_limit_s=limit_s,
        signal_time=signal_time,
        dependency=_opt_str(raw.get("dependency"), f"{key}.dependency"),
        nodes=_int(raw["nodes"], f"{key}.nodes", 1),
        ntasks_per_node=_int(raw["ntasks_per_node"], f"{key}.ntasks_per_node", 1),
        gpus_per_node=0 if gpus is None else _int(gpus, f"{key}.gpus_per_node", 0),
    )


def _train_config(raw: dict, stage: str, where: str, results_dir: Path,
                  compose_train: Callable[[list[str]], Any]):
    """Compose the stage's training config and validate it as ``nemo-fp8rl-train`` will."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from nemo_fp8rl.config.schema import ConfigError
    from nemo_fp8rl.validation import validate

    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(v, str) for v in groups.values()):
        raise LaunchError(f"{stage}.config_groups in {where} must map config groups of {shown_path(conf_dir())}/ "
                          "to option names, "
                          "e.g. {model: tiny, fp8: blockwise}")
    overrides = {k: v for k, v in raw.items() if k not in ("run", "config_groups")}
    for k, why in _OWNED.items():
        if k in overrides:
            raise LaunchError(f"{stage}.{k} cannot be set in a stage config ({where}): {why.format(stage=stage)}")
    try:
        base = compose_train([f"{g}={v}" for g, v in groups.items()])
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors have no common base class
        msg = str(e).strip().replace("\n\n", "\n").replace("\n", "; ")
        raise LaunchError(f"{stage}.config_groups.{msg} ({where})") from None
    try:
        merged = OmegaConf.merge(base, overrides)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).strip().splitlines()[0]  # OmegaConf appends full_key/object_type lines
        raise LaunchError(
            f"{stage}.{key} ({where} or the command line): {first}; the training keys and their types are in "
            f"{shown_path(PACKAGE_DIR / 'config' / 'schema.py')} (TrainConfig)"
        ) from None
    merged.output_dir = str(results_dir)
    merged.resume = True
    try:
        return validate(OmegaConf.to_object(merged))
    except (ConfigError, OmegaConfBaseException) as e:
        raise LaunchError(f"invalid training config of {where} (with the command-line overrides): "
                          f"{_scoped(str(e), stage)}") from None


def _recipe_env(train, user_keys: set) -> tuple[tuple[str, str], ...]:
    """Environment the stage's FP8 recipe needs before Transformer Engine is imported (blockwise scale
    type: TE reads ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` once, at import). A variable set in
    ``env_vars`` wins; the trainer refuses a mismatch with the recipe when it builds the model."""
    from nemo_fp8rl.fp8.recipes import build_fp8_recipe

    recipe = build_fp8_recipe(train)
    env = recipe.te_env() if recipe is not None else {}
    return tuple((k, v) for k, v in sorted(env.items()) if k not in user_keys)


def _scoped(msg: str, stage: str) -> str:
    """Name training keys as the launcher sees them: ``algorithm.eps_low`` -> ``rl.algorithm.eps_low``."""
    from nemo_fp8rl.config.schema import TrainConfig

    sections = "|".join(f.name for f in fields(TrainConfig))
    return re.sub(rf"(?<![\w.])({sections})\.(?=[A-Za-z_])", rf"{stage}.\1.", msg)


def _resolve_model(train, stage: str):
    """The model the ranks will build (:func:`~nemo_fp8rl.models.hf_config.resolve_readable_model_config`:
    ``model.hf_path``'s config.json when it is readable here, a registry model fetched once as the trainer
    would; else the configured preset, e.g. for a path that exists only inside the container, which the
    trainer checks at start)."""
    from nemo_fp8rl.models.hf_config import resolve_readable_model_config

    try:
        return resolve_readable_model_config(train.model)
    except (ValueError, OSError) as e:
        raise LaunchError(f"{stage}.model.hf_path={train.model.hf_path!r}: {_scoped(str(e), stage)}") from None


def _check_layout(run: RunSettings, train, model, stage: str, cluster_type: str) -> None:
    """The job shape against the layout and ``model`` (the resolved ``train.model``)."""
    from nemo_fp8rl.models.parallel import validate_layout

    world = run.nodes * run.ntasks_per_node
    shape = (f"{stage}.run.nodes={run.nodes} x {stage}.run.ntasks_per_node={run.ntasks_per_node} = {world} "
             "processes")
    try:
        validate_layout(train.parallel, world, model)
    except ValueError as e:
        raise LaunchError(f"{shape}, but {_scoped(str(e), stage)}") from None
    tp, pp = train.parallel.tensor_model_parallel_size, train.parallel.pipeline_model_parallel_size
    dp = world // (tp * pp)
    prompts = train.algorithm.prompts_per_step
    if prompts % dp:
        raise LaunchError(
            f"{shape} give data-parallel size DP = {world} / (TP={tp} x PP={pp}) = {dp}, which does not divide "
            f"{stage}.algorithm.prompts_per_step={prompts}; each DP rank draws prompts_per_step / DP prompts: "
            f"use a multiple of {dp} prompts or change the job shape"
        )
    if run.gpus_per_node and run.ntasks_per_node != run.gpus_per_node and cluster_type == "slurm":
        raise LaunchError(
            f"{stage}.run.ntasks_per_node={run.ntasks_per_node} but {stage}.run.gpus_per_node={run.gpus_per_node}: "
            f"GPU stages start one task per GPU; set {stage}.run.ntasks_per_node={run.gpus_per_node}"
        )


def _check_profile(run: RunSettings, train, stage: str) -> None:
    """``trainer.profile`` against the job: its ranks exist, and Nsight Systems profiles GPU stages only.

    The trainer refuses the same at start-up (:class:`nemo_fp8rl.trainer.profiling.StepProfiler`); here it
    stops the launch before the job waits in the queue."""
    prof = train.trainer.profile
    if prof.kind is None:
        return
    world = run.nodes * run.ntasks_per_node
    missing = sorted(r for r in prof.ranks if r >= world)
    if missing:
        raise LaunchError(f"{stage}.trainer.profile.ranks={list(prof.ranks)}: the job has {world} rank(s) "
                          f"({stage}.run.nodes x {stage}.run.ntasks_per_node), so {missing} would profile nothing; "
                          f"list ranks below {world}")
    if prof.kind == "nsys" and not run.gpus_per_node:
        raise LaunchError(f"{stage}.trainer.profile.kind=nsys needs a GPU stage ({stage}.run.gpus_per_node is 0): "
                          f"Nsight Systems records the GPU work between cudaProfilerStart and Stop; on CPU use "
                          f"{stage}.trainer.profile.kind=torch")


def _check_memory(run: RunSettings, train, model, stage: str, config_name: str, setting):
    """The memory plan of a GPU stage (``model``: the resolved ``train.model``); a layout that cannot fit
    stops the launch, naming knobs that fit."""
    import dataclasses

    from nemo_fp8rl.launcher.memory import PlanError, PlanOptions, memory_plan_setting, plan_config, suggest_fixes
    from nemo_fp8rl.launcher.memory_report import no_fix_hint

    try:
        gpu = memory_plan_setting(setting)
    except PlanError as e:
        raise LaunchError(str(e)) from None
    if gpu is None or not run.gpus_per_node:
        return None
    world = run.nodes * run.ntasks_per_node
    tp, pp = train.parallel.tensor_model_parallel_size, train.parallel.pipeline_model_parallel_size
    cfg = dataclasses.replace(train, model=model)
    options = PlanOptions(dp=world // (tp * pp), gpu=gpu[0] or "h100", gpu_memory_gib=gpu[1])
    try:
        plan = plan_config(cfg, options)
    except PlanError as e:
        raise LaunchError(f"memory plan of {stage}: {_scoped(str(e), stage)}") from None
    if not plan.fits:
        fixes = [_scoped(f, stage) for f in suggest_fixes(cfg, options, world=world, gpus_per_node=run.gpus_per_node)]
        hint = ("; it would fit with " + " or ".join(fixes)) if fixes else "; " + _scoped(no_fix_hint(plan), stage)
        if plan.train_total > plan.available:
            need = (f"needs {plan.train_total / 2**30:.1f} GiB per GPU, but {options.gpu_label} leaves "
                    f"{plan.available / 2**30:.1f} GiB after {options.headroom:.0%} headroom")
        else:
            need = f"does not fit {options.gpu_label}: {plan.summary()}"
        raise LaunchError(
            f"memory plan: {stage} (TP={tp} x PP={pp} x DP={options.dp}, {plan.arm}, {plan.optimizer} optimizer) "
            f"{need}{hint}. "
            f"`nemo-fp8rl-plan {stage}={config_name} <the same overrides>` prints the breakdown; +launcher.memory_plan=<gpu or GiB> "
            "names another GPU, +launcher.memory_plan=off skips this check"
        )
    return plan


def build_plans(cfg, *, compose_train: Callable[[list[str]], Any], choices: Mapping[str, str],
                launcher_dir: Path) -> list[StagePlan]:
    """Check the launcher config and build one :class:`StagePlan` per entry of ``stages``.

    Args:
        cfg: the composed launcher config (``launchers/conf/config.yaml`` + groups + overrides);
            ``launcher_scripts_path`` and ``base_results_dir`` are made absolute in place.
        compose_train: ``overrides -> DictConfig`` composing ``conf/config.yaml`` of the trainer
            with config-group overrides such as ``["model=tiny", "fp8=blockwise"]``.
        choices: the config-group choices of the launcher config (``{"rl": "tiny_grpo_blockwise", ...}``).
        launcher_dir: the default of ``launcher_scripts_path``
            (:func:`nemo_fp8rl.resources.default_launcher_scripts_dir`: ``launchers/`` in a checkout, the
            current directory for a wheel install, never inside the installed package).

    Raises:
        LaunchError: the first problem found, naming the key, the file and the fix.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if OmegaConf.select(cfg, "launcher_scripts_path", throw_on_missing=False) is None:
        cfg.launcher_scripts_path = str(launcher_dir)
    stages = OmegaConf.select(cfg, "stages", throw_on_missing=False)
    stage_list = list(stages) if OmegaConf.is_list(stages) else []
    _check_missing(cfg, choices)
    try:
        base = OmegaConf.select(cfg, "base_results_dir")
    except OmegaConfBaseException as e:
        raise LaunchError(f"base_results_dir: cannot resolve the value ({getattr(e, 'msg', None) or e})") from None
    cfg.base_results_dir = str(_path(base, "base_results_dir"))
    data = _resolve(cfg)

    if not stage_list:
        raise LaunchError(f"stages={data.get('stages')!r} must be a non-empty list of stage names, e.g. stages=[rl]; "
                          f"known stages: {sorted(STAGES)}")
    for s in stage_list:
        if s not in STAGES:
            raise LaunchError(f"stages: unknown stage {s!r}; known stages: {sorted(STAGES)} "
                              f"({_launcher_file('config.yaml')}, or stages=[rl] on the command line)")
    if len(set(stage_list)) != len(stage_list):
        raise LaunchError(f"stages={stage_list}: a stage is listed twice")
    stage_set = set(STAGES)
    unknown = sorted(k for k in data if k not in _TOP_KEYS and k not in stage_set)
    if unknown:
        raise LaunchError(f"{_launcher_file('config.yaml')}: unknown top-level key(s) {unknown}; valid keys: "
                          f"{sorted(_TOP_KEYS)} and the stage groups {sorted(STAGES)}")

    cluster_type = data.get("cluster_type")
    if cluster_type not in CLUSTER_TYPES:
        raise LaunchError(f"cluster_type={cluster_type!r} is not valid; choose one of {list(CLUSTER_TYPES)}")
    cluster = _cluster(data.get("cluster"))
    container = data.get("container")
    if container is not None and (not isinstance(container, str) or not container.strip()):
        raise LaunchError(f"container={container!r} must be an image name (e.g. nvcr.io#nvidia/nemo:25.07) or null")
    mounts = data.get("container_mounts") or []
    if not isinstance(mounts, list) or not all(isinstance(m, str) and m.strip() and "," not in m for m in mounts):
        raise LaunchError(f"container_mounts={mounts!r} must be a list of 'src[:dst[:flags]]' strings without commas")
    env = data.get("env_vars") or {}
    if not isinstance(env, dict):
        raise LaunchError(f"env_vars={env!r} must be a mapping NAME: value")
    env_pairs = []
    for k, v in env.items():
        if not _ENV_RE.match(str(k)):
            raise LaunchError(f"env_vars.{k}: {k!r} is not a valid environment variable name")
        if v is None:
            continue
        if isinstance(v, (dict, list)):
            raise LaunchError(f"env_vars.{k}={v!r} must be a string or a number")
        env_pairs.append((str(k), ("1" if v else "0") if isinstance(v, bool) else str(v)))
    launcher = data.get("launcher") or {}
    if not isinstance(launcher, dict):
        raise LaunchError(f"launcher={launcher!r} must be a mapping (dry_run, python, memory_plan, nsys, nsys_args)")
    _unknown_keys(launcher, ("dry_run", "python", "memory_plan", "nsys", "nsys_args"), "launcher",
                  _launcher_file("config.yaml"))
    dry_run = launcher.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise LaunchError(f"launcher.dry_run={dry_run!r} must be true or false")
    python = launcher.get("python")
    if python is not None and (not isinstance(python, str) or not python.strip()):
        raise LaunchError(f"launcher.python={python!r} must be an interpreter path or name, or null")
    if python is None:
        # Without a container the job runs the interpreter that runs the launcher (a shared filesystem
        # with the same environment, the usual cluster setup); in a container, the image's python.
        python = "python" if container else sys.executable

    nsys = launcher.get("nsys", "nsys")
    if not isinstance(nsys, str) or not nsys.strip() or any(c.isspace() for c in nsys.strip()):
        raise LaunchError(f"launcher.nsys={nsys!r} must be the Nsight Systems command or its path on the compute "
                          "nodes, without spaces (e.g. nsys or /usr/local/cuda/bin/nsys)")
    nsys_args = launcher.get("nsys_args") or []
    if not isinstance(nsys_args, list) or not all(isinstance(a, str) and a.startswith("-") for a in nsys_args):
        raise LaunchError(f"launcher.nsys_args={nsys_args!r} must be a list of nsys profile options, e.g. "
                          "['--cuda-memory-usage=true', '--gpu-metrics-devices=all']")

    base_mount = f"{cfg.base_results_dir}:{cfg.base_results_dir}"
    if container and not any(m.split(":", 1)[0].rstrip("/") == cfg.base_results_dir for m in mounts):
        mounts = [*mounts, base_mount]

    plans = []
    for stage in stage_list:
        config_name = choices.get(stage, stage)
        where = _stage_file(stage, config_name)
        raw = data.get(stage)
        if not isinstance(raw, dict):
            raise LaunchError(f"stage {stage!r} has no config; select one with {stage}=<name> (files in "
                              f"{_launcher_file(stage)}/)")
        run = _run(raw.get("run"), stage, where)
        train = _train_config(raw, stage, where, run.results_dir, compose_train)
        model = _resolve_model(train, stage)
        _check_layout(run, train, model, stage, cluster_type)
        _check_profile(run, train, stage)
        memory = _check_memory(run, train, model, stage, config_name, launcher.get("memory_plan", True))
        plans.append(StagePlan(
            stage=stage, config_name=config_name, cluster_type=cluster_type, run=run, cluster=cluster,
            container=container.strip() if container else None, container_mounts=tuple(mounts),
            env_vars=tuple(env_pairs) + _recipe_env(train, {k for k, _ in env_pairs}), python=python,
            dry_run=dry_run, train=train, memory=memory, nsys=nsys.strip(), nsys_args=tuple(nsys_args),
        ))
    return plans


__all__ = [
    "CLUSTER_TYPES",
    "STAGES",
    "ClusterSettings",
    "LaunchError",
    "RunSettings",
    "StagePlan",
    "build_plans",
    "parse_time_limit",
]
