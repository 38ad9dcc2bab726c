"""The OpenAI-compatible HTTP API over one model: FastAPI routes, SSE streaming, errors as OpenAI's JSON.

Every generation goes through the engine's continuous-batching Scheduler (it owns the engine): a
request is a scheduler Request iterated from the event loop, and cancelling it (client gone, shutdown)
frees its slot at the next step. The model loads in a thread after the socket is bound, so `/health`
answers 503 until it is ready. No traceback reaches a client, nor the log unless `debug` is set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bitnet.errors import UsageError
from bitnet.runtime.completions import Shaper, check_chat_logprobs, usage
from bitnet.runtime.scheduler import QueueFull, ShuttingDown
from bitnet.server.metrics import Metrics
from bitnet.server.schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from bitnet.runtime.engine import Engine, Step
    from bitnet.runtime.scheduler import Request as SeqRequest
    from bitnet.runtime.scheduler import Scheduler

log = logging.getLogger("bitnet.server")

_TYPE_TAGS = ("str", "int", "float", "bool", "dict", "list")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


@dataclass
class Settings:
    """What `bitnet-select serve` configures (its --help says what each does)."""

    model: str | None = None
    device: str | None = None
    n_ctx: int | None = None
    parallel: int = 4
    max_queue: int = 64
    api_key: str | None = None
    model_alias: str | None = None
    chat_template: str | None = None
    act_quant: str = "row"
    lm_head: str = "auto"
    kv_type: str = "f32"
    max_body_bytes: int = 1 << 20
    shutdown_timeout: float = 10.0
    debug: bool = False
    # Ray Serve: finish loading before the app's startup returns, so a replica takes traffic only when ready.
    load_before_start: bool = False


class OpenAIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _internal(exc: BaseException, debug: bool) -> OpenAIError:
    """Log an unexpected error in one line (a traceback only with debug); the client gets no details."""
    if debug:
        log.error("internal error", exc_info=exc)
    else:
        log.error("internal error: %s: %s (run with --debug for a traceback)", type(exc).__name__, exc)
    return OpenAIError(500, "internal server error", "server_error")


class ModelHost:
    """The model and its scheduler, loaded in a background thread; `error` if loading failed."""

    def __init__(self, settings: Settings, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.settings, self.on_fatal = settings, on_fatal
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.error: BaseException | None = None
        self.metrics = Metrics()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        assert self.engine is not None
        return self.settings.model_alias or self.engine.name

    def start(self) -> None:
        # A daemon: a SIGTERM during a long load must not wait for it.
        self._thread = threading.Thread(target=self._load, name="bitnet-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from bitnet.runtime.engine import load

        s = self.settings
        try:
            engine = load(s.model, device=s.device, n_ctx=s.n_ctx, act_quant=s.act_quant,
                          chat_template=s.chat_template, n_seqs=s.parallel, lm_head=s.lm_head, kv_type=s.kv_type)
            scheduler = engine.scheduler(n_slots=s.parallel, max_queue=s.max_queue)
            # One token through the scheduler before /health says ready: a backend that compiles its kernels
            # on first use does it now, not in the first client's time to first token.
            scheduler.submit([engine.tokenizer.bos_id or 0], max_tokens=1).text()
        except BaseException as exc:
            self.error = exc
            if s.debug:
                log.error("cannot load the model", exc_info=exc)
            else:
                log.error("error: %s", exc)
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        self.metrics.watch(lambda: scheduler.queue_depth, lambda: scheduler.running)
        self.engine, self.scheduler = engine, scheduler
        log.info("%s", engine.summary)
        log.info("model %s ready: n_ctx %d, %d parallel sequences, queue bound %d", self.name, engine.n_ctx,
                 s.parallel, s.max_queue)

    def close(self) -> None:
        """Cancel what waits, let running sequences finish for up to the shutdown timeout, free the model."""
        if self.scheduler is not None:
            self.scheduler.close(self.settings.shutdown_timeout)
        if self.engine is not None:
            self.engine.close()


class _Guard:
    """The outermost ASGI layer: bounds request bodies (413), counts requests by status, and turns any
    escaped exception into a one-line log and an OpenAI-shaped 500 (never a traceback)."""

    def __init__(self, app: Any, host: ModelHost) -> None:
        self.app, self.host = app, host

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.host.settings.max_body_bytes
        status: list[int] = []
        received = 0

        async def send_(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        async def receive_() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a chunked body with no Content-Length
                raise HTTPException(413, f"the request body exceeds {limit} bytes")
            return message

        try:
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await OpenAIError(413, f"the request body exceeds {limit} bytes").response()(scope, receive, send_)
            else:
                await self.app(scope, receive_, send_)
        except asyncio.CancelledError:
            # Only uvicorn's graceful-shutdown timeout cancels a request task: it is over, say so in one line.
            log.warning("%s cancelled at shutdown", scope["path"])
            if self.host.settings.debug:
                raise
        except Exception as exc:
            error = _internal(exc, self.host.settings.debug)
            if not status:
                await error.response()(scope, receive, send_)
        finally:
            path = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.host.metrics.requests.labels(path, str(status[0] if status else 499)).inc()


def create_app(settings: Settings, on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The ASGI app. The model starts loading when the app starts (its lifespan), not before."""
    host = ModelHost(settings, on_fatal)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        host.start()
        if settings.load_before_start:
            assert host._thread is not None
            await asyncio.to_thread(host._thread.join)
            if host.error is not None:
                raise host.error
        yield
        try:
            await asyncio.to_thread(host.close)
        except Exception as exc:
            _internal(exc, settings.debug)

    app = FastAPI(title="bitnet", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.host = host
    # Inside Starlette's ServerErrorMiddleware (which would log a traceback), outside everything else.
    app.add_middleware(_Guard, host=host)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(QueueFull)
    async def _queue_full(_: Request, exc: QueueFull) -> JSONResponse:
        # Retry-After: a slot frees as soon as any running sequence ends, typically within a second or so.
        return OpenAIError(429, f"the server is busy: {exc}", "rate_limit_error", None, "queue_full",
                           {"Retry-After": "1"}).response()

    @app.exception_handler(ShuttingDown)
    async def _shutting_down(_: Request, exc: ShuttingDown) -> JSONResponse:
        return OpenAIError(503, str(exc), "server_error", None, "shutting_down").response()

    @app.exception_handler(UsageError)
    async def _usage_error(_: Request, exc: UsageError) -> JSONResponse:
        return OpenAIError(400, str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # The deepest error says most (of a union, the branch that got furthest); pydantic names union
        # branches in the location ("str", "list[TextPart]"): clients know the fields only.
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and p not in _TYPE_TAGS and "[" not in str(p)]
        if first.get("type") == "json_invalid":
            return OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}").response()
        where = ".".join(loc)
        if not where:  # not a JSON object (or not sent as application/json, as `curl -d` does)
            return OpenAIError(400, "the body must be a JSON object sent as Content-Type: application/json").response()
        return OpenAIError(400, f"{where}: {first.get('msg')}", param=where).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        return OpenAIError(exc.status_code, str(exc.detail), kind, headers=exc.headers).response()

    def authorized(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise OpenAIError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                              code="invalid_api_key")

    def ready() -> ModelHost:
        if host.engine is None:
            raise OpenAIError(503, "the model is loading" if host.error is None else "the model failed to load",
                              "unavailable_error", headers={"Retry-After": "1"})
        return host

    def check_model(name: str | None) -> None:
        if name is not None and name != host.name:
            raise OpenAIError(404, f"the model {name!r} does not exist (this server has {host.name!r})",
                              param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        if host.engine is None:
            return JSONResponse({"status": "loading" if host.error is None else "error"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics() -> Response:
        return PlainTextResponse(host.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        h = ready()
        return {"object": "list", "data": [{"id": h.name, "object": "model", "created": 0, "owned_by": "bitnet"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        h = ready()
        _common_checks(body)
        check_model(body.model)
        if not body.messages:
            raise OpenAIError(400, "messages must be a non-empty list", param="messages")
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise OpenAIError(400, "response_format other than text is not supported", param="response_format")
        n_top = check_chat_logprobs(body.logprobs, body.top_logprobs)
        assert h.engine is not None
        # Tokenizing off the event loop: a 1 MB body of one word takes ~2 s, and other requests go on meanwhile.
        ids = await asyncio.to_thread(h.engine.apply_chat_template, [m.for_template() for m in body.messages])
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        shaper = Shaper(h.engine.tokenizer, h.name, True, n_top)
        return await _generate(h, request, body, ids, limit, shaper)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        h = ready()
        _common_checks(body)
        check_model(body.model)
        if body.echo or (body.best_of or 1) != 1:
            raise OpenAIError(400, "echo and best_of > 1 are not supported", param="echo" if body.echo else "best_of")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise OpenAIError(400, "one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        assert h.engine is not None
        ids = await asyncio.to_thread(h.engine.tokenize, prompt) if isinstance(prompt, str) else list(prompt)
        shaper = Shaper(h.engine.tokenizer, h.name, False, body.logprobs)
        return await _generate(h, request, body, ids, body.max_tokens, shaper)

    return app


def _common_checks(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n != 1:
        raise OpenAIError(400, "n must be 1 (one choice per request)", param="n")
    field = body.unsupported()
    if field is not None:
        raise OpenAIError(400, f"{field} is not supported by this server", param=field)
    extra = sorted(set(body.model_extra or {}))
    if extra:
        log.info("ignored unknown field(s): %s", ", ".join(extra))


async def _generate(host: ModelHost, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    ids: list[int], max_tokens: int | None, shaper: Shaper) -> Response:
    engine, scheduler = host.engine, host.scheduler
    assert engine is not None and scheduler is not None
    wanted = f"max_tokens {max_tokens}" if max_tokens is not None else "at least one token"
    if max_tokens is None:  # as OpenAI: as many as the context leaves
        max_tokens = engine.n_ctx - len(ids)
    if max_tokens < 1 or len(ids) + max_tokens > engine.n_ctx:
        raise OpenAIError(400, f"the prompt's {len(ids)} tokens plus {wanted} exceed the context of {engine.n_ctx} "
                          "tokens", param="max_tokens", code="context_length_exceeded")
    req = scheduler.submit(ids, max_tokens=max_tokens, logprobs=shaper.logprobs, loop=asyncio.get_running_loop(),
                           **body.sampling())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_events(host, req, shaper, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_cancel_on_disconnect(request, req))
    try:
        async for step in _steps(host, req, shaper):
            shaper.feed(step)
    except asyncio.CancelledError:
        req.cancel()
        raise
    except Exception as exc:
        raise _internal(exc, host.settings.debug) from None
    finally:
        watcher.cancel()
    return JSONResponse(shaper.response(req.finish_reason, _usage(req, shaper)))


def _usage(req: SeqRequest, shaper: Shaper) -> dict[str, Any]:
    return usage(req.prompt_tokens, shaper.tokens, req.cached_tokens)


async def _steps(host: ModelHost, req: SeqRequest, shaper: Shaper) -> AsyncIterator[Step]:
    """The request's Steps, recording time to first token, per-token latency and token counts."""
    m = host.metrics
    last = None
    try:
        async for step in req:
            now = time.perf_counter()
            if last is not None and step.token >= 0:
                m.token_latency.observe(now - last)
            last = now
            yield step
    finally:
        if req.first_token is not None:  # the scheduler's times (a first token may be the end token: no Step)
            m.ttft.observe(req.first_token - req.submitted)
        m.prompt_tokens.inc(req.prompt_tokens)
        m.generated_tokens.inc(shaper.tokens)


async def _cancel_on_disconnect(request: Request, req: SeqRequest) -> None:
    """Cancel the sequence when the client goes away (the body is read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            req.cancel()
            return


def _event(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(host: ModelHost, req: SeqRequest, shaper: Shaper, include_usage: bool) -> AsyncIterator[str]:
    """Server-Sent Events: the chunks, the usage chunk if asked for, then `data: [DONE]`. A client that goes
    away cancels this generator, and with it the sequence (its slot frees at the next step)."""
    finished = False
    try:
        for chunk in shaper.opening():
            yield _event(chunk)
        async for step in _steps(host, req, shaper):
            chunk = shaper.feed(step)
            if chunk is not None:
                yield _event(chunk)
        yield _event(shaper.final_chunk(req.finish_reason))
        if include_usage:
            yield _event(shaper.usage_chunk(_usage(req, shaper)))
        finished = True
    except Exception as exc:  # the headers are sent: the error goes in the stream, as OpenAI's does
        error = _internal(exc, host.settings.debug)
        yield _event({"error": {"message": error.message, "type": error.type, "param": None, "code": None}})
        finished = True
    finally:
        if not finished:
            req.cancel()
    yield "data: [DONE]\n\n"


def run(settings: Settings, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Bind, start serving (health says 503), load the model, serve until SIGTERM or SIGINT, then shut down
    gracefully: stop accepting, let in-flight requests finish for up to settings.shutdown_timeout seconds,
    cancel the rest. Returns normally after a signal; raises the loading error if the model fails to load."""
    import signal
    import socket

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:  # bound here, so a taken port is a one-line usage error and --port 0 can say what it got
        sock = socket.create_server((host, port), family=family)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]
    server: uvicorn.Server | None = None

    def fatal(_: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=fatal)
    config = uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=settings.shutdown_timeout,
                            lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises a captured SIGTERM/SIGINT once it has shut down, with the handlers it found: these
    # make that re-raise a no-op, so a graceful shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    url_host = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (loading the model; /health is 503 until it is ready)", url_host, bound)
    server.run(sockets=[sock])
    if app.state.host.error is not None:
        raise app.state.host.error
