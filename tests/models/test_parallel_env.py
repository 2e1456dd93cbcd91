"""Launch-environment parsing, layout validation messages, and the CPU pipeline-schedule shim."""

import pytest
import torch

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.models.cpu_schedules import cpu_pipeline_schedules
from nemo_fp8rl.models.parallel import read_launch_env, validate_layout


def test_torchrun_env():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
                           "MASTER_PORT": "1234", "SLURM_PROCID": "9", "SLURM_NTASKS": "16"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == \
        (3, 8, 1, "n0", 1234, "torchrun")  # torchrun wins over SLURM


def test_slurm_env_and_port_from_job_id():
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                           "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7", "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (5, 16, 5, "10.0.0.7", "slurm")
    assert env.master_port == 20000 + 123456 % 20000
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_single_process_without_env():
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single") and env.master_port > 0


@pytest.mark.parametrize("par, world, model, match", [
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 6, None,
     r"world size 6 is not divisible by parallel.tensor_model_parallel_size \(2\) x parallel.pipeline_model_parallel_size \(2\)"),
    (dict(tensor_model_parallel_size=3), 3, dict(), r"model.num_attention_heads=4 is not divisible by parallel.tensor_model_parallel_size=3"),
    (dict(tensor_model_parallel_size=4), 4, dict(num_query_groups=2), r"model.num_query_groups=2 .*tensor_model_parallel_size=4"),
    (dict(pipeline_model_parallel_size=2), 2, dict(), r"model.num_layers=3 is not divisible by parallel.pipeline_model_parallel_size=2"),
    (dict(tensor_model_parallel_size=2), 2, dict(ffn_hidden_size=385), r"model.ffn_hidden_size=385"),
    (dict(sequence_parallel=True), 1, None, r"sequence_parallel=true needs parallel.tensor_model_parallel_size > 1"),
    (dict(micro_batch_size=0), 1, None, r"parallel.micro_batch_size=0"),
])
def test_layout_errors_name_the_key(par, world, model, match):
    with pytest.raises(ValueError, match=match):
        validate_layout(ParallelConfig(**par), world, ModelConfig(vocab_size=16, **model) if model is not None else None)


def test_model_config_errors_name_the_key():
    from nemo_fp8rl.models import build_actor

    for kw, match in [
        (dict(), "model.vocab_size is not set"),
        (dict(vocab_size=16, normalization="BatchNorm"), "model.normalization"),
        (dict(vocab_size=16, activation="relu"), "model.activation"),
        (dict(vocab_size=16, params_dtype="bfloat16"), "model.params_dtype"),
        (dict(vocab_size=16, hf_path="/ckpt"), "model.hf_path"),
        (dict(vocab_size=16, hidden_size=130), "model.hidden_size=130"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_actor(ModelConfig(**kw), ParallelConfig(), seed=0, lr=1e-4, device="cpu")


def test_rowwise_has_no_te_recipe():
    from nemo_fp8rl.fp8 import get_recipe

    with pytest.raises(ValueError, match="rowwise"):
        get_recipe("rowwise").to_megatron_kwargs()  # build_gpt_model calls this on the TE path


def test_use_te_on_cpu_is_rejected():
    from nemo_fp8rl.models import build_actor

    with pytest.raises(ValueError, match="use_te=True but the model runs on the CPU"):
        build_actor(ModelConfig(vocab_size=16), ParallelConfig(), seed=0, lr=1e-4, use_te=True, device="cpu")


def test_cpu_schedule_shim_is_scoped_and_restores():
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    assert schedules.torch is torch and p2p_communication.torch is torch
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_pipeline_schedules():
            with cpu_pipeline_schedules():  # re-entrant
                assert schedules.torch is not torch
            assert p2p_communication.torch is not torch
            t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
            assert t.device.type == "cpu"
            assert schedules.torch.empty((3,), device=p2p_communication.torch.cuda.current_device()).device.type == "cpu"
            assert p2p_communication.torch.cuda.synchronize() is None
            assert schedules.torch.float32 is torch.float32 and schedules.torch.distributed is torch.distributed
            raise RuntimeError("boom")
    assert schedules.torch is torch and p2p_communication.torch is torch
    with cpu_pipeline_schedules(enabled=False):  # a CUDA model: megatron's code runs untouched
        assert schedules.torch is torch and p2p_communication.torch is torch
