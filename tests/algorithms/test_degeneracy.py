"""Garbled-output signals (nemo_fp8rl/algorithms/degeneracy.py): definitions checked against readable loops,
garbled batches flagged and real clean outputs far from the default thresholds (StabilityConfig)."""

import math
import random
import subprocess
import sys

import pytest
import torch

from nemo_fp8rl.algorithms.degeneracy import (
    degeneracy_metrics,
    degenerate_signals,
    longest_repeat,
    nonprintable_counts,
    replacement_counts,
    repetitive,
    unlikely_token_frac,
)
from nemo_fp8rl.algorithms.metrics import metrics_to_floats
from nemo_fp8rl.config.schema import StabilityConfig

ST = StabilityConfig()  # the defaults a run uses


def _signals(texts, st=ST):
    """What the trainer's monitor does with one step's texts: the signals over the default thresholds."""
    out = metrics_to_floats(degeneracy_metrics(texts, repeat_min_chars=st.repeat_min_chars,
                                               repeat_min_frac=st.repeat_min_frac))
    return out, degenerate_signals(out, repetitive_frac=st.repetitive_threshold,
                                   nonprintable_frac=st.nonprintable_threshold,
                                   replacement_frac=st.replacement_threshold, unlikely_frac=st.unlikely_threshold)


# ---------------------------------------------------------------------------------------------- definitions
def _longest_repeat_reference(s: str, max_period: int = 32) -> int:
    """run(s) by the definition: the longest [i, j) with s[k] == s[k + p] for i <= k < j - p and j - i >= 2p."""
    best = 0
    for p in range(1, max_period + 1):
        for i in range(len(s)):
            j = i + p
            while j < len(s) and s[j] == s[j - p]:
                j += 1
            if j - i >= 2 * p:
                best = max(best, j - i)
    return best


def test_longest_repeat_hand_computed():
    texts = ["", "a", "ab", "aa", "aab", "abcabcab", "1000000", "0579", "????////" * 3, "the " * 5 + "end",
             "x" + "abcd" * 2, "abcabd"]
    assert longest_repeat(texts).tolist() == [0, 0, 0, 2, 2, 8, 6, 0, 24, 20, 8, 0]
    assert longest_repeat(["????////" * 3], max_period=4).tolist() == [4]  # the 8-character unit is not seen
    with pytest.raises(ValueError, match="max_period"):
        longest_repeat(["aa"], max_period=0)


def test_longest_repeat_matches_the_definition_on_random_strings():
    rng = random.Random(0)
    texts = []
    for _ in range(300):
        alphabet = rng.choice(["ab", "abc", "0123456789", "xy?/ \n"])
        unit = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.5:  # plant a repeat of a random unit somewhere
            k = rng.randint(0, len(s))
            s = s[:k] + unit * rng.randint(1, 8) + s[k:]
        texts.append(s)
    for max_period in (1, 3, 32):
        assert longest_repeat(texts, max_period).tolist() == [_longest_repeat_reference(s, max_period) for s in texts]
    # more than one padded block of 64 responses, lengths differing a lot inside a block
    texts = [("ab" * rng.randint(0, 60)) + "c" * rng.randint(0, 3) for _ in range(150)]
    assert longest_repeat(texts).tolist() == [_longest_repeat_reference(s) for s in texts]


# Real generations: zero-shot SmolLM2-135M-Instruct (the model of model=smollm2_135m) on reasoning-gym
# chain_sum prompts through its chat template, temperature 1, up to 128 new tokens: the most diffuse real
# text of the built-in tasks (after warm-up the model answers "<answer>N</answer>").
SMOLLM2_ZERO_SHOT = [
    "The final answer to the equation is x = 4.",
    "1 + 5 = 6",
    "First, reduce the given arithmetic operation by adding the subtraction to the original number: 23 - 60 = 4\n"
    "Then, divide the result by 4 to find the final answer: 4 / 4 = 1\nNow, factor the result by finding the "
    "greatest common divisor of 4 and 5: 35 is result of the union\nFinally, convert the result into tens with "
    "decimal add progressed. Add the solution to the issue cycle. Add 1 remainder to solve this problem. First "
    "one is ratios of reactions that leave a common ratio of 2:1, and the option rejuven",
    "There is an unknown integer among 9, 7, 9, 7, 3, 7, 9, 7 that has been assigned to the equation 99 + 7 + 3 "
    "to avoid negation. So, 99 + 3 property.",
    "To solve this arithmetic problem, you can simply remove the fractions 46 and 63 from the original "
    "equation:\n\n46 + 63 = 72 \n72 - 63 = 5 \n5 is the dividend in the original equation.",
    "Beammapper helps you craft his excellent recommendation with all its kindness, kindness and kindness MORE... "
    "emergency. Pets with punctures.",
    "20\nMinimum: 20 max value of the variable '20'\nSyntax: Addition of numbers (not 1)\n\nMulti-step of "
    "addition rules\n05 adding numbers (at least 5)\n-15 seems impossible",
    "The number result of 11 can be found by subtracting 2 from 5 and multiplying 4 by 10. Using the rule of "
    "division, 4 x 100 \u00f7 5 = 4, which is the answer to the equation mentioned earlier.",
    "1.3", "3", "17.", "Answer: TRUE", "2 + 2 = 4\n3 = 3",
]
# The study's real-model samples after warm-up (docs/results.md, chain_sum) and their shapes
CHAIN_SUM_ANSWERS = ["<answer>-13</answer>", "<answer>34</answer>", "<answer>1084</answer>", "<answer>-138</answer>",
                     "<answer>2</answer>", "<answer>1000000</answer>", "<answer>-100</answer>"]
