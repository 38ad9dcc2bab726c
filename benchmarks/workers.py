"""Benchmark workers: each measurement runs in a fresh process that prints one `RESULT <json>` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def result(out: dict[str, Any]) -> None:
    """A worker's answer: the one line `run` reads back."""
    print("RESULT " + json.dumps(out), flush=True)


def run(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> dict[str, Any]:
    """Run a worker command; its RESULT, or RuntimeError with the end of its stderr."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    line = next((ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"{what} worker failed ({p.returncode}): {p.stderr.strip()[-800:]}")
    return json.loads(line)


def spawn(script: str, kind: str, model: str, threads: int, options: list[str], timeout: float,
          env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `script --worker kind` on `model` with `threads` CPU threads and its own options; its RESULT."""
    env = {**os.environ, "BITNET_NUM_THREADS": str(threads), **(env_extra or {})}
    cmd = [sys.executable, script, "--worker", kind, "--model", model, "--threads", str(threads), *options]
    return run(cmd, env, timeout, kind)
