"""Write golden values of NeMo RL's real ``ClippedPGLossFn`` for tests/integrations/test_nemo_rl.py.

Not run in CI (NeMo RL is not on PyPI). Usage, with a NeMo RL checkout (a git clone of
github.com/NVIDIA-NeMo/RL at the commit to match)::

    python tests/integrations/make_nemo_rl_fixture.py /path/to/RL [--out nemo_rl_golden.json]

The script imports ``nemo_rl.algorithms.loss`` from the checkout (nothing is stubbed), so the Python running
it needs what that import chain loads. What worked for commit 7ea279ab on CPU, in a scratch venv that sees
this project's venv (torch 2.13.0 CPU) through a ``.pth`` file: ``pip install requests ray pyzmq pynvml
uvicorn fastapi "transformers>=5.5,<5.9" mlflow swanlab wandb prometheus_client`` (pydantic, numpy, etc.
came from the project venv). Check that pip installed no other torch.

For every config of ``CONFIGS`` it runs the loss on fixed seeded float64 inputs (stored in the fixture, so
the tests do not depend on torch's random streams) with global counts larger than the microbatch's own
(as for one microbatch of a larger global batch), and records the loss, d loss / d next_token_logprobs,
the metrics and ``metric_normalizations``. It also records the commit hash of the checkout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

B, S = 4, 9
G_TOK_EXTRA, G_SEQ_EXTRA = 5, 2  # global counts = local counts + these

CONFIGS: dict[str, dict] = {
    "defaults": {},
    "no_kl": {"reference_policy_kl_penalty": 0.0},
    "sequence_level": {"token_level_loss": False},
    "dapo_clip_higher": {"ratio_clip_max": 0.28, "reference_policy_kl_penalty": 0.0},
    "dual_clip": {"ratio_clip_c": 3.0},
    "kl_k1": {"reference_policy_kl_type": "k1", "reference_policy_kl_penalty": 0.05},
    "kl_k2_seq": {
        "reference_policy_kl_type": "k2",
        "reference_policy_kl_penalty": 0.05,
        "token_level_loss": False,
    },
    "kl_clamps_bind": {
        "reference_policy_kl_penalty": 0.1,
        "kl_input_clamp_value": 0.2,
        "kl_output_clamp_value": 0.01,
    },
    "kl_no_clamps": {
        "reference_policy_kl_penalty": 0.1,
        "kl_input_clamp_value": None,
        "kl_output_clamp_value": None,
    },
    "kl_on_policy_approx": {"use_on_policy_kl_approximation": True, "reference_policy_kl_penalty": 0.1},
    "kl_in_reward": {"use_kl_in_reward": True},
    "is_plain": {"use_importance_sampling_correction": True},
    "tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
    },
    "tis_min": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "icepop": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.3,
        "truncated_importance_sampling_ratio_min": 0.8,
    },
    "seq_mask_tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.1,
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "gspo": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.0,
    },
    "gspo_is_tis": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
    },
    "reinforce": {"disable_ppo_ratio": True},
    "reinforce_dual_clip": {
        "disable_ppo_ratio": True,
        "ratio_clip_c": 3.0,
        "reference_policy_kl_penalty": 0.0,
    },
    "force_on_policy": {"force_on_policy_ratio": True},
    "cispo": {"use_cispo": True, "ratio_clip_max": 0.28},
    "vapo_nll": {"positive_example_nll_weight": 0.1},
}


def make_inputs() -> dict[str, list]:
    """Seeded float64 inputs in NeMo RL's layout ([B, S] aligned with input_ids, sample_mask [B])."""
    g = torch.Generator().manual_seed(1234)
    f64 = torch.float64
    prev = -torch.rand(B, S, generator=g, dtype=f64) * 2 - 0.05
    gen = prev + 0.15 * torch.randn(B, S, generator=g, dtype=f64)
    ref = prev + 0.3 * torch.randn(B, S, generator=g, dtype=f64)
    curr = prev + 0.25 * torch.randn(B, S, generator=g, dtype=f64)
    adv = torch.randn(B, S, generator=g, dtype=f64)
    lengths = torch.tensor([9, 6, 8, 4])
    token_mask = (torch.arange(S)[None] < lengths[:, None]).to(f64)
    token_mask[:, :2] = 0  # two prompt tokens
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=f64)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=f64)
    return {
        "prev_logprobs": prev.tolist(),
        "generation_logprobs": gen.tolist(),
        "reference_policy_logprobs": ref.tolist(),
        "advantages": adv.tolist(),
        "token_mask": token_mask.tolist(),
        "sample_mask": sample_mask.tolist(),
        "rewards": rewards.tolist(),
        "next_token_logprobs": curr[:, 1:].tolist(),
    }


