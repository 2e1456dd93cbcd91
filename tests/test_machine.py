"""nemo_fp8rl.machine: the machine description the trainer logs and the study records."""

from __future__ import annotations

import json

from nemo_fp8rl import machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 sha_ni

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel Xeon
flags\t\t: fpu avx2 amx_tile amx_bf16
"""


def test_first_cpu_block_gives_name_family_model_and_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO)
    name, flags = machine.cpu_model_and_flags(f)
    assert name == "AMD EPYC (family 25 model 17)"  # the first CPU's block only, not the second's
    assert {"avx2", "avx512f", "avx512_bf16"} <= flags and "amx_tile" not in flags


def test_without_cpuinfo_the_platform_names_the_cpu(tmp_path):
    name, flags = machine.cpu_model_and_flags(tmp_path / "missing")
    assert name and flags == set()


def test_describe_is_json_and_the_line_names_what_it_was_given():
    d = machine.describe(torch_threads=3, gpu="NVIDIA H200")
    assert json.loads(json.dumps(d)) == d
    assert d["cpus"] >= 1 and d["torch"] and set(d["cpu_flags"]) <= set(machine.SPEED_FLAGS)
    line = machine.describe_line(torch_threads=1, gpu="NVIDIA H200")
    assert "GPU NVIDIA H200" in line and "1 torch thread," in line and f"torch {d['torch']}" in line
    assert "torch_threads" not in machine.describe() and "gpu" not in machine.describe()


def test_a_recorded_machine_reads_back_as_the_same_line():
    d = json.loads(json.dumps(machine.describe(torch_threads=2)))  # as study_run.json stores it
    assert machine.as_line(d) == machine.describe_line(torch_threads=2)
    assert machine.as_line({"cpu": "X", "cpus": 4, "cpu_flags": []}) == "X, 4 CPUs, no avx2/avx512/amx, torch not installed"
