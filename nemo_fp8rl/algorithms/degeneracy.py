"""Garbled-output signals that need no task parser: repetition, bad characters, tokens BF16 finds absurd.

The task's invalid-response rate (``rollout/invalid_frac``) sees only what its parser rejects: a lenient
parser can half-score a rollout of ``"????////????////..."`` (verl #4435, an FP8 KV cache) and the
monitor would pass it. These signals read the decoded text itself (docs/design.md, "One training step",
stability monitor); each is a per-step share that ``stability.*`` compares with a threshold.

**Repetition.** A string s has period p on [i, j) when s[k] = s[k + p] for i <= k < j - p. The longest
periodic run of a response is the longest substring that has some period p <= ``max_period`` (32
characters: a repeated character, word, BPE token or n-gram of a few tokens) *and* holds at least two
copies of its unit (length >= 2p)::

    run(s) = max over p in 1..max_period of { j - i : s has period p on [i, j), j - i >= 2p }

A response is *repetitive* when ``run(s) >= min_chars`` and ``run(s) >= min_frac * len(s)``: the absolute
floor keeps short answers quiet (``"1000000"`` has a run of 6 zeros, 86% of it), the relative one keeps a
long, healthy response with one ruler line (``"----------"``) or a list quiet. Degenerate decoding
loops until ``max_new_tokens``, so its run covers most of the response.

    stability/repetitive_frac = |{responses that are repetitive}| / |responses|
    stability/repeat_run_max  = max over responses of run(s)   (characters; shown, not thresholded)

**Bad characters**, pooled over the step's response characters:

    stability/nonprintable_frac = |{chars with Unicode category Cc, Cs, Co or Cn, except \\t \\n \\r}| / |chars|
    stability/replacement_frac  = |{chars == U+FFFD}| / |chars|

Cc: control characters; Cs: surrogates; Co: private use; Cn: unassigned. Format characters (Cf: the
zero-width joiner of emoji sequences, soft hyphens) and every space are printable here, unlike
``str.isprintable``, which also rejects a newline and a no-break space. U+FFFD is what a byte-level
tokenizer's decode writes for bytes that are not UTF-8: a healthy model writes at most one, where
``max_new_tokens`` cuts a multi-byte character; a broken rollout that samples byte tokens at random
writes many.

**Unlikely tokens** (calibration steps, where the BF16 shadow forward of the rollout policy already ran):

    stability/unlikely_frac = |{response tokens t : hp_logp_t < log(prob)}| / |response tokens|

With sampling that matches the model, the expected share is the model's own tail mass below ``prob``
(small: the sampled token is rarely one the model itself gives < 1e-4). A rollout engine that samples
from a corrupted distribution (FP8 KV cache gibberish) picks tokens the high-precision model of the same
weights finds absurd, and the share goes towards 1.

Everything here is pure python + torch (no framework); the text signals run on CPU over code points.
"""

from __future__ import annotations

import functools
import math
import unicodedata
from collections.abc import Mapping, Sequence

import torch

from nemo_fp8rl.algorithms.metrics import Metric, make_metric

__all__ = [
    "MAX_PERIOD",
    "REPLACEMENT_CHAR",
    "codepoints",
    "degeneracy_metrics",
    "degenerate_signals",
    "longest_repeat",
    "nonprintable_counts",
    "replacement_counts",
    "repetitive",
    "unlikely_token_frac",
]

MAX_PERIOD = 32
"""Longest repeated unit, in characters, that :func:`longest_repeat` looks for (a repeated character up to
a repeated phrase of several BPE tokens)."""

REPLACEMENT_CHAR = 0xFFFD
"""U+FFFD REPLACEMENT CHARACTER, written by a decode for bytes that are not valid UTF-8."""

_CHUNK = 64  # responses per padded block (bounds the memory of long responses)
_PRINTABLE_CONTROLS = (0x09, 0x0A, 0x0D)  # tab, newline, carriage return
_NONPRINTABLE_CATEGORIES = ("Cc", "Cs", "Co", "Cn")


