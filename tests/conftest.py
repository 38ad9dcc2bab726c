"""Shared fixtures. Tests run in parallel (pytest -n auto): every path is per test or per worker."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BITNET_ENV = ("BITNET_DEVICE", "BITNET_GPU_FAKE", "BITNET_STRICT_MODE", "BITNET_DISABLE_PLUGINS",
              "BITNET_PLUGINS_STRICT", "BITNET_OPENCL_PLATFORM")


def opencl_platforms() -> list[str]:
    """Names of the OpenCL platforms whose first device compiles a kernel here (PoCL, and Intel's CPU
    runtime where installed). A compiler that cannot target this CPU is left out: PoCL 3.0, the only
    PoCL on PyPI, compiles with LLVM 14, which knows no AMD family after 25 (Zen 3 and 4), so on a Zen 5
    every build fails with "unknown target CPU 'generic'". opencl_builds() says which and why."""
    return [name for name, error in opencl_builds().items() if error is None]


@functools.cache
def opencl_builds() -> dict[str, str | None]:
    """Each OpenCL platform with a device: None where a trivial kernel builds, else the compiler's error."""
    try:
        import pyopencl as cl

        from bitnet_opencl.icd import use_installed_runtimes
    except ImportError:
        return {}
    use_installed_runtimes()  # before this process's first OpenCL call, so Intel's runtime is listed too
    found: dict[str, str | None] = {}
    try:
        platforms = [p for p in cl.get_platforms() if p.get_devices()]
    except cl.Error:
        return {}
    for platform in platforms:
        try:
            ctx = cl.Context(platform.get_devices()[:1])
            cl.Program(ctx, "kernel void one(global int *x) { x[0] = 1; }").build()
            found[platform.name.strip()] = None
        except cl.Error as exc:
            errors = [ln.strip() for ln in str(exc).splitlines() if ln.strip().startswith("error:")]
            found[platform.name.strip()] = errors[0] if errors else str(exc).splitlines()[0]
    return found


def cli_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in BITNET_ENV}
    env.update(overrides)
    return env


def raised_in_c_call(cause: BaseException) -> SystemError:
    """What CPython raises when `cause` (Ctrl-C's KeyboardInterrupt) lands inside a C call that then returns a value."""
    err = SystemError("<built-in function f> returned a result with an exception set")
    err.__cause__ = cause
    return err


def run_cli(*args: str, env: dict[str, str] | None = None, python: str = sys.executable,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`bitnet-select ARGS` in a fresh process, so discovery reads the real entry points."""
    return subprocess.run([python, "-m", "bitnet", *args], capture_output=True, text=True,
                          env=env if env is not None else cli_env(), timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def cli():
    return run_cli


# --- model / engine fixtures (reference provider, transformer, engine tests) -----------------------

# Parallel workers (pytest -n auto) times multi-threaded OpenBLAS oversubscribe the cores, and
# OpenBLAS threads then spin: a 20 ms prefill of the default model took 1 s. One thread each.
# (Effective only if numpy is not imported yet, which holds when conftest is collected.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# float_reference.py is a helper module beside the tests, importable whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def bitnet_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One cache directory per test session (per xdist worker) for the default model."""
    return str(tmp_path_factory.mktemp("bitnet-cache"))


@pytest.fixture(autouse=True)
def own_cache_dir(monkeypatch: pytest.MonkeyPatch, bitnet_cache_dir: str) -> None:
    """Every test's caches in the worker's temporary directory, never the user's (~/.cache/bitnet): a test that
    loaded a 254 MB file without one had added an entry to the user's gguf-load/ on each run, and the oldest
    entries there, those of the user's own models, made room for them."""
    monkeypatch.setenv("BITNET_CACHE_DIR", bitnet_cache_dir)


@pytest.fixture
def cpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run on the CPU backend (with the caches of `own_cache_dir`)."""
    for name in BITNET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BITNET_DEVICE", "cpu")


def _cpu_params() -> list[tuple[str, int]]:
    from bitnet_cpu import isa

    return [(level, n) for level in isa.host_levels() for n in (1, 2)]


@pytest.fixture(params=_cpu_params(), ids=[f"{level}-{n}thread" for level, n in _cpu_params()])
def cpu(request: pytest.FixtureRequest):
    """A CPU provider at each level this host runs, with 1 and 2 threads (ternary kernels)."""
    from cpu_support import provider

    return provider(request.param[1], request.param[0])


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def cpu_float(request: pytest.FixtureRequest):
    """A CPU provider at the host's level, with 1 and 2 threads (float kernels: one build for every level)."""
    from cpu_support import provider

    return provider(request.param)
