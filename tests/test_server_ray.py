"""Ray Serve scale-out (bitnet.server.ray): two replicas on a local Ray instance bound to loopback, driven by
the same `openai` client tests as the single server (test_server's, called here against Ray). One test
function, so parallel test workers start one Ray instance, not one each."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'bitnet-core[ray]')")
openai = pytest.importorskip("openai", reason="the server tests need openai (requirements-dev.txt)")

import test_server  # noqa: E402
from test_server import ALIAS, HELLO, KEY, Server  # noqa: E402

from conftest import cli_env  # noqa: E402


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One CPU thread per replica: two replicas share this machine's cores.
    # RAY_DEDUP_LOGS=0: every replica request log line reaches the output (Ray folds repeated ones).
    env = cli_env(BITNET_DEVICE="cpu", BITNET_NUM_THREADS="1", RAY_DEDUP_LOGS="0",
                  BITNET_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))
    s = Server(tmp_path_factory.mktemp("ray") / "log", "--num-replicas", "2", "--replica-cpus", "0.5", "--parallel",
               "2", "--n-ctx", "512", "--api-key", KEY, "--model-alias", ALIAS, env=env,
               command=("-m", "bitnet.server.ray"))
    try:
        deadline = time.monotonic() + 240
        while "ready: " not in s.output():
            assert s.proc.poll() is None, f"exited {s.proc.returncode}: {s.output()[-3000:]}"
            assert time.monotonic() < deadline, s.output()[-3000:]
            time.sleep(0.5)
        assert "with 2 replicas" in s.output(), s.output()[-3000:]
        s.wait_ready(60)
        yield s
    finally:
        assert s.stop(timeout=60) == 0, s.output()[-3000:]


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_client_through_two_ray_replicas(server: Server, client: openai.OpenAI) -> None:
    test_server.test_chat_completion_with_the_openai_client(client)
    test_server.test_chat_stream_matches_the_whole_reply(client)
    test_server.test_completions_and_models(client)

    def ask(_: int) -> str:
        return client.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=8, temperature=0,
                                              ).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, range(16), timeout=120))
    assert len(set(texts)) == 1  # the same greedy reply from either replica
    deadline = time.monotonic() + 20
    while True:  # the replicas' request logs reach the driver's output asynchronously
        replicas = set(re.findall(r"default_bitnet (\w+) \S+ -- POST /v1/chat/completions 200", server.output()))
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2, server.output()[-3000:]
