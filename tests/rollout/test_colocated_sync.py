"""The colocated weight sync: the torch engine gets the actor's weights on its device in its dtype.

On a GPU that is a device-to-device copy in BF16 (issue 39: the sync went BF16 on GPU -> float32 on CPU ->
GPU). A CPU test cannot see devices, so it checks the dtypes instead: with a BF16 model and a BF16 engine,
no float32 tensor is made anywhere on the way (every op's output is recorded), the engine keeps what the
stream handed it without another copy, and the weights it builds are the ones a float32 sync of the same
values builds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import get_rollout_engine
from nemo_fp8rl.rollout.torch_engine import TorchRolloutEngine, engine_dtype
from tests.rollout.conftest import CONFIGS, random_hf_weights


class _RecordDtypes(TorchDispatchMode):
    """Every op's floating-point outputs as (op, dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.out: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        for r in res if isinstance(res, (tuple, list)) else (res,):
            if isinstance(r, torch.Tensor) and r.is_floating_point():
                self.out.append((str(func), r.dtype, r.numel()))
        return res


def _cfg(name: str = "qwen2") -> ModelConfig:
    return ModelConfig(name=name, **CONFIGS[name])


def test_engine_dtype_is_bf16_on_cuda_and_float32_elsewhere():
    assert engine_dtype("cuda") == torch.bfloat16 and engine_dtype(torch.device("cuda", 1)) == torch.bfloat16
    assert engine_dtype("cpu") == torch.float32
    cfg = _cfg()
    # building the engine allocates nothing on its device, so a CUDA engine can be constructed here
    gpu = TorchRolloutEngine(cfg, fp8_scheme="vllm_w8a8", eos_id=2, pad_id=0, device="cuda")
    cpu = TorchRolloutEngine(cfg, fp8_scheme="vllm_w8a8", eos_id=2, pad_id=0)
    assert gpu.dtype == torch.bfloat16 and gpu.sync_target == (torch.device("cuda"), torch.bfloat16)
    assert cpu.dtype == torch.float32 and cpu.sync_target == (torch.device("cpu"), torch.float32)
    assert TorchRolloutEngine(cfg, fp8_scheme="off", eos_id=2, pad_id=0, device="cuda",
                              dtype=torch.float16).dtype == torch.float16  # an explicit dtype wins


@pytest.mark.parametrize("scheme", ["off", "vllm_w8a8", "vllm_block"])
def test_bf16_sync_equals_the_float32_sync_of_the_same_values(scheme):
    cfg = _cfg()
    bf16 = {k: v.to(torch.bfloat16) for k, v in random_hf_weights(cfg, seed=1).items()}
    f32 = {k: v.float() for k, v in bf16.items()}  # what the host round trip delivered: exact upcasts
    a = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=2, pad_id=0, dtype=torch.bfloat16)
    b = get_rollout_engine("torch", cfg, fp8_scheme=scheme, eos_id=2, pad_id=0, dtype=torch.bfloat16)
    sa, sb = a.update_weights(iter(bf16.items())), b.update_weights(iter(f32.items()))
    assert sa == sb  # the same amax / rel_err records, as Python floats
    assert all(isinstance(v, float) for rec in sa.values() for k, v in rec.items() if k in ("amax", "rel_err"))
    for la, lb in zip(a.weights.layers, b.weights.layers):
        for f in ("w_qkv", "w_o", "w_gate_up", "w_down", "input_norm", "b_qkv"):
            x, y = getattr(la, f), getattr(lb, f)
            assert x.dtype == torch.bfloat16 and torch.equal(x, y), f
    tokens = torch.tensor([[1, 5, 7, 3, 9]])
    assert torch.equal(a.logprobs(tokens), b.logprobs(tokens))


