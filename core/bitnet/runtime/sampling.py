"""Choosing the next token: greedy at temperature 0, else temperature, top-k, top-p and min-p sampling.

Before choosing, logits get `logit_bias` (OpenAI's: token id -> added value in [-100, 100]) and the
penalties, as llama.cpp applies them over the last `penalty_last_n` tokens of the context (prompt
and generated): `repeat_penalty` divides a positive logit and multiplies a negative one;
`frequency_penalty` subtracts count * value and `presence_penalty` subtracts the value once per
token present. min_p, as llama.cpp, keeps tokens whose probability is at least min_p times the most
likely one's, judged before temperature. Log-probabilities, when asked for, are those of the
model's own distribution (log-softmax of the raw logits), as OpenAI reports them.

The same seed gives the same tokens: draws come from numpy's PCG64 generator, one uniform
number per token, mapped through the cumulative distribution of the kept tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


MAX_TOP_LOGPROBS = 20


def _number(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or not lo <= value <= hi:
        raise UsageError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def check_logit_bias(logit_bias: Mapping[Any, Any] | None, vocab_size: int | None = None) -> dict[int, float]:
    """OpenAI's logit_bias ({"123": 5.0}, keys may be ints) as {id: bias}; ids checked against the vocabulary."""
    if logit_bias is None:
        return {}
    if not isinstance(logit_bias, Mapping):
        raise UsageError("logit_bias must map token ids to numbers in [-100, 100]")
    out: dict[int, float] = {}
    for key, value in logit_bias.items():
        text = str(key).strip()
        if isinstance(key, bool) or not (text.isdigit() or (isinstance(key, (int, np.integer)) and key >= 0)):
            raise UsageError(f"logit_bias key {key!r} is not a token id")
        tid = int(text)
        if vocab_size is not None and tid >= vocab_size:
            raise UsageError(f"logit_bias token id {tid} is out of range 0..{vocab_size - 1}")
        out[tid] = _number(f"logit_bias[{tid}]", value, -100.0, 100.0)
    return out


