"""GGUF (llama.cpp's file format) -> a Hugging Face checkpoint directory our loader reads.

A GGUF file holds a model's hyper-parameters and tokenizer as key/value metadata and its tensors,
often block-quantized. :func:`convert_gguf_to_hf` writes what ``model.hf_path`` needs:

- ``config.json``: a ``LlamaForCausalLM`` config from the ``llama.*`` metadata (block_count ->
  num_hidden_layers, embedding_length -> hidden_size, feed_forward_length -> intermediate_size,
  attention.head_count(_kv) -> num_attention_heads / num_key_value_heads, rope.freq_base ->
  rope_theta, attention.layer_norm_rms_epsilon -> rms_norm_eps, context_length ->
  max_position_embeddings); tied embeddings when the file has no ``output.weight``.
- ``model.safetensors``: every tensor dequantized to float32 (``gguf.quants.dequantize``; e.g. Q4_1
  blocks of 32 weights w_i = d * q_i + m with fp16 d, m and 4-bit q_i). The quantization error is
  part of the weights from then on: this is the GGUF model, not the original BF16 one.
- the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) and
  ``generation_config.json`` (BOS/EOS/PAD ids), from the ``tokenizer.ggml.*`` metadata.

llama.cpp stores q_proj and k_proj with the rows of each head permuted for its RoPE kernel (the two
halves of a head interleaved): with n heads of size h, its converter writes
``W.reshape(n, 2, h/2, in).swapaxes(1, 2).reshape(n h, in)``. :func:`unpermute_qk` applies the
inverse, ``W.reshape(n, h/2, 2, in).swapaxes(1, 2).reshape(n h, in)``, with n = num_attention_heads
for q and num_key_value_heads for k.

Only Llama-architecture files with a GPT-2 style byte-level BPE tokenizer are accepted; anything else
is refused naming the metadata key. Needs ``gguf`` (``pip install 'nemo-fp8rl[real]'``), ``tokenizers``,
``transformers`` and ``safetensors`` (the ``hf`` extra).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CONVERTER_VERSION",
    "GGUFConvertError",
    "convert_gguf_to_hf",
    "gguf_llama_config",
    "gguf_to_hf_name",
    "unpermute_qk",
]

#: Bumped when the output of :func:`convert_gguf_to_hf` changes (cached conversions are then redone).
CONVERTER_VERSION = 1

# llama.cpp tensor names -> transformers Llama names ({i} = layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp pre-tokenizer names we reproduce with `tokenizers` components (the regex split llama.cpp runs
# before BPE): gpt2's byte-level regex, preceded for smollm by one split per digit (\p{N}).
_PRE_TOKENIZERS = ("gpt2", "default", "smollm")
# GGUF token types (llama.cpp's llama_token_type): 3 = control (special), 4 = user-defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4


class GGUFConvertError(ValueError):
    """A GGUF file this converter cannot turn into a Hugging Face Llama checkpoint (names the key or tensor)."""


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install 'nemo-fp8rl[real]'") from e
    return gguf


def _field(reader, key: str, where: str, default: Any = ...) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise GGUFConvertError(f"{where}: metadata key {key!r} is missing")
        return default
    return f.contents()


def gguf_to_hf_name(name: str) -> str:
    """The transformers Llama tensor name of a llama.cpp tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        GGUFConvertError: a tensor that a Llama model does not have.
    """
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise GGUFConvertError(f"tensor {name!r} has no Llama counterpart (llama.cpp names: token_embd, output_norm, "
                           f"output, blk.N.{{{', '.join(_LAYER_NAMES)}}})")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's RoPE row permutation of a q_proj / k_proj weight.

    ``w``: [n_heads * head_dim, in_features] as stored in the GGUF file (per head, rows
    ``(0, h/2, 1, h/2 + 1, ...)`` of the Hugging Face layout). Returns the Hugging Face layout
    ``w.reshape(n, h/2, 2, in).swapaxes(1, 2).reshape(n h, in)``, same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFConvertError(f"a q/k weight of {rows} rows does not split into {n_heads} heads of even size")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_llama_config(reader, where: str = "gguf") -> dict:
    """config.json (a ``LlamaForCausalLM`` config dict) of a GGUF reader's ``llama.*`` metadata.

    Raises:
        GGUFConvertError: another architecture, or a required key missing.
    """
    arch = _field(reader, "general.architecture", where)
    if arch != "llama":
        raise GGUFConvertError(f"{where}: general.architecture={arch!r}; only 'llama' GGUF files are converted")
    heads = int(_field(reader, "llama.attention.head_count", where))
    hidden = int(_field(reader, "llama.embedding_length", where))
    names = {t.name for t in reader.tensors}
    n_vocab = len(_field(reader, "tokenizer.ggml.tokens", where))
    head_dim = int(_field(reader, "llama.rope.dimension_count", where, hidden // heads))
    if head_dim * heads != hidden:
        raise GGUFConvertError(f"{where}: llama.rope.dimension_count={head_dim} x head_count={heads} != "
                               f"embedding_length={hidden} (partial rotary embeddings are not supported)")
    if _field(reader, "llama.rope.scaling.type", where, None) not in (None, "none"):
        raise GGUFConvertError(f"{where}: llama.rope.scaling.type is set; RoPE scaling is not converted")

    def token_id(key):
        v = _field(reader, f"tokenizer.ggml.{key}", where, None)
        return None if v is None else int(v)

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size", where, n_vocab)),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length", where)),
        "num_hidden_layers": int(_field(reader, "llama.block_count", where)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", where, heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, "llama.context_length", where)),
        # stored as float32 in the file (9.999999747378752e-06 for 1e-5): round to what was meant
        "rms_norm_eps": float(f"{float(_field(reader, 'llama.attention.layer_norm_rms_epsilon', where)):.6g}"),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", where, 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
        "torch_dtype": "float32",
    }


def _tokenizer(reader, where: str):
    """A transformers ``PreTrainedTokenizerFast`` from ``tokenizer.ggml.*`` (byte-level BPE only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model", where)
    if kind != "gpt2":
        raise GGUFConvertError(f"{where}: tokenizer.ggml.model={kind!r}; only 'gpt2' (byte-level BPE) is converted")
    pre = _field(reader, "tokenizer.ggml.pre", where, "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFConvertError(f"{where}: tokenizer.ggml.pre={pre!r}; converted pre-tokenizers: {list(_PRE_TOKENIZERS)}")
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens", where)]
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type", where, [1] * len(tokens))]
    merges = [tuple(str(m).split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", where)]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConvertError(f"{where}: tokenizer.ggml.tokens holds duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key):
        i = _field(reader, f"tokenizer.ggml.{key}", where, None)
        return None if i is None else tokens[int(i)]

    kw = {k: v for k, v in (("bos_token", token("bos_token_id")), ("eos_token", token("eos_token_id")),
                            ("unk_token", token("unknown_token_id")), ("pad_token", token("padding_token_id")))
          if v is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kw)
    template = _field(reader, "tokenizer.chat_template", where, None)
    if template:
        fast.chat_template = str(template)
    if len(fast) != len(tokens):
        raise GGUFConvertError(f"{where}: the converted tokenizer has {len(fast)} tokens, the file {len(tokens)}")
    return fast


def _hf_tensors(reader, config: dict, where: str):
    """(Hugging Face name, float32 tensor in the Hugging Face layout) for every tensor of the file."""
    gguf = _import_gguf()
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFConvertError(f"{where}: tensor {t.name}: {t.tensor_type.name} cannot be dequantized ({e})") from None
        w = torch.from_numpy(arr.astype("float32", copy=False).copy())
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        yield name, w


def convert_gguf_to_hf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the Hugging Face checkpoint of a Llama GGUF file into ``out_dir`` (created; must be empty).

    Every tensor is checked against the shapes our loader derives from the written config.json
    (:func:`nemo_fp8rl.models.hf_weights.hf_shape`, via :func:`~nemo_fp8rl.models.hf_config.hf_config_to_model_fields`):
    no tensor missing, none extra, none of another shape, all finite.

    Returns:
        ``out_dir``.

    Raises:
        GGUFConvertError: unsupported architecture/tokenizer, or a tensor that fails the checks.
    """
    from safetensors.torch import save_file

    from nemo_fp8rl.config.model import ModelConfig
    from nemo_fp8rl.models.hf_config import hf_config_to_model_fields
    from nemo_fp8rl.models.hf_weights import hf_names, hf_shape

    gguf = _import_gguf()
    src = Path(gguf_file)
    where = str(src)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out}: convert_gguf_to_hf writes into an empty directory")
    reader = gguf.GGUFReader(str(src))
    config = gguf_llama_config(reader, where)
    model_cfg = ModelConfig(**hf_config_to_model_fields(config, where))
    expected = {n: hf_shape(model_cfg, n) for n in hf_names(model_cfg)
                if not (config["tie_word_embeddings"] and n == "lm_head.weight")}
    state: dict[str, torch.Tensor] = {}
    for name, w in _hf_tensors(reader, config, where):
        if name not in expected:
            raise GGUFConvertError(f"{where}: tensor {name} is not part of the model config.json describes")
        if tuple(w.shape) != tuple(expected[name]):
            raise GGUFConvertError(f"{where}: {name} has shape {tuple(w.shape)}, config.json implies {expected[name]}")
        if not torch.isfinite(w).all():
            raise GGUFConvertError(f"{where}: {name} holds non-finite values after dequantization")
        state[name] = w
    missing = sorted(set(expected) - set(state))
    if missing:
        raise GGUFConvertError(f"{where}: {len(missing)} tensors missing, e.g. {missing[:5]}")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok = _tokenizer(reader, where)
    tok.save_pretrained(str(out))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return out
