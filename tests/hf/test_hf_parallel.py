"""The checkpoint loader/exporter under tensor and pipeline parallelism (2 gloo processes each).

For TP=2 and PP=2, one launch loads all three architectures: the logits on every rank equal
``transformers``' (float32 tolerance); after one training step the exported directory (written by
rank 0 from TP-gathered / PP-broadcast weights) loads in ``transformers`` and reproduces our post-step
logits. The TP=2 layout pads the vocabulary differently from TP=1 (301 -> 320 rows, 307 -> 320).
"""

import pytest
import torch

from ._dist import run_ranks
from ._fixtures import ARCHS, hf_logits, hf_model, make_tokens

LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2, "micro_batch_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2, "micro_batch_size": 1},  # 3 microbatches through 1F1B
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_transformers(checkpoints, tmp_path, layout):
    refs = {a: hf_model(checkpoints[a]) for a in ARCHS}
    tokens = {a: make_tokens(refs[a].config.vocab_size, seed=5) for a in ARCHS}
    ranks = run_ranks("run_policies", {a: str(checkpoints[a]) for a in ARCHS}, LAYOUTS[layout], tokens,
                      str(tmp_path))
    for arch in ARCHS:
        ref = hf_logits(refs[arch], tokens[arch])
        for rank, res in enumerate(ranks):
            r = res[arch]
            assert r["layout"] == ((2, 1, 1) if layout == "tp2" else (1, 2, 1))
            torch.testing.assert_close(r["logits0"], ref, atol=1e-5, rtol=1e-5, msg=f"{arch} rank {rank}")
            torch.testing.assert_close(r["logits1"], ranks[0][arch]["logits1"], atol=0, rtol=0)
        after = hf_logits(tmp_path / arch, tokens[arch])
        torch.testing.assert_close(after, ranks[0][arch]["logits1"], atol=1e-5, rtol=1e-5)
        assert (after - ref).abs().max() > 1e-2
