"""The CUDA kernel provider: PyCUDA's primitives under the shared GPU host layer (bitnet.gpu.host).

One stream orders everything, as the in-order queue does for OpenCL: copies to the device are
asynchronous on it (an event keeps each host array until the copy is done), and `_copy_out`, the only
device-to-host path, synchronises the stream before it copies, so no read can overtake the work that
writes what it reads.

Every public operation runs with this provider's context current (pushed and popped around it) inside
an NVTX range named after it when the `nvtx` package is importable.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pycuda.driver as drv
from pycuda.compiler import SourceModule

from bitnet import gpu as kernels_src
from bitnet.errors import NoBackendError, UsageError
from bitnet.gpu.host import LM_FORMATS, GpuProvider, Kernel, OutOfDeviceMemory, pow2_floor, size_text
from bitnet.plugins.types import Device

from . import nvcc_options

try:
    import nvtx
except ImportError:  # profiling is optional: without nvtx the ranges cost one attribute test
    nvtx = None

LM_HEAD_ENV = "BITNET_CUDA_LM_HEAD"
# Launch arguments as PyCUDA's prepared calls pack them: P pointer, i int, f float, Q 64-bit count.
_FORMAT = {np.int32: "i", np.float32: "f", np.uint64: "Q"}


def lm_head_precision(capability: tuple[int, int], env: dict[str, str] | None = None) -> tuple[str, str]:
    """(format, why) for F32 LM-head tables: bf16 on CC >= 8.0 (f32's range, native conversions),
    fp16 on CC >= 6.0, f32 below; BITNET_CUDA_LM_HEAD=f32|f16|bf16 overrides."""
    forced = (os.environ if env is None else env).get(LM_HEAD_ENV, "").strip().lower()
    if forced:
        if forced not in LM_FORMATS:
            raise UsageError(f"{LM_HEAD_ENV}={forced!r}: expected one of {', '.join(LM_FORMATS)}")
        return forced, LM_HEAD_ENV
    cc = f"compute capability {capability[0]}.{capability[1]}"
    return ("bf16" if capability >= (8, 0) else "f16" if capability >= (6, 0) else "f32"), cc


# The primary context of each device (shared with other CUDA libraries in the process) and the modules
# built in it: retained and built once per process, kept for its life, as pycuda.autoprimaryctx does.
_CONTEXTS: dict[int, Any] = {}
_MODULES: dict[tuple[int, str, tuple[str, ...]], SourceModule] = {}


def open_cuda_device(index: int) -> tuple[Any, Any]:
    """The primary context and the device `index` (counted after CUDA_VISIBLE_DEVICES)."""
    try:
        drv.init()
        dev = drv.Device(index)
        if index not in _CONTEXTS:
            _CONTEXTS[index] = dev.retain_primary_context()
    except drv.Error as exc:
        raise NoBackendError(f"CUDA: cannot open device {index} ({exc})") from exc
    return _CONTEXTS[index], dev


def build_program(index: int, dev: Any, source: str, max_local: int) -> SourceModule:
    """Build once per process and device; PyCUDA caches the cubin on disk. A failure carries nvcc's log.
    The device's context must be current (SourceModule targets its compute capability)."""
    options = nvcc_options(max_local)
    key = (index, hashlib.sha256(source.encode()).hexdigest(), tuple(options))
    if key not in _MODULES:
        try:
            # no_extern_c: the vendor header includes C++ headers (cuda_fp16.h) and declares every
            # kernel extern "C" itself, so the host finds them by the names the body gives.
            _MODULES[key] = SourceModule(source, options=options, no_extern_c=True)
        except drv.CompileError as exc:  # its text holds the command line and nvcc's output
            major, minor = dev.compute_capability()
            raise NoBackendError(
                f"CUDA kernel build failed on {dev.name()} (sm_{major}{minor}):\n{exc}") from exc
    return _MODULES[key]


class CudaProvider(GpuProvider):
    """One CUDA device; `device.index` counts the devices CUDA_VISIBLE_DEVICES leaves visible."""

    max_grid_y = 65535  # CUDA's limit on gridDim.y: tokens per launch ride on y

    def __init__(self, device: Device, source: str | None = None) -> None:
        self.ctx, self.cu_device = open_cuda_device(device.index)
        self.capability: tuple[int, int] = self.cu_device.compute_capability()
        # F32 LM-head tables are re-encoded in this format; F16 tables stay F16 unless it is forced.
        self.lm_head_format, self.lm_head_reason = lm_head_precision(self.capability)
        self.lm_head_forced = self.lm_head_reason == LM_HEAD_ENV
        with self._current():
            attr = drv.device_attribute
            max_local = pow2_floor(min(kernels_src.MAX_LOCAL,
                                       self.cu_device.get_attribute(attr.MAX_THREADS_PER_BLOCK)))
            source = source or kernels_src.source("cuda")
            module = build_program(device.index, self.cu_device, source, max_local)
            _, total = drv.mem_get_info()
            self.stream = drv.Stream()  # blocking w.r.t. the legacy stream, so plain copies order too
            warp = self.cu_device.get_attribute(attr.WARP_SIZE)
            kernels = {}
            for name in kernels_src.kernel_names(source):
                func = module.get_function(name)
                kernels[name] = Kernel(func, func.get_attribute(drv.function_attribute.MAX_THREADS_PER_BLOCK),
                                       warp)
        super().__init__("cuda", device, f"CUDA device {self.cu_device.name()}", max_alloc=total, capacity=total)
        self._load_kernels(kernels, max_local)
        self._formats: dict[int, str] = {}  # id(kernel) -> the parameter format it was prepared with
        self._writes: list[tuple[Any, np.ndarray]] = []  # host-to-device copies in flight, with their sources

    @contextmanager
    def _current(self) -> Iterator[None]:
        self.ctx.push()
        try:
            yield
        finally:
            drv.Context.pop()

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """An NVTX range (domain "bitnet") when nvtx is importable: wrap a layer in one to see it in
        Nsight Systems around the per-operation ranges."""
        if nvtx is None:
            yield
            return
        nvtx.push_range(name, domain="bitnet")
        try:
            yield
        finally:
            nvtx.pop_range(domain="bitnet")

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        with self._current(), self.region(name):
            yield

    def _alloc(self, nbytes: int) -> Any:
        try:
            return drv.mem_alloc(nbytes)
        except drv.MemoryError as exc:
            free, total = drv.mem_get_info()
            raise OutOfDeviceMemory(f"the driver refused ({exc}); the device has {size_text(free)} free of "
                                    f"{size_text(total)}") from exc

    def _free(self, buf: Any) -> None:
        buf.free()  # PyCUDA makes the allocation's own context current for it

    def _copy_in(self, buf: Any, host: np.ndarray) -> None:
        # Pageable memory is staged at once, page-locked memory is not: keep the source until an event
        # proves the copy done.
        self._writes = [(e, h) for e, h in self._writes if not e.query()]
        drv.memcpy_htod_async(buf, host, self.stream)
        self._writes.append((drv.Event().record(self.stream), host))

    def _copy_out(self, host: np.ndarray, buf: Any) -> None:
        self.stream.synchronize()  # everything launched before this read, its writer included, is done
        drv.memcpy_dtoh(host, buf)
        self._writes.clear()

    def _copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, nbytes: int) -> None:
        drv.memcpy_dtod_async(int(dst) + dst_offset, int(src) + src_offset, nbytes, self.stream)

    def _launch(self, kernel: Any, grid: tuple[int, ...], local: int, args: list[Any]) -> None:
        fmt = "".join(_FORMAT.get(type(a), "P") for a in args)
        if self._formats.get(id(kernel)) != fmt:  # prepared calls pack arguments without inspecting them
            kernel.prepare(fmt)
            self._formats[id(kernel)] = fmt
        params = [a if type(a) in _FORMAT else int(a) for a in args]
        kernel.prepared_async_call(tuple(grid) + (1,) * (2 - len(grid)), (local, 1, 1), self.stream, *params)

    def _finish(self) -> None:
        self.stream.synchronize()
        self._writes.clear()
