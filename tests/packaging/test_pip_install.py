"""scripts/pip_install.py (the Makefile's installs): pip's configuration read as pip merges it and handed to uv,
a setting uv would apply differently refused, and pip doing the install where uv is not used or fails."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import pip_install  # noqa: E402


def test_pip_settings_merge_files_sections_and_environment(tmp_path):
    """PIP_CONFIG_FILE's [install] over its [global], PIP_* over both; a list over several lines comes whole."""
    cfg = tmp_path / "pip.conf"
    cfg.write_text("[global]\nindex-url = https://idx.invalid/simple\nfind-links = /from/global\n"
                   "extra-index-url =\n    https://a.invalid/simple\n    https://b.invalid/simple\n"
                   "[install]\nfind-links = /from/install\n[download]\nno-index = true\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}  # the machine's own PIP_* aside
    env.update(PIP_CONFIG_FILE=str(cfg), PIP_CONSTRAINT="/c1.txt /c2.txt")
    out = subprocess.run([sys.executable, "-c", "import sys, json; sys.path.insert(0, 'scripts'); import pip_install; "
                          "print(json.dumps(pip_install.pip_settings()))"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    settings = __import__("json").loads(out)
    assert settings["index-url"] == "https://idx.invalid/simple"
    assert settings["find-links"] == "/from/install"
    assert "no-index" not in settings  # [download] is not pip install's
    opts = pip_install.uv_options(settings)
    pairs = list(zip(opts[::2], opts[1::2]))
    assert ("--index-strategy", "unsafe-best-match") in pairs and ("--index-url", "https://idx.invalid/simple") in pairs
    assert [v for k, v in pairs if k == "--extra-index-url"] == ["https://a.invalid/simple", "https://b.invalid/simple"]
    assert [v for k, v in pairs if k == "--constraint"] == ["/c1.txt", "/c2.txt"]
    assert [v for k, v in pairs if k == "--find-links"] == ["/from/install"]


def test_uv_options_translate_or_refuse():
    assert pip_install.uv_options({"no-index": "1", "trusted-host": "h1 h2", "cert": "/ca.pem", "timeout": "60",
                                   "no-compile": "1"}) == [
        "--index-strategy", "unsafe-best-match", "--no-index", "--allow-insecure-host", "h1",
        "--allow-insecure-host", "h2", "--cert", "/ca.pem"]
    assert "--no-index" not in pip_install.uv_options({"no-index": "false"})
    with pytest.raises(ValueError, match="no-binary"):
        pip_install.uv_options({"no-binary": ":all:"})
    assert pip_install.uv_args(["-q", "--no-compile", "-e", "."]) == ["-q", "-e", "."]


def _wheel(where: Path, name: str) -> Path:
    """A pure-Python wheel of one module ``name`` with VALUE = 1 (name-1.0-py3-none-any.whl)."""
    files = {f"{name}/__init__.py": "VALUE = 1\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                           "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{name}-1.0.dist-info/RECORD"] = "\n".join([*record, f"{name}-1.0.dist-info/RECORD,,"]) + "\n"
    whl = where / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return whl


def test_installs_by_uv_and_by_pip_where_uv_is_not_used_or_fails(tmp_path):
    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        pytest.skip("no uv in the test environment (make install-test puts one there)")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # this environment's pip (and below its uv), copied: what ensurepip and pip_install would otherwise install
    site = next((venv / "lib").glob("python*/site-packages"))
    shutil.copytree(Path(sysconfig.get_paths()["purelib"]) / "pip", site / "pip")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    py = str(venv / "bin" / "python")

    # the machine's pip configuration aside (files and PIP_*): each case sets what it is about
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    base_env["PIP_CONFIG_FILE"] = os.devnull

    def install(name: str, *extra: str, **env: str) -> str:
        _wheel(wheels, name)
        proc = subprocess.run([py, str(ROOT / "scripts" / "pip_install.py"), "-q", "--no-compile", "--no-index",
                               "--find-links", str(wheels), *extra, name], capture_output=True, text=True,
                              env=dict(base_env, **env), cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert subprocess.run([py, "-c", f"import {name}; assert {name}.VALUE == 1"]).returncode == 0
        return proc.stdout

    # no uv to be had (no index, and no uv among the find-links): pip installs
    assert "(no uv)" in install("probe_no_uv", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels))
    shutil.copy2(uv, venv / "bin" / "uv")
    assert "pip_install: uv pip install -q --no-index" in install("probe_uv")
    assert "(NEMO_FP8RL_INSTALLER=pip)" in install("probe_forced", NEMO_FP8RL_INSTALLER="pip")
    # an argument only pip knows: uv refuses it and pip installs
    assert "(uv exited 2)" in install("probe_fallback", "--no-clean")
    # a pip setting uv would not apply as pip does: pip installs, and says which
    assert "pip setting pre='1' has no uv translation" in install("probe_setting", PIP_PRE="1")
