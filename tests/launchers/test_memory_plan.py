"""Memory plan (``nemo-fp8rl-plan``, nemo_fp8rl.launcher.memory): checked against megatron models built
and trained on this CPU (parameters, optimizer state, saved-for-backward bytes, peak heap), against the
published Megatron formulas (bytes/parameter table, Korthikanti et al. Table 2), and through the CLI and
the launcher's pre-submit check. The GPU profile itself cannot be measured here (no GPU)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.config.schema import AlgorithmConfig, Fp8Config, TrainConfig
from nemo_fp8rl.validation import validate
from nemo_fp8rl.launcher import LaunchError
from nemo_fp8rl.launcher.memory import (
    PlanOptions,
    config_optimizer,
    layer_activation_bytes,
    logits_bytes,
    megatron_reference,
    plan_arm,
    stage_parameters,
    state_bytes,
)

from ._launch import GPU_REQUIRED, REPO, plans

# --------------------------------------------------------------------------- measured on CPU
# One subprocess builds each model with real megatron-core (world of 1, CPU, float32), runs a train step
# to create the AdamW state, then measures a second step's peak heap (glibc mallinfo2 after every aten
# op) and the bytes autograd saves for one microbatch's backward (unique storages, parameters excluded).
_PROBE = r"""
import ctypes, gc, json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from nemo_fp8rl.config.model import ModelConfig, ParallelConfig
from nemo_fp8rl.fp8 import get_recipe
from nemo_fp8rl.models import build_actor

torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
def in_use():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd  # heap arena bytes in use + mmapped blocks (large tensors)
class Peak(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.peak = in_use()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use())
        return out
def loss_fn(mb, logprobs, entropy, *, global_tokens, global_seqs):
    m = mb["mask"]
    loss = (-(mb["advantages"][:, None] * logprobs * m).sum() - 0.01 * (entropy * m).sum()) / global_tokens
    return loss, {"loss/pg": (loss.detach(), "sum")}
