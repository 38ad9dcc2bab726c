"""Greedy, temperature, top-k and top-p sampling; determinism by seed; parameter checks."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet.errors import UsageError
from bitnet.runtime.reference import ReferenceProvider
from bitnet.runtime.sampling import Sampler, probabilities

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 3.0 - 1e-3, 0.0], np.float32)


def test_greedy_is_argmax_through_the_provider() -> None:
    p = ReferenceProvider()
    logits = np.stack([LOGITS[::-1], LOGITS])
    assert Sampler(0.0).sample(p, logits) == 1  # the last row, first index of the maximum
    assert p.dispatches["ref.argmax"] == 1


def test_same_seed_same_tokens() -> None:
    def run(seed: int) -> list[int]:
        s = Sampler(1.0, seed=seed)
        return [s.sample_host(LOGITS) for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    for s in (Sampler(1.5, top_k=1, seed=0), Sampler(1.5, top_p=1e-6, seed=0)):
        assert {s.sample_host(LOGITS) for _ in range(100)} == {1}


def test_probabilities() -> None:
    p = probabilities(LOGITS, 1.0)
    e = np.exp(LOGITS.astype(np.float64) - LOGITS.max())
    np.testing.assert_allclose(p, e / e.sum())
    p2 = probabilities(LOGITS, 1.0, top_k=2)
    assert np.count_nonzero(p2) == 2 and p2[1] > 0 and p2[4] > 0
    np.testing.assert_allclose(p2.sum(), 1.0)
    # top_p: tokens 1 and 4 hold 0.71 of the mass, with 2 0.93: 0.7 keeps two, 0.75 three.
    assert set(np.flatnonzero(probabilities(LOGITS, 1.0, top_p=0.7))) == {1, 4}
    p3 = probabilities(LOGITS, 1.0, top_p=0.75)
    assert set(np.flatnonzero(p3)) == {1, 2, 4}
    np.testing.assert_allclose(p3[[1, 4, 2]], p[[1, 4, 2]] / p[[1, 4, 2]].sum())
    # A low temperature sharpens, a high one flattens.
    assert probabilities(LOGITS, 0.1)[1] > p[1] > probabilities(LOGITS, 10.0)[1]


def test_distribution_matches_probabilities() -> None:
    s = Sampler(0.8, top_k=4, seed=123)
    counts = np.bincount([s.sample_host(LOGITS) for _ in range(20000)], minlength=len(LOGITS))
    want = probabilities(LOGITS, 0.8, top_k=4)
    assert counts[want == 0].sum() == 0
    np.testing.assert_allclose(counts / counts.sum(), want, atol=0.015)


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0},
                                    {"top_p": 1.5}, {"top_k": -1}, {"top_k": 2.5}])
def test_bad_parameters_are_usage_errors(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        Sampler(**kwargs)