CHAIN_OF_THOUGHT = [
    "First, 40 - 22 = 18. Then 18 + 94 = 112.\n<answer>112</answer>",
    "Step 1: 10 + 10 = 20\nStep 2: 20 + 10 = 30\nStep 3: 30 + 10 = 40\n<answer>40</answer>",
    "We add the terms one by one.\n\n| term | running sum |\n|------|-------------|\n| 12 | 12 |\n| 30 | 42 |\n"
    "| 58 | 100 |\n\n<answer>100</answer>",
    "1111 + 1111 = 2222, so the answer is <answer>2222</answer>",
    "The sum is 1000000 (one million), written 1,000,000.",
    "Let me check: 99 + 1 = 100, 100 + 900 = 1000. " + "-" * 40 + " Final: <answer>1000</answer>",
    "R\u00e9sum\u00e9: \u8ba1\u7b97 12 + 30 = 42 \U0001f44d\U0001f3fd and \U0001f468\u200d\U0001f469\u200d\U0001f467\t<answer>42</answer>",
]


def _arithmetic_answers(n=256):
    """The arithmetic task's answers and well-formed responses (``digits + 1`` digits; 0579, 1000, ...)."""
    from nemo_fp8rl.tasks.arithmetic import ArithmeticTask

    out = []
    for digits in (1, 3, 9):
        task = ArithmeticTask(digits=digits, seed=digits)
        out += [p.answer for p in task.prompts(n)]
    return out + ["0000", "1000", "1998", "0000000000", "1000000000"]


def test_repetitive_needs_both_the_absolute_and_the_relative_length():
    loop = "abc" * 11  # 33 characters with period 3
    healthy = SMOLLM2_ZERO_SHOT[2]  # 450 characters of (bad) prose
    texts = [loop, "answer: " + loop, "x" * 31, healthy + "-" * 40, healthy[:20] + "-" * 40, "1000000"]
    assert repetitive(texts, 32, 0.5).tolist() == [True, True, False, False, True, False]
    assert repetitive([""], 32, 0.0).tolist() == [False]


def test_character_counts():
    texts = ["ok\n\tline\r", "\x00\x1b[0m\x7f", "\ufffd\ufffdab", "\U000f0000\ud800x", "\u200d\u00a0\u0378", ""]
    # tab/newline/CR printable; NUL, ESC, DEL control; U+FFFD is only a replacement character; private use
    # and a lone surrogate non-printable; ZWJ (Cf) and no-break space printable; U+0378 unassigned
    assert nonprintable_counts(texts).tolist() == [0, 3, 0, 2, 1, 0]
    assert replacement_counts(texts).tolist() == [0, 0, 2, 0, 0, 0]


def test_unlikely_token_frac_hand_computed():
    p = torch.tensor([[0.5, 1e-5, 1e-3, 0.0], [1e-6, 0.9, 0.9, 0.9]])
    logp = torch.log(p.clamp_min(1e-30))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert float(unlikely_token_frac(logp, mask, 1e-4)) == pytest.approx(2 / 7)  # 1e-5 and 1e-6
    assert float(unlikely_token_frac(logp * mask, mask, 1e-2)) == pytest.approx(3 / 7)  # masked zeros never count
    assert float(unlikely_token_frac(logp, torch.zeros_like(mask), 1e-4)) == 0.0
    with pytest.raises(ValueError, match="prob"):
        unlikely_token_frac(logp, mask, 1.0)


def test_metrics_of_an_empty_step():
    out, flags = _signals([])
    assert out == {"stability/repetitive_frac": 0.0, "stability/repeat_run_max": 0.0,
                   "stability/nonprintable_frac": 0.0, "stability/replacement_frac": 0.0}
    assert flags == [] and _signals(["", ""])[1] == []


