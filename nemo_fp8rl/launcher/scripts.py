"""The files a launch writes: the resolved training config, the sbatch script, the local script.

How a SLURM job runs (``render_sbatch_script``)::

    sbatch <job>_submission.sh
      batch shell (first node): exports MASTER_ADDR/MASTER_PORT and env_vars
        srun: nodes x ntasks_per_node tasks, one per GPU/rank (in the container when one is set)
          python -m nemo_fp8rl.train --config-path=<results_dir> --config-name=<job>_train_config
            rank, world size, local rank <- SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (no torchrun)
      after srun: finished -> exit 0; stopped early by a signal -> scontrol requeue; failed -> exit code

Preemption and requeue. ``--signal=USR1@<signal_time>`` makes SLURM send SIGUSR1 to every task that
many seconds before the time limit; a preemption notice or ``scancel --signal=USR1`` does the same.
The trainer finishes the current step, writes an atomic checkpoint and exits 0. A clean exit 0 would
end the job, so the batch shell decides after srun returns, from the run directory rather than from
signals it may never see (``scancel --signal`` and ``--signal`` without ``B:`` reach the tasks only):

- exit 0 and ``checkpoints/latest`` at ``trainer.max_steps``: training is complete, the job ends;
- exit 0 with fewer steps: the trainer stopped on a signal after a checkpoint -> ``scontrol requeue``;
- killed by SIGUSR1/SIGTERM (exit 138/143): the signal came before the trainer's handler was
  installed (start-up, warm-up) -> requeue as well; the next run starts from the latest checkpoint
  or from scratch;
- the batch shell itself got SIGTERM (``scancel``, time limit, preemption in CANCEL/REQUEUE mode):
  SLURM decides the job's fate; the shell only waits for the tasks' checkpoint;
- any other exit code is a failure: no requeue, the job fails with that code.

The requeued job keeps its id, runs the same script (``SLURM_RESTART_COUNT`` counts the restarts),
appends to the same log files (``--open-mode=append``) and the trainer, launched with
``resume=true``, continues from ``<results_dir>/checkpoints/latest``.
"""

from __future__ import annotations

import shlex

from nemo_fp8rl.launcher.plan import StagePlan

_GENERATED = "written by nemo-fp8rl-launch; change the launcher YAMLs and launch again instead of editing"


def render_train_config(plan: StagePlan) -> str:
    """``<job>_train_config.yaml``: the fully resolved training config as a Hydra primary config.

    It starts from the registered schema (``train_schema``), so ``nemo-fp8rl-train`` type-checks and
    validates it exactly as a config composed from ``conf/``; Hydra's own settings match the
    trainer's ``conf/config.yaml`` (the run directory is ``output_dir``, no ``.hydra/`` folder, console
    logging only).
    """
    from omegaconf import OmegaConf

    head = OmegaConf.create({
        # Hydra logs to the console only; the trainer writes <output_dir>/train.log itself
        "defaults": ["train_schema", {"override hydra/job_logging": "stdout"}, "_self_"],
        "hydra": {"output_subdir": None, "run": {"dir": str(plan.results_dir)}, "job": {"chdir": False}},
    })
    body = OmegaConf.to_yaml(OmegaConf.structured(plan.train))
    return (
        f"# Resolved training config of stage {plan.stage}/{plan.config_name} (job {plan.job_name}),\n"
        f"# {_GENERATED}.\n"
        f"# Run by: {shlex.join(train_command(plan))}\n"
        + OmegaConf.to_yaml(head) + body
    )


