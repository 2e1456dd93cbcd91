"""Single-process tests build actors in the pytest process (torch.distributed world of size 1, gloo);
tear that down after each module so other test folders start clean."""

import warnings

import pytest


@pytest.fixture(autouse=True, scope="module")
def _clean_distributed():
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    yield
    from nemo_fp8rl.models import destroy_distributed

    destroy_distributed()