# ---------------------------------------------------------------------------------------- garbled vs clean
GARBLED = {
    # verl #4435: an FP8 KV cache, "????////" until max_new_tokens; a parser that finds a number half-scores it
    "question_slash": ["????////" * 16, "<answer>4</answer>????////????////????////????////????////????////",
                       "7????////????////????////????////????????//////////"],
    "repeated_tokens": [" the" * 30, "1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1", "=" * 64,
                        "answer answer answer answer answer answer answer answer"],
    "replacement_chars": ["\ufffd\ufffd x\ufffd 4\ufffd\ufffd1", "<answer>\ufffd\ufffd\ufffd</answer>",
                          "t\ufffd=U\ufffd\u32f2x\u92c68<\ufffdX\u02b3"],
    "control_chars": ["\x00\x01\x02 4 \x1b\x7f", "<answer>12</answer>\x00\x00\x00\x00",
                      "\x0e\x1cA/\x10 \x03B\x11 x"],
}


@pytest.mark.parametrize("kind", sorted(GARBLED))
def test_a_garbled_batch_is_flagged(kind):
    batch = GARBLED[kind] * 4  # 12-16 responses, every one garbled the same way
    out, flags = _signals(batch)
    expected = {"question_slash": "repetitive_frac", "repeated_tokens": "repetitive_frac",
                "replacement_chars": "replacement_frac", "control_chars": "nonprintable_frac"}[kind]
    assert expected in flags, out
    # half the responses of a step garbled (the rest clean) is still flagged
    mixed = batch + (CHAIN_SUM_ANSWERS + CHAIN_OF_THOUGHT)[: len(batch)]
    assert expected in _signals(mixed)[1], _signals(mixed)[0]


def test_random_byte_tokens_are_flagged():
    """What a byte-level tokenizer decodes from random byte tokens (invalid UTF-8 -> U+FFFD, C0 controls)."""
    rng = random.Random(1)
    texts = [bytes(rng.randrange(256) for _ in range(64)).decode("utf-8", errors="replace") for _ in range(16)]
    out, flags = _signals(texts)
    assert "replacement_frac" in flags and "nonprintable_frac" in flags, out


def test_a_clean_batch_is_not_flagged_and_stays_far_from_the_thresholds():
    """Real outputs of the built-in tasks (arithmetic answers, chain_sum answers and chain of thought,
    SmolLM2's zero-shot prose), legitimately repeated digits and short answers: nothing flagged, and every
    share at most a fifth of its threshold."""
    batches = {"arithmetic": _arithmetic_answers(), "chain_sum": CHAIN_SUM_ANSWERS * 4,
               "chain_of_thought": CHAIN_OF_THOUGHT * 2, "smollm2": SMOLLM2_ZERO_SHOT,
               "short": ["1", "", "7", "00", "-1", "1000000", "0.5"],
               "all": _arithmetic_answers() + CHAIN_SUM_ANSWERS + CHAIN_OF_THOUGHT + SMOLLM2_ZERO_SHOT}
    for name, texts in batches.items():
        out, flags = _signals(texts)
        assert flags == [], (name, out)
        assert out["stability/repetitive_frac"] <= ST.repetitive_threshold / 5, (name, out)
        assert out["stability/nonprintable_frac"] <= ST.nonprintable_threshold / 5, (name, out)
        assert out["stability/replacement_frac"] <= ST.replacement_threshold / 5, (name, out)
        assert out["stability/repeat_run_max"] < ST.repeat_min_chars + 10, (name, out)  # the 40-dash ruler


def test_one_truncated_multibyte_character_per_response_is_not_garbled():
    """``max_new_tokens`` cutting a multi-byte character leaves one U+FFFD at the end of a response."""
    texts = [t[:24] + "\ufffd" for t in CHAIN_OF_THOUGHT + SMOLLM2_ZERO_SHOT if len(t) >= 24]
    out, flags = _signals(texts)
    assert out["stability/replacement_frac"] == pytest.approx(0.04) and flags == []


def test_unlikely_tokens_flag_only_above_the_threshold():
    flags = degenerate_signals({"stability/unlikely_frac": 0.033}, repetitive_frac=0.25, nonprintable_frac=0.02,
                               replacement_frac=0.05, unlikely_frac=ST.unlikely_threshold)
    assert flags == []  # zero-shot SmolLM2's own tail mass below 1e-4 (StabilityConfig.unlikely_threshold)
    flags = degenerate_signals({"stability/unlikely_frac": 0.98, "stability/repetitive_frac": math.nan},
                               repetitive_frac=0.25, nonprintable_frac=0.02, replacement_frac=0.05,
                               unlikely_frac=ST.unlikely_threshold)
    assert flags == ["unlikely_frac"]  # uniform random tokens; a NaN share never flags


def test_degeneracy_imports_no_framework():
    code = ("import sys, nemo_fp8rl.algorithms.degeneracy\n"
            "print(' '.join(m.split('.')[0] for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not {"megatron", "transformer_engine", "hydra", "omegaconf"} & set(out.stdout.split())
