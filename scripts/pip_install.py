"""``pip install ARGS`` into this interpreter's environment, done by uv where it can, else by pip.

Run it with the virtual environment's Python: ``.venv/bin/python scripts/pip_install.py -e ".[test]"``. The
Makefile installs through it (``make demo``, ``make test``).

Why: ``make test`` starts on a clean machine, and the test extras are ~200 packages, inside CI's 20-minute
budget. ``make install-test`` into a fresh venv took 174 s with pip and 89 s with uv, bytecode compilation
included in both, ``pip freeze`` equal but for uv (2026-12-07, a 2-core AVX2-only EPYC with nothing else
running).

The same packages as pip would pick, from the same places: uv does not read pip's configuration, so its
options are pip's own, read from ``pip config list`` (pip's files and ``PIP_*`` variables, merged as pip
merges them for ``pip install``: ``PIP_*`` over the ``[install]`` section over ``[global]``):

- ``index-url``, ``extra-index-url``, ``find-links``, ``no-index``, ``constraint``, ``trusted-host``,
  ``cert`` become uv's options of those names (``trusted-host``: ``--allow-insecure-host``);
- uv's ``--index-strategy unsafe-best-match`` is pip's rule: the best version over all indexes (uv's
  default takes a package from the first index that has it);
- settings that change nothing uv does (timeouts, the version check, progress, ``no-compile``: uv does not
  compile; the Makefile compiles afterwards) are dropped;
- any other setting (``no-binary``, ``pre``, ``proxy``, ...) means the install is done by pip, as set up.

pip does it also when ``NEMO_FP8RL_INSTALLER=pip``, when uv cannot be installed into the environment
(``uv>=0.13.8,<0.14`` from the configured indexes), or when uv fails (then pip runs the same arguments; what
uv installed before failing stays, and pip completes it). The line ``pip_install: ...`` says which ran.
"""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path

UV_SPEC = "uv>=0.13.8,<0.14"
"""The uv the environment gets (the options below as that release spells them)."""

# pip settings -> uv's option; "multi": a space-separated list in pip's config, one option per item
TRANSLATED = {"index-url": ("--index-url", False), "extra-index-url": ("--extra-index-url", True),
              "find-links": ("--find-links", True), "constraint": ("--constraint", True),
              "trusted-host": ("--allow-insecure-host", True), "cert": ("--cert", False)}
FLAGS = {"no-index": "--no-index"}
IGNORED = {"timeout", "default-timeout", "disable-pip-version-check", "no-compile", "compile", "progress-bar",
           "no-color", "quiet", "verbose", "retries", "root-user-action", "no-input", "cache-dir", "no-cache-dir",
           "break-system-packages", "user-agent", "require-virtualenv", "config-file",
           "no-warn-script-location"}
SECTIONS = ("global", "install", ":env:")
"""pip's precedence for ``pip install``, lowest first."""


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """pip's effective settings for ``pip install`` as ``{key: value}``, from ``pip config list`` (a line per
    ``section.key='value'``; the files are already merged there, sections are merged here)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    by_section: dict[str, dict[str, str]] = {s: {} for s in SECTIONS}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not (sep and dot) or section not in by_section:
            continue
        try:  # pip writes repr(value): a list over several lines of a file comes with escaped newlines
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            value = value.strip()
        by_section[section][key.strip().replace("_", "-")] = str(value)
    merged: dict[str, str] = {}
    for s in SECTIONS:
        merged.update(by_section[s])
    return merged


def _true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def uv_options(settings: dict[str, str]) -> list[str]:
    """uv's options for pip's ``settings``. Raises ValueError naming a setting uv would not apply as pip does."""
    opts = ["--index-strategy", "unsafe-best-match"]
    for key, value in settings.items():
        if key in TRANSLATED:
            opt, multi = TRANSLATED[key]
            for item in (value.split() if multi else [value]):
                opts += [opt, item]
        elif key in FLAGS:
            if _true(value):
                opts.append(FLAGS[key])
        elif key not in IGNORED:
            raise ValueError(f"pip setting {key}={value!r} has no uv translation here")
    return opts


def uv_args(args: list[str]) -> list[str]:
    """pip's install arguments as uv's: ``--no-compile`` dropped (uv does not compile)."""
    return [a for a in args if a != "--no-compile"]


def _uv(python: str) -> str | None:
    """The environment's uv executable, installed by pip if missing; None where it cannot be had."""
    uv = Path(python).parent / "uv"
    if uv.is_file():
        return str(uv)
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", UV_SPEC],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not uv.is_file():
        print(f"pip_install: uv could not be installed ({(proc.stderr or proc.stdout).strip()[-300:]})", flush=True)
        return None
    return str(uv)


def main(args: list[str]) -> int:
    python = sys.executable
    pip = [python, "-m", "pip", "install", *args]
    why = ""
    if os.environ.get("NEMO_FP8RL_INSTALLER", "uv") == "pip":
        why = "NEMO_FP8RL_INSTALLER=pip"
    else:
        try:
            opts = uv_options(pip_settings(python))
        except (ValueError, subprocess.CalledProcessError) as e:
            why = str(e)
        else:
            uv = _uv(python)
            if uv is None:
                why = "no uv"
            else:
                cmd = [uv, "pip", "install", "--python", python, *opts, *uv_args(args)]
                print("pip_install: uv pip install " + shlex.join(uv_args(args)), flush=True)
                rc = subprocess.run(cmd).returncode
                if rc == 0:
                    return 0
                why = f"uv exited {rc}"
    print(f"pip_install: pip install {shlex.join(args)} ({why})", flush=True)
    return subprocess.run(pip).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
