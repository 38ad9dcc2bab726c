"""The OpenCL kernel provider: PyOpenCL's primitives under the shared GPU host layer (bitnet.gpu.host).

One in-order command queue orders everything: copies to the device are not blocking (their events keep
the host arrays alive until the next read proves them done), and a read is a blocking copy, which waits
for exactly the work queued before it.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl as cl

from bitnet import gpu as kernels_src
from bitnet.errors import NoBackendError
from bitnet.gpu.host import GpuProvider, Kernel, OutOfDeviceMemory, pow2_floor
from bitnet.plugins.types import Device

from .icd import use_installed_runtimes
from .probe import device_features, opencl_c_version


def open_cl_device(platform_index: int, device_index: int) -> tuple[cl.Context, cl.Device]:
    """A fresh context on device `device_index` of platform `platform_index`."""
    use_installed_runtimes()
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise NoBackendError(f"OpenCL: no platform ({exc})") from exc
    try:
        dev = platforms[platform_index].get_devices()[device_index]
    except (IndexError, cl.Error) as exc:
        raise NoBackendError(f"OpenCL: no device {device_index} on platform {platform_index}") from exc
    return cl.Context([dev]), dev


def driver_caches_builds(dev: cl.Device) -> bool:
    """Whether the driver keeps its own on-disk cache of source builds (PoCL, NVIDIA), in which case
    PyOpenCL skips its binary cache and builds from source, and the driver answers from its cache."""
    from pyopencl.characterize import has_src_build_cache

    return bool(has_src_build_cache(dev))


def program_cache_dir(dev: cl.Device) -> Path | None:
    """Where the compiled program of `dev` is cached on disk, or None where only the driver knows.

    PoCL: its kernel cache (POCL_CACHE_DIR, else $XDG_CACHE_HOME/pocl/kcache, else
    ~/.cache/pocl/kcache), which also holds the per-kernel code PoCL generates at the first launch
    of each work-group size, the larger part of a cold start. Drivers without their own cache:
    PyOpenCL's binary cache, kept under bitnet's cache directory (BITNET_CACHE_DIR).
    """
    if dev.platform.name.strip() == "Portable Computing Language":
        if os.environ.get("POCL_CACHE_DIR"):
            return Path(os.environ["POCL_CACHE_DIR"])
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) if xdg and Path(xdg).is_dir() else Path.home() / ".cache"
        return base / "pocl" / "kcache"
    if driver_caches_builds(dev):
        return None
    from bitnet.plugins.types import cache_dir

    return cache_dir() / "opencl-programs"


def build_program(ctx: cl.Context, dev: cl.Device, source: str, max_local: int) -> cl.Program:
    """Build once per context, from the on-disk cache when an earlier process built the same source for
    the same device (program_cache_dir). A failure carries the build log."""
    std = "-cl-std=CL3.0" if opencl_c_version(dev) >= (3, 0) else "-cl-std=CL1.2"
    options = [*kernels_src.build_options(max_local, device_features(dev)), std]
    if dev.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
        options.append("-cl-fp32-correctly-rounded-divide-sqrt")  # 127/max must round as NumPy's does
    cache = None if driver_caches_builds(dev) else program_cache_dir(dev)
    try:
        with warnings.catch_warnings():  # Intel's runtime logs every build, failed or not; failures raise
            warnings.simplefilter("ignore", cl.CompilerWarning)
            return cl.Program(ctx, source).build(options=options, cache_dir=str(cache) if cache else None)
    except cl.Error as exc:  # PyOpenCL puts the device's build log in the message
        raise NoBackendError(f"OpenCL kernel build failed on {dev.name.strip()}:\n{exc}") from exc


# Driver codes that mean "no memory for this buffer" (some drivers allocate at first use, so the
# enqueue that first touches a buffer can report them too).
_OUT_OF_MEMORY = {cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE, cl.status_code.OUT_OF_RESOURCES,
                  cl.status_code.OUT_OF_HOST_MEMORY, cl.status_code.INVALID_BUFFER_SIZE}


def _is_out_of_memory(exc: cl.Error) -> bool:
    return isinstance(exc, cl.MemoryError) or getattr(exc, "code", None) in _OUT_OF_MEMORY


class OpenCLProvider(GpuProvider):
    """One OpenCL device; `device.properties` carry `platform_index` and `device_index`."""

    def __init__(self, device: Device, source: str | None = None) -> None:
        props = device.properties
        if "platform_index" not in props or "device_index" not in props:
            raise NoBackendError(f"device {device.name!r} lacks platform_index / device_index: "
                                 "open a device the opencl probe found")
        self.ctx, self.cl_device = open_cl_device(props["platform_index"], props["device_index"])
        dev = self.cl_device
        if not dev.endian_little:
            raise NoBackendError(f"OpenCL device {dev.name.strip()} is big-endian; the code "
                                 "words of the ternary layout assume little-endian")
        super().__init__("opencl", device, f"OpenCL device {dev.name.strip()}",
                         max_alloc=dev.max_mem_alloc_size, capacity=dev.global_mem_size)
        self.queue = cl.CommandQueue(self.ctx)  # in order
        self._writes: list[cl.Event] = []  # host-to-device copies in flight (they own their host arrays)
        self.features = device_features(dev)
        max_local = pow2_floor(min(kernels_src.MAX_LOCAL, dev.max_work_group_size))
        t0 = time.perf_counter()
        program = build_program(self.ctx, dev, source or kernels_src.source("opencl"), max_local)
        # A cold build takes seconds on some drivers; from the on-disk cache, milliseconds.
        self.build_ms = (time.perf_counter() - t0) * 1e3
        self.program_cache = program_cache_dir(dev)
        info = cl.kernel_work_group_info
        self._load_kernels({k.function_name: Kernel(k, k.get_work_group_info(info.WORK_GROUP_SIZE, dev),
                                                    k.get_work_group_info(info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE,
                                                                          dev))
                            for k in program.all_kernels()}, max_local)

    def _alloc(self, nbytes: int) -> cl.Buffer:
        try:
            return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, nbytes)
        except cl.Error as exc:
            if not _is_out_of_memory(exc):
                raise
            raise OutOfDeviceMemory(f"the driver refused ({exc})") from exc

    def _free(self, buf: cl.Buffer) -> None:
        buf.release()

    def _copy_in(self, buf: cl.Buffer, host: np.ndarray) -> None:
        # Not blocking (a blocking write would wait for all queued work); the event keeps `host` alive.
        done = cl.command_execution_status.COMPLETE
        self._writes = [e for e in self._writes if e.command_execution_status != done]
        try:
            self._writes.append(cl.enqueue_copy(self.queue, buf, host, is_blocking=False))
        except cl.Error as exc:
            raise self._enqueue_error(exc, "a copy to the device") from exc

    def _copy_out(self, host: np.ndarray, buf: cl.Buffer) -> None:
        cl.enqueue_copy(self.queue, host, buf, is_blocking=True)  # waits for the work queued before it
        self._writes.clear()

    def _copy(self, dst: cl.Buffer, dst_offset: int, src: cl.Buffer, src_offset: int, nbytes: int) -> None:
        cl.enqueue_copy(self.queue, dst, src, dst_offset=dst_offset, src_offset=src_offset, byte_count=nbytes)

    def _launch(self, kernel: cl.Kernel, grid: tuple[int, ...], local: int, args: list[Any]) -> None:
        try:
            kernel(self.queue, (grid[0] * local, *grid[1:]), (local,) + (1,) * (len(grid) - 1), *args)
        except cl.Error as exc:
            raise self._enqueue_error(exc, f"kernel {kernel.function_name}") from exc

    def _enqueue_error(self, exc: cl.Error, what: str) -> Exception:
        return self.pool.ran_out(what, exc) if _is_out_of_memory(exc) else exc

    def _finish(self) -> None:
        self.queue.finish()
        self._writes.clear()