def global_counts(inputs: dict[str, list]) -> tuple[float, float]:
    tm = torch.tensor(inputs["token_mask"], dtype=torch.float64)[:, 1:]
    sm = torch.tensor(inputs["sample_mask"], dtype=torch.float64)
    return float((tm * sm[:, None]).sum()) + G_TOK_EXTRA, float(sm.sum()) + G_SEQ_EXTRA


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("nemo_rl_checkout", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("nemo_rl_golden.json"))
    ap.add_argument("--check-dropin", action="store_true", help="also run ours through NeMo RL's call path")
    args = ap.parse_args()
    root = args.nemo_rl_checkout.resolve()
    sys.path.insert(0, str(root))
    from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = (root / "COMMIT").read_text().strip()  # a `git archive` export: write the hash there

    inputs = make_inputs()
    g_tok, g_seq = global_counts(inputs)
    cases = {}
    for name, overrides in CONFIGS.items():
        loss_fn = ClippedPGLossFn(ClippedPGLossConfig(**overrides))
        data = BatchedDataDict(
            {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items() if k != "next_token_logprobs"}
        )
        lp = torch.tensor(inputs["next_token_logprobs"], dtype=torch.float64, requires_grad=True)
        loss, metrics = loss_fn(
            data=data,
            global_valid_seqs=torch.tensor(g_seq, dtype=torch.float64),
            global_valid_toks=torch.tensor(g_tok, dtype=torch.float64),
            next_token_logprobs=lp,
        )
        loss.backward()
        cases[name] = {
            "config": overrides,
            "loss": loss.item(),
            "grad": lp.grad.tolist(),
            "metrics": {k: float(v) for k, v in metrics.items()},
            "metric_normalizations": {k: v.value for k, v in loss_fn.metric_normalizations.items()},
            "loss_type": loss_fn.loss_type.value,
            "input_type": loss_fn.input_type.value,
        }
    out = {
        "nemo_rl_commit": commit,
        "generator": "tests/integrations/make_nemo_rl_fixture.py",
        "global_valid_toks": g_tok,
        "global_valid_seqs": g_seq,
        "inputs": inputs,
        "cases": cases,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(cases)} cases from NeMo RL {commit} to {args.out}")
    if args.check_dropin:
        check_dropin(inputs, g_tok, g_seq)


def check_dropin(inputs: dict[str, list], g_tok: float, g_seq: float) -> None:
    """Run ours and NeMo RL's class through NeMo RL's own call path (float32 logits), print the gaps.

    ``wrap_loss_fn_with_input_preparation`` is how the Megatron worker calls the loss (keyword arguments).
    NeMo RL's ``prepare_loss_input`` moves tensors to CUDA, so on a CPU ``prepare_on_cpu`` takes its place:
    its LOGPROB branch, dispatched on ``loss_fn.input_type == LossInputType.LOGPROB`` with NeMo RL's enum
    (ours must be that very enum). Needs this project importable (``PYTHONPATH=<repo root>``).
    """
    from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.algorithms.loss.interfaces import LossInputType
    from nemo_rl.algorithms.loss.wrapper import wrap_loss_fn_with_input_preparation
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    def prepare_on_cpu(logits, data, loss_fn, **_):
        if loss_fn.input_type != LossInputType.LOGPROB:
            raise TypeError(f"input_type {loss_fn.input_type!r} is not NeMo RL's LossInputType.LOGPROB")
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, data["input_ids"][:, 1:, None])
        return {"next_token_logprobs": logp.squeeze(-1)}, data

    from nemo_fp8rl.integrations.nemo_rl import ClippedPGLossFn as Ours

    g = torch.Generator().manual_seed(7)
    vocab = 11
    input_ids = torch.randint(0, vocab, (B, S), generator=g)
    logits0 = torch.randn(B, S, vocab, generator=g)
    worst = 0.0
    for name, overrides in CONFIGS.items():
        results = []
        for cls in (ClippedPGLossFn, Ours):
            data = BatchedDataDict(
                {
                    k: torch.tensor(v, dtype=torch.float32)
                    for k, v in inputs.items()
                    if k != "next_token_logprobs"
                }
            )
            data["input_ids"] = input_ids
            logits = logits0.clone().requires_grad_(True)
            loss_fn = cls(ClippedPGLossConfig(**overrides))
            loss, metrics = wrap_loss_fn_with_input_preparation(
                logits, data, torch.tensor(g_seq), torch.tensor(g_tok), loss_fn, prepare_on_cpu
            )
            loss.backward()
            results.append((loss.item(), logits.grad.clone(), metrics))
        (l0, g0, m0), (l1, g1, m1) = results
        rel = max(
            abs(l1 - l0) / max(abs(l0), 1e-12), float((g1 - g0).abs().max() / g0.abs().max().clamp(min=1e-12))
        )
        worst = max(worst, rel)
        missing = sorted(set(m0) - set(m1))
        print(f"{name:24s} loss/grad max rel diff {rel:.1e}" + (f"  MISSING {missing}" if missing else ""))
    print(f"worst {worst:.1e} over {len(CONFIGS)} configs (float32, through NeMo RL's call path)")


if __name__ == "__main__":
    main()
