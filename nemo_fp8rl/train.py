"""``nemo-fp8rl-train`` (= ``python -m nemo_fp8rl.train``): one RL run from Hydra config.

    nemo-fp8rl-train fp8=blockwise calibration=paper algorithm=dapo trainer.max_steps=50 output_dir=runs/x
    nemo-fp8rl-train -m fp8=tensorwise,blockwise seed=1,2,3        # Hydra multirun sweep

Config groups and every key: ``conf/`` and ``nemo_fp8rl/config/schema.py``. Distributed runs start one
process per rank (torchrun or SLURM srun); rank setup comes from their environment variables.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
logger = logging.getLogger("nemo_fp8rl")


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    from nemo_fp8rl.config.schema import TrainConfig

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_train_config(dict_cfg):
    """OmegaConf DictConfig (from Hydra) -> validated :class:`TrainConfig`."""
    from omegaconf import OmegaConf

    from nemo_fp8rl.config.schema import validate

    return validate(OmegaConf.to_object(dict_cfg))


def write_resolved_config(cfg, output_dir: str) -> None:
    from omegaconf import OmegaConf

    from nemo_fp8rl.trainer.checkpoint import atomic_write_bytes

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(output_dir) / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)).encode())


def run(cfg) -> dict:
    """Warm-up (cached) then RL; returns the last step's metrics. ``cfg``: a validated TrainConfig."""
    import torch.distributed as dist

    import torch

    from nemo_fp8rl.trainer import RLTrainer, run_warmup

    if cfg.trainer.cpu_threads and not torch.cuda.is_available():
        torch.set_num_threads(cfg.trainer.cpu_threads)
    trainer = RLTrainer(cfg)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        write_resolved_config(cfg, cfg.output_dir)
    resuming = cfg.resume and trainer.ckpt.latest_step() is not None
    warm = None if resuming else run_warmup(cfg, trainer.model_cfg, trainer.task)
    trainer.setup(warm_start=warm)
    return trainer.fit()


def _main_hydra() -> None:
    import hydra
    from omegaconf import DictConfig

    register_schema()

    @hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
    def _app(dict_cfg: DictConfig) -> None:
        from nemo_fp8rl.config.schema import ConfigError

        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and not any(o.startswith("output_dir=") for o in hc.overrides.task):
            dict_cfg.output_dir = hc.runtime.output_dir  # one run directory per sweep job
        try:
            cfg = to_train_config(dict_cfg)
        except ConfigError as e:
            print(f"nemo-fp8rl-train: invalid config: {e}", file=sys.stderr)
            sys.exit(2)
        run(cfg)

    _app()


def main() -> None:
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _main_hydra()


if __name__ == "__main__":
    main()
