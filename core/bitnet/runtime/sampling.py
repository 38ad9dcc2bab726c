"""Choosing the next token: greedy at temperature 0, else temperature, top-k and top-p sampling.

The same seed gives the same tokens: draws come from numpy's PCG64 generator, one uniform
number per token, mapped through the cumulative distribution of the kept tokens.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bitnet.errors import UsageError
from bitnet.runtime.provider import KernelProvider


def check_params(temperature: float, top_k: int, top_p: float) -> None:
    if not (isinstance(temperature, (int, float)) and temperature >= 0 and math.isfinite(temperature)):
        raise UsageError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise UsageError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise UsageError(f"top_p must be in (0, 1], got {top_p!r}")


def probabilities(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution to sample from (float64, sums to 1): softmax(logits / T), then top-k, then top-p.

    top_k keeps the k largest logits (0 = all); top_p keeps the smallest set of most likely
    tokens whose probability reaches top_p (at least one). Ties are kept in index order.
    """
    z = np.asarray(logits, dtype=np.float64).reshape(-1) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    kept = z[order]
    p = np.exp(kept - kept[0])
    p /= p.sum()
    if top_p < 1.0:
        # Keep a token while the mass before it is still short of top_p.
        before = np.cumsum(p) - p
        n_keep = max(1, int(np.count_nonzero(before < top_p)))
        order, p = order[:n_keep], p[:n_keep] / p[:n_keep].sum()
    out = np.zeros(z.shape[0], dtype=np.float64)
    out[order] = p
    return out


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One index from distribution p with one uniform draw (inverse CDF)."""
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # Guard the float edge u * total == total, and never land on a zero-probability index.
    i = min(i, len(p) - 1)
    while p[i] == 0:
        i -= 1
    return i


class Sampler:
    """Stateful only in its random generator; greedy needs no generator draws at all."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None) -> None:
        check_params(temperature, top_k, top_p)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def sample(self, provider: KernelProvider, logits: Any) -> int:
        """The next token from the last row of a logits handle."""
        if self.greedy:
            return int(provider.argmax(logits)[-1])
        return self.sample_host(provider.to_host(logits)[-1])

    def sample_host(self, logits: np.ndarray) -> int:
        """The next token from host logits [vocab]."""
        if self.greedy:
            return int(np.argmax(logits))
        return draw(probabilities(logits, self.temperature, self.top_k, self.top_p), self.rng)
