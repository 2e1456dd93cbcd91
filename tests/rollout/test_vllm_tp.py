"""``rollout.tensor_parallel_size=2`` with the vllm engine: two gloo ranks under torchrun, real vLLM on CPU.

One torchrun launch for the module (``_vllm_tp_main.py``: a T=2 engine, then a T=1 engine per rank, the
torch engine, the build refusals; ~1-2 min on 2 shared cores); the tests read what each rank recorded.
Tensor parallelism changes only the summation order of the sharded matmuls (row-parallel partial sums
all-reduced): float32 log-probs of the T=2 engine differ from the T=1 engine's by ~2e-6 (measured here:
at most 2.6e-6 over 9 prompts x 12 tokens, greedy and sampled), so ``LOGP_TOL = 2e-5`` leaves ~8x.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_fp8rl.rollout.vllm_spmd import rollout_share_layout
from nemo_fp8rl.rollout.vllm_support import check_vllm_supported, vllm_available

HERE = Path(__file__).resolve().parent
LOGP_TOL = 2e-5


def test_share_layout_follows_vllms_consecutive_groups():
    """Megatron's default order puts TP innermost: replicas (model-parallel groups) of TP=2 x PP=2 x DP=2."""
    mp = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}  # dp rank -> its replica's global ranks (group order)
    replicas = [mp[(r // 2) % 2] for r in range(8)]
    got = [rollout_share_layout(replicas, r, 2) for r in range(8)]
    # vLLM groups {0,1} {2,3} {4,5} {6,7}: each inside one replica, two engines (shares) per replica
    assert got == [(0, 2, True), (0, 2, False), (0, 2, True), (0, 2, False),
                   (1, 2, True), (1, 2, False), (1, 2, True), (1, 2, False)]
    assert [rollout_share_layout(replicas, r, 1) for r in (0, 5, 6)] == [(0, 4, True), (3, 4, True), (2, 4, True)]
    # T=4 would group ranks 0-3: two replicas
    with pytest.raises(ValueError, match=r"consecutive ranks \[0, 1, 2, 3\].*different data-parallel replicas"):
        rollout_share_layout(replicas, 0, 4)
    # one replica (DP=1): T=4 spans both pipeline stages of it, fine
    assert rollout_share_layout([[0, 1, 2, 3]] * 4, 3, 4) == (0, 1, False)
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=4 must divide.*= 2"):
        rollout_share_layout([[0, 1], [0, 1], [2, 3], [2, 3]], 0, 4)


def test_config_validation_of_the_rollout_tp_size():
    from nemo_fp8rl.config.schema import ConfigError, TrainConfig
    from nemo_fp8rl.validation import validate

    cfg = TrainConfig()
    cfg.rollout.engine, cfg.rollout.tensor_parallel_size = "vllm", 2
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2 must divide.*parallel.tensor_model_parallel_size"):
        validate(cfg)
    cfg.parallel.tensor_model_parallel_size = 2
    validate(cfg)
    cfg.rollout.engine = "torch"
    with pytest.raises(ConfigError, match="applies to rollout.engine=vllm"):
        validate(cfg)
    with pytest.raises(ValueError, match="does not divide the 3 processes"):
        check_vllm_supported(tensor_parallel_size=2, installed=False, world_size=3)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        check_vllm_supported(tensor_parallel_size=0, installed=False)


def test_block_fp8_needs_whole_blocks_per_tp_shard():
    from nemo_fp8rl.config.model import ModelConfig

    m = ModelConfig(vocab_size=64, num_layers=1, hidden_size=256, num_attention_heads=2, num_query_groups=2,
                    kv_channels=128, ffn_hidden_size=512)
    check_vllm_supported(fp8_scheme="vllm_block", tensor_parallel_size=2, installed=False, model_cfg=m)
    with pytest.raises(ValueError, match=r"per tensor-parallel shard.*gate_proj/up_proj.*rollout.tensor_parallel_size=8"):
        check_vllm_supported(fp8_scheme="vllm_block", tensor_parallel_size=8, installed=False,
                             model_cfg=ModelConfig(vocab_size=64, num_layers=1, hidden_size=1024, num_attention_heads=8,
                                                   num_query_groups=8, ffn_hidden_size=512))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not vllm_available():
        pytest.skip("vLLM is not installed (pip install nemo-fp8rl[vllm])")
    tmp = tmp_path_factory.mktemp("vllm_tp")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--log-dir",
           str(tmp / "logs"), "--redirects", "3", str(HERE / "_vllm_tp_main.py"), str(tmp / "rec")]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env)
    errs = "\n".join(p.read_text() for p in sorted((tmp / "logs").glob("*/attempt_0/*/stderr.log")))
    assert proc.returncode == 0, errs[-8000:]
    return [torch.load(tmp / f"rec.{r}.pt", weights_only=False) for r in (0, 1)]


def _same(a, b) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.rollout_logp, b.rollout_logp) and \
        torch.equal(a.response_lens, b.response_lens)