out = {}
for case in json.loads(sys.argv[1]):
    model = ModelConfig(**case["model"])
    mb, rows, T = case["micro_batch_size"], case["rows"], model.seq_length
    kw = {"distributed_optimizer": True} if case["optimizer"] == "distributed" else {}
    actor = build_actor(model, ParallelConfig(micro_batch_size=mb), device="cpu", seed=0, lr=1e-3,
                        fp8_recipe=get_recipe(case["fp8"]) if case["fp8"] else None, **kw)
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, model.vocab_size, (rows, T), generator=g), "mask": torch.ones(rows, T),
             "advantages": torch.randn(rows, generator=g)}
    actor.train_step(batch, loss_fn)  # creates the optimizer state: the next step is the steady state
    gc.collect()
    before = in_use()
    with Peak() as pk:
        actor.train_step(batch, loss_fn)
    params = list(actor.model.parameters())
    n_params = sum(p.numel() for p in params)
    if kw:
        from nemo_fp8rl.models.optim import optimizer_state_bytes
        opt = optimizer_state_bytes(actor.optimizer)
    else:
        opt = sum(v.numel() * v.element_size() for s in actor.optimizer.state.values() for v in s.values()
                  if torch.is_tensor(v))
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved = {}
    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_storages:
            saved.setdefault(s.data_ptr(), s.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor.train_step({k: v[:mb] for k, v in batch.items()}, loss_fn)
    # megatron DDP keeps the float32 gradients in a persistent buffer (torch AdamW: .grad, made each step)
    grad_buffer = sum(b.grad_data.numel() * b.grad_data.element_size()
                      for b in (*actor.ddp.buffers, *actor.ddp.expert_parallel_buffers)) if kw else 0
    out[case["name"]] = {
        "params": n_params, "param_tensors": len(params), "optimizer": opt, "saved": sum(saved.values()),
        "grad_buffer": grad_buffer,
        # steady-state peak: the persistent weights, optimizer state and gradient buffer + what the step adds
        "peak": 4 * n_params + opt + grad_buffer + pk.peak - before,
    }
    del actor, batch
    gc.collect()
print(json.dumps(out))
"""

TINY_MODEL = dict(vocab_size=16)  # the tiny preset (ModelConfig defaults) with the arithmetic task's 16 tokens
MID_MODEL = dict(vocab_size=4096, make_vocab_size_divisible_by=128, num_layers=4, hidden_size=512,
                 num_attention_heads=8, num_query_groups=2, kv_channels=80, ffn_hidden_size=1536, seq_length=128,
                 qk_layernorm=True)  # GQA, head dim != h / heads, Qwen3-style QK norm
CASES = [
    # name, model, micro batch, rows (microbatches = rows / micro batch), fp8 recipe[, optimizer]
    ("tiny", TINY_MODEL, 8, 16, None),
    ("tiny_tensorwise", TINY_MODEL, 8, 16, "tensorwise"),
    ("tiny_mxfp8", TINY_MODEL, 8, 16, "mxfp8"),
    ("mid", MID_MODEL, 2, 4, None),
    ("mid_blockwise", MID_MODEL, 2, 4, "blockwise"),
    # megatron DDP (float32 grad buffer) + distributed optimizer at DP=1 (optim.distributed=true)
    ("mid_distributed", MID_MODEL, 2, 4, None, "distributed"),
    # one microbatch: the gradients appear while the activations are freed, so the plan is an upper bound
    ("mha_tied_qknorm", dict(vocab_size=300, num_layers=2, hidden_size=128, num_attention_heads=4,
                             ffn_hidden_size=384, qk_layernorm=True, untie_embeddings_and_output_weights=False),
     4, 4, "delayed"),
    ("gelu_bias", dict(vocab_size=1000, num_layers=2, hidden_size=256, num_attention_heads=8, ffn_hidden_size=640,
                       seq_length=128, activation="gelu", add_bias_linear=True), 2, 2, None),
]


def _cpu_plan(model_kw: dict, mb: int, rows: int, fp8, optimizer: str = "adamw"):
    cfg = TrainConfig(model=ModelConfig(**model_kw), parallel=ParallelConfig(micro_batch_size=mb),
                      fp8=Fp8Config(recipe=fp8),
                      algorithm=AlgorithmConfig(prompts_per_step=rows // 2, group_size=2, minibatches_per_step=1))
    return cfg, plan_arm(validate(cfg), PlanOptions(device="cpu"), recipe_name=fp8, optimizer=optimizer)


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.fixture(scope="module")
def measured():
    if not _has_mallinfo2():
        pytest.skip("peak heap is measured with glibc's mallinfo2 (glibc >= 2.33); not available here")
    cases = [dict(name=c[0], model=c[1], micro_batch_size=c[2], rows=c[3], fp8=c[4],
                  optimizer=c[5] if len(c) > 5 else "adamw") for c in CASES]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=str(REPO), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name,model_kw,mb,rows,fp8,optimizer", [(*c[:5], c[5] if len(c) > 5 else "adamw")
                                                                  for c in CASES], ids=[c[0] for c in CASES])
def test_plan_matches_a_megatron_model_trained_on_cpu(measured, name, model_kw, mb, rows, fp8, optimizer):
    cfg, plan = _cpu_plan(model_kw, mb, rows, fp8, optimizer)
    got = measured[name]
    model = cfg.model
    # parameters: megatron's model holds exactly what the plan counts
    assert got["params"] == stage_parameters(model, 1, 1, 0).total
    assert plan.components["weights"] == 4 * got["params"]
    # Adam: two float32 moments per parameter (+ a float32 step counter per parameter tensor for torch
    # AdamW, one per parameter group for megatron's optimizer)
    if optimizer == "adamw":
        assert got["optimizer"] == plan.components["optimizer"] + 4 * got["param_tensors"]
    else:
        assert 0 <= got["optimizer"] - plan.components["optimizer"] <= 4 * got["param_tensors"]
        assert got["grad_buffer"] == pytest.approx(plan.components["grads"], rel=0.01)  # up to bucket padding
    # saved for backward (one microbatch): the plan's activations and weight copies, without the
    # logits gradient and temporaries of the backward (12 bytes per token per vocabulary entry)
    tokens = mb * cfg.model.seq_length
    assert plan.components["logits"] == logits_bytes(model, tokens, 1, "cpu")
    saved_plan = (plan.components["activations"] + plan.components["weight copies"] + 8 * tokens * model.padded_vocab(1))
    assert got["saved"] == pytest.approx(saved_plan, rel=0.01), (got["saved"], saved_plan)
    # peak heap of a steady-state train step
    if plan.microbatches >= 2:
        assert got["peak"] == pytest.approx(plan.train_total, rel=0.15), (got["peak"], plan.train_total)
    else:
        assert plan.train_total * 0.8 <= got["peak"] <= plan.train_total * 1.02, (got["peak"], plan.train_total)


def test_fp8_weight_copies_on_cpu_follow_the_emulation():
    """Per-tensor and blockwise emulation keep a float32 fake-quantized weight for the backward; rowwise
    and MXFP8 requantize from the parameter."""
    copies = {r: _cpu_plan(MID_MODEL, 2, 4, r)[1].components["weight copies"]
              for r in (None, "delayed", "tensorwise", "blockwise", "rowwise", "mxfp8")}
    cfg = _cpu_plan(MID_MODEL, 2, 4, None)[0]
    linear = stage_parameters(cfg.model, 1, 1, 0).fp8_linear
    assert copies[None] == copies["rowwise"] == copies["mxfp8"] == 0
    assert copies["delayed"] == copies["tensorwise"] == copies["blockwise"] == 4 * linear


# --------------------------------------------------------------------------- published formulas
def _gpu_cfg(preset: str, tp: int, pp: int, dp_world: int, mb: int = 1, sp: bool = True, fp8=None):
    from nemo_fp8rl.launch import compose_train_config
    from nemo_fp8rl.launcher.memory_cli import train_config_from_overrides

    cfg = train_config_from_overrides(
        [f"model={preset}", f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
         f"parallel.micro_batch_size={mb}", f"parallel.sequence_parallel={str(sp).lower()}",
         *([f"fp8={fp8}"] if fp8 else [])], compose_train_config)
    return cfg, PlanOptions(dp=dp_world // (tp * pp))


@pytest.mark.parametrize("dp", [1, 2, 8])
def test_bytes_per_parameter_follow_megatrons_table(dp):
    """Megatron Core's distributed-optimizer table: fp32 params + fp32 grads, non-distributed = 16,
    distributed = 8 + 8/d; bf16 params + fp32 grads, distributed = 6 + 12/d."""
    P = 10**9
    assert sum(state_bytes(P, "adamw", dp, "gpu").values()) == 16 * P
    assert sum(state_bytes(P, "distributed", dp, "gpu").values()) == pytest.approx((6 + 12 / dp) * P, rel=1e-12)
    # float32 parameters (CPU): the parameters are the main parameters, "8 + 8/d"
    assert sum(state_bytes(P, "distributed", dp, "cpu").values()) == pytest.approx((8 + 8 / dp) * P, rel=1e-12)


def test_layer_activations_reproduce_korthikanti_table_2():
    """GPT layer (MHA, 4h GeLU MLP, BF16, flash attention): [3] gives 34 s b h / t with sequence
    parallelism and s b h (10 + 24 / t) without; both include 2 bytes of dropout masks, which our
    runs do not have (no dropout)."""
    h, tokens, t = 4096, 8192, 8
    model = ModelConfig(vocab_size=32000, hidden_size=h, num_attention_heads=32, ffn_hidden_size=4 * h,
                        activation="gelu")
    sp = layer_activation_bytes(model, tokens, t, scaling=None, device="gpu", sequence_parallel=True)
    no_sp = layer_activation_bytes(model, tokens, t, scaling=None, device="gpu", sequence_parallel=False)
    assert sp == (34 - 2) * tokens * h / t
    assert no_sp == (10 - 2 + 24 / t) * tokens * h
    fp8 = layer_activation_bytes(model, tokens, t, scaling="tensorwise", device="gpu", sequence_parallel=True)
    assert fp8 < sp  # FP8 GEMM inputs are saved in 1 byte


@pytest.mark.parametrize("preset", ["tiny", "llama3_8b", "qwen3_8b", "qwen2_5_32b", "qwen3_32b"])
def test_parameter_count_of_every_preset(preset):
    """The plan's parameters = the published Hugging Face count (tests/models/test_presets.py checks that
    against the checkpoints) + Megatron's vocabulary padding (+ a tied head's copy only under PP)."""
    from nemo_fp8rl.models.hf_weights import count_parameters

    cfg, _ = _gpu_cfg(preset, 1, 1, 1, sp=False) if preset != "tiny" else (None, None)
    model = cfg.model if cfg else ModelConfig(vocab_size=16)
    vocab = model.padded_vocab(1)
    heads = 1 if model.tied_embeddings else 2
    padding = (vocab - model.vocab_size) * model.hidden_size * heads
    assert stage_parameters(model, 1, 1, 0).total - padding == count_parameters(model)
    # TP/PP split: the stages of one replica hold everything once (a tied head twice under PP)
    pp = 2 if model.num_layers % 2 == 0 else 1
    split = sum(stage_parameters(model, 1, pp, s).total for s in range(pp))
    assert split == stage_parameters(model, 1, 1, 0).total + (
        vocab * model.hidden_size if model.tied_embeddings and pp > 1 else 0)


@pytest.mark.parametrize("preset,tp,pp,world", [("llama3_8b", 4, 1, 8), ("qwen3_8b", 4, 1, 8),
                                                ("qwen2_5_32b", 8, 2, 32), ("qwen3_32b", 8, 2, 32)])
def test_distributed_optimizer_state_matches_megatron_theoretical_memory(preset, tp, pp, world):
    """Megatron-LM's report_theoretical_memory: most loaded shard x (6 + 12 / DP). Ours counts QK norms
    and QKV biases too; the difference is below 0.1%."""
    cfg, options = _gpu_cfg(preset, tp, pp, world)
    plan = plan_arm(cfg, options, recipe_name=None, optimizer="distributed")
    ours = sum(plan.components[k] for k in ("weights", "grads", "optimizer"))
    ref = megatron_reference(cfg, options.dp, "distributed")["weights+optimizer"]
    assert ours == pytest.approx(ref, rel=1e-3)


def test_pipeline_first_stage_holds_pp_microbatches():
    cfg, options = _gpu_cfg("qwen3_32b", 8, 4, 32)
    plan = plan_arm(cfg, options, recipe_name="blockwise", optimizer="distributed")
    assert plan.stage == 0 and plan.in_flight == 4
    one, _ = _gpu_cfg("qwen3_32b", 8, 4, 32)
    one.algorithm.prompts_per_step, one.algorithm.group_size, one.algorithm.minibatches_per_step = 2, 2, 2
    few = plan_arm(one, options, recipe_name="blockwise", optimizer="distributed")
    assert few.microbatches == 2 and few.in_flight == 2  # fewer microbatches than stages: fewer in flight
    assert few.components["activations"] < plan.components["activations"]


def test_fp8_recipes_cost_weight_copies_and_save_activations():
    cfg, options = _gpu_cfg("qwen3_8b", 4, 1, 8, mb=2)
    arms = {r: plan_arm(cfg, options, recipe_name=r, optimizer="distributed").components
            for r in (None, "delayed", "tensorwise", "blockwise", "mxfp8")}
    assert arms[None]["weight copies"] == 0  # BF16 parameters feed BF16 GEMMs directly
    # row-wise + column-wise FP8 copies: 2 bytes per weight, + scales (MXFP8: a byte per 32)
    assert 0 < arms["tensorwise"]["weight copies"] == arms["delayed"]["weight copies"] < \
        arms["blockwise"]["weight copies"] < arms["mxfp8"]["weight copies"]
    assert arms["tensorwise"]["activations"] < arms["blockwise"]["activations"] < arms[None]["activations"]
    adamw = plan_arm(cfg, options, recipe_name=None, optimizer="adamw").components
    assert adamw["weight copies"] > 0  # float32 parameters: BF16 casts kept for the backward


def test_config_optimizer_follows_optim_distributed():
    """optim.distributed: true/false, or null = true on GPU and false on CPU."""
    from types import SimpleNamespace

    def cfg(**optim):
        return SimpleNamespace(optim=SimpleNamespace(**optim))

    assert config_optimizer(cfg(distributed=None), "gpu") == "distributed"
    assert config_optimizer(cfg(distributed=None), "cpu") == "adamw"
    assert config_optimizer(cfg(distributed=True), "cpu") == "distributed"
    assert config_optimizer(cfg(distributed=False), "gpu") == "adamw"


def test_rollout_engine_share():
    cfg, options = _gpu_cfg("qwen3_8b", 4, 1, 8, mb=1)
    cfg.rollout.fp8.scheme = "vllm_block"
    base = plan_arm(cfg, options, recipe_name="blockwise", optimizer="distributed")
    assert base.rollout is None  # the torch engine runs on the host
    import dataclasses

    shared = plan_arm(cfg, dataclasses.replace(options, rollout_share=0.3), recipe_name="blockwise",
                      optimizer="distributed")
    r = shared.rollout
    assert shared.available == base.available - r.reserved
    # KV cache of one 4096-token sequence: K and V, 36 layers, 8 / 4 KV heads of 128, BF16
    assert r.kv_per_sequence == 2 * 2 * 36 * 2 * 128 * 4096
    assert r.concurrent == (r.reserved - r.weights) // r.kv_per_sequence
    bf16 = plan_arm(cfg, dataclasses.replace(options, rollout_share=0.3), recipe_name=None, optimizer="distributed")
    assert bf16.rollout.weights > r.weights  # the BF16 arm's engine keeps BF16 linears


def test_vllm_engine_reserves_its_gpu_share_and_sleeps_during_training():
    """``rollout.engine=vllm`` on GPU: the engine reserves ``rollout.gpu_memory_utilization`` of each GPU and
    holds the whole model per ``rollout.tensor_parallel_size`` GPUs (not sharded like training). With
    ``rollout.enable_sleep`` its memory is free while training runs, and at generation time it sits next
    to the training state that stays resident (all but activations and logits)."""
    import dataclasses

    from nemo_fp8rl.launcher.memory import rollout_plan, suggest_fixes

    cfg, options = _gpu_cfg("qwen3_8b", 4, 1, 8, mb=1, fp8="blockwise")
    cfg.rollout.engine, cfg.rollout.fp8.scheme = "vllm", "vllm_block"
    cap, head = options.capacity_bytes, int(options.headroom * options.capacity_bytes)
    plan = plan_arm(cfg, options, recipe_name="blockwise", optimizer="distributed")
    r = plan.rollout
    assert r.reserved == int(0.5 * cap) and r.sleeps
    a = cfg.algorithm
    whole = rollout_plan(cfg.model, 1, 1, cfg.model.seq_length, a.prompts_per_step // options.dp * a.group_size,
                         "vllm_block", r.reserved, vocab_rows=cfg.model.padded_vocab(4))
    assert r.weights == whole.weights and r.kv_per_sequence == whole.kv_per_sequence
    assert plan.available == cap - head  # asleep while training
    resident = plan.train_total - plan.components["activations"] - plan.components["logits"]
    assert plan.resident == resident and plan.generation_fits == (resident + r.reserved <= cap - head)
    assert plan.fits

    cfg.rollout.enable_sleep = False  # keeps its memory: training gets what is left
    awake = plan_arm(cfg, options, recipe_name="blockwise", optimizer="distributed")
    assert not awake.rollout.sleeps and awake.available == cap - head - r.reserved

    # a share that leaves no room next to the resident training state: refused, the knob named
    cfg.rollout.enable_sleep = True
    cfg.rollout.gpu_memory_utilization = 0.9
    big = plan_arm(cfg, options, recipe_name="blockwise", optimizer="distributed")
    assert big.train_total <= big.available and not big.generation_fits and not big.fits
    assert "generation: resident training state" in big.summary() and "does NOT fit" in big.summary()
    fixes = suggest_fixes(cfg, options)
    assert any(f.startswith("rollout.gpu_memory_utilization=") for f in fixes), fixes
    fixed = float(next(f for f in fixes if f.startswith("rollout.gpu_memory_utilization=")).split("=")[1])
    assert plan_arm(cfg, dataclasses.replace(options, rollout_share=fixed), recipe_name="blockwise",
                    optimizer="distributed").fits


# --------------------------------------------------------------------------- the CLI
def _plan(*argv):
    from nemo_fp8rl.launch import plan_main

    return plan_main(list(argv))


def test_cli_prints_every_recipe_side_by_side(capsys):
    rc = _plan("model=qwen3_32b", "parallel=tp8_pp2", "fp8=blockwise", "parallel.micro_batch_size=1",
               "--world-size", "32", "--compare-megatron")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "layout TP=8 x PP=2 x DP=2" in out
    for col in ("bf16", "delayed", "tensorwise", "blockwise*", "mxfp8"):
        assert col in out
    for row in ("weights", "weight copies", "grads", "optimizer", "activations", "logits", "fits"):
        assert f"  {row}" in out
    assert "optimizer distributed" in out and "Megatron-LM theoretical memory" in out
    assert "this config (blockwise, optimizer " in out and ": fits" in out


@pytest.mark.parametrize("argv,needle", [
    (["rl=qwen3_8b_grpo_bf16", "rl.rollout.top_p=0.9"], "use +rl.rollout.top_p=0.9"),
    (["model=tiny", "rollout.enginex=vllm"], "rollout.enginex"),
])
def test_cli_bad_override_is_one_line_not_a_traceback(capsys, argv, needle):
    rc = _plan(*argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_cli_says_when_the_rollout_engine_is_what_does_not_fit(capsys):
    """32B BF16 with one vllm engine per GPU on an H100: training fits, but a whole BF16 model per GPU (61 GiB)
    does not fit the engine's share; the plan says so (not "use more GPUs per replica", which would not help)."""
    one = ("rl.rollout.tensor_parallel_size=1", "rl.rollout.gpu_memory_utilization=0.6")
    rc = _plan("rl=qwen2_5_32b_dapo_bf16", *one)
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "is smaller than its weights (61.0 GiB)" in out, out
    assert "training fits, the rollout engine does not" in out and "the BF16 arm generates in BF16" in out, out
    assert "a larger rollout.tensor_parallel_size splits it" in out, out
    assert _plan("rl=qwen2_5_32b_dapo_bf16", *one, "--gpu", "h200") == 0
    assert _plan("rl=qwen2_5_32b_dapo_bf16") == 0  # the stage as shipped: one engine per 2 GPUs


