"""`bitnet-select serve` end to end: a real server process on a free loopback port, driven by the official
`openai` client and by httpx for every error case. Bounded: each server is stopped by its own pid, every
request has a timeout, the load test sends 64 requests."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (requirements-dev.txt)")
openai = pytest.importorskip("openai", reason="the server tests need openai (requirements-dev.txt)")
pytest.importorskip("fastapi", reason="the server tests need the [server] extra")

from conftest import ROOT, cli_env  # noqa: E402

KEY = "sk-test-key"
N_CTX = 2048  # the default model's own context
ALIAS = "tiny"
CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`bitnet-select serve` in a subprocess; its log goes to a file (a pipe could fill and block it)."""

    def __init__(self, log: Path, *args: str, env: dict[str, str] | None = None,
                 command: tuple[str, ...] = ("-m", "bitnet", "serve")) -> None:
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, *command, "--port", str(self.port), *args],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         cwd=ROOT)

    def wait_ready(self, timeout: float = 120) -> list[int]:
        """Poll /health until 200; the statuses seen on the way."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}: {self.output()}"
            try:
                seen.append(httpx.get(self.url + "/health", timeout=5).status_code)
                if seen[-1] == 200:
                    return seen
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise AssertionError(f"not ready in {timeout} s: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=AUTH, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return cli_env(BITNET_DEVICE="cpu", BITNET_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Iterator[Server]:
    # 4 slots and 2 waiting places: 8 concurrent clients overflow it (429s), 6 fit.
    s = Server(tmp_path_factory.mktemp("server") / "log", "--parallel", "4", "--max-queue", "2", "--n-ctx", str(N_CTX),
               "--api-key", KEY, "--model-alias", ALIAS, env=env)
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.output()
        assert "Traceback" not in s.output()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


HELLO = [{"role": "user", "content": "Hello"}]


def test_chat_completion_with_the_openai_client(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == ALIAS and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    n = r.usage.completion_tokens
    assert 1 <= n <= 6 and len(choice.logprobs.content) == n
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + n and r.usage.prompt_tokens > 5


def test_chat_stream_matches_the_whole_reply(client: openai.OpenAI) -> None:
    kwargs = dict(model=ALIAS, messages=HELLO, max_tokens=8, temperature=0.8, seed=7)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    without = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in without)


def test_completions_and_models(client: openai.OpenAI) -> None:
    r = client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.object == "text_completion" and len(lp.tokens) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text or r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=ALIAS, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    assert [m.id for m in client.models.list()] == [ALIAS]


def _post(server: Server, body: object, path: str = CHAT, headers: dict[str, str] | None = None,
          timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, (bytes, str, Iterator)) else json.dumps(body)
    h = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=timeout)


def _error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    return err


@pytest.mark.parametrize("body,param", [
    (b'{"messages": [', None),                                                       # malformed JSON
    ({"messages": HELLO, "max_tokens": "many"}, "max_tokens"),                       # a field of the wrong type
    ({"messages": "Hello"}, "messages"),
    ({"messages": HELLO, "temperature": {"x": 1}}, "temperature"),
    ({"messages": []}, "messages"),                                                   # empty messages
    ({"messages": HELLO, "max_tokens": N_CTX + 1}, "max_tokens"),                    # beyond the context
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * N_CTX}]}, "max_tokens"),    # the prompt alone too long
    ({"messages": HELLO, "n": 2}, "n"),
    ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools"),                # would change the meaning
    ({"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "max_tokens": 1},
     "messages.0.content.0.type"),
    ({"messages": HELLO, "top_logprobs": 2}, None),                                  # needs logprobs
    ({"messages": HELLO, "temperature": -1}, None),                                  # range checked by the engine
    ({"messages": HELLO, "logit_bias": {"99999": 1}}, None),
])
def test_bad_requests_are_400(server: Server, body: object, param: str | None) -> None:
    err = _error(_post(server, body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_unknown_fields_are_ignored_and_text_parts_joined(server: Server) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    body = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}],
            "max_tokens": 3, "temperature": 0, "parallel_tool_calls": False, "service_tier": "auto"}
    joined = {**body, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == _post(server, joined).json()["choices"][0]["message"]


def test_context_overflow_says_so(server: Server) -> None:
    err = _error(_post(server, {"messages": HELLO, "max_tokens": N_CTX + 1}), 400)
    assert err["code"] == "context_length_exceeded" and str(N_CTX) in str(err["message"])
    for ids in ([1] * N_CTX, [1] * (N_CTX + 1)):  # no max_tokens: whatever the context leaves, here nothing
        err = _error(_post(server, {"prompt": ids}, "/v1/completions"), 400)
        assert err["code"] == "context_length_exceeded"


def test_api_key(server: Server) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = _error(_post(server, {"messages": HELLO, "max_tokens": 1}, headers=headers), 401)
        assert err["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # for load balancers: no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_model_and_route_are_404(server: Server, client: openai.OpenAI) -> None:
    err = _error(_post(server, {"model": "gpt-4o", "messages": HELLO}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    _error(httpx.get(server.url + "/v1/nothing", headers=AUTH, timeout=10), 404)


def test_oversized_body_is_413(server: Server) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    _error(_post(server, big), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts as it reads
        yield big.encode()[: 1 << 20]
        yield big.encode()[1 << 20:]

    _error(_post(server, chunks()), 413)


def _stream_lines(server: Server, body: dict[str, object], path: str = CHAT) -> Iterator[str]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        yield from r.iter_lines()


def test_sse_ends_with_done(server: Server) -> None:
    lines = [x for x in _stream_lines(server, {"messages": HELLO, "max_tokens": 3}) if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def _running(server: Server) -> float:
    return server.metrics()["bitnet_running_sequences"]


def _wait_running(server: Server, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while _running(server) != n:
        assert time.monotonic() < deadline, f"running sequences stayed {_running(server)}, expected {n}"
        time.sleep(0.02)


# Long enough (seconds here) that a slot never frees by finishing before a test has looked.
LONG = {"messages": HELLO, "max_tokens": N_CTX - 64, "temperature": 0}


@pytest.fixture(scope="module")
def no_eos(env: dict[str, str]) -> dict[str, float]:
    """A logit_bias that bans the default model's end tokens, so a generation runs to max_tokens."""
    import bitnet

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BITNET_CACHE_DIR", env["BITNET_CACHE_DIR"])
        with bitnet.load(None, device="cpu") as engine:
            return {str(i): -100.0 for i in engine.tokenizer.eog_ids}


