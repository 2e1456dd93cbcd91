"""``trainer.profile``: a range of RL steps profiled on the listed ranks (nemo_fp8rl/trainer/profiling.py;
docs/design.md, "Profiling"). On a CPU the torch profiler runs for real; ``nsys`` needs CUDA."""

import json

import pytest
import torch

from nemo_fp8rl.config.schema import ConfigError, ProfileConfig
from nemo_fp8rl.trainer import RLTrainer
from nemo_fp8rl.trainer.logger import read_metrics
from nemo_fp8rl.trainer.profiling import StepProfiler

from ._cli import every_phase_config, strip_timing


def _cfg(out, steps, **profile):
    cfg = every_phase_config(out, steps)
    for k, v in profile.items():
        setattr(cfg.trainer.profile, k, v)
    return cfg


def _fit(cfg):
    tr = RLTrainer(cfg)
    tr.setup()
    tr.fit()  # closes the trainer (signal handlers, engine, logger) on every exit
    return strip_timing(read_metrics(cfg.output_dir))


PHASES = ("step", "rollout", "weight_sync", "logprobs", "shadow", "train", "push_forward")


def test_torch_profile_names_every_phase_changes_no_metric_and_is_written_when_the_run_ends_inside_it(tmp_path):
    """Steps 1-5 requested, the run has 3 (0-2): the profile holds steps 1 and 2, written when the trainer closes."""
    plain = _fit(_cfg(tmp_path / "plain", 3))
    cfg = _cfg(tmp_path / "prof", 3, kind="torch", start_step=1, end_step=5)
    assert _fit(cfg) == plain  # the profiler observes: same seed, same metrics
    files = sorted(p.name for p in (tmp_path / "prof" / "profile").iterdir())
    assert files == ["rank0_steps1-2.json", "rank0_steps1-2.txt"]
    events = json.loads((tmp_path / "prof" / "profile" / "rank0_steps1-2.json").read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    ranges = [e["name"] for e in events if e.get("cat") == "user_annotation"]  # host-side ranges (a GPU adds
    for phase in PHASES:  # gpu_user_annotation copies)
        assert f"phase/{phase}" in ranges, phase
    assert ranges.count("phase/step") == 2  # the two steps of the range the run reached, no other
    # the phases hold the model's work: the ops of the forward and backward passes are in the trace
    assert "aten::mm" in names or "aten::addmm" in names or "aten::matmul" in names
    table = (tmp_path / "prof" / "profile" / "rank0_steps1-2.txt").read_text()
    assert table.startswith("torch.profiler, rank 0, steps 1-2, sorted by self_") and "phase/" in table


def test_a_rank_not_listed_and_a_range_not_reached_profile_nothing(tmp_path):
    prof = StepProfiler(ProfileConfig(kind="torch", start_step=0, end_step=0, ranks=[1]), rank=0, world_size=2,
                        out_dir=tmp_path)
    prof.before_step(0)
    assert not prof.active
    prof = StepProfiler(ProfileConfig(kind="torch", start_step=5, end_step=6), rank=0, world_size=1, out_dir=tmp_path)
    for step in range(3):
        prof.before_step(step)
        assert not prof.active
        prof.after_step(step)
    prof.stop()
    assert not (tmp_path / "profile").exists()


def test_ranks_outside_the_job_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.profile.ranks=\[0, 4\]: the job has 2 rank\(s\) .*\[4\]"):
        StepProfiler(ProfileConfig(kind="torch", ranks=[0, 4]), rank=0, world_size=2, out_dir=tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_nsys_without_cuda_is_refused_with_the_alternative(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.profile.kind=nsys needs a CUDA GPU.*trainer.profile.kind=torch"):
        StepProfiler(ProfileConfig(kind="nsys"), rank=0, world_size=1, out_dir=tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torch", "nsys"])
def test_on_cuda_the_profile_holds_the_phase_and_its_kernels(tmp_path, kind):
    """torch: the trace has the phase as a host range and on the GPU, and the matmul's CUDA kernel; nsys:
    cudaProfilerStart/Stop and the NVTX range run (without nsys attached they record nothing)."""
    from nemo_fp8rl.trainer import timing

    prof = StepProfiler(ProfileConfig(kind=kind, start_step=0, end_step=0), rank=0, world_size=1, out_dir=tmp_path)
    a = torch.randn(1024, 1024, device="cuda")
    prof.before_step(0)
    assert prof.active
    timings: dict = {}
    with timing.timed(timings, "train"):
        (a @ a).sum()
    prof.after_step(0)
    assert not prof.active and timings["train"] > 0
    if kind == "nsys":
        assert not (tmp_path / "profile").exists()
        return
    events = json.loads((tmp_path / "profile" / "rank0_steps0-0.json").read_text())["traceEvents"]
    cats = {(e.get("cat"), e.get("name")) for e in events}
    assert ("user_annotation", "phase/train") in cats and ("gpu_user_annotation", "phase/train") in cats, cats
    assert any(c == "kernel" for c, _ in cats), cats
    assert "sorted by self_cuda_time_total" in (tmp_path / "profile" / "rank0_steps0-0.txt").read_text()
