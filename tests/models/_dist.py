"""2-process gloo runs of this folder's ``_scenarios.py`` (see ``tests/_dist.py``)."""

import functools
from pathlib import Path

from tests._dist import run_ranks as _run_ranks

run_ranks = functools.partial(_run_ranks, Path(__file__).resolve().parent / "_scenarios.py")
