"""Driven by test_async_checkpoint.py's kill -9 test: publishes an asynchronous checkpoint of step 1,
then starts one of step 2 whose writer process records its pid and sleeps before writing, prints
``scheduled <pid of megatron's results-queue manager>``, and keeps "training" until it is killed."""

import os
import sys
import time

import torch


def main(out: str) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.trainer.checkpoint import CheckpointManager

    actor = build_actor(ModelConfig(**TINY), ParallelConfig(micro_batch_size=3), seed=0, lr=1e-3, weight_decay=0.0,
                        fp8_recipe=None, device="cpu", keep_reference=False)
    mgr = CheckpointManager(out, async_save=True)
    sharded, local = actor.sharded_checkpoint_state()
    mgr.save(1, {"actor_local": local}, {"k": 1}, sharded=sharded)
    mgr.wait()

    real = filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc

    def slow_writer(*args, **kwargs):  # runs in the forked async writer
        with open(os.path.join(out, "writer.pid"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
        real(*args, **kwargs)

    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(slow_writer)
    sharded, local = actor.sharded_checkpoint_state()
    mgr.save(2, {"actor_local": local}, {"k": 1}, sharded=sharded)
    from nemo_fp8rl.trainer import dist_checkpoint

    print("scheduled", dist_checkpoint._manager._process.pid, flush=True)  # and megatron's results-queue server
    while True:  # training goes on while the writer writes
        with torch.no_grad():
            for p in actor.model.parameters():
                p.add_(1e-3)
        time.sleep(0.05)


TINY = {"vocab_size": 19, "make_vocab_size_divisible_by": 4, "num_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "ffn_hidden_size": 96, "seq_length": 32}

if __name__ == "__main__":  # megatron's writer spawns its results-queue manager: the guard is needed
    main(sys.argv[1])
