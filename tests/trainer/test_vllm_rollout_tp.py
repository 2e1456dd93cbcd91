"""The trainer with ``rollout.engine=vllm rollout.tensor_parallel_size=2`` at TP=2 (torchrun, 2 gloo ranks, CPU).

The replica's two model-parallel ranks form one vLLM tensor-parallel engine (verl's SPMD mode): both
ranks stream the full weights into their half of it, generate the replica's whole batch together with
the same share generator, and train on that batch. One launch (~1.5 min on 2 shared cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_fp8rl.rollout.vllm_support import vllm_available

from ._cli import TINY, metrics

HERE = Path(__file__).resolve().parent
ARGS = [*TINY, "warmup.steps=0", "fp8=off", "calibration=off", "seed=5", "parallel.tensor_model_parallel_size=2",
        "rollout.engine=vllm", "rollout.tensor_parallel_size=2", "rollout.sync_bucket_mb=0.1",
        "trainer.max_steps=2", "algorithm.dynamic_sampling=false"]


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install nemo-fp8rl[vllm])")
def test_two_tp_ranks_generate_together_with_one_vllm_tp2_engine(tmp_path):
    out, rec = tmp_path / "run", tmp_path / "record"
    env = dict(os.environ, ROLLOUT_RECORD=str(rec), ROLLOUT_RECORD_ENGINE="vllm", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--log-dir",
           str(tmp_path / "logs"), "--redirects", "3", str(HERE / "_rollout_record_main.py"), *ARGS, f"output_dir={out}"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env)
    errs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*/attempt_0/*/stderr.log")))
    assert proc.returncode == 0, errs[-8000:]
    recs = [json.loads(Path(f"{rec}.{r}.json").read_text()) for r in (0, 1)]

    B = 4 * 4  # prompts_per_step x group_size, one data-parallel replica
    for r in recs:
        assert r["tp_group_ranks"] == [0, 1]  # one vLLM engine over both trainer ranks
        assert r["engine_batches"] == [B, B]  # it generated the replica's whole batch at each of the 2 steps
        assert [rows for _, rows in r["gathered"]] == [B, B]
    assert recs[0]["gathered"] == recs[1]["gathered"]  # both ranks trained on the same rollout batch
    assert recs[0]["gathered"][0][0] != recs[0]["gathered"][1][0]

    m = metrics(out)
    assert [r["step"] for r in m] == [0, 1]
    for r in m:
        # FP8 off: vLLM's (TP=2) log-probs of its samples are the trainer's (TP=2) up to float noise
        assert r["mismatch/logp_abs_diff_max"] < 1e-4, r["mismatch/logp_abs_diff_max"]
        assert r["rollout/response_len"] > 0
        assert 0 < r["timing/weight_sync"] < r["timing/rollout"]
