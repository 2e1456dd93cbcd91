"""``make demo``: the CPU default job.

Until the RL trainer lands this runs the FP8 numerics demo: for every training recipe, the relative
error that FP8 emulation puts on a linear layer's three GEMMs (forward, dgrad, wgrad), on Gaussian
activations and on activations with outlier channels (where granularity matters).
"""

from __future__ import annotations

import torch

from nemo_fp8rl.fp8 import Fp8LinearState, fp8_linear, get_recipe, list_recipes


def linear_error_table(tokens: int = 1024, k: int = 512, n: int = 512, seed: int = 0) -> list[dict]:
    """Relative Frobenius error of y, dx and dW under each recipe vs float32, for two input kinds."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    gy = torch.randn(tokens, n, generator=g)
    gauss = torch.randn(tokens, k, generator=g)
    outlier = gauss.clone()
    outlier[:, :4] *= 50.0  # a few loud channels, as in LLM activations
    rows = []
    for kind, x0 in (("gaussian", gauss), ("outlier channels", outlier)):
        x_ref = x0.clone().requires_grad_()
        w_ref = w.clone().requires_grad_()
        torch.nn.functional.linear(x_ref, w_ref).backward(gy)
        y_ref = x0 @ w.t()
        for name in list_recipes():
            r = get_recipe(name)
            x = x0.clone().requires_grad_()
            ww = w.clone().requires_grad_()
            st = Fp8LinearState(r)
            for _ in range(2 if name == "delayed" else 1):  # delayed: second step uses history scales
                x.grad = ww.grad = None
                y = fp8_linear(x, ww, None, r, st)
                y.backward(gy)

            def rel(a, b):
                return ((a - b).norm() / b.norm()).item()

            rows.append({"input": kind, "recipe": name, "y": rel(y.detach(), y_ref),
                         "dgrad": rel(x.grad, x_ref.grad), "wgrad": rel(ww.grad, w_ref.grad)})
    return rows


def main() -> None:
    rows = linear_error_table()
    print("FP8 emulation: relative error of a 1024x512 @ 512x512 linear vs float32")
    print(f"{'input':<18}{'recipe':<12}{'forward':>10}{'dgrad':>10}{'wgrad':>10}")
    for r in rows:
        print(f"{r['input']:<18}{r['recipe']:<12}{r['y']:>10.4f}{r['dgrad']:>10.4f}{r['wgrad']:>10.4f}")


if __name__ == "__main__":
    main()
