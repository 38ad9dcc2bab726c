"""Shared fixtures. Tests run in parallel (pytest -n auto): every path is per test or per worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BITNET_ENV = ("BITNET_DEVICE", "BITNET_GPU_FAKE", "BITNET_STRICT_MODE", "BITNET_DISABLE_PLUGINS",
              "BITNET_PLUGINS_STRICT", "BITNET_OPENCL_PLATFORM")


def cli_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in BITNET_ENV}
    env.update(overrides)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, python: str = sys.executable,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`bitnet-select ARGS` in a fresh process, so discovery reads the real entry points."""
    return subprocess.run([python, "-m", "bitnet", *args], capture_output=True, text=True,
                          env=env if env is not None else cli_env(), timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def cli():
    return run_cli
