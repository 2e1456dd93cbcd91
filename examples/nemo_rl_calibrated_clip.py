"""NeMo RL GRPO with Calibrated Clipping: the loss swap and the BF16 shadow forward, runnable on a CPU.

    .venv/bin/python examples/nemo_rl_calibrated_clip.py --steps 8

NeMo RL itself is not needed to run this: ``ToyPolicy`` stands in for NeMo RL's ``Policy`` with the three
methods the calibration needs (``get_logprobs``, ``train``, ``run_all_workers_single_data``) and one
in-process "worker" that carries :class:`~nemo_fp8rl.integrations.nemo_rl.Fp8ShadowWorkerMixin`, as a
NeMo RL ``MegatronPolicyWorker`` subclass would. Its model is a toy bigram policy with emulated FP8
(``tensorwise``); the "rollout engine" is a copy with another FP8 scheme (``rowwise``), so the generation
and trainer log-probs disagree as they do with vLLM FP8. ``train`` calls the loss exactly as NeMo RL's
workers do (keyword arguments, ``next_token_logprobs`` ``[B, S-1]``, global valid counts per global batch,
metrics divided by the number of global batches and summed over microbatches).

The driver loop below (``run``) is what changes in a NeMo RL GRPO script, marked ``# <-``:
the import of ``ClippedPGLossFn`` and, at calibration steps, the three shadow/FP8 log-prob passes around
``policy.train`` and ``calibration.update``. docs/integrations.md has the NeMo RL wiring.
"""

from __future__ import annotations

import argparse
import copy
from collections import defaultdict

import torch

from nemo_fp8rl.algorithms import grpo_advantages, metrics_to_floats
from nemo_fp8rl.fp8 import convert_to_fp8, get_recipe
from nemo_fp8rl.integrations.nemo_rl import ClippedPGLossFn, Fp8ShadowWorkerMixin, shadow_logprobs  # <-

VOCAB, PROMPT, RESPONSE, TARGET = 16, 4, 12, 3