def test_a_cancelled_stream_frees_its_slot(server: Server, no_eos: dict[str, float]) -> None:
    _wait_running(server, 0)
    before = server.metrics()["bitnet_generation_tokens_total"]
    body = {**LONG, "logit_bias": no_eos, "stream": True}
    with httpx.stream("POST", server.url + CHAT, json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert _running(server) == 1
    # The client is gone: the slot frees within a step, long before the tokens it asked for.
    _wait_running(server, 0, timeout=5)
    generated = server.metrics()["bitnet_generation_tokens_total"] - before
    assert generated < LONG["max_tokens"] / 2
    time.sleep(0.3)
    assert server.metrics()["bitnet_generation_tokens_total"] - before == generated  # nothing runs on


def test_a_non_streaming_client_that_leaves_frees_its_slot(server: Server, no_eos: dict[str, float]) -> None:
    _wait_running(server, 0)
    before = server.metrics()["bitnet_generation_tokens_total"]
    body = json.dumps({**LONG, "logit_bias": no_eos}).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.sendall(head + body)
        _wait_running(server, 1)
    # The connection is closed with no answer read: the sequence is cancelled, not run to its end.
    _wait_running(server, 0, timeout=5)
    assert server.metrics()["bitnet_generation_tokens_total"] - before < LONG["max_tokens"] / 2


def test_a_full_queue_is_429_with_retry_after(server: Server, no_eos: dict[str, float]) -> None:
    _wait_running(server, 0)
    body = {**LONG, "logit_bias": no_eos, "stream": True}
    streams = []
    try:  # 4 slots and 2 waiting places: the 7th request is refused
        for _ in range(6):
            cm = httpx.stream("POST", server.url + CHAT, json=body, headers=AUTH, timeout=60)
            r = cm.__enter__()
            streams.append(cm)
            assert r.status_code == 200
        _wait_running(server, 4)
        r = _post(server, {"messages": HELLO, "max_tokens": 2})
        err = _error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
                model=ALIAS, messages=HELLO, max_tokens=2)
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
    _wait_running(server, 0)


PROMPTS = [f"Tell me about number {i}" for i in range(8)]


def _one(client: openai.OpenAI, i: int) -> tuple[str, str, dict[str, int]] | None:
    """Request i of the load test: its prompt, its text and usage, or None if it was refused with 429."""
    prompt = PROMPTS[i % len(PROMPTS)]
    msgs = [{"role": "user", "content": prompt}]
    try:
        if i % 2:
            chunks = list(client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=12, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            u = chunks[-1].usage
        else:
            r = client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=12, temperature=0)
            text, u = r.choices[0].message.content, r.usage
    except openai.RateLimitError:
        return None
    return prompt, text, {"prompt": u.prompt_tokens, "completion": u.completion_tokens}


