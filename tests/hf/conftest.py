"""Shared fixtures: tiny random checkpoints of each architecture (built once per session) and a
clean torch.distributed world after each module (single-process tests build actors in-process)."""

import warnings

import pytest

from ._fixtures import ARCHS, make_checkpoint, make_tokenizer


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_ckpts")
    return {arch: make_checkpoint(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tok") / "tok"
    make_tokenizer(d)
    return d


@pytest.fixture(autouse=True, scope="module")
def _clean_distributed():
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    yield
    from nemo_fp8rl.models import destroy_distributed

    destroy_distributed()
