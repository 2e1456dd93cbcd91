"""``nemo-fp8rl-train`` under torchrun, recording what each rank's vLLM engine generated.

Usage (under torchrun): ``_vllm_tp_main.py <hydra overrides>`` with ``VLLM_TP_RECORD`` in the environment:
each rank writes ``VLLM_TP_RECORD.<rank>.json`` = {"engine_batches": [B of each engine call],
"tp_group_ranks": [vLLM's group of this rank's engine], "gathered": [[hash of tokens and log-probs, rows]
of each batch the trainer got]}. Everything else is the real CLI.
"""

import atexit
import hashlib
import json
import os

from nemo_fp8rl.rollout import vllm_engine
from nemo_fp8rl.train import main
from nemo_fp8rl.trainer import rl_trainer

record = {"engine_batches": [], "tp_group_ranks": None, "gathered": []}
_generate = vllm_engine.VllmEngine.generate
_engine_generate = rl_trainer.RLTrainer._engine_generate


def generate(self, prompts, params, generator):
    record["engine_batches"].append(len(prompts))
    record["tp_group_ranks"] = list(self.tp_group_ranks)
    return _generate(self, prompts, params, generator)


def engine_generate(self, prompts):
    batch = _engine_generate(self, prompts)
    digest = hashlib.sha256(batch.tokens.numpy().tobytes() + batch.rollout_logp.numpy().tobytes()).hexdigest()
    record["gathered"].append([digest, batch.batch_size])
    return batch


def _write():
    with open(f"{os.environ['VLLM_TP_RECORD']}.{os.environ['RANK']}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":  # not in the processes that multiprocessing spawns (they import this file too)
    vllm_engine.VllmEngine.generate = generate
    rl_trainer.RLTrainer._engine_generate = engine_generate
    atexit.register(_write)
    main()
