"""Shared fixtures of the fault-injection tests."""

import os
import subprocess

import pytest


@pytest.fixture
def small_tmpfs(tmp_path):
    """``small_tmpfs(size)`` mounts a real tmpfs of ``size`` (e.g. ``"1m"``) and returns its path; it is
    unmounted after the test. Skips without root (mount needs it)."""
    mounts = []

    def mount(size: str):
        mnt = tmp_path / f"small{len(mounts)}"
        mnt.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]
        if os.geteuid() != 0 or subprocess.run(cmd, check=False).returncode:
            pytest.skip("needs root to mount a small tmpfs")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", str(mnt)], check=False)
