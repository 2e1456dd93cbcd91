"""GRPO smoke run of the real CLI from a tiny Qwen3 checkpoint with its own tokenizer and chat template.

``python -m nemo_fp8rl.train model.hf_path=<ckpt> task=math_jsonl task.path=<jsonl> fp8=blockwise
calibration=paper ...``: the model shape comes from the checkpoint's config.json, the weights from its
safetensors, the prompts from its tokenizer and chat template; FP8 is emulated, calibration is on,
no supervised warm-up (RL starts from the checkpoint).

The checkpoint is a policy that already answers in the task's format part of the time (trained with
transformers on the chat-formatted prompts, two answers per prompt). Rewards at step 0 are therefore
only positive if weights, tokenizer, chat template and EOS all reached the trainer intact; a random
or mis-loaded model scores 0. After the run the trained policy is a Hugging Face directory
(``<output_dir>/hf``, with the tokenizer) that transformers loads, close to the starting checkpoint.
"""

import json
import math

import torch

from tests.trainer._cli import metrics, run_cli

from ._fixtures import hf_logits, hf_model, make_policy_checkpoint, make_tokenizer, make_tokens

ROWS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 4 + 5?", "answer": "9"}]
# each prompt with its right answer and a wrong one: the checkpoint's policy splits between them
EXAMPLES = [("What is 2 + 3?", "5"), ("What is 2 + 3?", "6"), ("What is 4 + 5?", "9"), ("What is 4 + 5?", "8")]


def test_grpo_from_hf_checkpoint(tmp_path):
    make_tokenizer(tmp_path / "tok")
    ckpt = make_policy_checkpoint(tmp_path / "qwen3-tiny", tmp_path / "tok", EXAMPLES)
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    run_cli(out, f"model.hf_path={ckpt}", "task=math_jsonl", f"task.path={data}", "fp8=blockwise",
            "calibration=paper", "calibration.interval=1", "calibration.min_tokens=4", "warmup.steps=0",
            "trainer.max_steps=2", "algorithm.prompts_per_step=2", "algorithm.group_size=8",
            "algorithm.minibatches_per_step=2", "rollout.max_new_tokens=8", "task.format_reward=0.5",
            timeout=600)

    recs = metrics(out)
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        for k in ("reward/mean", "policy/entropy", "train/loss", "train/grad_norm", "clip/lower", "clip/upper",
                  "calib/alpha_bf16", "calib/tokens", "rollout/response_len", "mismatch/logp_abs_diff_mean"):
            assert k in r and r[k] is not None and math.isfinite(r[k]), (k, r.get(k))
        assert r["train/skipped"] == 0.0 and r["calib/skipped"] == 0.0
    r0 = recs[0]
    # the checkpoint's behaviour survived the trip: boxed answers (format reward), some of them right,
    # ending with the chat EOS (<|im_end|>) before the 8-token limit
    assert r0["rollout/invalid_frac"] < 0.5
    assert 0.5 < r0["reward/mean"] < 1.0 and r0["reward/accuracy"] > 0.1
    assert r0["rollout/eos_frac"] > 0.5

    # the resolved config holds the checkpoint's shape
    import yaml

    model = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert (model["num_layers"], model["hidden_size"], model["kv_channels"], model["vocab_size"]) == (2, 64, 32, 320)
    assert model["qk_layernorm"] is True and model["untie_embeddings_and_output_weights"] is False

    # the trained policy comes out as a Hugging Face checkpoint, with the tokenizer
    exported = out / "hf"
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()
    src, trained = hf_model(ckpt), hf_model(exported)
    diffs = [(trained.state_dict()[n] - p).abs().max().item() for n, p in src.state_dict().items()]
    assert max(diffs) > 0, "the exported policy equals the starting checkpoint: no update reached it"
    # 2 steps x 2 AdamW updates at lr 1e-4 move each weight by at most ~4e-4: the run started from
    # the checkpoint's weights (another initialisation would differ by ~0.02-1)
    assert max(diffs) < 5e-3
    assert torch.isfinite(hf_logits(trained, make_tokens(320))).all()
