"""OpenAI-shaped results of an engine run: `text_completion` and `chat.completion` dicts and their
stream chunks, as llama-cpp-python's `create_completion` / `create_chat_completion` return them, so
code written for either ports with a one-line change. The HTTP server sends these same dicts.
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


def _usage(engine: Engine, n_completion: int) -> dict[str, int]:
    n_prompt = engine.stats.prompt_tokens
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def _piece(engine: Engine, token: int) -> str:
    return engine.tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _check_stream(stream: Any) -> None:
    if not isinstance(stream, bool):
        raise UsageError(f"stream must be true or false, got {stream!r}")


# -- text completions ---------------------------------------------------------------------------------

def completion(engine: Engine, prompt: str | Sequence[int], stream: bool = False, logprobs: int | None = None,
               **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """`logprobs` is the legacy completions field: how many alternatives to list per token (0..20)."""
    _check_stream(stream)
    steps = engine.stream(prompt, logprobs=logprobs, **kwargs)  # checks everything before any compute
    head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
            "model": engine.name}
    if stream:
        return _completion_chunks(engine, head, steps, logprobs is not None)
    text, lp, n = [], _LegacyLogprobs(engine), 0
    for s in steps:
        text.append(s.text)
        if s.token >= 0:
            n += 1
            if logprobs is not None:
                lp.add(s)
    choice = {"text": "".join(text), "index": 0, "logprobs": lp.out if logprobs is not None else None,
              "finish_reason": engine.stats.finish_reason}
    return {**head, "choices": [choice], "usage": _usage(engine, n)}


class _LegacyLogprobs:
    def __init__(self, engine: Engine) -> None:
        self.engine, self.offset = engine, 0
        self.out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, s: Step) -> None:
        piece = _piece(self.engine, s.token)
        self.out["tokens"].append(piece)
        self.out["token_logprobs"].append(s.logprob)
        self.out["top_logprobs"].append({_piece(self.engine, t): v for t, v in s.top})
        self.out["text_offset"].append(self.offset)
        self.offset += len(piece)


def _completion_chunks(engine: Engine, head: dict[str, Any], steps: Iterator[Step],
                       want_logprobs: bool) -> Iterator[dict[str, Any]]:
    n = 0
    for s in steps:
        lp = None
        if s.token >= 0:
            n += 1
            if want_logprobs:
                lp = _LegacyLogprobs(engine)
                lp.add(s)
        if s.text or lp is not None:
            yield {**head, "choices": [{"text": s.text, "index": 0, "logprobs": lp.out if lp else None,
                                        "finish_reason": None}]}
    yield {**head, "choices": [{"text": "", "index": 0, "logprobs": None,
                                "finish_reason": engine.stats.finish_reason}], "usage": _usage(engine, n)}


# -- chat completions ---------------------------------------------------------------------------------

def _chat_logprob(engine: Engine, s: Step) -> dict[str, Any]:
    def entry(token: int, value: float) -> dict[str, Any]:
        return {"token": _piece(engine, token), "logprob": value, "bytes": list(engine.tokenizer.token_bytes(token))}

    assert s.logprob is not None
    return {**entry(s.token, s.logprob), "top_logprobs": [entry(t, v) for t, v in s.top]}


def chat_completion(engine: Engine, messages: Sequence[Mapping[str, Any]], stream: bool = False,
                    logprobs: bool = False, top_logprobs: int | None = None,
                    **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """`logprobs` (bool) and `top_logprobs` (0..20, needs logprobs) as in OpenAI's chat API."""
    _check_stream(stream)
    if not isinstance(logprobs, bool):
        raise UsageError(f"logprobs must be true or false, got {logprobs!r}")
    if top_logprobs is not None and not logprobs:
        raise UsageError("top_logprobs needs logprobs: true")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise UsageError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    ids = engine.apply_chat_template(messages)
    steps = engine.stream(ids, logprobs=(top_logprobs or 0) if logprobs else None, **kwargs)
    head = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": engine.name}
    if stream:
        return _chat_chunks(engine, head, steps, logprobs)
    text, content, n = [], [], 0
    for s in steps:
        text.append(s.text)
        if s.token >= 0:
            n += 1
            if logprobs:
                content.append(_chat_logprob(engine, s))
    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
              "logprobs": {"content": content} if logprobs else None, "finish_reason": engine.stats.finish_reason}
    return {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(engine, n)}


def _chat_chunks(engine: Engine, head: dict[str, Any], steps: Iterator[Step],
                 want_logprobs: bool) -> Iterator[dict[str, Any]]:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    n = 0
    for s in steps:
        lp = None
        if s.token >= 0:
            n += 1
            if want_logprobs:
                lp = {"content": [_chat_logprob(engine, s)]}
        if s.text or lp is not None:
            yield chunk({"content": s.text}, lp)
    yield {**chunk({}, None, engine.stats.finish_reason), "usage": _usage(engine, n)}
