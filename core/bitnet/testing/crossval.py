"""The cross-validation prompts, and two measures of how far one set of logits is from another.

The prompts are deterministic text of about a chosen number of tokens, from words that stress
tokenizers and models alike (accents, CJK, symbols, numbers, runs of whitespace).
tests/test_crossval_llama.py compares our logits with llama.cpp's over them; tests/test_lm_head.py and
benchmarks/bench_cpu.py measure the int8 LM head against the F16 head over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

WORDS = ("the of and to in is was for on that with as by at from it an were are which this be or "
         "BitNet ternary weights llama quantization block row scale 1.58 2B-4T 12345 3.14159 1,000,000 "
         "naïve café Zürich 日本語 Ωmega — “quoted” (paren) [bracket] {brace} x=y+z; foo_bar() #hash "
         "@at $9.99 100% it's they'll I'm we've don't CAPS MiXeD e.g. ... !? \n \n\n \t   ").split(" ")
SHORT = tuple(range(10, 42, 2))  # 16 prompts of 10-40 tokens: statistics over many positions
LONG = (10, 50, 200)  # for comparisons that must hold at every position of long prompts


def prompt_text(tokenize: Callable[[str], Sequence[int]], n_tokens: int, seed: int) -> str:
    """Deterministic text of about n_tokens tokens (at least that many) under `tokenize`."""
    rng = np.random.default_rng(seed)
    words: list[str] = []
    while True:
        words.extend(rng.choice(WORDS, 8))
        text = " ".join(words)
        if len(tokenize(text)) >= n_tokens:
            return text


def crossval_prompts(tokenize: Callable[[str], Sequence[int]], lengths: Sequence[int] = SHORT,
                     seed: int = 0) -> list[list[int]]:
    """The token ids of one prompt per length, prompt i from seed + i."""
    return [list(tokenize(prompt_text(tokenize, n, seed + i))) for i, n in enumerate(lengths)]


def agreement(want: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position (row) of two logits arrays [n, vocab]: whether the arg-max is the same, and the KL
    divergence KL(softmax(want) || softmax(got)) in nats."""
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, np.float64) - np.max(z, axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    lw, lg = log_softmax(want), log_softmax(got)
    return np.argmax(want, axis=1) == np.argmax(got, axis=1), (np.exp(lw) * (lw - lg)).sum(axis=1)