def sbatch_directives(plan: StagePlan) -> list[str]:
    """The ``#SBATCH`` lines, sorted. CPU stages (``run.gpus_per_node`` 0) get no ``--gpus-per-node``."""
    r, c = plan.run, plan.cluster
    opts = {
        "job-name": plan.job_name,
        "nodes": r.nodes,
        "ntasks-per-node": r.ntasks_per_node,
        "time": r.time_limit,
        "output": plan.log_path("out"),
        "error": plan.log_path("err"),
        "open-mode": "append",
        "signal": f"USR1@{r.signal_time}",
        "requeue": None,
    }
    if r.gpus_per_node:
        opts["gpus-per-node"] = r.gpus_per_node
    if c.partition:
        opts["partition"] = c.partition
    if c.account:
        opts["account"] = c.account
    if c.exclusive:
        opts["exclusive"] = None
    if c.mem is not None:
        opts["mem"] = c.mem
    if c.nodelist:
        opts["nodelist"] = c.nodelist
    if r.dependency:
        opts["dependency"] = r.dependency
    return sorted(f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={v}" for k, v in opts.items())


def train_command(plan: StagePlan) -> list[str]:
    """The training CLI on the resolved config: what every rank runs."""
    return [plan.python, "-u", "-m", "nemo_fp8rl.train", f"--config-path={plan.results_dir}",
            f"--config-name={plan.train_config_name}"]


def rank_command(plan: StagePlan) -> list[str]:
    """What srun (or torchrun) starts per rank: :func:`train_command`, through the Nsight Systems wrapper
    (:func:`render_nsys_wrapper`) when ``trainer.profile.kind=nsys``."""
    wrap = ["bash", str(plan.nsys_wrapper_path)] if plan.nsys_ranks else []
    return wrap + train_command(plan)


def nsys_profile_command(plan: StagePlan, output: str) -> list[str]:
    """``nsys profile`` with the options that record exactly the trainer's profiled steps.

    ``--capture-range=cudaProfilerApi --capture-range-end=stop``: recording starts at the trainer's
    ``cudaProfilerStart`` before ``trainer.profile.start_step`` and ends at its ``cudaProfilerStop`` after
    ``end_step`` (:mod:`nemo_fp8rl.trainer.profiling`); ``--trace=cuda,nvtx,osrt``: kernels and copies, the
    trainer's NVTX range per step phase, and OS runtime calls (host waits); ``--sample=none
    --cpuctxsw=none``: no CPU sampling, which costs host time in the steps measured. Then
    ``launcher.nsys_args``, and ``--output`` (nsys adds ``.nsys-rep``).
    """
    return [plan.nsys, "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
            "--trace=cuda,nvtx,osrt", "--sample=none", "--cpuctxsw=none", *plan.nsys_args, f"--output={output}"]


def render_nsys_wrapper(plan: StagePlan) -> str:
    """``<job>_nsys.sh``: runs its arguments (the training command), under ``nsys profile`` on the ranks of
    ``trainer.profile.ranks`` only, so the other ranks run unobserved and write no empty reports.

    The rank is torchrun's ``RANK`` when torchrun set ``RANK`` and ``WORLD_SIZE`` (local launches), else
    SLURM's ``SLURM_PROCID``: the order :func:`nemo_fp8rl.models.parallel.read_launch_env` reads them in.
    Each report is ``<results_dir>/profile/nsys_rank<R>_<start time>.nsys-rep``: a requeued or relaunched
    job writes new files next to the earlier ones, never over them.
    """
    q = shlex.quote
    prof = plan.train.trainer.profile
    profile_dir = plan.results_dir / "profile"
    output = f"{q(str(profile_dir))}/nsys_rank\"$r\"_\"$(date +%Y%m%dT%H%M%S)\""
    nsys = " ".join(q(t) for t in nsys_profile_command(plan, "")[:-1])
    ranks = " ".join(str(r) for r in plan.nsys_ranks)
    return "\n".join([
        "#!/bin/bash",
        f"# Nsight Systems around ranks {ranks} (trainer.profile.ranks) of job {plan.job_name}, steps "
        f"{prof.start_step}-{prof.end_step}",
        "# (the trainer calls cudaProfilerStart/Stop around them); every other rank runs the command as is.",
        f"# {_GENERATED}.",
        'if [ -n "${RANK:-}" ] && [ -n "${WORLD_SIZE:-}" ]; then r="$RANK"; else r="${SLURM_PROCID:-0}"; fi',
        f'case " {ranks} " in',
        '    *" $r "*)',
        f"        if ! command -v {q(plan.nsys)} >/dev/null; then",
        f'            echo "nemo-fp8rl: rank $r: launcher.nsys={plan.nsys} is not a command on $(hostname); set '
        f'launcher.nsys=<path of nsys> (e.g. /usr/local/cuda/bin/nsys) and launch again" >&2',
        "            exit 2",
        "        fi",
        f"        mkdir -p {q(str(profile_dir))}",
        f'        exec {nsys} --output={output} "$@"',
        "        ;;",
        "esac",
        'exec "$@"',
        "",
    ])


def srun_command(plan: StagePlan) -> list[str]:
    """One srun starting one task per rank (per GPU), in the container when one is set (pyxis)."""
    r = plan.run
    cmd = ["srun", "--kill-on-bad-exit=1", f"--nodes={r.nodes}", f"--ntasks-per-node={r.ntasks_per_node}"]
    if plan.container:
        cmd += [f"--container-image={plan.container}", f"--container-mounts={','.join(plan.container_mounts)}",
                "--no-container-mount-home"]
    for arg in plan.cluster.srun_args:
        cmd += shlex.split(arg)
    return cmd + rank_command(plan)


def _srun_lines(plan: StagePlan) -> str:
    """srun and its options a few to a line, the training command on the last line."""
    cmd, train = srun_command(plan), rank_command(plan)
    opts = cmd[: len(cmd) - len(train)]
    rows = [" ".join(shlex.quote(t) for t in opts[:4])]
    rows += [shlex.quote(t) for t in opts[4:]]
    rows.append(" ".join(shlex.quote(t) for t in train))
    return " \\\n    ".join(rows)


def _exports(plan: StagePlan) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in plan.env_vars]


