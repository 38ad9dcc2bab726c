"""Continuous batching: many sequences share one model, one forward pass per step.

A background thread runs steps. Each step takes one token from every decoding sequence and a chunk
of the prompt of sequences still prefilling (up to a token budget, decodes first so they never wait
on a long prompt), runs them as one batch through `Transformer.forward_batch` (each row at its own
position in its own sequence slot), and samples the next token of every sequence whose row was the
last of its prompt or a decode. Requests join and leave between steps: a slot frees the moment its
sequence ends or is cancelled. A slot keeps the tokens its last sequence left in the cache, and a new
request goes to the free slot sharing the longest prefix with it (a chat's next turn reuses its turn).

Batch invariance: every per-token computation is per row (per-row int8 activations, integer dot
products, per-row float reductions in a fixed order) and every sequence samples with its own
generator, so a sequence's tokens never depend on what runs beside it.

Results reach the caller through a Request: iterate it (blocking) or `async for` it (from an event
loop); `cancel()` frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bitnet.errors import UsageError
from bitnet.runtime.transformer import PREFILL_CHUNK

if TYPE_CHECKING:
    from bitnet.runtime.engine import Engine, Step
    from bitnet.runtime.sampling import Sampler

_DONE = object()
SWITCH_INTERVAL = 0.0005  # seconds: see Scheduler.__init__


class QueueFull(UsageError):
    """The scheduler's queue is at its bound: try again later (HTTP 429)."""


class ShuttingDown(UsageError):
    """The scheduler is closing and takes no new request (HTTP 503)."""