def test_bf16_sync_makes_no_float32_copy_and_keeps_the_streamed_tensors():
    """Scheme off (the BF16 arm): the weights go into the engine as they came, nothing is upcast."""
    cfg = _cfg()
    sd = {k: v.to(torch.bfloat16) for k, v in random_hf_weights(cfg, seed=2).items()}
    eng = get_rollout_engine("torch", cfg, fp8_scheme="off", eos_id=2, pad_id=0, dtype=torch.bfloat16)
    rec = _RecordDtypes()
    with rec:
        eng.update_weights(iter(sd.items()))
    smallest = min(v.numel() for v in sd.values())
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).numel()
    big = [(op, n) for op, dt, n in rec.out if dt == torch.float32 and n >= smallest]
    # float32 only for RoPE's table, the statistics and the LM head (once per sync: the logits are float32,
    # and a per-token upcast of the V x d head would cost more), never a layer's weight
    assert [n for _, n in big] in ([], [head]), big
    assert eng.weights.lm_head.dtype == torch.float32
    lw = eng.weights.layers[0]
    assert lw.w_o.data_ptr() == sd["model.layers.0.self_attn.o_proj.weight"].data_ptr()  # kept, not copied
    assert lw.w_down.data_ptr() == sd["model.layers.0.mlp.down_proj.weight"].data_ptr()
    assert eng.weights.embed.data_ptr() == sd["model.embed_tokens.weight"].data_ptr()


def test_bf16_fp8_sync_upcasts_only_inside_the_quantizer():
    """vllm_w8a8: the float32 tensors of a sync are the quantizer's own (one fused linear at a time) and the
    relative-error statistic's; the streamed weights are never copied to float32 as a whole model."""
    cfg = _cfg()
    sd = {k: v.to(torch.bfloat16) for k, v in random_hf_weights(cfg, seed=3).items()}
    eng = get_rollout_engine("torch", cfg, fp8_scheme="vllm_w8a8", eos_id=2, pad_id=0, dtype=torch.bfloat16)
    rec = _RecordDtypes()
    with rec:
        eng.update_weights(iter(sd.items()))
    emb = sd["model.embed_tokens.weight"].numel()
    norms = {v.numel() for k, v in sd.items() if "norm" in k or "bias" in k}
    smallest = min(v.numel() for v in sd.values())  # below: RoPE's table, the statistics
    f32_numels = {n for _, dt, n in rec.out if dt == torch.float32 and n >= smallest}
    linears = {2 * 128 * 64, 64 * 128, (4 + 2 + 2) * 16 * 64, 64 * 64}  # gate_up, down, qkv, o
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).numel()
    # besides the quantizer's: the LM head's float32 copy, once per sync (the logits are float32)
    assert f32_numels <= linears | {head}, f32_numels - linears - {head}
    assert eng.weights.embed.dtype == torch.bfloat16 and eng.weights.lm_head.dtype == torch.float32
    assert not (norms & f32_numels) and (emb == head or emb not in f32_numels)


def test_trainer_streams_the_stage_in_the_engine_dtype():
    """RLTrainer._weight_stream: a single-stage actor streams its stage in the engine's (device, dtype)."""
    from nemo_fp8rl.config.model import ParallelConfig
    from nemo_fp8rl.models import build_actor
    from nemo_fp8rl.trainer.rl_trainer import RLTrainer

    actor = build_actor(ModelConfig(vocab_size=19, qk_layernorm=True), ParallelConfig(), seed=0, lr=1e-4,
                        device="cpu")
    actor.model.bfloat16()  # BF16 parameters, as on a GPU (the CPU actor refuses to build them)
    ref = dict(actor.iter_weights())  # float32 CPU tensors
    fake = SimpleNamespace(engine=SimpleNamespace(sync_target=(torch.device("cpu"), torch.bfloat16)),
                           actor=actor, model_cfg=actor.model_cfg)
    rec = _RecordDtypes()
    with rec:
        streamed = dict(RLTrainer._weight_stream(fake))
    assert not [o for o in rec.out if o[1] == torch.float32], "a float32 copy was made on the way"
    assert streamed.keys() == ref.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t.float(), ref[k]) for k, t in streamed.items())
    params = {p.data_ptr() for p in actor.model.parameters()}
    assert not any(t.data_ptr() in params for t in streamed.values())  # copies the engine owns
    # an engine without a sync target (vllm) gets the actor's float32 CPU stream
    fake.engine = SimpleNamespace()
    assert all(t.dtype == torch.float32 for _, t in RLTrainer._weight_stream(fake))