def test_vllm_groups_the_two_ranks_and_both_return_the_same_batches(ranks):
    assert [r["tp_group_ranks"] for r in ranks] == [[0, 1], [0, 1]]
    for k in ("greedy_a", "sampled_a", "greedy_b", "greedy_a_again"):
        ranks[0]["tp2"][k].validate()
        assert _same(ranks[0]["tp2"][k], ranks[1]["tp2"][k]), k


def test_tp2_generates_what_a_whole_model_engine_generates(ranks):
    for r in ranks:
        for k in ("greedy_a", "sampled_a", "greedy_b"):
            a, b = r["tp2"][k], r["tp1"][k]
            assert torch.equal(a.tokens, b.tokens), k  # same seeds, logits equal to float noise
            d = float((a.rollout_logp - b.rollout_logp).abs().max())
            assert d < LOGP_TOL, (k, d)
            assert float(a.rollout_logp.sum()) < -1.0


def test_tp2_logprobs_match_the_torch_reference(ranks):
    r = ranks[0]
    for k in ("greedy_a", "sampled_a"):
        d = float((r["tp2"][k].rollout_logp - r[f"torch_logp_{k}"]).abs().max())
        assert d < 1e-4, (k, d)  # the bound of test_vllm_engine.py (T=1 vs torch)


def test_weight_sync_reaches_every_shard(ranks):
    t = ranks[0]["tp2"]
    assert not torch.equal(t["greedy_a"].tokens, t["greedy_b"].tokens)  # new weights, new tokens
    assert _same(t["greedy_a"], t["greedy_a_again"])  # syncing the old weights back restores them


def test_ranks_of_a_group_must_pass_the_same_requests(ranks):
    for r in ranks:  # rank-dependent prompts: refused on both ranks before vLLM runs (no deadlock)
        assert r["mixed_prompts_error"] is not None and "same batch together" in r["mixed_prompts_error"]


def test_closing_the_engine_keeps_the_trainers_process_group(ranks):
    assert all(r["process_group_kept"] for r in ranks)


def test_build_rendezvous_refuses_mismatched_or_missing_ranks(ranks):
    for r in ranks:
        e = r["differing_settings_error"]
        assert e is not None and "other than rank 0's" in e and "max_num_seqs=64" in e, e
    e = ranks[0]["missing_rank_error"]
    assert e is not None and "rank(s) [1] did not start building" in e, e


def test_timings_are_real_durations_within_the_launch(ranks):
    """Not a speed test: the build, sync and generate seconds each rank measured (pytest -s prints rank 0's)
    are positive and finite, and, being disjoint intervals of one process, add up to less than the
    launch, which ran within the fixture's 600 s subprocess timeout. The T=2 vs T=1 log-prob gaps these
    runs also give are bounded in test_tp2_generates_what_a_whole_model_engine_generates."""
    for rank, r in enumerate(ranks):
        spans = {"build_tp2_s": r["build_tp2_s"], "build_tp1_s": r["build_tp1_s"]}
        spans.update({f"{tp}.{k}": r[tp][k] for tp in ("tp2", "tp1") for k in ("sync_s", "gen_s", "gen2_s")})
        assert all(0.0 < v < float("inf") for v in spans.values()), (rank, spans)
        assert sum(spans.values()) < 600.0, (rank, spans)
    r = ranks[0]
    print(f"\nbuild T=2 {r['build_tp2_s']:.1f}s T=1 {r['build_tp1_s']:.1f}s; sync T=2 {r['tp2']['sync_s']:.2f}s "
          f"T=1 {r['tp1']['sync_s']:.2f}s; generate 9x12 greedy, first call T=2 {r['tp2']['gen_s']:.2f}s "
          f"T=1 {r['tp1']['gen_s']:.2f}s, later call T=2 {r['tp2']['gen2_s']:.2f}s T=1 {r['tp1']['gen2_s']:.2f}s")
