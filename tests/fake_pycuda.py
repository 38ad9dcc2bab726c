"""A stand-in for pycuda.driver and pycuda.compiler that records what the CUDA provider asks of the
driver (launches, copies, synchronisations, context pushes), so the host code runs without a GPU.
No kernel computes: device-to-host copies return zeros. Install with `install(monkeypatch)`."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np


class Error(Exception):
    pass


class MemoryError(Error):  # noqa: A001 (pycuda's name)
    pass


class CompileError(Error):
    pass


class Driver:
    """The recorded state: `log` holds ("launch", name, grid, block, fmt, args), ("htod",), ("dtoh",),
    ("dtod",), ("sync",), ("push",), ("pop",), ("alloc", n), ("free", n) in order."""

    def __init__(self, capability: tuple[int, int] = (8, 6), memory: int = 1 << 30) -> None:
        self.capability, self.memory, self.used = capability, memory, 0
        self.log: list[tuple] = []
        self.depth = 0  # context stack depth
        self.next_address = 1 << 20
        self.live: dict[int, int] = {}  # address -> bytes of each allocation not yet freed
        self.fail_source: str | None = None  # SourceModule raises CompileError for a source containing it


class Allocation:
    def __init__(self, drv: Driver, nbytes: int) -> None:
        self.drv, self.nbytes, self.address = drv, nbytes, drv.next_address
        drv.next_address += (nbytes + 255) // 256 * 256  # cuMemAlloc aligns to 256 bytes
        drv.used += nbytes
        drv.live[self.address] = nbytes
        drv.log.append(("alloc", nbytes))

    def __int__(self) -> int:
        return self.address

    def free(self) -> None:
        self.drv.used -= self.nbytes
        del self.drv.live[self.address]
        self.drv.log.append(("free", self.nbytes))


def install(monkeypatch: Any, state: Driver) -> types.ModuleType:
    """Put fake pycuda, pycuda.driver and pycuda.compiler in sys.modules; return the driver module."""
    drv = types.ModuleType("pycuda.driver")
    drv.Error, drv.MemoryError, drv.CompileError = Error, MemoryError, CompileError
    drv.device_attribute = types.SimpleNamespace(MAX_THREADS_PER_BLOCK="MAX_THREADS_PER_BLOCK",
                                                 WARP_SIZE="WARP_SIZE")
    drv.function_attribute = types.SimpleNamespace(MAX_THREADS_PER_BLOCK="F_MAX_THREADS_PER_BLOCK")
    attrs = {"MAX_THREADS_PER_BLOCK": 1024, "WARP_SIZE": 32}

    def in_context() -> None:
        assert state.depth > 0, "a driver call without a current context"

    class Context:
        def push(self) -> None:
            state.depth += 1
            state.log.append(("push",))

        @staticmethod
        def pop() -> None:
            assert state.depth > 0, "pop of an empty context stack"
            state.depth -= 1
            state.log.append(("pop",))

    class Device:
        def __init__(self, index: int) -> None:
            if index != 0:
                raise Error("cuDeviceGet failed: invalid device ordinal")

        def compute_capability(self) -> tuple[int, int]:
            return state.capability

        def name(self) -> str:
            return "Fake GPU"

        def get_attribute(self, a: str) -> int:
            return attrs[a]

        def retain_primary_context(self) -> Context:
            return Context()

    class Stream:
        def synchronize(self) -> None:
            in_context()
            state.log.append(("sync",))

    class Event:
        def record(self, stream: Stream | None = None) -> Event:
            return self

        def query(self) -> bool:
            return True

    def mem_alloc(nbytes: int) -> Allocation:
        in_context()
        if state.used + nbytes > state.memory:
            raise MemoryError("cuMemAlloc failed: out of memory")
        return Allocation(state, nbytes)

    def memcpy_htod_async(dst: Allocation, src: np.ndarray, stream: Stream) -> None:
        in_context()
        assert isinstance(stream, Stream) and src.nbytes <= dst.nbytes
        state.log.append(("htod",))

    def memcpy_dtoh(dst: np.ndarray, src: Allocation) -> None:
        in_context()
        assert dst.nbytes <= src.nbytes
        dst[...] = 0
        state.log.append(("dtoh",))

    def inside_one_allocation(address: int, size: int) -> bool:
        return any(a <= address and address + size <= a + n for a, n in state.live.items())

    def memcpy_dtod_async(dst: Allocation | int, src: Allocation | int, size: int, stream: Stream) -> None:
        in_context()
        assert isinstance(stream, Stream)
        assert inside_one_allocation(int(dst), size) and inside_one_allocation(int(src), size), "copy out of bounds"
        state.log.append(("dtod", size))

    class Function:
        def __init__(self, name: str) -> None:
            self.name, self.fmt = name, None

        def get_attribute(self, a: str) -> int:
            return 1024

        def prepare(self, fmt: str) -> None:
            self.fmt = fmt

        def prepared_async_call(self, grid: tuple, block: tuple, stream: Stream, *args: Any) -> None:
            in_context()
            assert isinstance(stream, Stream), "a launch off the provider's stream"
            assert self.fmt is not None and len(self.fmt) == len(args), (self.name, self.fmt, args)
            state.log.append(("launch", self.name, grid, block, self.fmt, args))

    class SourceModule:
        def __init__(self, source: str, options: list[str] | None = None, no_extern_c: bool = False,
                     **kw: Any) -> None:
            in_context()
            if state.fail_source and state.fail_source in source:
                raise CompileError(f"nvcc compilation of kernel.cu failed\n[stderr:\n{state.fail_source}]")
            self.options, self.no_extern_c = options, no_extern_c

        def get_function(self, name: str) -> Function:
            return Function(name)

    drv.init = lambda: None
    drv.Device, drv.Context, drv.Stream, drv.Event = Device, Context, Stream, Event
    drv.mem_alloc, drv.mem_get_info = mem_alloc, lambda: (state.memory - state.used, state.memory)
    drv.memcpy_htod_async, drv.memcpy_dtoh = memcpy_htod_async, memcpy_dtoh
    drv.memcpy_dtod_async = memcpy_dtod_async
    compiler = types.ModuleType("pycuda.compiler")
    compiler.SourceModule = SourceModule
    pkg = types.ModuleType("pycuda")
    pkg.driver, pkg.compiler = drv, compiler
    for name, mod in (("pycuda", pkg), ("pycuda.driver", drv), ("pycuda.compiler", compiler)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "bitnet_cuda.provider", raising=False)
    return drv
