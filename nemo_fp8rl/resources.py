"""Where the files the CLIs read live: inside the installed package (a wheel needs no checkout).

``conf/`` (the trainer's Hydra configs) is ``nemo_fp8rl/conf``, the launcher's YAMLs are
``nemo_fp8rl/launcher/conf``; in a checkout the top-level ``conf`` and ``launchers/conf`` are links to
them, so the paths the docs use still work there. Every module asks this one place.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def conf_dir() -> Path:
    """The trainer's Hydra config directory (``config.yaml`` + groups algorithm/, fp8/, model/, ...)."""
    return PACKAGE_DIR / "conf"


def launcher_conf_dir() -> Path:
    """The launcher's Hydra config directory (``config.yaml``, ``cluster/``, ``rl/``)."""
    return PACKAGE_DIR / "launcher" / "conf"


def checkout_dir() -> Path | None:
    """The source checkout this package runs from (editable install), or None for a wheel install."""
    top = PACKAGE_DIR.parent
    return top if (top / "pyproject.toml").is_file() and (top / "nemo_fp8rl").is_dir() else None


def default_launcher_scripts_dir() -> Path:
    """Default ``launcher_scripts_path`` (results land in its ``results/``): ``launchers/`` in a checkout,
    the current directory for a wheel install (never the read-only package directory)."""
    top = checkout_dir()
    return top / "launchers" if top is not None else Path.cwd()
