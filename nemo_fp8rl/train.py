"""``nemo-fp8rl-train`` (= ``python -m nemo_fp8rl.train``): one RL run from Hydra config.

    nemo-fp8rl-train fp8=blockwise calibration=paper algorithm=dapo trainer.max_steps=50 output_dir=runs/x
    nemo-fp8rl-train -m fp8=tensorwise,blockwise seed=1,2,3        # Hydra multirun sweep

Config groups and every key: ``nemo_fp8rl/conf/`` (``conf/`` in a checkout) and
``nemo_fp8rl/config/schema.py``. Distributed runs start one process per rank (torchrun or SLURM srun);
rank setup comes from their environment variables.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from nemo_fp8rl.resources import conf_dir

CONF_DIR = str(conf_dir())
logger = logging.getLogger("nemo_fp8rl")


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    from nemo_fp8rl.config.schema import TrainConfig

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_train_config(dict_cfg):
    """OmegaConf DictConfig (from Hydra) -> validated :class:`TrainConfig`."""
    from omegaconf import OmegaConf

    from nemo_fp8rl.models.hf_config import resolve_model_config
    from nemo_fp8rl.validation import validate

    cfg = OmegaConf.to_object(dict_cfg)
    # model.hf_path fills the shape from config.json before validation checks the parallel layout
    cfg.model = resolve_model_config(cfg.model)
    return validate(cfg)


def write_resolved_config(cfg, output_dir: str) -> None:
    from omegaconf import OmegaConf

    from nemo_fp8rl.trainer.atomic_publish import atomic_write_bytes

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(output_dir) / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)).encode())


def prepare(cfg):
    """Build the trainer, warm up (cached), restore or initialise weights, then write config.yaml.

    Everything here runs before the first RL step; what fails here is configuration or input.
    config.yaml is written only after the run directory was accepted (never over another run's).
    """
    import torch
    import torch.distributed as dist

    from nemo_fp8rl.trainer import RLTrainer, run_warmup

    if cfg.trainer.cpu_threads and not torch.cuda.is_available():
        torch.set_num_threads(cfg.trainer.cpu_threads)
    trainer = RLTrainer(cfg)
    try:
        # One decision for all ranks (rank 0 looks, everyone follows) before anything is written.
        resuming = trainer.decide_start() is not None
        warm = None if resuming else run_warmup(cfg, trainer.model_cfg, trainer.task)
        trainer.setup(warm_start=warm)
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            write_resolved_config(cfg, cfg.output_dir)
    except BaseException:
        trainer.close()  # the engine, reward workers and signal handlers of a run that never started
        raise
    return trainer


def run(cfg) -> dict:
    """Warm-up (cached) then RL; returns the last step's metrics. ``cfg``: a validated TrainConfig."""
    return prepare(cfg).fit()


def run_cli(cfg) -> int:
    """:func:`run` with user errors turned into one message and an exit code (no traceback).

    2: the configuration, checkpoint or input data cannot work (nothing was trained);
    3: training stopped itself (repeated non-finite updates; a checkpoint of the last good state exists);
    1: a checkpoint could not be written (disk full, permissions).
    """
    from nemo_fp8rl.config.schema import ConfigError
    from nemo_fp8rl.trainer import CheckpointError, StopTraining

    try:
        trainer = prepare(cfg)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"nemo-fp8rl-train: cannot start: {e}", file=sys.stderr)
        return 2
    try:
        trainer.fit()
    except StopTraining as e:
        print(f"nemo-fp8rl-train: stopped: {e}", file=sys.stderr)
        return 3
    except CheckpointError as e:
        print(f"nemo-fp8rl-train: checkpoint failed: {e}", file=sys.stderr)
        return 1
    return 0


def _main_hydra() -> None:
    import hydra
    from omegaconf import DictConfig

    register_schema()

    @hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
    def _app(dict_cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from nemo_fp8rl.config.schema import ConfigError

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and not any(o.startswith("output_dir=") for o in hc.overrides.task):
            dict_cfg.output_dir = hc.runtime.output_dir  # one run directory per sweep job
        try:
            cfg = to_train_config(dict_cfg)
        except ConfigError as e:
            print(f"nemo-fp8rl-train: invalid config: {e}", file=sys.stderr)
            sys.exit(2)
        rc = run_cli(cfg)
        if rc:  # a multirun keeps going after a successful job: exit only on failure
            sys.exit(rc)

    _app()


def main() -> None:
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _main_hydra()


if __name__ == "__main__":
    main()
