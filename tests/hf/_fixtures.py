"""Tiny random Hugging Face checkpoints and a tokenizer, built locally (nothing is downloaded).

Every checkpoint is a real ``transformers`` model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``) saved with ``save_pretrained``; weights are redrawn so that every tensor matters:
matrices N(0, 0.15^2) (logits of order 1, not ~0 as with the 0.02 default), norm weights 1 + N(0, 0.2^2)
(a norm mapped to the wrong place changes the output), biases N(0, 0.1^2) (HF initialises them to 0).

ARCHS (2 layers, GQA 4 query heads / 2 KV heads, vocabularies that megatron pads):
- ``llama``: Llama-3.1 RoPE scaling (llama3, factor 8, theta 500k: the low frequencies are rescaled).
- ``qwen2``: q/k/v biases, untied head, saved in several safetensors shards with an index.
- ``qwen3``: QK RMSNorm, tied embeddings, head_dim 32 with 4 heads > hidden 64 (as Qwen3-32B).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "What is 2 + 3? Put the answer in \\boxed{}.", "The answer is \\boxed{5}.",
    "Compute 12 * 7 and give the result.", "Let x = 4. Then 2x = 8, so \\boxed{8}.",
    "Solve for y: y - 3 = 10.", "Therefore the final answer is \\boxed{13}.",
]


def make_tokenizer(out: Path):
    """A byte-level BPE tokenizer (every string encodable) with Qwen-style specials and chat template,
    saved to ``out`` as a transformers ``PreTrainedTokenizerFast``; also writes a generation_config.json
    listing both end tokens. Returns the saved tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    ids = [fast.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids, "pad_token_id": ids[1]}))
    return fast


def hf_config(arch: str, vocab_size: int | None = None):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "initializer_range": 0.15}
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size or 301, max_position_embeddings=16384, head_dim=16,
                           rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}, **common)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab_size or 307, max_position_embeddings=256, rope_theta=10000.0,
                           tie_word_embeddings=False, **common)
    if arch == "qwen3":
        return Qwen3Config(vocab_size=vocab_size or 320, max_position_embeddings=256, head_dim=32,
                           rope_theta=1000000.0, tie_word_embeddings=True, **common)
    raise ValueError(arch)


def randomize_(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def make_checkpoint(arch: str, out: Path, *, seed: int = 0, vocab_size: int | None = None,
                    shard: bool | None = None) -> Path:
    """Save a tiny random ``arch`` model to ``out`` (float32 safetensors); qwen2 is sharded by default."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, vocab_size))
    randomize_(model, seed)
    if not model.config.tie_word_embeddings:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    kw = {"max_shard_size": "40KB"} if (shard if shard is not None else arch == "qwen2") else {}
    model.save_pretrained(str(out), **kw)
    return out


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(path_or_model, tokens: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, T, V] of a transformers model (or checkpoint directory) on ``tokens``."""
    model = path_or_model if not isinstance(path_or_model, (str, Path)) else hf_model(path_or_model)
    return model(input_ids=tokens).logits.float()


def make_tokens(vocab: int, B: int = 3, T: int = 10, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def make_policy_checkpoint(out: Path, tokenizer_dir: Path, examples: list[tuple[str, str]], *, steps: int = 150,
                           seed: int = 0) -> Path:
    """A tiny Qwen3 chat model that already does the task part of the time, like a published checkpoint.

    Trained with transformers (AdamW, cross-entropy on the answer tokens) on ``examples`` (prompt,
    answer) rendered as the task renders them: chat template + generation prompt, then
    ``\\boxed{answer}<|im_end|>``. Giving a prompt two answers makes the policy split between them, so
    GRPO groups see different rewards. Saved with the tokenizer files, float32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    cfg = hf_config("qwen3", vocab_size=320)
    cfg.initializer_range = 0.02
    model = AutoModelForCausalLM.from_config(cfg)
    seqs, starts = [], []
    for prompt, answer in examples:
        p = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        p = list(p["input_ids"] if hasattr(p, "keys") else p)
        seqs.append(p + tok.encode("\\boxed{" + answer + "}", add_special_tokens=False) + [tok.eos_token_id])
        starts.append(len(p))
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), tok.pad_token_id)
    labels = torch.full((len(seqs), T), -100)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, st: len(s)] = torch.tensor(s[st:])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: more threads only contend on shared cores
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return out
