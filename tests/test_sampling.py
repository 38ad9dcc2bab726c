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


def test_min_p_keeps_tokens_near_the_most_likely_before_temperature() -> None:
    # p(token) / p(best) = exp(z - z_max): min_p 0.5 keeps z >= 3 - ln 2 = 2.307: tokens 1, 2, 4.
    assert set(np.flatnonzero(probabilities(LOGITS, 1.0, min_p=0.5))) == {1, 2, 4}
    assert set(np.flatnonzero(probabilities(LOGITS, 5.0, min_p=0.5))) == {1, 2, 4}  # temperature does not move it
    assert set(np.flatnonzero(probabilities(LOGITS, 1.0, min_p=0.7))) == {1, 4}
    s = Sampler(2.0, min_p=0.7, seed=1)
    assert {s.sample_host(LOGITS) for _ in range(200)} == {1, 4}


def test_logit_bias_steers_greedy_and_sampled_choices() -> None:
    p = ReferenceProvider()
    assert Sampler(0.0, logit_bias={"3": 100}).sample(p, LOGITS[None]) == 3
    assert Sampler(0.0, logit_bias={1: -100, 4: -100}).sample(p, LOGITS[None]) == 2
    assert p.dispatches["ref.argmax"] == 0  # biased logits are chosen on the host
    s = Sampler(1.0, logit_bias={0: -100, 1: -100, 2: -100, 3: -100, 4: -100}, seed=0)
    assert {s.sample_host(LOGITS) for _ in range(50)} == {5}


def test_penalties_follow_llama_cpp() -> None:
    history = [1, 1, 3, 0]
    z = Sampler(repeat_penalty=2.0).adjust(LOGITS, history)
    # Written out: positive logits are divided, negative multiplied, once per distinct token.
    np.testing.assert_allclose(z, [0.5, 1.5, 2.5, -2.0, 3.0 - 1e-3, 0.0], rtol=1e-6)
    z = Sampler(frequency_penalty=0.5, presence_penalty=0.25).adjust(LOGITS, history)
    np.testing.assert_allclose(z, [0.25, 1.75, 2.5, -1.75, 3.0 - 1e-3, 0.0], rtol=1e-6)
    # Only the last penalty_last_n tokens count.
    np.testing.assert_allclose(Sampler(repeat_penalty=2.0, penalty_last_n=1).adjust(LOGITS, history)[1], 3.0)
    assert Sampler(0.0, repeat_penalty=2.0).sample_host(LOGITS, history) == 4


def test_logprobs_are_the_model_distribution() -> None:
    c = Sampler(0.0, logprobs=3).pick_host(LOGITS)
    lp = np.log(probabilities(LOGITS, 1.0))
    assert c.token == 1 and abs(c.logprob - lp[1]) < 1e-9
    assert [t for t, _ in c.top] == [1, 4, 2]
    np.testing.assert_allclose([v for _, v in c.top], lp[[1, 4, 2]], rtol=1e-9)
    assert Sampler(0.0).pick_host(LOGITS).logprob is None


@pytest.mark.parametrize("kwargs", [{"min_p": 1.5}, {"repeat_penalty": 0.0}, {"presence_penalty": 3.0},
                                    {"frequency_penalty": float("nan")}, {"logit_bias": {"x": 1}},
                                    {"logit_bias": {"1": 101}}, {"logit_bias": [1]}, {"logprobs": 21},
                                    {"logprobs": True}, {"penalty_last_n": -1}])
def test_bad_new_parameters_are_usage_errors(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        Sampler(**kwargs)


def _biased_mismatches(pick: object) -> int:
    """Cases where pick(sampler, logits) differs from argmax(adjust(logits)), over small logits with ties,
    NaN and infinities."""
    rng, wrong = np.random.default_rng(0), 0
    for case in range(600):
        raw = rng.integers(-3, 4, 12).astype(np.float32)
        if case % 7 == 0:
            raw[rng.integers(12)] = rng.choice([np.nan, np.inf, -np.inf])
        ids = rng.choice(12, rng.integers(1, 5), replace=False)
        s = Sampler(0.0, logit_bias={int(i): float(rng.integers(-3, 4)) for i in ids})
        wrong += pick(s, raw) != int(np.argmax(s.adjust(raw)))
    return wrong


def test_greedy_with_a_bias_is_the_argmax_of_the_biased_logits() -> None:
    # Chosen without a copy of the logits, yet the same token, ties included; a pick that broke a tie
    # between a biased id and the unbiased argmax towards the biased one is caught.
    assert _biased_mismatches(lambda s, raw: s.sample_host(raw)) == 0

    def ties_to_the_biased(s: Sampler, raw: np.ndarray) -> int:
        best, top = int(np.argmax(raw)), max(raw[i] + b for i, b in s.logit_bias.items())
        return int(np.argmax(s.adjust(raw))) if top != raw[best] or np.isnan(top) else min(
            i for i, b in s.logit_bias.items() if raw[i] + b == top)

    assert _biased_mismatches(ties_to_the_biased) > 0


def test_out_of_range_logit_bias_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="out of range"):
        Sampler(0.0, logit_bias={"6": 1.0}).sample_host(LOGITS)
