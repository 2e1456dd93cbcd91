"""Forward+backward time of the emulated FP8 linear vs torch.nn.Linear vs torchao's emulated Float8Linear.

All arms run in one process, interleaved, on the same inputs; the table prints medians and the
overhead ratio of each emulation over the high-precision linear. Target: our overhead ratio
no worse than torchao's emulation for the recipes both implement (tensorwise, rowwise).

    python benchmarks/bench_fp8_linear.py [--repeats 20] [--shapes 1024x512x512,4096x1024x1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import warnings

import torch

from nemo_fp8rl.fp8 import Fp8Linear, get_recipe


def _time(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _fwd_bwd(mod, x, gy):
    def run():
        x.grad = None
        for p in mod.parameters():
            p.grad = None
        mod(x).backward(gy)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shapes", default="512x256x256,2048x512x512,4096x1024x1024",
                    help="comma-separated MxKxN (tokens x in_features x out_features)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except Exception:  # noqa: BLE001
        Float8Linear = None
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats} (median)")
    header = f"{'shape MxKxN':>16} {'arm':>22} {'ms':>9} {'x nn.Linear':>12}"
    print(header)
    print("-" * len(header))
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.lower().split("x"))
        torch.manual_seed(0)
        base = torch.nn.Linear(k, n)
        x = torch.randn(m, k, requires_grad=True)
        gy = torch.randn(m, n)
        arms = {"nn.Linear": base}
        for name in ("tensorwise", "rowwise", "blockwise", "mxfp8", "delayed"):
            arms[f"ours/{name}"] = Fp8Linear.from_linear(base, get_recipe(name))
        if Float8Linear is not None:
            for rn in ("tensorwise", "rowwise"):
                cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(rn), emulate=True)
                ao = Float8Linear.from_float(torch.nn.Linear(k, n), config=cfg)
                ao.weight, ao.bias = base.weight, base.bias
                arms[f"torchao/{rn}"] = ao
        times = {a: _time(_fwd_bwd(mod, x, gy), args.repeats) for a, mod in arms.items()}
        ref = times["nn.Linear"]
        for a, t in times.items():
            print(f"{shape:>16} {a:>22} {t * 1e3:9.2f} {t / ref:12.2f}")
        for rn in ("tensorwise", "rowwise"):
            if f"torchao/{rn}" in times:
                ratio = times[f"ours/{rn}"] / times[f"torchao/{rn}"]
                print(f"{shape:>16} {'ours/torchao ' + rn:>22} {'':9} {ratio:12.2f}")
        print()


if __name__ == "__main__":
    main()
