"""Per-token truncated-importance-sampling weights of a recorded run, step by step (issue 41).

Rebuilds the run recorded in ``--run`` (its ``study_run.json``: overrides and seed; its warm-up from
``--warmup-cache``), runs its first ``--steps`` RL steps exactly as the run did, and at each step captures
what the policy loss receives: the trainer's old log-probs, the rollout engine's log-probs, the advantages
and the rollout-correction weights. The step's ``reward/mean`` is compared with the record's
``metrics.jsonl`` (same seed and config on CPU give the same trajectory), so a row that does not reproduce
is flagged, not silently reported.

Per step, over response tokens with a non-zero advantage (m [B, T] the response mask, A [B] the
sequence advantage broadcast over its tokens):

    rho_t = exp(old_logp_t - rollout_logp_t) = pi_old / pi_rollout       (the TIS ratio; old = the trainer)
    w_t   = min(rho_t, C)                                                (``algorithm.tis_cap`` = C)
    capped = share of tokens with rho_t > C;  low = share with rho_t < 1 - eps_low
    push(sign) = sum_{t: sign(A_t) = sign} |A_t| w_t / sum_t |A_t|       (how much of the first
        minibatch's policy-gradient mass each sign carries under TIS, ratio = 1 there)
    fixed-clip view of the same tokens, old = rollout (the ``fp8`` arm): its first-minibatch ratio is
        rho_t itself, and the clipped surrogate passes gradient rho_t A_t unless A_t < 0 and
        rho_t < 1 - eps_low, or A_t > 0 and rho_t > 1 + eps_high:
    zeroed(sign) = share of that sign's tokens whose gradient fixed clip zeroes;
    push_fixed(sign) = sum_{t: sign, not zeroed} |A_t| rho_t / sum_t |A_t|

Also checked at every step: the weights the loss received equal min(rho_t, C) (``max |w - min(rho, C)|``).

    python benchmarks/study/tis_weights.py --run benchmarks/study/records/track/2xlr/fp8_recompute_tis/seed1 \
        --warmup-cache /work/study-out/track/.warmup_cache --steps 10 --json runs/tis_weights.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout_accuracy as ra  # noqa: E402  (build(): a run's trainer as nemo_fp8rl.train builds it)


def token_stats(old_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, weights: torch.Tensor, cap: float, eps_low: float, eps_high: float) -> dict:
    """The module docstring's per-step numbers. All inputs ``[B, T]`` float (advantages broadcast over T)."""
    m = (mask > 0) & (advantages != 0)
    d = (old_logp - rollout_logp)[m].double()
    rho = d.clamp(-20.0, 20.0).exp()
    a = advantages[m].double()
    w = weights[m].double()
    pos, neg = a > 0, a < 0
    abs_a = a.abs()
    total = float(abs_a.sum()) or 1.0
    zeroed = (neg & (rho < 1.0 - eps_low)) | (pos & (rho > 1.0 + eps_high))
    q = torch.quantile(rho, torch.tensor([0.01, 0.1, 0.5, 0.9, 0.99], dtype=rho.dtype)).tolist() if rho.numel() else [math.nan] * 5
    out = {
        "tokens": int(m.sum()), "tokens_pos": int(pos.sum()), "tokens_neg": int(neg.sum()),
        "rho_q01": q[0], "rho_q10": q[1], "rho_q50": q[2], "rho_q90": q[3], "rho_q99": q[4],
        "capped": float((rho > cap).double().mean()) if rho.numel() else math.nan,
        "low": float((rho < 1.0 - eps_low).double().mean()) if rho.numel() else math.nan,
        "weight_check": float((w - rho.clamp(max=cap)).abs().max()) if rho.numel() else 0.0,
    }
    for name, s in (("pos", pos), ("neg", neg)):
        n = int(s.sum())
        out[f"mean_w_{name}"] = float(w[s].mean()) if n else math.nan
        out[f"zeroed_{name}"] = float(zeroed[s].double().mean()) if n else math.nan
        out[f"push_tis_{name}"] = float((abs_a[s] * w[s]).sum()) / total
        out[f"push_fixed_{name}"] = float((abs_a[s & ~zeroed] * rho[s & ~zeroed]).sum()) / total
    return out


def _stop_now(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a record directory with study_run.json and metrics.jsonl")
    ap.add_argument("--warmup-cache", required=True, help="the study's .warmup_cache (the run's warm-up)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Hydra overrides on top (then the record is not a reference and no row is compared)")
    ap.add_argument("--json", default="", help="append one JSON line per step here")
    args = ap.parse_args()

    run = Path(args.run)
    meta_path = run / "study_run.json"
    if not meta_path.is_file():
        sys.exit(f"--run {run}: no study_run.json there (a run_study.py record directory is expected)")
    meta = json.loads(meta_path.read_text())
    recorded = {}
    if (run / "metrics.jsonl").is_file() and not args.extra:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            recorded[int(row["step"])] = row
    with tempfile.TemporaryDirectory(prefix="tis_weights_") as tmp:
        trainer = ra.build([*meta["overrides"], f"trainer.max_steps={meta['steps']}", *args.extra], int(meta["seed"]), Path(tmp), Path(args.warmup_cache))
        # The trainer traps SIGTERM/SIGINT and only sets a flag that its fit() reads; the loop below does not,
        # so a signal was ignored until all steps had run. This measurement keeps no checkpoint: a signal
        # stops it at once, and the finally below closes the trainer (engine, reward worker, its handlers).
        # A signal during the build (its warm-up can take minutes) was kept by the trainer's handler: it stops
        # the measurement here, before the first step.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop_now)
        try:
            if trainer._stop_signal is not None:
                _stop_now(trainer._stop_signal, None)
            a = trainer.cfg.algorithm
            if a.old_logprobs != "recompute" or a.rollout_correction != "tis":
                sys.exit(f"{run}: algorithm.old_logprobs={a.old_logprobs}, rollout_correction={a.rollout_correction};"
                         " this measures TIS weights of a recompute run (old_logprobs=recompute, rollout_correction=tis)")
            captured = {}
            update = trainer._update

            def capture(data, lower, upper):
                captured.update({k: data[k].detach().clone() for k in ("old_logp", "rollout_logp", "advantages",
                                                                        "mask", "weights")})
                return update(data, lower, upper)

            trainer._update = capture
            for _ in range(args.steps):
                metrics = trainer.step()
                step = trainer.step_idx - 1
                row = {"run": str(run), "step": step, "extra": args.extra, "reward": float(metrics["reward/mean"]),
                       **token_stats(captured["old_logp"], captured["rollout_logp"], captured["advantages"],
                                     captured["mask"], captured["weights"], a.tis_cap, a.eps_low, a.eps_high)}
                if step in recorded:
                    row["reproduces"] = abs(row["reward"] - float(recorded[step]["reward/mean"])) < 1e-9
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                               if k not in ("run", "extra")), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            trainer.close()


if __name__ == "__main__":
    main()
