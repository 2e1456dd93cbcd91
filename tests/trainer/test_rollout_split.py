"""``rollout.split_prompts``: the model-parallel ranks of a replica share its rollout (torchrun, TP=2).

Each rank generates half of the replica's sequences with its own engine; the halves are gathered so both
ranks train on one batch, and the run is deterministic (same seed, same metrics). The engine here is the
torch engine with the split forced on (it is the vllm engine's default; the torch engine keeps it off by
default so CPU runs at TP/PP keep TP=1's rollouts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ._cli import TINY, metrics, strip_timing

HERE = Path(__file__).resolve().parent
ARGS = [*TINY, "warmup.steps=0", "fp8=off", "calibration=off", "seed=5", "parallel.tensor_model_parallel_size=2",
        "trainer.max_steps=2", "algorithm.dynamic_sampling=false"]


def _launch(tmp: Path, name: str, *overrides: str) -> tuple[Path, list[dict]]:
    out, rec = tmp / name, tmp / f"{name}_record"
    env = dict(os.environ, ROLLOUT_RECORD=str(rec), ROLLOUT_RECORD_ENGINE="torch", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--log-dir", str(tmp / f"{name}_logs"), "--redirects", "3", str(HERE / "_rollout_record_main.py"), *ARGS,
           f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    errs = "\n".join(p.read_text() for p in sorted((tmp / f"{name}_logs").glob("*/attempt_0/*/stderr.log")))
    assert proc.returncode == 0, errs[-6000:]
    return out, [json.loads(Path(f"{rec}.{r}.json").read_text()) for r in (0, 1)]


def test_tp_ranks_split_the_rollout_and_train_on_the_same_batch(tmp_path):
    B = 4 * 4  # prompts_per_step x group_size, one data-parallel replica
    out, recs = _launch(tmp_path, "split", "rollout.split_prompts=true")
    for r in recs:
        assert r["engine_batches"] == [B // 2, B // 2]  # each rank generated half, at each of the 2 steps
        assert [rows for _, rows in r["gathered"]] == [B, B]
    assert recs[0]["gathered"] == recs[1]["gathered"]  # both TP ranks got the same gathered batch
    assert recs[0]["gathered"][0][0] != recs[0]["gathered"][1][0]

    again, recs2 = _launch(tmp_path, "split_again", "rollout.split_prompts=true")
    assert recs2[0]["gathered"] == recs[0]["gathered"]
    assert strip_timing(metrics(again)) == strip_timing(metrics(out))
