"""bitnet.load and the Engine: streaming generation, stop conditions, limits, logits, stats."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from float_reference import forward

from bitnet.errors import NoBackendError, UsageError
from bitnet.runtime.engine import Engine, StopFilter

PROMPT = "The quick brown fox"


@pytest.fixture
def engine(cpu_env: None) -> Engine:
    import bitnet

    with bitnet.load() as e:
        yield e


def greedy_ids_without_cache(engine: Engine, ids: list[int], n: int) -> list[int]:
    """Greedy continuation recomputing every position from scratch (no KV cache reuse)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(engine.logits(ids)[-1])))
    return ids[-n:]


def test_load_default_model(engine: Engine) -> None:
    assert engine.summary.startswith("requested=cpu detected=[") and engine.summary.endswith("selected=cpu")
    assert engine.provider.backend == "cpu"
    assert engine.config.arch == "bitnet-b1.58" and engine.config.activation == "relu2"
    assert engine.n_ctx == min(engine.config.n_ctx_train, 4096)
    assert engine.stats.load_ms > 0


def test_logits_match_float_reference(engine: Engine) -> None:
    ids = engine.tokenize(PROMPT)
    logits = engine.logits(ids)
    assert logits.dtype == np.float32 and logits.shape == (len(ids), engine.config.vocab_size)
    want = forward(engine.model, ids, "row")
    assert np.abs(logits - want).max() < 1e-4 * np.abs(want).max()


def test_generate_streams_greedy_text(engine: Engine) -> None:
    ids = engine.tokenize(PROMPT)
    engine.tokenizer.is_eog = lambda tok: False  # type: ignore[method-assign]
    pieces = list(engine.generate(PROMPT, max_tokens=8))
    assert all(isinstance(p, str) for p in pieces)
    s = engine.stats
    assert s.prompt_tokens == len(ids) and s.generated_tokens == 8 and len(s.token_latencies_ms) == 7
    assert 0 < s.prefill_ms <= s.ttft_ms and s.decode_ms > 0 and s.prefill_tps > 0 and s.decode_tps > 0
    assert s.to_json()["decode_tps"] == s.decode_tps
    # The KV-cached stream equals greedy decoding recomputed from scratch at every step.
    assert "".join(pieces) == engine.detokenize(greedy_ids_without_cache(engine, ids, 8))


def test_generate_is_lazy_and_checks_before_compute(engine: Engine) -> None:
    before = sum(engine.provider.dispatches.values())
    it = engine.generate(PROMPT, max_tokens=4)
    assert sum(engine.provider.dispatches.values()) == before  # nothing runs until iterated
    assert len(list(it)) <= 4
    with pytest.raises(UsageError):
        engine.generate(PROMPT, max_tokens=-1)
    with pytest.raises(UsageError):
        engine.generate(PROMPT, temperature=-1)
    with pytest.raises(UsageError):
        engine.generate(PROMPT, stop=[""])
    assert list(engine.generate(PROMPT, max_tokens=0)) == []


def test_a_new_run_ends_an_unfinished_one(engine: Engine) -> None:
    engine.tokenizer.is_eog = lambda tok: False  # type: ignore[method-assign]
    first = engine.generate(PROMPT, max_tokens=10)
    next(first)
    engine.logits(engine.tokenize("another"))  # reuses the KV cache
    with pytest.raises(UsageError, match="interrupted"):
        list(first)


def test_context_overflow_is_usage_error(cpu_env: None) -> None:
    import bitnet

    with bitnet.load(n_ctx=16) as e:
        n = len(e.tokenize(PROMPT))
        msg = f"prompt of {n} tokens plus 100 to generate exceeds the context of 16"
        with pytest.raises(UsageError, match=msg):
            e.generate(PROMPT, max_tokens=100)
        with pytest.raises(UsageError, match="context of 16"):
            e.logits(list(range(17)))
        assert len(list(e.generate(PROMPT, max_tokens=16 - n))) <= 16 - n  # exactly full is fine


def test_same_seed_same_text(engine: Engine) -> None:
    def run(seed: int) -> str:
        return "".join(engine.generate(PROMPT, max_tokens=12, temperature=1.0, top_p=0.95, seed=seed))

    assert run(3) == run(3)


def test_max_tokens(engine: Engine) -> None:
    engine.tokenizer.is_eog = lambda tok: False  # type: ignore[method-assign]
    list(engine.generate(PROMPT, max_tokens=5, temperature=1.0, seed=1))
    assert engine.stats.generated_tokens == 5


def test_stops_at_end_of_generation(engine: Engine) -> None:
    ids = engine.tokenize(PROMPT)
    want = greedy_ids_without_cache(engine, ids, 6)
    k = next(i for i in range(1, 6) if want[i] not in want[:i])
    engine.tokenizer.is_eog = lambda tok: tok == want[k]  # type: ignore[method-assign]
    text = "".join(engine.generate(PROMPT, max_tokens=20))
    assert text == engine.detokenize(want[:k])  # the end token itself is not emitted
    assert engine.stats.generated_tokens == k + 1


def test_stop_string(engine: Engine) -> None:
    engine.tokenizer.is_eog = lambda tok: False  # type: ignore[method-assign]
    full = "".join(engine.generate(PROMPT, max_tokens=16))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full.index(stop)
    assert "".join(engine.generate(PROMPT, max_tokens=16, stop=["\x00never", stop])) == full[:cut]


def test_stop_filter_holds_back_possible_starts() -> None:
    f = StopFilter(["world", "wx"])
    assert f.push("hello wo") == ("hello ", False)  # "wo" may begin "world"
    assert f.push("r") == ("", False)
    assert f.push("ld! more") == ("", True)
    g = StopFilter(["wx"])
    assert g.push("aw") == ("a", False)
    assert g.push("a") == ("wa", False)  # the held "w" was not a stop after all
    assert g.pending == ""
    assert StopFilter([]).push("abc") == ("abc", False)


def test_fake_device_cannot_run(cpu_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import bitnet

    monkeypatch.setenv("BITNET_GPU_FAKE", "cuda")
    with pytest.raises(NoBackendError):
        bitnet.load(device="cuda")


def test_import_bitnet_stays_light() -> None:
    code = "import sys, bitnet; assert 'numpy' not in sys.modules; assert callable(bitnet.load)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
