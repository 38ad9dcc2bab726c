"""Many sequences at once: the batched forward pass, continuous batching, and batch invariance."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from float_reference import random_model

import bitnet
from bitnet.errors import NoBackendError, UsageError
from bitnet.modelfile.writer import SyntheticSpec, write_model
from bitnet.runtime.engine import Engine
from bitnet.runtime.reference import ReferenceProvider
from bitnet.runtime.scheduler import QueueFull, Scheduler
from bitnet.runtime.transformer import Transformer
from bitnet_cpu.provider import CpuProvider

PROMPTS = ["Hello", "Once upon a time, in a land far away,", "The quick brown fox", "1, 2, 3,", "Numbers: 42"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("batch") / "m.gguf", SyntheticSpec(arch="bitnet-b1.58", n_ctx=256))


def open_engine(model_path: Path, device: str, n_seqs: int) -> Engine:
    try:
        return bitnet.load(str(model_path), device=device, n_seqs=n_seqs)
    except NoBackendError as exc:
        pytest.skip(f"{device} cannot run here: {exc}")


@pytest.fixture(scope="module", params=["cpu", "opencl"])
def engine(request: pytest.FixtureRequest, model_path: Path) -> Iterator[Engine]:
    e = open_engine(model_path, request.param, n_seqs=3)
    yield e
    e.close()


def no_eog(engine: Engine) -> dict[int, float]:
    return {t: -100.0 for t in engine.tokenizer.eog_ids}


# -- the forward pass ---------------------------------------------------------------------------------

@pytest.mark.parametrize("provider_cls", [ReferenceProvider, CpuProvider])
def test_a_batch_of_sequences_gives_each_the_logits_it_has_alone(provider_cls: type) -> None:
    model = random_model(seed=3)
    alone, batched = Transformer(model, provider_cls(), 32, "row"), Transformer(model, provider_cls(), 32, "row", 3)
    a, b, c = [5, 17, 250, 3, 3, 99], [42, 7, 128, 0], [11, 12]
    want_a = alone.provider.to_host(alone.forward(np.array(a), 0, all_logits=True))
    alone.reset()
    want_b = alone.provider.to_host(alone.forward(np.array(b[:3]), 0, all_logits=False))
    want_b2 = alone.provider.to_host(alone.forward(np.array(b[3:]), 3, all_logits=False))
    alone.reset()
    want_c = alone.provider.to_host(alone.forward(np.array(c), 0, all_logits=False))
    # Step 1: a's whole prompt in slot 2 beside b's first three tokens in slot 0.
    got = batched.provider.to_host(batched.forward_batch(
        np.array(a + b[:3]), np.array([2] * 6 + [0] * 3), np.array([*range(6), *range(3)]), np.arange(9)))
    np.testing.assert_array_equal(got[:6], want_a)  # bit for bit: rows never see each other
    np.testing.assert_array_equal(got[8:9], want_b)
    # Step 2: b decodes beside c's prompt in slot 1; only the two last rows get logits.
    got = batched.provider.to_host(batched.forward_batch(
        np.array(b[3:] + c), np.array([0, 1, 1]), np.array([3, 0, 1]), np.array([0, 2])))
    np.testing.assert_array_equal(got, np.concatenate([want_b2, want_c]))


def test_forward_batch_rejects_inconsistent_batches() -> None:
    tr = Transformer(random_model(seed=3), ReferenceProvider(), 8, "row", 2)
    one = np.array([1], np.int32)
    with pytest.raises(UsageError, match="slot out of range"):
        tr.forward_batch(one, np.array([2]), np.array([0]), np.array([0]))
    with pytest.raises(UsageError, match="beyond the context"):
        tr.forward_batch(one, np.array([0]), np.array([8]), np.array([0]))
    with pytest.raises(UsageError, match="follows only 0 cached"):
        tr.forward_batch(one, np.array([1]), np.array([3]), np.array([0]))
    with pytest.raises(UsageError, match="must follow each other"):
        tr.forward_batch(np.array([1, 2]), np.array([0, 0]), np.array([0, 2]), np.array([1]))
    with pytest.raises(UsageError, match="consecutive in the batch"):
        tr.forward_batch(np.array([1, 2, 3]), np.array([0, 1, 0]), np.array([0, 0, 1]), np.array([2]))
    with pytest.raises(UsageError, match="ascending"):
        tr.forward_batch(np.array([1, 2]), np.array([0, 0]), np.array([0, 1]), np.array([1, 0]))
    with pytest.raises(UsageError, match="ascending"):
        tr.forward_batch(np.array([1, 2]), np.array([0, 0]), np.array([0, 1]), np.array([1, 1]))
    with pytest.raises(UsageError, match="ascending"):
        tr.forward_batch(one, np.array([0]), np.array([0]), np.array([1]))
    for bad in (-1, tr.config.vocab_size):
        with pytest.raises(UsageError, match="token id out of range"):
            tr.forward_batch(np.array([bad]), np.array([0]), np.array([0]), np.array([0]))
    assert tr.filled == [0, 0]  # refused batches stored nothing


# -- continuous batching ----------------------------------------------------------------------------

def alone_texts(engine: Engine, **kwargs: object) -> list[str]:
    out = []
    for p in PROMPTS:
        engine.reset()
        out.append("".join(engine.generate(p, **kwargs)))
    return out


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.95, seed=7)], ids=["greedy", "seeded"])
def test_generate_batch_gives_every_sequence_its_text_alone(engine: Engine, sampling: dict) -> None:
    kwargs = dict(max_tokens=12, logit_bias=no_eog(engine), **sampling)
    want = alone_texts(engine, **kwargs)
    assert engine.generate_batch(PROMPTS, **kwargs) == want  # 5 prompts on 3 slots: some wait, some join late


def test_prefill_chunks_interleave_with_decodes_and_change_nothing(engine: Engine) -> None:
    kwargs = dict(max_tokens=10, logit_bias=no_eog(engine))
    want = alone_texts(engine, **kwargs)
    with Scheduler(engine, step_tokens=4, prefill_chunk=2) as s:  # every prompt takes several steps
        requests = [s.submit(p, **kwargs) for p in PROMPTS]
        texts = [r.text() for r in requests]
        steps = s.steps
    assert texts == want
    n_tokens = sum(len(engine.tokenize(p)) for p in PROMPTS) + 10 * len(PROMPTS)
    assert steps < n_tokens  # rows of several sequences shared steps


def test_requests_join_between_steps_and_a_slot_frees_when_its_sequence_ends(engine: Engine) -> None:
    kwargs = dict(logit_bias=no_eog(engine))
    with Scheduler(engine) as s:
        long = s.submit(PROMPTS[1], max_tokens=200, **kwargs)
        first = next(iter(long))  # running
        # Submitted while the scheduler waits at its next step (it takes _wake between steps): the short one joins
        # long before the long one can end, however slowly this thread runs beside the other test workers (with
        # 60 tokens and no hold, a loaded CI host once let the long one finish first).
        with s._wake:
            short = s.submit(PROMPTS[0], max_tokens=3, **kwargs)
        assert short.text() and short.finish_reason == "length" and short.generated_tokens == 3
        assert long.finish_reason is None  # still going while the short one came and went
        rest = "".join(step.text for step in long)
        assert long.finish_reason == "length" and len(first.text + rest) > 0
        deadline = time.monotonic() + 10
        while s.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.running == 0 and s.queue_depth == 0


def test_cancel_frees_the_slot_at_the_next_step(engine: Engine) -> None:
    kwargs = dict(logit_bias=no_eog(engine))
    with Scheduler(engine, n_slots=1, max_queue=4) as s:
        doomed = s.submit(PROMPTS[2], max_tokens=200, **kwargs)
        waiting = s.submit(PROMPTS[0], max_tokens=4, **kwargs)
        it = iter(doomed)
        next(it)
        doomed.cancel()
        list(it)  # ends
        assert doomed.finish_reason == "cancelled" and doomed.generated_tokens < 200
        assert waiting.text() and waiting.finish_reason == "length"


def test_the_queue_is_bounded(engine: Engine) -> None:
    kwargs = dict(max_tokens=50, logit_bias=no_eog(engine))
    with Scheduler(engine, n_slots=1, max_queue=1) as s:
        # The slot's request runs (its first token is out) and has 199 to go, so it still holds the slot while the
        # next two are submitted: with 50 tokens, not yet started, it had finished first on a loaded CI host.
        next(iter(s.submit(PROMPTS[0], **{**kwargs, "max_tokens": 200})))
        s.submit(PROMPTS[1], **kwargs)
        with pytest.raises(QueueFull, match="the bound is 1"):
            s.submit(PROMPTS[2], **kwargs)
        s.close(timeout=0)  # waiting ones cancelled, running ones cut: no hang


def test_bad_requests_fail_at_submit_and_the_engine_is_owned_while_it_runs(engine: Engine) -> None:
    with Scheduler(engine) as s:
        with pytest.raises(UsageError, match="top_p"):
            s.submit("x", top_p=2.0)
        with pytest.raises(UsageError, match="exceeds the context"):
            s.submit("x", max_tokens=10_000)
        with pytest.raises(UsageError, match="a Scheduler runs"):
            engine.generate("x")
        with pytest.raises(UsageError, match="already has a running Scheduler"):
            Scheduler(engine)
    assert "".join(engine.generate("x", max_tokens=1)) is not None  # free again once closed
    with pytest.raises(UsageError, match="n_slots"):
        Scheduler(engine, n_slots=engine.n_seqs + 1)


def test_async_iteration(engine: Engine) -> None:
    kwargs = dict(max_tokens=8, logit_bias=no_eog(engine))
    want = alone_texts(engine, **kwargs)[:3]

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        with Scheduler(engine) as s:
            requests = [s.submit(p, loop=loop, **kwargs) for p in PROMPTS[:3]]

            async def collect(r) -> str:  # type: ignore[no-untyped-def]
                return "".join([step.text async for step in r])

            return list(await asyncio.wait_for(asyncio.gather(*(collect(r) for r in requests)), 120))

    assert asyncio.run(main()) == want


def test_n_seqs_is_checked_and_multiplies_the_kv_cache(model_path: Path) -> None:
    with pytest.raises(UsageError, match="n_seqs must be"):
        bitnet.load(str(model_path), device="cpu", n_seqs=0)
    with pytest.raises(UsageError, match="x 100000 sequences needs"):
        bitnet.load(str(model_path), device="cpu", n_ctx=256, n_seqs=100_000)


def test_nothing_to_generate_and_a_closed_scheduler(engine: Engine) -> None:
    from bitnet.runtime.scheduler import ShuttingDown

    s = Scheduler(engine)
    r = s.submit(PROMPTS[0], max_tokens=0)
    assert r.text() == "" and r.finish_reason == "length" and r.generated_tokens == 0
    s.close()
    with pytest.raises(ShuttingDown, match="shutting down"):
        s.submit(PROMPTS[0], max_tokens=4)
