"""Pure-torch RL math for nemo_fp8rl: policy losses, advantages, rollout correction, Calibrated Clipping.

Imports only torch and the standard library, so any framework can use it and it runs on CPU.
"""

from nemo_fp8rl.algorithms.metrics import REDUCTIONS, Metric, make_metric, metrics_to_floats, reduce_metrics

__all__ = ["Metric", "REDUCTIONS", "make_metric", "metrics_to_floats", "reduce_metrics"]