def _first_fix(out: str) -> tuple[list[str], int | None]:
    """The overrides and GPU count of the first knob the plan names ('would fit with: ...')."""
    import re

    line = next(ln for ln in out.splitlines() if "would fit with:" in ln)
    first = line.split("would fit with:", 1)[1].split("; or ")[0]
    gpus = re.search(r"(\d+) (?:GPUs per model replica, (\d+) for DP|GPUs for DP)", first)
    world = int(gpus.group(2) or gpus.group(1)) if gpus else None
    return re.findall(r"parallel\.\w+=\d+", first), world


@pytest.mark.parametrize("argv,world", [
    # 32B on one node at TP=1: no single knob is enough, the smallest layout that fits is named
    (["model=qwen3_32b", "fp8=blockwise", "parallel.micro_batch_size=1"], 8),
    # 8B at TP=4 with 8-sequence microbatches: a smaller micro batch (or more model parallelism)
    (["model=qwen3_8b", "fp8=blockwise", "parallel.micro_batch_size=8", "parallel.tensor_model_parallel_size=4",
      "parallel.sequence_parallel=true"], 8),
])
def test_cli_names_a_knob_that_makes_it_fit(capsys, argv, world):
    rc = _plan(*argv, "--world-size", str(world))
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "does NOT fit" in out and "would fit with:" in out, out
    fix, fix_world = _first_fix(out)
    assert fix, out
    # following the advice gives a layout the plan accepts
    assert _plan(*argv, *fix, "--world-size", str(fix_world or world)) == 0, capsys.readouterr().out
    capsys.readouterr()
    # the same layout on a (hypothetical) GPU with enough memory fits
    assert _plan(*argv, "--world-size", str(world), "--gpu-memory-gib", "2000") == 0