def codepoints(text: str) -> torch.Tensor:
    """The Unicode code points of ``text``: int32 [len(text)] (lone surrogates kept as their code point)."""
    if not text:
        return torch.zeros(0, dtype=torch.int32)
    return torch.frombuffer(bytearray(text.encode("utf-32-le", "surrogatepass")), dtype=torch.int32).clone()


def _padded(texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [n, L] int32 padded with -1, lengths [n] int64)``."""
    cps = [codepoints(t) for t in texts]
    lens = torch.tensor([c.numel() for c in cps], dtype=torch.int64)
    codes = torch.full((len(cps), max(int(lens.max()), 1) if cps else 1), -1, dtype=torch.int32)
    for i, c in enumerate(cps):
        codes[i, : c.numel()] = c
    return codes, lens


def _longest_repeat_block(codes: torch.Tensor, max_period: int) -> torch.Tensor:
    """:func:`longest_repeat` of a padded block ``codes`` [n, L] (pad -1); int64 [n]."""
    n, L = codes.shape
    best = torch.zeros(n, dtype=torch.int64)
    for p in range(1, min(max_period, L // 2) + 1):
        # eq[:, k] = s[k] == s[k + p] with k + p inside the string (pads are -1, never a code point)
        eq = (codes[:, p:] == codes[:, :-p]) & (codes[:, p:] >= 0)
        idx = torch.arange(L - p, dtype=torch.int64).expand(n, -1)
        # the last k' <= k with eq False (-1 if none): k - k' equal pairs end at k, a run of period p
        # covering k - k' + p characters
        last_break = torch.cummax(torch.where(eq, torch.full_like(idx, -1), idx), dim=1).values
        pairs = (idx - last_break).max(dim=1).values
        best = torch.maximum(best, torch.where(pairs >= p, pairs + p, torch.zeros_like(pairs)))
    return best


def longest_repeat(texts: Sequence[str], max_period: int = MAX_PERIOD) -> torch.Tensor:
    """run(s) of each text (module docstring): the longest substring with a period p <= ``max_period`` that
    holds at least two copies of its unit, in characters; 0 when there is none. int64 [len(texts)].

    ``"abcabcab"`` -> 8 (period 3), ``"1000000"`` -> 6, ``"ab"`` -> 0, ``"aab"`` -> 2.
    """
    if max_period < 1:
        raise ValueError(f"max_period={max_period} must be >= 1")
    out = [torch.zeros(0, dtype=torch.int64)]
    for i in range(0, len(texts), _CHUNK):
        codes, _ = _padded(texts[i : i + _CHUNK])
        out.append(_longest_repeat_block(codes, max_period))
    return torch.cat(out)


def repetitive(texts: Sequence[str], min_chars: int, min_frac: float, max_period: int = MAX_PERIOD) -> torch.Tensor:
    """Which texts are repetitive: ``run(s) >= min_chars`` and ``run(s) >= min_frac * len(s)``. bool [n]."""
    return _repetitive(longest_repeat(texts, max_period), texts, min_chars, min_frac)


def _repetitive(run: torch.Tensor, texts: Sequence[str], min_chars: int, min_frac: float) -> torch.Tensor:
    lens = torch.tensor([len(t) for t in texts], dtype=torch.float64)
    return (run >= min_chars) & (run.double() >= min_frac * lens) & (run > 0)


@functools.lru_cache(maxsize=65536)
def _is_nonprintable(cp: int) -> bool:
    if cp in _PRINTABLE_CONTROLS:
        return False
    if 0xD800 <= cp <= 0xDFFF:
        return True  # a lone surrogate (category Cs)
    return unicodedata.category(chr(cp)) in _NONPRINTABLE_CATEGORIES


def _per_text_counts(texts: Sequence[str], flag) -> torch.Tensor:
    """``sum(flag(cp) for cp in text)`` per text, classifying each distinct code point once. int64 [n]."""
    cps = [codepoints(t) for t in texts]
    if not cps or sum(c.numel() for c in cps) == 0:
        return torch.zeros(len(cps), dtype=torch.int64)
    flat = torch.cat(cps)
    rows = torch.repeat_interleave(torch.arange(len(cps)), torch.tensor([c.numel() for c in cps]))
    uniq, inverse = torch.unique(flat, return_inverse=True)
    bad = torch.tensor([flag(int(u)) for u in uniq.tolist()], dtype=torch.int64)[inverse]
    return torch.zeros(len(cps), dtype=torch.int64).index_add_(0, rows, bad)


def nonprintable_counts(texts: Sequence[str]) -> torch.Tensor:
    """Non-printable characters per text (Unicode categories Cc, Cs, Co, Cn; tab, newline and carriage
    return are printable). int64 [n]."""
    return _per_text_counts(texts, _is_nonprintable)


def replacement_counts(texts: Sequence[str]) -> torch.Tensor:
    """U+FFFD replacement characters per text. int64 [n]."""
    return torch.tensor([t.count(chr(REPLACEMENT_CHAR)) for t in texts], dtype=torch.int64)


def unlikely_token_frac(logp: torch.Tensor, mask: torch.Tensor, prob: float) -> torch.Tensor:
    """Share of response tokens whose log-prob is below ``log(prob)``: sum(mask * [logp < log prob]) / sum(mask).

    Args:
        logp: [B, T] log-probs of the sampled tokens (here the BF16 shadow's ``hp_old_logp``).
        mask: [B, T] 1 on response tokens.
        prob: probability below which a sampled token counts as very unlikely, in (0, 1).

    Returns:
        0-dim float tensor on ``logp``'s device (0 when the mask is empty); no host sync.
    """
    if not 0.0 < prob < 1.0:
        raise ValueError(f"prob={prob} must be in (0, 1)")
    m = mask.float()
    low = (logp.float() < math.log(prob)).float() * m
    return low.sum() / m.sum().clamp_min(1.0)


def degeneracy_metrics(texts: Sequence[str], *, repeat_min_chars: int, repeat_min_frac: float,
                       max_period: int = MAX_PERIOD) -> dict[str, Metric]:
    """The text signals of one step's decoded responses (module docstring), as metrics.

    ``stability/repetitive_frac`` (mean), ``stability/repeat_run_max`` (max, characters),
    ``stability/nonprintable_frac`` and ``stability/replacement_frac`` (mean; pooled over this rank's
    characters, 0 without any). Across data-parallel ranks the shares are averaged per rank.
    """
    n = max(len(texts), 1)
    chars = max(sum(len(t) for t in texts), 1)
    run = longest_repeat(texts, max_period)
    rep = _repetitive(run, texts, repeat_min_chars, repeat_min_frac)
    return {
        "stability/repetitive_frac": make_metric(rep.double().sum() / n, "mean"),
        "stability/repeat_run_max": make_metric(float(run.max()) if run.numel() else 0.0, "max"),
        "stability/nonprintable_frac": make_metric(nonprintable_counts(texts).sum().double() / chars, "mean"),
        "stability/replacement_frac": make_metric(replacement_counts(texts).sum().double() / chars, "mean"),
    }


def degenerate_signals(metrics: Mapping[str, float], *, repetitive_frac: float, nonprintable_frac: float,
                       replacement_frac: float, unlikely_frac: float) -> list[str]:
    """The signals among ``stability/{repetitive,nonprintable,replacement,unlikely}_frac`` in ``metrics``
    (floats) that exceed their threshold (the keyword of the same name), e.g. ``["replacement_frac"]``.
    Absent ones (``unlikely_frac`` outside calibration steps) are skipped."""
    limits = {"repetitive_frac": repetitive_frac, "nonprintable_frac": nonprintable_frac,
              "replacement_frac": replacement_frac, "unlikely_frac": unlikely_frac}
    out = []
    for name, limit in limits.items():
        v = metrics.get(f"stability/{name}")
        if v is not None and math.isfinite(v) and v > limit:
            out.append(name)
    return out
