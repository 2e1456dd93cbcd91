"""Part vllm_rollout (needs vLLM's CUDA build; skipped where vLLM is not installed): vLLM generation
throughput, BF16 vs FP8: Qwen3-8B layer widths (conf/model/qwen3_8b.yaml, ``layers`` layers), dummy
weights (``load_format="dummy"``), eager mode; arms ``bf16``, ``fp8_w8a8`` (online ``fp8_per_tensor`` =
our ``vllm_w8a8``: per-tensor weight, dynamic per-token activations) and ``fp8_block`` (a block-FP8
checkpoint config, 128x128 weight scales, dynamic 1x128 activations = our ``vllm_block``); decode
tokens/s (256 prompts x 128 new tokens) and prefill tokens/s (32 x 2048-token prompts), and the ratio
to BF16. With 4 layers the BF16 LM head (151936 x 4096) is ~45% of the weights and eager decode carries
vLLM's per-step CPU overhead, so the FP8 decode gain here is a lower bound of a 36-layer model's;
prefill shows the GEMMs. Dry run (``GPU_CHECK_DRY_VLLM=1``): a tiny float32 model, FP8 off.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
from vllm_common import _VLLM_CHILD_ENV, _close_llm, _quant_methods, _qwen3_8b_config


def run(ctx, layers: int = 4, repeats: int = 2) -> None:
    """Generation throughput of vLLM, BF16 vs FP8, same shapes, dummy weights, arms in one process."""
    res, save, dry, deadline = ctx.res, ctx.save, ctx.dry, ctx.deadline
    from nemo_fp8rl.rollout import vllm_engine, vllm_patches

    # the vllm engine's FP8 kernel settings (DeepGEMM without UE8M0 scales, no FlashInfer block GEMM), so
    # the arms time the kernels `rollout.engine=vllm` runs
    fp8_env = getattr(vllm_patches, "VLLM_FP8_ENV", {})
    for k, v in {**_VLLM_CHILD_ENV, **fp8_env}.items():
        os.environ.setdefault(k, v)
    import vllm
    from vllm import LLM
    from vllm import SamplingParams as VSP
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.models.hf_config import model_config_to_hf_config

    if dry:  # CPU: a tiny model in float32, the high-precision arm only (vLLM's FP8 needs a GPU here)
        decode = {"batch": 8, "prompt": 8, "new": 8}
        prefill = {"batch": 2, "prompt": 64}
        cfg = ModelConfig(name="tiny", vocab_size=512, num_layers=2, hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, kv_channels=32, ffn_hidden_size=256, qk_layernorm=True, seq_length=128)
        dtype = "float32"
    else:
        decode = {"batch": 256, "prompt": 128, "new": 128}
        prefill = {"batch": 32, "prompt": 2048}
        cfg = _qwen3_8b_config(layers, seq_length=prefill["prompt"] + 64)
        dtype = "bfloat16"
    # the vllm engine's two FP8 schemes, built as it builds them: vllm_w8a8 = per-tensor weight scale +
    # dynamic per-token activations, vLLM's online "fp8_per_tensor" (before the online shorthands existed,
    # quantization="fp8" did the same); vllm_block = the checkpoint format our FP8 sync sends (E4M3
    # weights + 128x128 weight_scale_inv, dynamic 1x128 activations), declared in config.json as a
    # block-FP8 checkpoint, which dummy loading fills
    w8a8 = "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"
    block_cfg = getattr(vllm_engine, "BLOCK_FP8_QUANTIZATION_CONFIG",
                        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    kernel_report = getattr(vllm_patches, "fp8_linear_report", None)
    arms = [("bf16" if not dry else "float32", {}, None, None),
            ("fp8_w8a8", {"quantization": w8a8}, None, "vllm_w8a8"),
            ("fp8_block", {}, dict(block_cfg), "vllm_block")]
    res.update(vllm=vllm.__version__, shape={k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
        "vocab_size")}, dtype=dtype, enforce_eager=True, weights="dummy (load_format=dummy)",
        decode=decode | {"what": "generated tokens/s: batch prompts of `prompt` random ids, `new` tokens each, EOS ignored"},
        prefill=prefill | {"what": "prompt tokens/s: batch prompts of `prompt` random ids, 1 new token"},
        repeats=repeats, w8a8_quantization=w8a8, fp8_env={k: os.environ.get(k) for k in fp8_env}, arms={},
        skipped={}, errors={})
    g = torch.Generator().manual_seed(0)
    dec_prompts = [{"prompt_token_ids": torch.randint(1, cfg.vocab_size, (decode["prompt"],), generator=g).tolist()}
                   for _ in range(decode["batch"])]
    pre_prompts = [{"prompt_token_ids": torch.randint(1, cfg.vocab_size, (prefill["prompt"],), generator=g).tolist()}
                   for _ in range(prefill["batch"])]
    arm_times: list[float] = []
    for name, kw, qcfg, scheme in arms:
        if dry and name != "float32":
            res["skipped"][name] = "dry run: the FP8 arms run on the GPU"
            continue
        est = max(arm_times, default=45.0)
        if deadline - time.time() < est:
            res["skipped"][name] = f"out of time ({deadline - time.time():.0f}s left, ~{est:.0f}s per arm)"
            continue
        t_arm = time.monotonic()
        llm = None
        tmp = tempfile.TemporaryDirectory(prefix="gpu_check_vllm_")
        try:
            config = model_config_to_hf_config(cfg, dtype=dtype)
            if qcfg:
                config["quantization_config"] = qcfg
            (Path(tmp.name) / "config.json").write_text(json.dumps(config))
            t0 = time.perf_counter()
            llm = LLM(model=tmp.name, skip_tokenizer_init=True, load_format="dummy", dtype=dtype, enforce_eager=True,
                      max_model_len=cfg.seq_length, max_num_seqs=max(decode["batch"], prefill["batch"]),
                      max_num_batched_tokens=max(8192, prefill["prompt"]), enable_prefix_caching=False,
                      generation_config="vllm", seed=0,
                      **({} if dry else {"gpu_memory_utilization": 0.3}), **kw)
            arm = {"build_s": round(time.perf_counter() - t0, 1)}
            try:
                arm["quant_methods"] = llm.collective_rpc(_quant_methods)[0]
                if scheme and kernel_report is not None:  # the engine's check that the kernels compute the scheme
                    report = llm.collective_rpc(kernel_report, args=(scheme,))[0]
                    arm["fp8_kernels"], arm["fp8_problems"] = report["kernels"], report["problems"][:8]
            except Exception as e:  # noqa: BLE001  (informational only)
                arm.setdefault("quant_methods", f"unknown ({type(e).__name__})")
                arm["fp8_kernels"] = f"unknown ({type(e).__name__}: {e})"[:300]

            def timed(prompts, sp, llm=llm):
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                return time.perf_counter() - t, outs

            dec_sp = VSP(temperature=1.0, max_tokens=decode["new"], ignore_eos=True, detokenize=False)
            pre_sp = VSP(temperature=1.0, max_tokens=1, ignore_eos=True, detokenize=False)
            # warm-up at the timed batch shapes (prefill chunks and decode batch: kernels JIT-compile and
            # autotune per shape on first use), a few tokens only
            timed(dec_prompts, VSP(temperature=1.0, max_tokens=4, ignore_eos=True, detokenize=False))
            dec, pre = [], []
            for _ in range(repeats):
                s, outs = timed(dec_prompts, dec_sp)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                if n != decode["batch"] * decode["new"]:
                    raise RuntimeError(f"decode generated {n} tokens, expected {decode['batch'] * decode['new']}")
                dec.append(s)
                s, _ = timed(pre_prompts, pre_sp)
                pre.append(s)
            # fastest of the repeats: the least disturbed by anything else on the machine
            arm.update(decode_s=[round(x, 4) for x in dec], prefill_s=[round(x, 4) for x in pre],
                       decode_tokens_per_s=decode["batch"] * decode["new"] / min(dec),
                       prefill_tokens_per_s=prefill["batch"] * prefill["prompt"] / min(pre))
            res["arms"][name] = arm
        except Exception as e:  # noqa: BLE001  (one arm failing must not hide the others)
            res["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
            res.setdefault("traceback", "")
            res["traceback"] += f"--- {name}\n{traceback.format_exc()[-4000:]}\n"
        finally:
            if llm is not None:
                _close_llm(llm)
            llm = None
            tmp.cleanup()
            arm_times.append(time.monotonic() - t_arm)
            res.setdefault("arm_seconds", {})[name] = round(arm_times[-1], 1)
            save()
    base = res["arms"].get("bf16" if not dry else "float32")
    if base:
        res["vs_high_precision"] = {k: {"decode": a["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                                        "prefill": a["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]}
                                    for k, a in res["arms"].items()}
    if res["errors"]:
        res["failed"] = f"arm(s) {sorted(res['errors'])} failed"


def headline(res: dict) -> str:
    rel = res.get("vs_high_precision", {})
    parts = [f"{k} decode {a['decode_tokens_per_s']:.0f} tok/s" + (f" ({rel[k]['decode']:.2f}x)" if k in rel else "")
             + f", prefill {a['prefill_tokens_per_s']:.0f} tok/s" + (f" ({rel[k]['prefill']:.2f}x)" if k in rel else "")
             for k, a in res.get("arms", {}).items()]
    parts += [f"{k}: {v[:80]}" for k, v in res.get("errors", {}).items()]
    parts += [f"{k} skipped" for k in res.get("skipped", {})]
    return "; ".join(parts)


def tables(res: dict) -> list[str]:
    if not res.get("arms"):
        return []
    vr = res
    lines = [(f"vLLM generation ({vr.get('vllm')}, {vr['shape']['num_layers']} layers of "
              f"{vr['shape']['hidden_size']} width, {vr.get('dtype')}, dummy weights; decode: "
              f"{vr['decode']['batch']} x {vr['decode']['new']} new tokens, prefill: "
              f"{vr['prefill']['batch']} x {vr['prefill']['prompt']} prompt tokens; fastest of "
              f"{vr.get('repeats')}):"), "",
             "| arm | decode tok/s | x high precision | prefill tok/s | x high precision | quant methods (FP8 kernels) |",
             "|---|---|---|---|---|---|"]
    rel = vr.get("vs_high_precision", {})
    for k, a in vr["arms"].items():
        r = rel.get(k, {})
        qm = ", ".join(a["quant_methods"]) if isinstance(a["quant_methods"], list) else a["quant_methods"]
        kern = a.get("fp8_kernels")
        kern = f" ({', '.join(kern) if isinstance(kern, list) else kern})" if kern is not None else ""
        lines.append(f"| {k} | {a['decode_tokens_per_s']:.0f} | {r.get('decode', float('nan')):.2f} | "
                     f"{a['prefill_tokens_per_s']:.0f} | {r.get('prefill', float('nan')):.2f} | {qm}{kern} |")
    return lines