def probabilities(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> np.ndarray:
    """The distribution to sample from (float64, sums to 1): softmax(logits / T), then top-k, then top-p.

    top_k keeps the k largest logits (0 = all); top_p keeps the smallest set of most likely
    tokens whose probability reaches top_p (at least one); min_p first drops tokens less likely
    than min_p times the most likely (on the logits before temperature). Ties are kept in index order.
    """
    raw = np.asarray(logits, dtype=np.float64).reshape(-1)
    z = raw / temperature
    order = np.argsort(-z, kind="stable")
    if min_p > 0.0:
        order = order[raw[order] >= raw[order[0]] + math.log(min_p)]
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


@dataclass(frozen=True)
class Choice:
    """A sampled token; with logprobs asked for, its log-probability and the most likely alternatives."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Stateful only in its random generator; greedy needs no generator draws at all."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, *,
                 min_p: float = 0.0, repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, penalty_last_n: int = 64,
                 logit_bias: Mapping[Any, Any] | None = None, logprobs: int | None = None) -> None:
        check_params(temperature, top_k, top_p)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.min_p = _number("min_p", min_p, 0.0, 1.0)
        self.repeat_penalty = _number("repeat_penalty", repeat_penalty, 0.0, 10.0)
        if self.repeat_penalty == 0.0:
            raise UsageError("repeat_penalty must be > 0 (1 is off)")
        self.presence_penalty = _number("presence_penalty", presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", frequency_penalty, -2.0, 2.0)
        if isinstance(penalty_last_n, bool) or not isinstance(penalty_last_n, (int, np.integer)) or penalty_last_n < 0:
            raise UsageError(f"penalty_last_n must be an integer >= 0, got {penalty_last_n!r}")
        self.penalty_last_n = int(penalty_last_n)
        self.logit_bias = check_logit_bias(logit_bias)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise UsageError(f"logprobs (top alternatives) must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {logprobs!r}")
        self.logprobs = logprobs
        self.rng = np.random.Generator(np.random.PCG64(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.penalty_last_n > 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    @property
    def needs_host(self) -> bool:
        """Whether choosing needs the logits on the host (anything but a plain arg-max)."""
        return not self.greedy or bool(self.logit_bias) or self.penalized or self.logprobs is not None

    def sample(self, provider: KernelProvider, logits: Any, history: Sequence[int] = ()) -> int:
        """The next token from the last row of a logits handle."""
        return self.pick(provider, logits, history).token

    def pick(self, provider: KernelProvider, logits: Any, history: Sequence[int] = ()) -> Choice:
        """The next token from the last row of a logits handle; `history` is the context so far (for penalties)."""
        if not self.needs_host:
            return Choice(int(provider.argmax(logits)[-1]))  # stays on the device: no vocabulary-sized copy
        return self.pick_host(host_logits(provider, logits)[-1], history)

    def sample_host(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token from host logits [vocab]."""
        return self.pick_host(logits, history).token

    def pick_host(self, logits: np.ndarray, history: Sequence[int] = ()) -> Choice:
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)
        if self.greedy and self.logprobs is None and not (self.penalized and len(history)):
            return Choice(self._biased_argmax(raw))
        z = self.adjust(raw, history)
        token = int(np.argmax(z)) if self.greedy else draw(
            probabilities(z, self.temperature, self.top_k, self.top_p, self.min_p), self.rng)
        if self.logprobs is None:
            return Choice(token)
        lp = log_softmax(raw)
        top = np.argsort(-lp, kind="stable")[:self.logprobs]
        return Choice(token, float(lp[token]), tuple((int(i), float(lp[i])) for i in top))

    def _biased_argmax(self, raw: np.ndarray) -> int:
        """argmax(adjust(raw)) when only logit_bias applies, without adjust's copy of the vocabulary (eight
        sequences decoding with a bias had spent 0.6 ms a step on those). Only the biased ids change, so
        the answer is the unbiased argmax or one of them, ties to the lowest id as np.argmax breaks them."""
        best = int(np.argmax(raw))
        if not self.logit_bias:
            return best
        ids = np.fromiter(self.logit_bias, np.int64)
        if best not in self.logit_bias and ids.max() < raw.shape[0] and not np.isnan(raw[best]):
            vals = raw[ids] + np.fromiter(self.logit_bias.values(), np.float32)
            if not np.isnan(vals).any():
                top = vals.max()
                if top < raw[best]:
                    return best
                first = int(ids[vals == top].min())
                return first if top > raw[best] else min(first, best)
        return int(np.argmax(self.adjust(raw)))  # the rest, with adjust's check of the ids

    def adjust(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """Logits after logit_bias and the penalties (a copy when anything changes)."""
        z = logits
        if self.logit_bias:
            z = z.astype(np.float32, copy=True)
            ids = np.fromiter(self.logit_bias, np.int64)
            if ids.max() >= z.shape[0]:
                raise UsageError(f"logit_bias token id {int(ids.max())} is out of range 0..{z.shape[0] - 1}")
            z[ids] += np.fromiter(self.logit_bias.values(), np.float32)
        if self.penalized and len(history):
            counts = Counter(int(t) for t in history[-self.penalty_last_n:])
            ids = np.fromiter(counts, np.int64)
            n = np.fromiter(counts.values(), np.float32)
            z = z.astype(np.float32, copy=True) if z is logits else z
            v = z[ids]
            v = np.where(v > 0, v / self.repeat_penalty, v * self.repeat_penalty)
            z[ids] = v - n * self.frequency_penalty - self.presence_penalty
        return z


def host_logits(provider: KernelProvider, logits: Any) -> np.ndarray:
    """Logits on the host for pick_host, which never writes them: read in place when they are host memory
    already (a copy of 8 rows of a 128k vocabulary cost 0.5 ms a step, fresh pages), else the provider's copy."""
    return logits if isinstance(logits, np.ndarray) else provider.to_host(logits)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    m = z.max()
    return z - m - math.log(np.exp(z - m).sum())
