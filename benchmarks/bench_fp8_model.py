"""Model-level FP8 emulation cost: forward+backward of SmolLM2-135M on one fixed batch, BF16 vs each recipe.

Every arm is its own module tree over the same weight tensors (transformers' Llama, float32 on the CPU): the
unconverted model, and the model after ``convert_to_fp8(recipe)`` under the default ``fp8.compile=auto`` (what
a user and the trainer get), the fused quantizer everywhere (``fp8.compile=true``) and, for comparison, the
eager one (``fp8.compile=false``). The arms run
interleaved, round after round (A, B, C, A, B, C, ...), so machine load affects them alike; the table
prints each arm's median time and its ratio to the unconverted model's median.

Targets (issue 26, on the project's 2-core CPU): tensorwise <= 1.15x, blockwise <= 1.3x.

    python benchmarks/bench_fp8_model.py [--model registry:smollm2-135m] [--batch 16 --seq 96]
        [--recipes tensorwise,blockwise,delayed] [--compile all|auto|both|true|false] [--rounds 7] [--threads 2]

Without the real model (``--model tiny``) a 4-layer random Llama of SmolLM2's width runs instead.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from nemo_fp8rl import machine


def load_model(spec: str) -> torch.nn.Module:
    """``registry:<name>`` (a fetched registry model), a Hugging Face directory, or ``tiny``."""
    import transformers

    if spec == "tiny":
        cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                                       num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                       tie_word_embeddings=True)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).float()
    path = spec
    if spec.startswith("registry:"):
        from nemo_fp8rl.models.registry import model_path

        path = str(model_path(spec.split(":", 1)[1]))
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="registry:smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--recipes", default="tensorwise,blockwise,delayed")
    ap.add_argument("--compile", default="all", choices=("all", "auto", "both", "true", "false"),
                    help="fp8.compile arms: all = auto, true, false; both = true, false")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    from nemo_fp8rl.fp8 import convert_to_fp8, fused, get_recipe

    base = load_model(args.model)
    base.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), generator=g)
    modes = {"all": ("auto", "true", "false"), "auto": ("auto",), "both": ("true", "false"), "true": ("true",),
             "false": ("false",)}[args.compile]
    arms = {"unconverted": (base, "false")}
    for name in args.recipes.split(","):
        for mode in modes:
            # a new module tree over the same parameter tensors (memory: one model, not one per arm)
            m = convert_to_fp8(copy.deepcopy(base, memo={id(p): p for p in base.parameters()}), get_recipe(name))
            arms[f"{name} ({ {'auto': 'default auto', 'true': 'fused', 'false': 'eager'}[mode] })"] = (m, mode)

    def step(model, mode):
        with fused.compile_mode_set(mode):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            model.zero_grad(set_to_none=True)  # the arms share the parameters: free the grads each time

    print(f"{machine.describe_line(torch.get_num_threads())}; model {args.model}, "
          f"batch {args.batch}x{args.seq}, rounds {args.rounds} (+1 warm-up, compiles included there)")
    t0 = time.perf_counter()
    for name, (m, mode) in arms.items():  # warm-up round: compiles, allocator
        step(m, mode)
    print(f"warm-up round: {time.perf_counter() - t0:.1f} s")
    times = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (m, mode) in arms.items():
            t = time.perf_counter()
            step(m, mode)
            times[name].append(time.perf_counter() - t)
    ref = statistics.median(times["unconverted"])
    header = f"{'arm':>24} {'median s':>9} {'min s':>8} {'x unconverted':>14}"
    print(header)
    print("-" * len(header))
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>24} {med:9.3f} {min(ts):8.3f} {med / ref:14.2f}")
    if fused.compile_unavailable():
        print(f"note: compile unavailable ({fused.compile_unavailable()}): the fused arms ran eager")


if __name__ == "__main__":
    main()
