"""Request bodies of the OpenAI HTTP API, as pydantic models: a field of the wrong type is a 400 before
anything runs. Unknown fields are ignored, as OpenAI-compatible servers do (clients send fields of
newer API versions), except those that would change what the answer means (tools, JSON mode), which
are refused rather than silently dropped. Values (ranges, token ids) are checked by the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Fields a client may send whose meaning we do not implement: refused with a 400 when set.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "suffix")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0  # extensions of llama.cpp's server: top_k, min_p, repeat_penalty
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    user: str | None = None

    def unsupported(self) -> str | None:
        """The first field set that this server does not implement, if any."""
        extra = self.model_extra or {}
        return next((f for f in UNSUPPORTED if extra.get(f) is not None), None)

    def sampling(self) -> dict[str, Any]:
        """The keyword arguments of Scheduler.submit for the sampling fields."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, seed=self.seed, stop=stop, logit_bias=self.logit_bias)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates take it: a role the templates know and plain text."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Body):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None  # the legacy field: alternatives per token
    echo: bool = False
    best_of: int | None = None


_Body.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
