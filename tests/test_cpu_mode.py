"""The CPU the tests are shown (tests/conftest.py): this machine's, or with ``NEMO_FP8RL_TEST_CPU=avx2`` an
AVX2-only x86 CPU, as on the AVX2-only AMD EPYC CI machines. `make test` runs the feature-dependent test
files again in that mode, so a machine with AVX-512 catches what would fail without it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nemo_fp8rl.rollout.vllm_support import cpu_features

from .conftest import TEST_CPU


@pytest.mark.parametrize("avx512,amx", [(True, False), (False, True), (False, False)])
def test_our_feature_detection_reads_the_presented_cpu(present_cpu, avx512, amx):
    present_cpu(avx512=avx512, amx=amx)
    assert cpu_features() == {"avx512": avx512, "amx": amx}
    assert torch.cpu._is_avx512_supported() == avx512 and torch.cpu._is_amx_tile_supported() == amx


def test_without_the_mode_the_detection_is_torchs():
    if TEST_CPU:
        pytest.skip(f"NEMO_FP8RL_TEST_CPU={TEST_CPU} presents another CPU")
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    want = {"avx512": bool(torch.cpu._is_avx512_supported()), "amx": bool(torch.cpu._is_amx_tile_supported())}
    assert cpu_features() == want
    if caps:
        assert want == {"avx512": bool(caps.get("avx512_f")), "amx": bool(caps.get("amx_tile"))}


def test_avx2_mode_presents_an_avx2_only_cpu():
    if TEST_CPU != "avx2":
        pytest.skip("runs under NEMO_FP8RL_TEST_CPU=avx2 (make test's second pass)")
    assert cpu_features() == {"avx512": False, "amx": False}
    assert not torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
    if hasattr(torch.cpu, "get_capabilities"):
        caps = torch.cpu.get_capabilities()
        assert not any(v for k, v in caps.items() if k.startswith(("avx512", "amx"))), dict(caps)
    # torch's own kernels run their AVX2 versions (or the default ones on a CPU without AVX2), here and in
    # the processes a test starts
    assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0 and out.stdout.split()[-1] in ("AVX2", "DEFAULT"), out
