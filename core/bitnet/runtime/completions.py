"""OpenAI-shaped results of a run: `text_completion` and `chat.completion` dicts and their stream
chunks, as llama-cpp-python's `create_completion` / `create_chat_completion` return them, so code
written for either ports with a one-line change.

`Shaper` turns a stream of Steps into those dicts one Step at a time, whoever produces the Steps: the
engine's own run (`completion`, `chat_completion` below) or the scheduler's Requests in the HTTP
server (bitnet.server), so both answer with the same shapes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bitnet.errors import UsageError
from bitnet.runtime.sampling import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from bitnet.runtime.engine import Engine, Step
    from bitnet.text.tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def check_chat_logprobs(logprobs: Any, top_logprobs: Any) -> int | None:
    """OpenAI chat's `logprobs` (bool) and `top_logprobs` (0..20, needs logprobs) as the number of
    alternatives to compute per token, None for no log-probabilities."""
    if not isinstance(logprobs, bool):
        raise UsageError(f"logprobs must be true or false, got {logprobs!r}")
    if top_logprobs is not None and not logprobs:
        raise UsageError("top_logprobs needs logprobs: true")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise UsageError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    return (top_logprobs or 0) if logprobs else None


class Shaper:
    """One choice's OpenAI dicts built from Steps: `feed` each Step (it returns the stream chunk to send,
    if any), then `final_chunk` or `response` with the finish reason and the usage."""

    def __init__(self, tokenizer: Tokenizer, model: str, chat: bool, logprobs: int | None) -> None:
        # logprobs: None for none, else the alternatives per token (chat's top_logprobs, legacy `logprobs`)
        self.tokenizer, self.chat, self.logprobs = tokenizer, chat, logprobs
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}", "created": int(time.time()),
                     "model": model}
        self.tokens = 0  # sampled tokens that produced a Step (the end-of-generation token does not)
        self._text: list[str] = []
        self._chat_lp: list[dict[str, Any]] = []
        self._legacy_lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                 "text_offset": []}
        self._offset = 0

    def _piece(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def _chat_entry(self, token: int, value: float) -> dict[str, Any]:
        return {"token": self._piece(token), "logprob": value, "bytes": list(self.tokenizer.token_bytes(token))}

    def _choice(self, body: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": [{"index": 0, **body, "logprobs": logprobs,
                                                         "finish_reason": finish}]}

    def opening(self) -> list[dict[str, Any]]:
        """Chunks to send before the first Step (chat: the assistant's role)."""
        return [self._choice({"delta": {"role": "assistant", "content": ""}}, None, None)] if self.chat else []

    def feed(self, s: Step) -> dict[str, Any] | None:
        """Take one Step into the whole response; return its stream chunk, None if it has nothing to say."""
        self._text.append(s.text)
        lp: Any = None
        if s.token >= 0:
            self.tokens += 1
            if self.logprobs is not None and s.logprob is not None:
                if self.chat:
                    entry = {**self._chat_entry(s.token, s.logprob),
                             "top_logprobs": [self._chat_entry(t, v) for t, v in s.top]}
                    self._chat_lp.append(entry)
                    lp = {"content": [entry]}
                else:
                    piece = self._piece(s.token)
                    lp = {"tokens": [piece], "token_logprobs": [s.logprob],
                          "top_logprobs": [{self._piece(t): v for t, v in s.top}], "text_offset": [self._offset]}
                    self._offset += len(piece)
                    for k, v in lp.items():
                        self._legacy_lp[k] += v
        if not s.text and lp is None:
            return None
        body = {"delta": {"content": s.text}} if self.chat else {"text": s.text}
        return self._choice(body, lp, None)

    def final_chunk(self, finish_reason: str | None) -> dict[str, Any]:
        body = {"delta": {}} if self.chat else {"text": ""}
        return self._choice(body, None, finish_reason)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's `stream_options.include_usage` chunk: no choices, the usage of the whole run."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": [], "usage": usage}

    def response(self, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        text = "".join(self._text)
        if self.chat:
            lp = {"content": self._chat_lp} if self.logprobs is not None else None
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": finish_reason}
            return {**self.head, "object": "chat.completion", "choices": [choice], "usage": usage}
        lp = self._legacy_lp if self.logprobs is not None else None
        choice = {"text": text, "index": 0, "logprobs": lp, "finish_reason": finish_reason}
        return {**self.head, "object": "text_completion", "choices": [choice], "usage": usage}


# -- the engine's own runs (Engine.create_completion / create_chat_completion) -------------------------

def _check_stream(stream: Any) -> None:
    if not isinstance(stream, bool):
        raise UsageError(f"stream must be true or false, got {stream!r}")


def completion(engine: Engine, prompt: str | Sequence[int], stream: bool = False, logprobs: int | None = None,
               **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """`logprobs` is the legacy completions field: how many alternatives to list per token (0..20)."""
    _check_stream(stream)
    steps = engine.stream(prompt, logprobs=logprobs, **kwargs)  # checks everything before any compute
    return _result(engine, Shaper(engine.tokenizer, engine.name, False, logprobs), steps, stream)


def chat_completion(engine: Engine, messages: Sequence[Mapping[str, Any]], stream: bool = False,
                    logprobs: bool = False, top_logprobs: int | None = None,
                    **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """`logprobs` (bool) and `top_logprobs` (0..20, needs logprobs) as in OpenAI's chat API."""
    _check_stream(stream)
    n_top = check_chat_logprobs(logprobs, top_logprobs)
    steps = engine.stream(engine.apply_chat_template(messages), logprobs=n_top, **kwargs)
    return _result(engine, Shaper(engine.tokenizer, engine.name, True, n_top), steps, stream)


def _result(engine: Engine, shaper: Shaper, steps: Iterator[Step],
            stream: bool) -> dict[str, Any] | Iterator[dict[str, Any]]:
    if stream:
        return _chunks(engine, shaper, steps)
    for s in steps:
        shaper.feed(s)
    # engine.stats is the run's once its steps have run (the run replaces it when it starts).
    return shaper.response(engine.stats.finish_reason, usage(engine.stats.prompt_tokens, shaper.tokens))


def _chunks(engine: Engine, shaper: Shaper, steps: Iterator[Step]) -> Iterator[dict[str, Any]]:
    yield from shaper.opening()
    for s in steps:
        chunk = shaper.feed(s)
        if chunk is not None:
            yield chunk
    # As llama-cpp-python: the last chunk carries the finish reason and the usage.
    yield {**shaper.final_chunk(engine.stats.finish_reason), "usage": usage(engine.stats.prompt_tokens, shaper.tokens)}
