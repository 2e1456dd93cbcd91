"""``nemo-fp8rl-train`` under torchrun, recording what each rank's rollout engine generated.

Usage (under torchrun): ``_split_rollout_main.py <hydra overrides>`` with ``SPLIT_RECORD`` in the
environment: each rank writes ``SPLIT_RECORD.<rank>.json`` = {"engine_batches": [B of each engine call],
"gathered": [[hash of tokens, rows] of each batch the trainer got]}. Everything else is the real CLI.
"""

import atexit
import hashlib
import json
import os

import nemo_fp8rl.rollout.torch_engine as torch_engine
import nemo_fp8rl.trainer.rl_trainer as rl_trainer
from nemo_fp8rl.train import main

record = {"engine_batches": [], "gathered": []}
_generate = torch_engine.TorchRolloutEngine.generate
_engine_generate = rl_trainer.RLTrainer._engine_generate


def generate(self, prompts, params, generator):
    record["engine_batches"].append(len(prompts))
    return _generate(self, prompts, params, generator)


def engine_generate(self, prompts):
    batch = _engine_generate(self, prompts)
    digest = hashlib.sha256(batch.tokens.numpy().tobytes() + batch.rollout_logp.numpy().tobytes()).hexdigest()
    record["gathered"].append([digest, batch.batch_size])
    return batch


def _write():
    with open(f"{os.environ['SPLIT_RECORD']}.{os.environ['RANK']}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":  # not in the processes that multiprocessing spawns (they import this file too)
    torch_engine.TorchRolloutEngine.generate = generate
    rl_trainer.RLTrainer._engine_generate = engine_generate
    atexit.register(_write)
    main()
