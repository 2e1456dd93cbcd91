"""Runs ``_kernel_checks.py`` (the Triton kernels against the reference quantizer, bit for bit) in Triton's
CPU interpreter, in a process of its own: ``TRITON_INTERPRET=1`` only takes effect if it is set before
Triton is first imported, and in this test session something (torch, vLLM) imported it already."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_are_bit_equal_to_the_reference_in_the_interpreter():
    checks = Path(__file__).with_name("_kernel_checks.py")
    env = dict(os.environ, TRITON_INTERPRET="1", NEMO_FP8RL_KERNELS="interpret", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(checks)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=str(checks.parents[2]))
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail
