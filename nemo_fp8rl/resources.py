"""Where the files the CLIs read live: inside the installed package (a wheel needs no checkout).

``conf/`` (the trainer's Hydra configs) is ``nemo_fp8rl/conf``, the launcher's YAMLs are
``nemo_fp8rl/launcher/conf``; in a checkout the top-level ``conf`` and ``launchers/conf`` are links to
them, so the paths the docs use still work there. Every module asks this one place, and every message
that names one of these files names it with :func:`shown_path` (a path a wheel user can open too).
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


def shown_path(path: Path) -> str:
    """How a user-facing message names a file or directory the package ships (``path`` under the package
    directory; it need not exist, e.g. the stage YAML a user asked for and that is missing).

    In a checkout: the path from the checkout's top, ``nemo_fp8rl/launcher/conf/rl/x.yaml`` (the top-level
    ``launchers/conf`` link leads to the same file). For a wheel install there is no checkout to be
    relative to, so the absolute location follows:
    ``nemo_fp8rl/launcher/conf/rl/x.yaml (in the installed package: /.../site-packages/nemo_fp8rl/...)``.
    """
    path = Path(path)
    try:
        rel = path.relative_to(PACKAGE_DIR)
    except ValueError:
        raise ValueError(f"shown_path: {path} is not inside the package directory {PACKAGE_DIR}") from None
    name = "/".join(("nemo_fp8rl", *rel.parts))
    return name if checkout_dir() is not None else f"{name} (in the installed package: {path})"