def render_sbatch_script(plan: StagePlan) -> str:
    """``<job>_submission.sh``: sorted ``#SBATCH`` lines, exports, one srun, the requeue decision."""
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# SLURM job {plan.job_name}: stage {plan.stage}/{plan.config_name}, {plan.describe().split(': ', 1)[1]}.",
        f"# {_GENERATED}. Resubmit with: sbatch {q(str(plan.submission_script_path))}",
        *sbatch_directives(plan),
        "",
        "set -uo pipefail",
        "",
        "# Rank setup without torchrun: each srun task reads SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID",
        "# (nemo_fp8rl.models.parallel.read_launch_env); the first node of the job hosts the rendezvous.",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        *_exports(plan),
        "",
        f"OUTPUT_DIR={q(str(plan.results_dir))}",
        f"MAX_STEPS={int(plan.train.trainer.max_steps)}",
        'latest_step() {  # step of <output_dir>/checkpoints/latest ("step_<N>"), -1 without a checkpoint',
        '    local s',
        '    s=$(sed -n \'s/^step_\\([0-9][0-9]*\\)$/\\1/p\' "$OUTPUT_DIR/checkpoints/latest" 2>/dev/null | head -n 1)',
        '    echo "${s:--1}"',
        "}",
        "START_STEP=$(latest_step)",
        ('echo "nemo-fp8rl: job $SLURM_JOB_ID run $((${SLURM_RESTART_COUNT:-0} + 1)) on $SLURM_JOB_NODELIST,'
         ' latest checkpoint step $START_STEP, $(date -Is)"'),
        "",
        "# Signals that reach the tasks (--signal, scancel --signal, preemption) make the trainer finish its",
        "# step, checkpoint and exit 0. One sent to this shell alone (scancel --batch) is passed on to srun,",
        "# which forwards it to the tasks. SIGTERM to this shell means SLURM itself is ending the job.",
        'SRUN_PID=""',
        "SHELL_TERM=0",
        ("trap 'echo \"nemo-fp8rl: batch shell got SIGUSR1, passing it to the tasks\"; "
         "[ -n \"$SRUN_PID\" ] && kill -USR1 \"$SRUN_PID\" 2>/dev/null' USR1"),
        "trap 'SHELL_TERM=1; echo \"nemo-fp8rl: batch shell got SIGTERM, waiting for the tasks to checkpoint\"' TERM",
        "",
        _srun_lines(plan) + " &",
        "SRUN_PID=$!",
        '# wait returns early when a trapped signal arrives: keep waiting until srun itself has exited',
        'while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; done',
        'wait "$SRUN_PID"',
        "RC=$?",
        "STEP=$(latest_step)",
        "",
        'if [ "$RC" -eq 0 ] && [ "$STEP" -ge "$MAX_STEPS" ]; then',
        '    echo "nemo-fp8rl: training finished at step $STEP of $MAX_STEPS"',
        "    exit 0",
        "fi",
        'if [ "$SHELL_TERM" -eq 1 ]; then',
        '    echo "nemo-fp8rl: job ended by SLURM (cancel, time limit or preemption) at step $STEP; srun exit code $RC"',
        '    exit "$RC"',
        "fi",
        "requeue() {",
        '    echo "nemo-fp8rl: $1; requeueing job $SLURM_JOB_ID"',
        '    if scontrol requeue "$SLURM_JOB_ID"; then',
        "        exit 0",
        "    fi",
        f'    echo "nemo-fp8rl: scontrol requeue failed; resubmit with: sbatch {q(str(plan.submission_script_path))}" >&2',
        "    exit 1",
        "}",
        'if [ "$RC" -eq 0 ] && [ "$STEP" -gt "$START_STEP" ]; then',
        '    requeue "stopped by a signal after the checkpoint of step $STEP of $MAX_STEPS"',
        "fi",
        'if [ "$RC" -eq 138 ] || [ "$RC" -eq 143 ]; then',
        ('    requeue "the tasks were killed by SIGUSR1/SIGTERM (srun exit code $RC) before the trainer could'
         ' checkpoint (start-up or warm-up); the next run resumes from step $STEP (-1: from scratch)"'),
        "fi",
        'if [ "$RC" -eq 0 ]; then',
        '    echo "nemo-fp8rl: the trainer exited 0 at step $STEP of $MAX_STEPS without progress; not requeueing" >&2',
        "    exit 1",
        "fi",
        'echo "nemo-fp8rl: training failed with exit code $RC at step $STEP; not requeueing" >&2',
        'exit "$RC"',
        "",
    ]
    return "\n".join(lines)