@dataclass
class Request:
    """One sequence submitted to a Scheduler: its prompt, its sampling, and the steps it produced."""

    ids: list[int]
    sampler: Sampler
    max_tokens: int
    stops: tuple[str, ...]
    loop: asyncio.AbstractEventLoop | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled", or "error"
    error: BaseException | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None  # perf_counter time of the first sampled token
    _cancelled: bool = False
    _sync: collections.deque[Any] = field(default_factory=collections.deque)
    _ready: threading.Condition = field(default_factory=threading.Condition)
    _async: asyncio.Queue[Any] | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.ids)
        if self.loop is not None:
            self._async = asyncio.Queue()

    def cancel(self) -> None:
        """Stop this sequence: its slot frees at the next step, and iteration ends."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _put(self, item: Any) -> None:
        if self._async is not None and self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the loop closed: nobody is listening any more
                self._cancelled = True
            return
        with self._ready:
            self._sync.append(item)
            self._ready.notify()

    def __iter__(self) -> Iterator[Step]:
        while True:
            with self._ready:
                while not self._sync:
                    self._ready.wait()
                item = self._sync.popleft()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    async def __aiter__(self) -> AsyncIterator[Step]:
        assert self._async is not None, "submit with loop= to iterate asynchronously"
        while True:
            item = await self._async.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def text(self) -> str:
        """Wait for the end and return the whole text."""
        return "".join(s.text for s in self)


class _Running:
    """A request in a slot: where its prompt is, and its own text decoding."""

    def __init__(self, req: Request, slot: int, reuse: int, engine: Engine) -> None:
        from bitnet.runtime.engine import StopFilter

        self.req, self.slot, self.pos = req, slot, reuse  # tokens of `history` already in the cache
        self.history = list(req.ids)
        self.decode = engine.tokenizer.stream_decoder()
        self.held = StopFilter(req.stops)
        req.cached_tokens = reuse


class Scheduler:
    """Runs requests on one engine with `n_slots` sequence slots; at most `max_queue` wait for a slot."""

    def __init__(self, engine: Engine, n_slots: int | None = None, max_queue: int = 64,
                 step_tokens: int = 256, prefill_chunk: int = PREFILL_CHUNK) -> None:
        n_slots = engine.n_seqs if n_slots is None else n_slots
        if not 1 <= n_slots <= engine.n_seqs:
            raise UsageError(f"n_slots must be in 1..{engine.n_seqs} (the engine's sequence slots), got {n_slots}")
        if max_queue < 0 or step_tokens < n_slots or prefill_chunk < 1:
            raise UsageError("max_queue >= 0, step_tokens >= n_slots and prefill_chunk >= 1 are required")
        self.engine, self.n_slots, self.max_queue = engine, n_slots, max_queue
        self.step_tokens, self.prefill_chunk = step_tokens, prefill_chunk
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, _Running] = {}
        self._slot_ids: list[list[int]] = [[] for _ in range(n_slots)]  # tokens each slot's cache holds
        self._wake = threading.Condition()
        self._stopping = False
        self.steps = 0  # forward passes run
        if engine._scheduler is not None:
            raise UsageError("this engine already has a running Scheduler")
        engine.reset()  # the slots take over the cache; engine.generate must not run beside them
        engine._scheduler = self
        # Every token wakes a consumer thread (or an event loop) that needs the GIL while this thread
        # runs Python between kernels: at CPython's default 5 ms switch interval that wait cost ~1.5 ms
        # a token (a tiny model: 560 tokens/s vs 1600 at 0.5 ms). Restored by close().
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._loop, name="bitnet-scheduler", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], max_tokens: int = 128,
               loop: asyncio.AbstractEventLoop | None = None, **options: Any) -> Request:
        """Queue a sequence (options as Engine.prepare's; `loop` to iterate it with `async for`).
        Everything is checked here, before it queues; QueueFull past the bound."""
        ids, sampler, stops = self.engine.prepare(prompt, max_tokens, **options)
        req = Request(ids, sampler, max_tokens, stops, loop=loop)
        if max_tokens == 0:  # as engine.generate: nothing to run
            self._finish(req, "length")
            return req
        with self._wake:
            if self._stopping:
                raise ShuttingDown("the server is shutting down and takes no new request")
            # Room: the queue's bound plus the slots not yet taken (the thread may not have admitted yet).
            if len(self._waiting) >= self.max_queue + self.n_slots - len(self._running):
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the bound is {self.max_queue})")
            self._waiting.append(req)
            self._wake.notify()
        return req

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests; cancel those still waiting; let running ones finish for up to `timeout`
        seconds (None: until they end), then cancel them; stop the thread."""
        with self._wake:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._wake.notify()
        for req in waiting:
            self._finish(req, "cancelled")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread.is_alive() and self._running:
            if deadline is not None and time.monotonic() >= deadline:
                for r in list(self._running.values()):
                    r.req.cancel()
                deadline = None
            self._thread.join(0.05)
        with self._wake:
            self._wake.notify()
        self._thread.join()
        if self.engine._scheduler is self:
            self.engine._scheduler = None
            self.engine.reset()
            sys.setswitchinterval(self._switch)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the scheduler thread ------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        req.finish_reason, req.error = reason, error
        req._put(_DONE)

    def _admit(self) -> None:
        free = [s for s in range(self.n_slots) if s not in self._running]
        while free and self._waiting:
            req = self._waiting.popleft()
            if req.cancelled:
                self._finish(req, "cancelled")
                continue
            from bitnet.runtime.engine import common_prefix

            # The free slot whose cached tokens share the longest prefix; at least the last prompt token runs.
            best = max(free, key=lambda s: common_prefix(self._slot_ids[s], req.ids))
            free.remove(best)
            reuse = min(common_prefix(self._slot_ids[best], req.ids), len(req.ids) - 1)
            del self._slot_ids[best][reuse:]
            self._running[best] = _Running(req, best, reuse, self.engine)

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._admit()
                while not self._running and not self._stopping:
                    self._wake.wait()
                    self._admit()
                if not self._running and self._stopping:
                    return
            try:
                self._step()
            except BaseException as exc:  # a failed step fails every sequence in it, not the thread
                for slot, r in list(self._running.items()):
                    self._slot_ids[slot] = []
                    self._finish(r.req, "error", exc)
                self._running.clear()

    def _step(self) -> None:
        for slot, r in list(self._running.items()):  # cancelled between steps: free the slot now
            if r.req.cancelled:
                del self._running[slot]
                self._finish(r.req, "cancelled")
        if not self._running:
            return
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        sampled: list[tuple[_Running, int]] = []  # (sequence, its row in the batch)
        budget = self.step_tokens
        order = sorted(self._running.values(), key=lambda r: r.pos < len(r.history) - 1)  # decodes first
        for r in order:
            left = len(r.history) - r.pos
            n = min(left, budget, self.prefill_chunk if left > 1 else 1)
            if n <= 0:
                continue
            ids += r.history[r.pos:r.pos + n]
            slots += [r.slot] * n
            positions += range(r.pos, r.pos + n)
            budget -= n
            r.pos += n
            self._slot_ids[r.slot] = r.history[:r.pos]
            if r.pos == len(r.history):
                sampled.append((r, len(ids) - 1))
        rows = np.asarray([row for _, row in sampled], np.int32)
        logits = self.engine.transformer.forward_batch(np.asarray(ids, np.int32), np.asarray(slots, np.int32),
                                                       np.asarray(positions, np.int32), rows)
        self.steps += 1
        if not sampled:  # only prefill chunks this step
            return
        choices = _pick_rows(self.engine, logits, [r for r, _ in sampled])
        for (r, _), choice in zip(sampled, choices, strict=True):
            self._advance(r, choice)

    def _advance(self, r: _Running, choice: Any) -> None:
        from bitnet.runtime.engine import Step

        req, tok = r.req, self.engine.tokenizer
        if req.first_token is None:
            req.first_token = time.perf_counter()
        req.generated_tokens += 1
        reason = None
        if tok.is_eog(choice.token):
            reason = "stop"
        else:
            r.history.append(choice.token)
            text, stopped = r.held.push(r.decode(choice.token))
            req._put(Step(choice.token, text, choice.logprob, choice.top))
            if stopped:
                reason = "stop"
            elif req.generated_tokens >= req.max_tokens:
                reason = "length"
        if reason is None:
            return
        if not r.held.stopped and r.held.pending:
            req._put(Step(-1, r.held.pending))
        del self._running[r.slot]
        self._finish(req, reason)


def _pick_rows(engine: Engine, logits: Any, seqs: list[_Running]) -> list[Any]:
    """Each sequence's next token from its row: one device argmax for the plain greedy ones, one copy of
    the logits to the host for the others (biases, penalties, sampling, logprobs)."""
    from bitnet.runtime.sampling import Choice, host_logits

    slow = [s.req.sampler.needs_host for s in seqs]
    host = host_logits(engine.provider, logits) if any(slow) else None
    best = engine.provider.argmax(logits) if not all(slow) else None
    return [s.req.sampler.pick_host(host[i], s.history) if on_host else Choice(int(best[i]))
            for i, (s, on_host) in enumerate(zip(seqs, slow, strict=True))]