def test_cli_launcher_stage_without_its_required_paths(capsys):
    rc = _plan("rl=qwen3_8b_grpo_blockwise")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "rl/qwen3_8b_grpo_blockwise: 8 ranks" in out and "TP=4 x PP=1 x DP=2" in out
    assert "sequence_parallel=true" in out


def test_cli_cpu_plan_of_the_tiny_preset(capsys):
    assert _plan("model=tiny", "--device", "cpu") == 0
    out = capsys.readouterr().out
    assert "CPU (emulated FP8, float32)" in out and "rowwise" in out and "host memory" in out


@pytest.mark.parametrize("argv,words", [
    (["model=qwen3_8b", "--gpu", "a100x"], ["--gpu 'a100x'", "h100", "h200"]),
    (["model=qwen3_8b", "--rollout-share", "1.5"], ["--rollout-share 1.5", "(0, 1)"]),
    (["model=qwen3_8b", "parallel.micro_batch_sise=2"], ["micro_batch_sise"]),
    (["model=qwen9"], ["model=qwen9", "qwen3_8b"]),
    (["model=qwen3_8b", "parallel.tensor_model_parallel_size=3"], ["tensor_model_parallel_size=3"]),
    (["model=qwen3_8b", "parallel=tp8", "--world-size", "12"], ["--world-size 12", "TP x PP = 8"]),
    (["model=qwen3_8b", "fp8=rowwise", "parallel=tp8"], ["'rowwise' has no Transformer Engine recipe", "--device cpu"]),
    ([], ["give a config"]),
])
def test_cli_bad_input_names_the_key(capsys, argv, words):
    assert _plan(*argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


# --------------------------------------------------------------------------- the launcher's check
def test_launcher_refuses_a_layout_that_cannot_fit(tmp_path):
    # Qwen2.5-32B on one node (TP=8 x PP=1 x DP=1): too big for an 80 GB GPU with either optimizer
    shrink = ["rl=qwen2_5_32b_dapo_blockwise", f"base_results_dir={tmp_path}", *GPU_REQUIRED,
              "rl.parallel.pipeline_model_parallel_size=1", "rl.run.nodes=1"]
    with pytest.raises(LaunchError) as e:
        plans(*shrink)
    msg = str(e.value)
    assert "memory plan" in msg and "TP=8 x PP=1 x DP=1" in msg and "h100" in msg
    # the knob, scoped as the launcher spells it: PP=2 (16 GPUs, DP=1) fits training but not the stage's vLLM
    # engines next to the optimizer state that DP=1 leaves unsharded (both phases are planned)
    assert "rl.parallel.pipeline_model_parallel_size=4" in msg
    assert "+launcher.memory_plan=off" in msg
    (plan,) = plans(*shrink, "+launcher.memory_plan=off")  # the user's override wins
    assert plan.memory is None
    with pytest.raises(LaunchError, match="launcher.memory_plan='a100x'"):
        plans(*shrink, "+launcher.memory_plan=a100x")


def test_launcher_plans_shipped_gpu_stages(tmp_path):
    (plan,) = plans("rl=qwen2_5_32b_dapo_blockwise", f"base_results_dir={tmp_path}", *GPU_REQUIRED)
    assert plan.memory is not None and plan.memory.fits
    assert plan.memory.recipe == "blockwise" and plan.memory.optimizer == config_optimizer(plan.train, "gpu")
    assert plan.memory.capacity == 81559 * 2**20
    with pytest.raises(LaunchError, match="24 GiB GPU"):  # a smaller GPU cannot hold it
        plans("rl=qwen2_5_32b_dapo_blockwise", f"base_results_dir={tmp_path}", *GPU_REQUIRED,
              "+launcher.memory_plan=24")
    (cpu,) = plans("rl=tiny_grpo_blockwise", f"base_results_dir={tmp_path}")
    assert cpu.memory is None  # CPU stages: no GPU to plan


def test_launcher_dry_run_prints_the_plan(tmp_path):
    from ._launch import launch_cli

    proc = launch_cli(f"base_results_dir={tmp_path}", "rl=qwen3_8b_grpo_blockwise", *GPU_REQUIRED,
                      "launcher.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    assert "memory plan:       blockwise/" in proc.stdout and "fits" in proc.stdout
