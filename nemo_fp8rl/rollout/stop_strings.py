"""Stop strings: a response ends as soon as its decoded text holds one of them (``SamplingParams.stop``).

The rule is vLLM's with ``SamplingParams(stop=..., include_stop_str_in_output=True)``, whose detokenizer
checks after every token (``vllm/v1/engine/detokenizer.py``). With ``T(n)`` the text of a response's
first ``n`` tokens and ``m`` = ``min_tokens``: the response ends after its first ``n > m`` tokens such that
``T(n)`` holds a stop string that ends after character ``len(T(m))``, that is at the token whose decoding
completed the string. That token is kept whole, so text past the stop string inside it stays in the
response (vLLM cuts its ``text`` there but keeps the token in ``token_ids``; our rewards decode the
tokens). With ``m = 0`` the condition is simply "``T(n)`` holds a stop string".

:class:`StopStrings` applies the rule to the torch engine's batch, which is read on the host only at its
stop checks, every ``k`` decode steps (``rollout.stop_check_interval``, the cadence of the EOS checks). At a
check each live row's tokens since the last check are copied (one transfer for the batch) and its whole
response so far is decoded once, ``T(n)``. No stop string in it: the row goes on. One in it: the prefixes
since the last check are decoded in turn, ``T(c + 1), T(c + 2), ...``, and the first that holds one is
where the row ends; the tokens it wrote after that one are dropped afterwards (:meth:`StopStrings.cut`),
so, as for an EOS, a row records nothing after its ending token.

Why this finds the token a check after every token finds: when the decoding of a prefix is a prefix of
the decoding (``T(i)`` is a prefix of ``T(n)`` for ``i < n``), a stop string in ``T(i)`` is one in
``T(n)`` ending at the same place; so no stop string in ``T(n)`` means none in any earlier prefix, and a
stop string in ``T(n)`` is first completed by one of the tokens tried. Decoding is prefix-stable for the
character tokenizer, and for byte-level BPE everywhere but inside a multi-byte character split across
tokens (whose first bytes decode to U+FFFD until the rest arrives). Why the whole prefix and not only a
tail of tokens long enough to hold the longest stop string: a suffix of the tokens does not decode to the
suffix of the text in general (SentencePiece drops a leading space, byte-level BPE splits characters,
tokenizers clean up spaces before punctuation), and a token may decode to no character at all, so no
token count provably covers a string. The price is ``O(n)`` decoded characters per live row and check,
``O(n^2 / k)`` over a response of ``n`` tokens, on the host (no device work, no extra sync). Measured with
SmolLM2's tokenizer on the 2-core CPU: 4.7 ms per 512-token response at k = 8, 17 ms per 1024-token one
(136 ms at k = 1), i.e. about 4.5 s of host time for 256 responses of 1024 tokens at k = 8, during which
the device waits: an incremental decoder (vLLM's ``DecodeStream``) would make it linear, at the price of
text that may differ from the tokenizer's ``decode`` the rewards read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["StopStrings", "stop_string_end"]


def _holds(text: str, stop: Sequence[str], after: int) -> bool:
    """Whether ``text`` holds a stop string that ends after character ``after``."""
    return any(text.find(s, max(after - len(s) + 1, 0)) >= 0 for s in stop)


def stop_string_end(ids: Sequence[int], stop: Sequence[str], decode: Callable[[Sequence[int]], str],
                    min_tokens: int = 0, checked: int = 0) -> int | None:
    """The number of tokens after which the response ``ids`` ends on a stop string, or None.

    The rule of the module docstring: the smallest ``n`` with ``checked < n <= len(ids)`` and ``n >
    min_tokens`` such that ``decode(ids[:n])`` holds a stop string ending after the text of
    ``ids[:min_tokens]``. ``checked``: leading tokens already known to end nothing (an earlier check).
    One decode of ``ids`` when it holds no stop string; more only to find where one was completed.
    """
    n, m = len(ids), int(min_tokens)
    if n <= max(checked, m):
        return None
    after = len(decode(ids[:m])) if m else 0
    if not _holds(decode(ids), stop, after):
        return None
    for e in range(max(checked, m) + 1, n):
        if _holds(decode(ids[:e]), stop, after):
            return e
    return n


class StopStrings:
    """The stop-string state of one torch-engine ``generate`` call over ``batch_size`` rows.

    Args:
        stop: the stop strings (``SamplingParams.stop``, non-empty).
        decode: the task tokenizer's ``decode(ids) -> str``.
        min_tokens: ``SamplingParams.min_tokens``.
        batch_size: rows of the batch (indices as in the engine's output).
    """

    def __init__(self, stop: Sequence[str], decode: Callable[[Sequence[int]], str], min_tokens: int,
                 batch_size: int) -> None:
        self.stop = tuple(stop)
        self.decode = decode
        self.min_tokens = int(min_tokens)
        self.ids: list[list[int]] = [[] for _ in range(batch_size)]
        """Per row, the response tokens read so far (on the host)."""
        self.ends: dict[int, int] = {}
        """Rows that ended on a stop string -> their response length (the ending token included)."""
        self.seen = 0
        """Decode steps whose tokens have been read (every live row writes one token per step)."""

    def check(self, rows: torch.Tensor, alive: torch.Tensor, tokens: torch.Tensor, prompt_lens: torch.Tensor,
              resp: torch.Tensor, upto: int) -> list[bool]:
        """Read what the live rows wrote in decode steps ``[seen, upto)`` and find those that ended.

        ``rows`` [L]: batch index of each live row; ``alive`` [L] bool: not ended on EOS; ``tokens`` [B, W],
        ``prompt_lens`` [B], ``resp`` [B] (tokens recorded per row; it stops growing at an EOS): the
        engine's buffers on its device. One device-to-host transfer. Returns, per live row, whether it
        goes on (neither an EOS nor a stop string); rows that ended on a stop string are added to
        :attr:`ends`.
        """
        steps = torch.arange(self.seen, upto, device=tokens.device)
        pos = prompt_lens[rows].unsqueeze(1) + steps
        window = torch.cat([rows.unsqueeze(1), alive.long().unsqueeze(1), resp[rows].unsqueeze(1),
                            tokens[rows.unsqueeze(1), pos]], dim=1).tolist()
        live = []
        for b, a, n, *new in window:
            ids = self.ids[b]
            c = len(ids)
            ids.extend(new[: n - c])
            end = stop_string_end(ids, self.stop, self.decode, self.min_tokens, checked=c)
            if end is not None:
                self.ends[b] = end
            live.append(bool(a) and end is None)
        self.seen = upto
        return live

    def cut(self, tokens: torch.Tensor, logp: torch.Tensor, prompt_lens: torch.Tensor, resp: torch.Tensor,
            pad_id: int) -> None:
        """In place on the CPU buffers: end each row of :attr:`ends` at its stop token (later positions get
        ``pad_id`` and log-prob 0, ``resp`` the new length), as if it had stopped there."""
        for b, e in self.ends.items():
            start = int(prompt_lens[b]) + e
            tokens[b, start:] = pad_id
            logp[b, start:] = 0.0
            resp[b] = e