def bigram_policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    d = 64
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, d),
        torch.nn.Linear(d, d),
        torch.nn.GELU(),
        torch.nn.Linear(d, d),
        torch.nn.GELU(),
        torch.nn.Linear(d, VOCAB),
    )


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` log-probs of ``input_ids[:, 1:]`` (with the graph)."""
    logp = torch.log_softmax(model(input_ids[:, :-1]).float(), -1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


class ToyWorker(Fp8ShadowWorkerMixin):
    def __init__(self, model: torch.nn.Module):
        self.model = model


class ToyPolicy:
    """Stand-in for NeMo RL's ``Policy`` (one in-process worker)."""

    def __init__(self, model: torch.nn.Module, lr: float, minibatches: int, microbatches: int):
        self.worker = ToyWorker(model)
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.minibatches, self.microbatches = minibatches, microbatches

    def run_all_workers_single_data(self, method_name: str, *args, **kwargs) -> list:
        return [getattr(self.worker, method_name)(*args, **kwargs)]

    @torch.no_grad()
    def get_logprobs(self, data: dict) -> dict:
        lp = token_logprobs(self.worker.model, data["input_ids"])
        return {"logprobs": torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)}  # NeMo RL: column 0 is 0

    def train(self, data: dict, loss_fn) -> dict:
        """NeMo RL worker semantics: per global batch, global counts; sum of microbatch metrics / n_gb."""
        n = data["input_ids"].shape[0]
        out: dict[str, list] = defaultdict(list)
        for gb in torch.arange(n).chunk(self.minibatches):
            mask = data["token_mask"][gb, 1:] * data["sample_mask"][gb, None]
            global_valid_toks, global_valid_seqs = mask.sum(), data["sample_mask"][gb].sum()
            self.opt.zero_grad()
            for mb in gb.chunk(self.microbatches):
                mb_data = {k: v[mb] for k, v in data.items()}
                loss, metrics = loss_fn(
                    data=mb_data,
                    global_valid_seqs=global_valid_seqs,
                    global_valid_toks=global_valid_toks,
                    next_token_logprobs=token_logprobs(self.worker.model, mb_data["input_ids"]),
                )
                loss.backward()
                for k, v in metrics.items():
                    out[k].append(v / self.minibatches)
            self.opt.step()
        reduced = {}
        for k, v in out.items():  # grpo.py: min/max for the extrema, sum otherwise
            reduced[k] = min(v) if k.endswith("_min") else max(v) if k.endswith("_max") else sum(v)
        return reduced


@torch.no_grad()
def rollout(engine: torch.nn.Module, prompts: torch.Tensor, group: int, gen: torch.Generator) -> dict:
    """Sample responses with the "rollout engine" and build NeMo RL's train_data ([B, S] layout)."""
    ids = prompts.repeat_interleave(group, 0)
    for _ in range(RESPONSE):
        probs = torch.softmax(engine(ids[:, -1:]).float()[:, -1], -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
    gen_lp = token_logprobs(engine, ids)
    reward = (ids[:, PROMPT:] == TARGET).float().mean(-1)
    adv = grpo_advantages(reward, group_size=group)
    token_mask = torch.zeros_like(ids, dtype=torch.float32)
    token_mask[:, PROMPT:] = 1
    return {
        "input_ids": ids,
        "generation_logprobs": torch.cat([torch.zeros_like(gen_lp[:, :1]), gen_lp], 1),
        "advantages": adv[:, None].expand_as(token_mask).clone(),
        "token_mask": token_mask,
        "sample_mask": torch.ones(ids.shape[0]),
        "reward": reward,
    }


def run(
    steps: int = 8, seed: int = 0, interval: int = 2, lr: float = 3e-3, verbose: bool = True
) -> list[dict]:
    model = bigram_policy(seed)
    engine = convert_to_fp8(copy.deepcopy(model), get_recipe("rowwise"))  # rollout FP8 scheme
    convert_to_fp8(model, get_recipe("tensorwise"))  # trainer FP8 recipe
    policy = ToyPolicy(model, lr=lr, minibatches=4, microbatches=2)
    loss_cfg = {  # NeMo RL's loss_fn section (grpo_math_1B.yaml style) + our calibration key
        "reference_policy_kl_penalty": 0.0,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.28,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "calibration": {"interval": interval, "min_tokens": 32},
    }
    loss_fn = ClippedPGLossFn(loss_cfg)  # <- was nemo_rl.algorithms.loss.ClippedPGLossFn
    gen = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        engine.load_state_dict(model.state_dict())  # weight sync to the rollout engine
        prompts = torch.randint(0, VOCAB, (8, PROMPT), generator=gen)
        data = rollout(engine, prompts, group=8, gen=gen)
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
        calibrating = loss_fn.calibration.should_calibrate(step)  # <-
        if calibrating:  # <- BF16 shadow of the weights that produced prev_logprobs
            hp_prev = shadow_logprobs(policy, data)
        metrics = policy.train({k: v for k, v in data.items() if k != "reward"}, loss_fn)
        if calibrating:  # <- FP8 and BF16 log-probs after the step's updates, same tokens
            loss_fn.observe_shadow(
                data,
                logprobs=policy.get_logprobs(data)["logprobs"],
                hp_logprobs=shadow_logprobs(policy, data),
                hp_prev_logprobs=hp_prev,
                step=step,
            )
            metrics.update(metrics_to_floats(loss_fn.calibration.update(step)))  # bounds apply from next step
        metrics["reward"] = data["reward"].mean().item()
        history.append(metrics)
        if verbose:
            calib = (
                f"  calib: alpha bf16 {metrics['calib/alpha_bf16']:.3f}"
                f" fp8 {metrics['calib/alpha_fp8_nominal']:.3f}"
                if calibrating
                else ""
            )
            print(
                f"step {step}: reward {metrics['reward']:.3f} loss {metrics['loss']:+.4f} "
                f"token_mult_prob_error {metrics['token_mult_prob_error']:.4f} "
                f"bounds {metrics['clip/lower']:.3f}/{metrics['clip/upper']:.3f} "
                f"low_clipped {metrics['clip/low_clipped']:.3f}{calib}"
            )
    return history


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=int, default=2, help="calibration interval (steps)")
    args = ap.parse_args(argv)
    run(steps=args.steps, seed=args.seed, interval=args.interval)


if __name__ == "__main__":
    main()
