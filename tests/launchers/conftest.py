import pytest


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """One warm-up cache for every run of the launcher tests (the tiny warm-up is computed once)."""
    return tmp_path_factory.mktemp("warmup_cache")
