"""Perplexity of a text under a model, as llama.cpp's llama-perplexity measures it.

The text's tokens are cut into consecutive windows; each window runs from position 0 after the
BOS token (when the model adds one), so every token is predicted once, from the tokens before it
in its window. The sum of log-probabilities is taken in float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bitnet.errors import UsageError

if TYPE_CHECKING:
    from bitnet.runtime.engine import Engine


# Rows whose float64 log-softmax is taken at a time: a whole window of 2B-4T (4096 x 128256) had made three float64
# copies of its logits, 12.6 GB beside the 2.1 GB of float32 ones.
ROWS = 128


def _nll(rows: np.ndarray, targets: Sequence[int]) -> float:
    """The negative log-likelihood of targets[i] under logits rows[i], summed, in float64."""
    x = rows.astype(np.float64)
    top = x.max(axis=1)
    lse = np.log(np.exp(x - top[:, None]).sum(axis=1)) + top
    return float((lse - x[np.arange(len(targets)), targets]).sum())


@dataclass(frozen=True)
class Perplexity:
    value: float
    tokens: int  # tokens predicted
    window: int  # positions per window, the BOS included

    def __str__(self) -> str:
        return f"perplexity {self.value:.4f} over {self.tokens} tokens (windows of {self.window})"


def perplexity(engine: Engine, ids: Sequence[int], window: int | None = None) -> Perplexity:
    """Perplexity of token ids (without a BOS: one is put before each window) in windows of `window`
    positions (default: the engine's context). With a BOS a window predicts `window` tokens; a model
    without one cannot predict a window's first token, so it predicts window - 1."""
    window = engine.n_ctx if window is None else window
    prefix = [engine.tokenizer.bos_id] if engine.tokenizer.add_bos and engine.tokenizer.bos_id is not None else []
    if window > engine.n_ctx:
        raise UsageError(f"a window of {window} positions exceeds the context of {engine.n_ctx}")
    if window < 2 - len(prefix):
        raise UsageError(f"a window of {window} position(s) predicts nothing")
    ids = [int(i) for i in ids]
    if len(ids) < 2 - len(prefix):
        raise UsageError("the text is too short to measure: it needs at least 2 tokens")
    nll, count = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        targets = chunk if prefix else chunk[1:]
        if not targets:
            break
        logits = engine.logits((prefix + chunk)[:-1])  # row i predicts targets[i]
        for r in range(0, len(targets), ROWS):
            nll += _nll(logits[r:r + ROWS], targets[r:r + ROWS])
        count += len(targets)
    return Perplexity(math.exp(nll / count), count, window)


def text_perplexity(engine: Engine, text: str, window: int | None = None) -> Perplexity:
    return perplexity(engine, engine.tokenizer.encode(text, add_bos=False), window)
