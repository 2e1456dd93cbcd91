"""Packages whose public names load on first use (PEP 562), so importing the package stays cheap.

``__getattr__, __dir__ = lazy_exports(__name__, {"Name": "submodule", ...})`` in a package's
``__init__``: ``package.Name`` imports ``package.submodule`` the first time it is asked for.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` serving ``exports``
    (public name -> the submodule of ``package`` that defines it)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
