"""Generation throughput of the torch rollout engine vs the vLLM engine, side by side in one run.

Both engines get the same random Hugging Face-named weights (FP8 off, float32 on CPU / bfloat16 on GPU)
and the same prompts; each (batch size, response length) cell is timed for both, interleaved, and the
table prints generated tokens per second and the vLLM/torch ratio. EOS is ignored so every response has
exactly the asked length (tokens/s counts response tokens only). Also: the seconds of one weight sync
per million parameters (``update_weights``, the call the trainer makes before every rollout).

    python benchmarks/bench_rollout.py [--batches 16,64] [--lengths 32,128] [--repeats 3] [--model tiny]
                                       [--threads N]

``--model tiny``: hidden 128, 2 layers, 4 heads (head dim 32), vocabulary 512; ``--model small``: hidden
512, 8 layers, GQA 8/2, vocabulary 4096. ``--hf-path DIR`` (or ``registry:smollm2-135m``, fetched through
the model registry on first use) benchmarks a real pretrained checkpoint with its own weights instead:

    python benchmarks/bench_rollout.py --hf-path registry:smollm2-135m --batches 8 --lengths 32 --threads 1
 Numbers depend on the machine and on what else runs on it:
quote them with the machine (the first printed line names it). docs/results.md has numbers.

Each cell reports the fastest of ``--repeats`` timed runs after one warm-up run per engine: other jobs on
a shared machine only ever slow a run down, so the minimum is the least disturbed estimate (``timeit``'s
reasoning); the runs alternate between the engines so both see the same load. ``--threads`` sets torch's
intra-op thread count for both engines (vLLM's CPU kernels run on torch's OpenMP pool; the vllm engine
restores the count after every call). On a 2-core machine shared with another job, 2 threads were up to
40x slower and erratic (each OpenMP barrier waits for a preempted thread): compare at 1 thread there.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from nemo_fp8rl import machine
from nemo_fp8rl.config.model import ModelConfig
from nemo_fp8rl.rollout import SamplingParams, get_rollout_engine
from nemo_fp8rl.rollout.model import ModelShape, expected_hf_shapes

SHAPES = {
    "tiny": {"vocab_size": 512, "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "ffn_hidden_size": 384},
    "small": {"vocab_size": 4096, "num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 2,
              "ffn_hidden_size": 1536},
}


def random_weights(cfg: ModelConfig, seed: int = 0, logit_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """HF-named weights: linears ~ N(0, 1/fan_in), norms = 1, embeddings ~ N(0, 1).

    ``logit_scale`` multiplies the LM head (untied): > 1 gives peaked next-token distributions, like a
    trained model's, instead of near-uniform ones (benchmarks/gpu/part_vllm_parity.py uses 4).
    """
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, s in expected_hf_shapes(ModelShape.from_config(cfg), cfg.vocab_size).items():
        if len(s) == 1:
            sd[k] = torch.ones(s)
        elif k == "model.embed_tokens.weight":
            sd[k] = torch.randn(s, generator=g)
        else:
            sd[k] = torch.randn(s, generator=g) / s[1] ** 0.5 * (logit_scale if k == "lm_head.weight" else 1.0)
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--lengths", default="32,128")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-path", default=None, metavar="DIR|registry:NAME",
                    help="a Hugging Face checkpoint (its shape and weights) instead of --model's random weights")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for both engines (default: torch's)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM's first import: only the table on stdout
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.hf_path:
        import dataclasses

        from nemo_fp8rl.models.hf_config import resolve_model_config
        from nemo_fp8rl.models.hf_load import load_hf_state_dict

        cfg = resolve_model_config(ModelConfig(hf_path=args.hf_path))  # registry:NAME -> its cached directory
        cfg = dataclasses.replace(cfg, seq_length=args.prompt_len + max(lengths))
        sd = load_hf_state_dict(cfg.hf_path, cfg)
        args.model = Path(cfg.hf_path).name
    else:
        cfg = ModelConfig(name=args.model, seq_length=args.prompt_len + max(lengths),
                          untie_embeddings_and_output_weights=True, **SHAPES[args.model])
        sd = random_weights(cfg)
    n_params = sum(t.numel() for t in sd.values())
    engines = {
        "torch": get_rollout_engine("torch", cfg, fp8_scheme="off", eos_id=0, pad_id=0),
        "vllm": get_rollout_engine("vllm", cfg, fp8_scheme="off", eos_id=0, pad_id=0),
    }
    sync = {}
    for name, eng in engines.items():
        eng.update_weights(sd)  # first sync (vLLM: replaces the dummy weights)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            eng.update_weights(sd)
            ts.append(time.perf_counter() - t0)
        sync[name] = min(ts)

    g = torch.Generator().manual_seed(0)
    import vllm  # installed: the vllm engine above imported it

    print(f"{machine.describe_line(torch.get_num_threads())}, vllm {vllm.__version__}")
    print(f"model {args.model}: {n_params / 1e6:.2f}M parameters, prompt {args.prompt_len} tokens, "
          f"fastest of {args.repeats} (after 1 warm-up)")
    print(f"{'batch':>6} {'resp':>5} {'torch tok/s':>12} {'vllm tok/s':>11} {'vllm/torch':>10}")
    for B in batches:
        prompts = [[1 + (b * 7 + i) % (cfg.vocab_size - 1) for i in range(args.prompt_len)] for b in range(B)]
        for N in lengths:
            params = SamplingParams(temperature=1.0, max_new_tokens=N, stop_on_eos=False)
            times: dict[str, list[float]] = {k: [] for k in engines}
            for eng in engines.values():  # warm-up (vLLM's first call at a new batch shape is slower)
                eng.generate(prompts, params, g)
            for _ in range(args.repeats):
                for name, eng in engines.items():  # interleaved: both see the same machine load
                    t0 = time.perf_counter()
                    out = eng.generate(prompts, params, g)
                    times[name].append(time.perf_counter() - t0)
                    assert int(out.response_lens.sum()) == B * N
            tps = {k: B * N / min(v) for k, v in times.items()}
            print(f"{B:>6} {N:>5} {tps['torch']:>12.0f} {tps['vllm']:>11.0f} {tps['vllm'] / tps['torch']:>10.2f}")
    for name, s in sync.items():
        print(f"weight sync {name}: {s:.3f} s ({s / (n_params / 1e6):.3f} s per million parameters)")


if __name__ == "__main__":
    main()
