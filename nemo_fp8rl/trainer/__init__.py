"""The RL loop, its checkpoints, metrics logging and supervised warm-up."""

from nemo_fp8rl.trainer.checkpoint import CheckpointError, CheckpointManager
from nemo_fp8rl.trainer.logger import MetricsLogger, read_metrics
from nemo_fp8rl.trainer.rl_trainer import RLTrainer, StopTraining, model_fingerprint
from nemo_fp8rl.trainer.warmup import run_warmup

__all__ = ["CheckpointError", "CheckpointManager", "MetricsLogger", "RLTrainer", "StopTraining",
           "model_fingerprint", "read_metrics", "run_warmup"]
