from pathlib import Path

import pytest

from ._dist import run_gloo


@pytest.fixture(scope="session")
def gloo_results():
    """Per-rank results of ``_dist_cases.all_cases`` on a 2-process gloo group (started once)."""
    return run_gloo(Path(__file__).parent / "_dist_cases.py", "all_cases")
