"""`bitnet-select serve` vs llama-cpp-python's own server on one model: aggregate tokens/s and p50/p95 time
to first token at 1 and 8 concurrent streaming clients, both servers started here with the same threads.

Both get the same prompt on /v1/completions with the end-of-generation tokens banned, so every request
generates exactly --max-tokens tokens (checked: finish_reason "length"), and the same logit_bias keeps
them on tokens that have text. Aggregate tokens/s is all the
tokens of a level over its wall time; time to first token is from sending a request to its first streamed
text. The servers are measured one after the other, each idle while the other runs.

    python -m bitnet.modelfile.writer /tmp/2b4t.gguf --preset 2b4t --weight-type i2_s
    python -m bitnet.modelfile.writer /tmp/2b4t-tq2.gguf --preset 2b4t --weight-type tq2_0 --arch bitnet
    python benchmarks/bench_server.py --model /tmp/2b4t.gguf --llama-model /tmp/2b4t-tq2.gguf --threads 2

llama.cpp cannot read I2_S: give its TQ2_0 twin (same shapes) as --llama-model. Needs
`pip install 'llama-cpp-python[server]'` and the [server] extra.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

PROMPT = "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str]) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)

    def wait_ready(self, path: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        sys.exit(f"{self.name} not ready in {timeout} s: see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _logit_bias(model: str) -> dict[str, float]:
    """Ban the end-of-generation tokens (every request runs to max_tokens) and favour the vocabulary's normal
    tokens: a synthetic file's vocabulary is mostly empty control tokens, whose text would never stream."""
    from bitnet.modelfile.model import load_model
    from bitnet.text.tokenizer import Tokenizer

    metadata = load_model(model).metadata
    types = metadata.get("tokenizer.ggml.token_type") or []
    bias = {str(i): 30.0 for i, t in enumerate(types) if t == 1}  # 1: NORMAL in GGUF's token types
    bias.update({str(i): -100.0 for i in Tokenizer.from_metadata(metadata).eog_ids})
    return bias


def _one(url: str, body: dict[str, Any]) -> tuple[float, int]:
    """One streaming request: (seconds to its first text, tokens generated)."""
    t0 = time.perf_counter()
    ttft, finish = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if ttft is None and choice.get("text"):
                ttft = time.perf_counter() - t0
            finish = choice.get("finish_reason") or finish
    if finish != "length":
        sys.exit(f"{url}: finish_reason {finish!r}, expected 'length' (the token count would be wrong)")
    return (ttft if ttft is not None else time.perf_counter() - t0), body["max_tokens"]


def _level(url: str, clients: int, requests: int, body: dict[str, Any]) -> dict[str, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda _: _one(url, body), range(requests)))
    wall = time.perf_counter() - t0
    ttfts = sorted(t for t, _ in results)
    p95 = ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]
    return {"tps": sum(n for _, n in results) / wall, "p50": statistics.median(ttfts), "p95": p95, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the file our server runs (I2_S, TQ2_0, ...)")
    ap.add_argument("--llama-model", default=None, help="the file llama.cpp runs (default: --model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    ap.add_argument("--clients", default="1,8", help="concurrency levels")
    ap.add_argument("--rounds", type=int, default=1, help="requests per client at each level")
    ap.add_argument("--n-ctx", type=int, default=512)
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    env = {**os.environ, "BITNET_NUM_THREADS": str(args.threads), "BITNET_DEVICE": "cpu"}
    ours_port, llama_port = _free_port(), _free_port()
    ours = _Proc("bitnet", [sys.executable, "-m", "bitnet", "serve", "-m", args.model, "--port", str(ours_port),
                            "--parallel", str(max(levels)), "--n-ctx", str(args.n_ctx)], ours_port, env)
    llama = _Proc("llama-cpp-python", [sys.executable, "-m", "llama_cpp.server", "--model",
                                       args.llama_model or args.model, "--port", str(llama_port), "--host",
                                       "127.0.0.1", "--n_threads", str(args.threads), "--n_ctx", str(args.n_ctx),
                                       # by default a new request aborts the stream in progress: queue instead
                                       "--interrupt_requests", "False"],
                  llama_port, env)
    try:
        ours.wait_ready("/health")
        llama.wait_ready("/v1/models")
        body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                "logit_bias": _logit_bias(args.model)}
        for server in (ours, llama):  # warm-up: first-use costs (page faults of the mapped file) out of the figures
            _one(server.url, body)
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "unknown CPU")
        print(f"{cpu}; {args.threads} threads; {args.max_tokens} tokens per request; prompt {PROMPT[:30]!r}...")
        print(f"{'clients':>7}  {'server':<18}{'tokens/s':>9}  {'TTFT p50 ms':>11}  {'p95 ms':>7}  {'wall s':>6}")
        for c in levels:
            figures = {}
            for server in (ours, llama):
                figures[server.name] = f = _level(server.url, c, c * args.rounds, body)
                print(f"{c:>7}  {server.name:<18}{f['tps']:>9.2f}  {f['p50'] * 1e3:>11.0f}  {f['p95'] * 1e3:>7.0f}"
                      f"  {f['wall']:>6.1f}", flush=True)
            ratio = figures["bitnet"]["tps"] / figures["llama-cpp-python"]["tps"]
            print(f"{c:>7}  ours / llama-cpp-python aggregate tokens/s: {ratio:.2f}x", flush=True)
    finally:
        ours.stop()
        llama.stop()


if __name__ == "__main__":
    main()
