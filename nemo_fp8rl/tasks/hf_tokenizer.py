"""A Hugging Face tokenizer behind our :class:`~nemo_fp8rl.tasks.base.Tokenizer` interface.

:class:`HFTokenizer` wraps a ``transformers`` tokenizer loaded from a local checkpoint directory
(``tokenizer.json`` / ``tokenizer_config.json``; nothing is downloaded) and adds what tasks and the
sampler need:

- ``vocab_size`` = ``len(tokenizer)`` (base vocabulary + added special tokens). The model's embedding
  may have more rows (Qwen pads 151,669 tokens to 151,936); ids at or above ``vocab_size`` decode as
  ``<unk:ID>`` so a response that samples them is visibly ill-formed, as with the character tokenizer.
- ``encode(text)`` adds no special tokens (pieces of a response, e.g. ``\\boxed{42}``);
  :meth:`HFTokenizer.encode_prompt` builds a whole prompt: the chat template's user turn plus the
  generation prompt (``apply_chat_template(..., add_generation_prompt=True)``) when the tokenizer has
  a template, else the text with the tokenizer's own special tokens (BOS for Llama, none for Qwen).
- EOS: ``eos_id`` is the tokenizer's ``eos_token`` (for chat checkpoints the end-of-turn token, e.g.
  Qwen's ``<|im_end|>``, Llama-3-Instruct's ``<|eot_id|>``), else the first ``eos_token_id`` of
  ``generation_config.json``. ``eos_ids`` holds all of them (generation_config.json often lists
  several: Qwen3 ``[<|im_end|>, <|endoftext|>]``); the rollout engine stops on any of them.
- ``pad_id``: the tokenizer's pad token, else ``eos_id`` (Llama-3 has none; pads are masked anyway).
- ``bos_id``: the BOS token id, or None when the tokenizer has none (Qwen); prompts come from
  :meth:`encode_prompt`, which knows whether to add one.

:func:`save_hf_tokenizer` writes a task's tokenizer (this adapter's, or the character tokenizer) as a
Hugging Face tokenizer directory, for an engine that loads its own (vLLM's detokenizer for stop strings).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HFTokenizer", "load_tokenizer", "save_hf_tokenizer"]


class HFTokenizer:
    """Adapter from a ``transformers`` tokenizer to the task/sampler ``Tokenizer`` interface.

    Args:
        tokenizer: a ``transformers.PreTrainedTokenizerBase``.
        extra_eos_ids: more end-of-sequence ids (e.g. from ``generation_config.json``).
        name: where it came from (for messages).
    """

    def __init__(self, tokenizer: Any, *, extra_eos_ids: Sequence[int] = (), name: str = "") -> None:
        self.tokenizer = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", "") or "tokenizer"
        self.vocab_size = len(tokenizer)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        eos += [int(i) for i in extra_eos_ids if int(i) not in eos]
        if not eos:
            raise ValueError(
                f"{self.name}: the tokenizer has no EOS token and generation_config.json names none; set "
                "eos_token in tokenizer_config.json (the sampler needs to know where a response ends)"
            )
        bad = [i for i in eos if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{self.name}: EOS ids {bad} are outside the tokenizer's {self.vocab_size} tokens")
        self.eos_ids: tuple[int, ...] = tuple(int(i) for i in eos)
        self.eos_id: int = self.eos_ids[0]
        self.bos_id: int | None = tokenizer.bos_token_id
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load the tokenizer of a local checkpoint directory (``transformers.AutoTokenizer``, no download).

        EOS ids listed in the directory's ``generation_config.json`` are added to ``eos_ids``.

        Raises:
            FileNotFoundError: ``path`` is not a directory or holds no tokenizer files.
            ImportError: ``transformers`` is not installed (``pip install 'nemo-fp8rl[hf]'``).
        """
        d = Path(path)
        if not d.is_dir():
            raise FileNotFoundError(f"tokenizer path {str(path)!r} is not a directory (a local Hugging Face checkpoint)")
        if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
            raise FileNotFoundError(
                f"{d}: no tokenizer files (tokenizer.json / tokenizer_config.json); copy the tokenizer of the "
                "checkpoint into this directory"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError("Hugging Face tokenizers need 'transformers': pip install 'nemo-fp8rl[hf]'") from e
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        extra: list[int] = []
        gen = d / "generation_config.json"
        if gen.is_file():
            try:
                ids = json.loads(gen.read_text()).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise ValueError(f"{gen}: invalid JSON ({e.msg} at line {e.lineno})") from None
            if ids is not None:
                extra = [ids] if isinstance(ids, int) else list(ids)
        return cls(tok, extra_eos_ids=extra, name=str(d))

    # ---------------------------------------------------------------- Tokenizer interface
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are kept, ids outside the vocabulary render as ``<unk:ID>``."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            if run:
                out.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            out.append(f"<unk:{i}>")
        if run:
            out.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(out)

    # ---------------------------------------------------------------- prompts
    def encode_prompt(self, text: str, *, chat_template: bool = True, system_prompt: str | None = None) -> list[int]:
        """Ids of a whole prompt that the model continues with its answer.

        With ``chat_template`` and a tokenizer that has one: the template applied to
        ``[{"role": "system", ...}?, {"role": "user", "content": text}]`` with the generation prompt
        (the assistant turn's opening). Otherwise ``text`` with the tokenizer's own special tokens
        (``system_prompt`` is then prepended as plain text followed by a newline).
        """
        if chat_template and self.has_chat_template:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": text}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        if system_prompt:
            text = system_prompt + "\n" + text
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_ids={list(self.eos_ids)}, "
                f"chat_template={self.has_chat_template})")