def local_command(plan: StagePlan) -> list[str]:
    """torchrun (``python -m torch.distributed.run``) with every rank of the job on this machine."""
    run = [plan.python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={plan.world_size}"]
    if plan.nsys_ranks:  # each rank runs the wrapper, which runs python (or nsys, then python)
        return run + ["--no-python", *rank_command(plan)]
    # torchrun starts each rank as "<its own python> -u -m nemo_fp8rl.train <args>"
    return run + train_command(plan)[2:]


def render_local_script(plan: StagePlan) -> str:
    """``<job>_local.sh``: the same training command under torchrun, all ranks on this machine.

    torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and forwards SIGTERM/SIGINT to the
    ranks (checkpoint, exit); running the script again continues from the latest checkpoint.
    """
    cmd = local_command(plan)
    return "\n".join([
        "#!/bin/bash",
        (f"# Local run of stage {plan.stage}/{plan.config_name}: {plan.world_size} ranks under torchrun on this "
         f"machine (TP={plan.tp} x PP={plan.pp} x DP={plan.dp})."),
        f"# {_GENERATED}. Run again to continue from the latest checkpoint.",
        "set -euo pipefail",
        *_exports(plan),
        "exec " + " ".join(shlex.quote(t) for t in cmd),
        "",
    ])


__all__ = [
    "local_command",
    "nsys_profile_command",
    "rank_command",
    "render_local_script",
    "render_nsys_wrapper",
    "render_sbatch_script",
    "render_train_config",
    "sbatch_directives",
    "srun_command",
    "train_command",
]
