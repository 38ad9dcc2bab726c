"""Benchmark workers: each measurement runs in a fresh process that prints one `RESULT <json>` line."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class WorkerError(RuntimeError):
    """A worker that failed, timed out or printed no RESULT, in one line."""

    exit_code = 1


def result(out: dict[str, Any]) -> None:
    """A worker's answer: the one line `run` reads back."""
    print("RESULT " + json.dumps(out), flush=True)


def run(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> dict[str, Any]:
    """Run a worker command; its RESULT, or WorkerError with the last line of its stderr (a traceback's error)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"{what} worker timed out after {timeout:g} s") from None
    line = next((ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        last = next((ln.strip() for ln in reversed(p.stderr.splitlines()) if ln.strip()), "no error output")
        raise WorkerError(f"{what} worker failed (exit {p.returncode}): {last}")
    return json.loads(line)


def main_exit(main: Callable[[], int]) -> int:
    """A benchmark's exit code: a failed worker (1) or a bad model file (4) is one line on stderr, no traceback."""
    from bitnet.errors import BitnetError

    try:
        return main()
    except (WorkerError, BitnetError) as e:
        print(f"{Path(sys.argv[0]).name}: {e}", file=sys.stderr)
        return e.exit_code


def spawn(script: str, kind: str, model: str, threads: int, options: list[str], timeout: float,
          env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `script --worker kind` on `model` with `threads` CPU threads and its own options; its RESULT."""
    env = {**os.environ, "BITNET_NUM_THREADS": str(threads), **(env_extra or {})}
    cmd = [sys.executable, script, "--worker", kind, "--model", model, "--threads", str(threads), *options]
    return run(cmd, env, timeout, kind)


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """n processes spinning on the CPU for as long as the block runs: the co-tenants of a shared machine."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