def load_tokenizer(spec: Any) -> HFTokenizer | Any:
    """A tokenizer from a task's ``tokenizer`` argument: a directory path -> :class:`HFTokenizer`;
    an object with ``encode``/``decode`` (any ``Tokenizer``) is returned as is."""
    if isinstance(spec, (str, os.PathLike)):
        return HFTokenizer.from_pretrained(spec)
    if hasattr(spec, "encode") and hasattr(spec, "decode") and hasattr(spec, "eos_id"):
        return spec
    raise TypeError(f"tokenizer={spec!r}: give a Hugging Face checkpoint/tokenizer directory or a Tokenizer object")


def save_hf_tokenizer(tokenizer: Any, directory: str | os.PathLike) -> int | None:
    """Write ``tokenizer`` to ``directory`` as a Hugging Face tokenizer (``AutoTokenizer`` loads it); return
    the EOS id the written tokenizer declares.

    - :class:`HFTokenizer`: the wrapped ``transformers`` tokenizer's ``save_pretrained``.
    - :class:`~nemo_fp8rl.tasks.base.CharTokenizer`: a ``tokenizers`` word-level model with one token per
      character at the same ids (``<pad>``, ``<bos>``, ``<eos>`` = 0, 1, 2 as special tokens), a
      pre-tokenizer that splits every character and a decoder that concatenates, so its decoding (and
      vLLM's incremental one) is the character tokenizer's ``decode``. Ids outside the vocabulary, which
      ``CharTokenizer.decode`` renders as ``<unk:ID>``, decode to nothing here.

    Raises ``TypeError`` for another kind of tokenizer (name the engine's alternative in the message).
    """
    from nemo_fp8rl.tasks.base import CharTokenizer

    os.makedirs(directory, exist_ok=True)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tokenizer.save_pretrained(str(directory))
        return tokenizer.tokenizer.eos_token_id
    if isinstance(tokenizer, CharTokenizer):
        try:
            from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:
            raise ImportError("writing the character tokenizer in Hugging Face form needs 'transformers': "
                              "pip install 'nemo-fp8rl[hf]'") from e
        specials = list(CharTokenizer.SPECIALS)
        vocab = {t: i for i, t in enumerate(specials)}
        vocab.update({c: i + len(specials) for i, c in enumerate(tokenizer.chars)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[tokenizer.pad_id]))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
        tok.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
        tok.add_special_tokens(specials)
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=specials[tokenizer.pad_id],
                                     bos_token=specials[tokenizer.bos_id], eos_token=specials[tokenizer.eos_id],
                                     clean_up_tokenization_spaces=False)
        hf.save_pretrained(str(directory))
        return tokenizer.eos_id
    raise TypeError(f"cannot write tokenizer {tokenizer!r} in Hugging Face form (HFTokenizer and CharTokenizer "
                    "can be); stop strings with rollout.engine=vllm need one, or use rollout.engine=torch")