def test_load_64_requests_8_at_a_time(server: Server, client: openai.OpenAI) -> None:
    _wait_running(server, 0)
    alone = {p: client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": p}],
                                               max_tokens=12, temperature=0).choices[0].message.content
             for p in PROMPTS}
    before = server.metrics()
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _one(client, i), range(64), timeout=300))
    assert time.monotonic() - t0 < 300
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    done = [r for r in results if r is not None]
    refused = len(results) - len(done)
    assert len(results) == 64 and len(done) >= 8, f"only {len(done)} of 64 completed"
    for prompt, text, _ in done:  # batch invariance, end to end
        assert text == alone[prompt], prompt
    ok = 'bitnet_requests_total{endpoint="/v1/chat/completions",status="200"}'
    busy = 'bitnet_requests_total{endpoint="/v1/chat/completions",status="429"}'
    assert delta(ok) == len(done) and delta(busy) == refused
    assert delta("bitnet_generation_tokens_total") == sum(u["completion"] for *_, u in done)
    assert delta("bitnet_prompt_tokens_total") == sum(u["prompt"] for *_, u in done)
    assert delta("bitnet_time_to_first_token_seconds_count") == len(done)
    assert after["bitnet_queue_depth"] == 0 and after["bitnet_running_sequences"] == 0


def test_health_is_503_while_loading_then_sigterm_exits_0(tmp_path: Path, env: dict[str, str],
                                                          no_eos: dict[str, float]) -> None:
    s = Server(tmp_path / "log", "--parallel", "2", "--n-ctx", "16384", "--shutdown-timeout", "10", env=env)
    try:
        seen = s.wait_ready()
        assert seen[0] == 503 and seen[-1] == 200, seen
        # In flight at SIGTERM: one that ends within the 10 s bound (300 tokens: under a second here, a few
        # seconds on a busy machine) and one that cannot (16000 tokens: 15 s or more).
        short = {"messages": HELLO, "max_tokens": 300, "stream": True, "logit_bias": no_eos}
        long = {**short, "max_tokens": 16000}
        with httpx.stream("POST", s.url + CHAT, json=long, timeout=60) as r_long, \
                httpx.stream("POST", s.url + CHAT, json=short, timeout=60) as r_short:
            long_lines, short_lines = r_long.iter_lines(), r_short.iter_lines()
            next(long_lines), next(short_lines)
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(s.url + "/health", timeout=5)
            assert [x for x in short_lines if x][-1] == "data: [DONE]"  # finished
            with pytest.raises(httpx.RemoteProtocolError):  # still running at the bound: cancelled
                for _ in long_lines:
                    pass
        assert s.proc.wait(30) == 0
        assert time.monotonic() - t0 < 25
    finally:
        s.stop()
    log = s.output()
    assert "Traceback" not in log and "Shutting down" in log


def test_a_model_that_cannot_load_exits_with_its_code(tmp_path: Path, env: dict[str, str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    s = Server(tmp_path / "log", "-m", str(bad), env=env)
    try:
        assert s.proc.wait(60) == 4, s.output()
    finally:
        s.stop()
    assert re.search(r"ERROR bitnet.server: error: .*", s.output()) and "Traceback" not in s.output()


def test_a_taken_port_is_a_usage_error(env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "bitnet", "serve", "--port", str(port)], capture_output=True,
                           text=True, env=env, timeout=60)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr


def test_serve_without_the_server_extra_exits_2(tmp_path: Path) -> None:
    """A real interpreter environment without FastAPI: a fresh venv holding only what `bitnet-select`
    needs to start (click, pluggy) and bitnet-core's source."""
    import click
    import pluggy

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    for module in (click, pluggy):
        src = Path(module.__file__).parent
        (site / src.name).symlink_to(src)
    (site / "bitnet-core.pth").write_text(str(ROOT / "core") + "\n")
    python = str(venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import fastapi"], capture_output=True, timeout=60)
    assert probe.returncode != 0  # the environment really lacks it
    r = subprocess.run([python, "-m", "bitnet", "serve"], capture_output=True, text=True, timeout=60,
                       env=cli_env())
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("error: serve needs the server extra (fastapi, uvicorn, prometheus_client not "
                                "installed): pip install 'bitnet-core[server]'")
