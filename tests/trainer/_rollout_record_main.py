"""``nemo-fp8rl-train`` under torchrun, recording what each rank's rollout engine generated.

Usage (under torchrun): ``_rollout_record_main.py <hydra overrides>`` with ``ROLLOUT_RECORD`` (a path
prefix) and ``ROLLOUT_RECORD_ENGINE`` (``torch`` or ``vllm``: the engine class to watch) in the
environment. Each rank writes ``ROLLOUT_RECORD.<rank>.json`` = {"engine_batches": [B of each engine
call], "tp_group_ranks": [vLLM's group of this rank's engine, or null], "gathered": [[hash of tokens and
log-probs, rows] of each batch the trainer got]}. Everything else is the real CLI.
"""

import atexit
import hashlib
import importlib
import json
import os

from nemo_fp8rl.train import main
from nemo_fp8rl.trainer import rl_trainer

ENGINES = {"torch": ("nemo_fp8rl.rollout.torch_engine", "TorchRolloutEngine"),
           "vllm": ("nemo_fp8rl.rollout.vllm_engine", "VllmEngine")}
record = {"engine_batches": [], "tp_group_ranks": None, "gathered": []}


def _watch(engine_cls):
    original = engine_cls.generate

    def generate(self, prompts, params, generator):
        record["engine_batches"].append(len(prompts))
        if hasattr(self, "tp_group_ranks"):
            record["tp_group_ranks"] = list(self.tp_group_ranks)
        return original(self, prompts, params, generator)

    engine_cls.generate = generate


def _watch_trainer():
    original = rl_trainer.RLTrainer._engine_generate

    def engine_generate(self, prompts):
        batch = original(self, prompts)
        digest = hashlib.sha256(batch.tokens.numpy().tobytes() + batch.rollout_logp.numpy().tobytes()).hexdigest()
        record["gathered"].append([digest, batch.batch_size])
        return batch

    rl_trainer.RLTrainer._engine_generate = engine_generate


def _write():
    with open(f"{os.environ['ROLLOUT_RECORD']}.{os.environ['RANK']}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":  # not in the processes that multiprocessing spawns (they import this file too)
    module, name = ENGINES[os.environ.get("ROLLOUT_RECORD_ENGINE", "torch")]
    _watch(getattr(importlib.import_module(module), name))
    _watch_trainer()
    atexit.register(_write)
    main()
