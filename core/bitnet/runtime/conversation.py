"""A multi-turn chat with one engine: the messages so far, fitted into the context, replies streamed.

Each turn renders the whole conversation through the chat template; the engine then reuses the
KV cache of every token the previous turn left there (its prompt and its reply), so a turn
prefills only its own new tokens. When the conversation no longer fits (prompt plus room for a
reply of max_tokens), the oldest exchanges are dropped, never the system prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bitnet.errors import UsageError

if TYPE_CHECKING:
    from bitnet.runtime.engine import Engine

# What a chat's /set changes: max_tokens and the sampling options, by our names or ollama's.
ALIASES = {"num_predict": "max_tokens", "repeat_last_n": "penalty_last_n"}
INTEGER_OPTIONS = ("max_tokens", "top_k", "seed", "penalty_last_n")
NUMBER_OPTIONS = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")


class Conversation:
    def __init__(self, engine: Engine, system: str | None = None, max_tokens: int = 512, **sampling: Any) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise UsageError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        self.engine, self.max_tokens, self.sampling = engine, max_tokens, sampling
        engine.prepare([0], 1, **sampling)  # every option checked now, not at the first turn
        self.messages: list[dict[str, str]] = []
        self.dropped = 0  # messages the last turn dropped to fit the context
        if system:
            self.set_system(system)

    def set_system(self, text: str) -> None:
        """Replace the system prompt (an empty text removes it); the rest of the conversation stays."""
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def set_option(self, name: str, value: str) -> str:
        """Set max_tokens or a sampling option from its text for the turns to come, checked as the chat's
        options were at its start (a UsageError leaves everything as it was); the option's own name."""
        name = ALIASES.get(name, name)
        if name not in INTEGER_OPTIONS + NUMBER_OPTIONS:
            raise UsageError(f"unknown parameter {name!r}; one of {', '.join(INTEGER_OPTIONS + NUMBER_OPTIONS)}")
        try:
            number = int(value) if name in INTEGER_OPTIONS else float(value)
        except ValueError:
            raise UsageError(f"{name} takes {'an integer' if name in INTEGER_OPTIONS else 'a number'}, "
                             f"got {value!r}") from None
        if name == "max_tokens":
            if number < 1:
                raise UsageError(f"max_tokens must be an integer >= 1, got {number}")
            self.max_tokens = number
        else:
            sampling = {**self.sampling, name: number}
            self.engine.prepare([0], 1, **sampling)
            self.sampling = sampling
        return name

    def options(self) -> dict[str, Any]:
        """max_tokens and the sampling options the next turn runs with."""
        return {"max_tokens": self.max_tokens, **self.sampling}

    def clear(self) -> None:
        """Forget every exchange; keep the system prompt."""
        self.messages = [m for m in self.messages if m["role"] == "system"]

    def _fit(self) -> tuple[list[int], int]:
        """Prompt ids of the conversation and the reply budget, dropping the oldest exchanges to make room."""
        n_ctx = self.engine.n_ctx
        alone = [m for m in self.messages if m["role"] == "system"] + self.messages[-1:]
        n_alone = len(self.engine.apply_chat_template(alone))
        if n_alone >= n_ctx:  # checked first: a message that cannot fit must not cost the history
            raise UsageError(f"this message needs {n_alone} tokens with the system prompt; the context holds {n_ctx}")
        self.dropped = 0
        while True:
            ids = self.engine.apply_chat_template(self.messages)
            first = next(i for i, m in enumerate(self.messages) if m["role"] != "system")
            if len(ids) + self.max_tokens <= n_ctx or first == len(self.messages) - 1:
                return ids, min(self.max_tokens, n_ctx - len(ids))
            # An exchange: the user's message and the reply that followed it.
            n = 2 if self.messages[first + 1]["role"] == "assistant" and first + 1 < len(self.messages) - 1 else 1
            del self.messages[first:first + n]
            self.dropped += n

    def reply(self, text: str) -> Iterator[str]:
        """Add the user's message and stream the reply. The reply joins the conversation as far as it got,
        also when the caller stops early (close the iterator: Ctrl-C ends a reply, not the chat)."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids, budget = self._fit()
        except BaseException:
            self.messages.pop()
            raise
        pieces: list[str] = []
        try:
            for piece in self.engine.generate(ids, max_tokens=budget, **self.sampling):
                pieces.append(piece)
                yield piece
        finally:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
