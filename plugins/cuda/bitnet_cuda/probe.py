"""Find CUDA devices through pycuda.driver, or say precisely why there are none."""

from __future__ import annotations

import ctypes
import os
from typing import Any

from bitnet.plugins.types import Device, ProbeResult

PYCUDA_INSTALL = 'pip install "bitnet-cuda[pycuda]"'

# What cuInit returns where no usable driver or device exists, by the description pycuda's error
# carries (cuGetErrorString's text): used when the driver itself cannot be asked for the code.
CUINIT_ERRORS = {
    "initialization error": (3, "CUDA_ERROR_NOT_INITIALIZED"),
    "CUDA driver version is insufficient for CUDA runtime version": (35, "CUDA_ERROR_INSUFFICIENT_DRIVER"),
    "CUDA-capable device(s) is/are busy or unavailable": (46, "CUDA_ERROR_DEVICES_UNAVAILABLE"),
    "no CUDA-capable device is detected": (100, "CUDA_ERROR_NO_DEVICE"),
    "OS call failed or operation not supported on this OS": (304, "CUDA_ERROR_OPERATING_SYSTEM"),
    "system not yet initialized": (802, "CUDA_ERROR_SYSTEM_NOT_READY"),
    "system has unsupported display driver / cuda driver combination":
        (803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    "forward compatibility was attempted on non supported HW":
        (804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"),
    "unknown error": (999, "CUDA_ERROR_UNKNOWN"),
}


def _driver_cuinit() -> tuple[int, str] | None:
    """cuInit's own result code and name, asked of libcuda directly (pycuda's error keeps only the
    description); None when libcuda cannot be loaded or reports success."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        code = int(lib.cuInit(0))
        name = ctypes.c_char_p()
        if code == 0 or lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
            return None
        return code, name.value.decode()
    except (OSError, AttributeError):
        return None


def cuinit_failure(exc: Exception) -> str:
    """The reason for a failed cuInit: its result name and code, then the driver's description."""
    text = str(exc).removeprefix("cuInit failed: ").strip()
    found = _driver_cuinit() or CUINIT_ERRORS.get(text)
    if found is None:
        return f"cuInit failed: {text}"
    return f"cuInit failed with {found[1]} ({found[0]}): {text}"


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"  # the driver API encodes 12.4 as 12040


def probe() -> ProbeResult:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return ProbeResult.unavailable(f"CUDA_VISIBLE_DEVICES={visible!r} hides every device")
    try:
        import pycuda.driver as drv
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("pycuda"):
            return ProbeResult.unavailable(
                f"pycuda is not installed ({PYCUDA_INSTALL}; it builds against the CUDA toolkit and driver)")
        return ProbeResult.unavailable(f"pycuda failed to import: {exc}")
    except ImportError as exc:
        # pycuda's extension links libcuda.so: without the driver the import itself fails.
        text = str(exc)
        if "libcuda" in text:
            return ProbeResult.unavailable(f"libcuda not found (no NVIDIA driver): {text}")
        return ProbeResult.unavailable(f"pycuda failed to import: {text}")
    try:
        drv.init()
    except drv.Error as exc:
        return ProbeResult.unavailable(cuinit_failure(exc))
    try:
        return _devices(drv)
    except drv.Error as exc:  # a device that vanished or is in use elsewhere: a reason, never a crash
        return ProbeResult.unavailable(f"CUDA device query failed: {exc}")


def _devices(drv: Any) -> ProbeResult:
    count = drv.Device.count()
    if count == 0:
        return ProbeResult.unavailable("the CUDA driver reports zero devices")
    devices = []
    a = drv.device_attribute
    for i in range(count):
        dev = drv.Device(i)
        major, minor = dev.compute_capability()
        attrs = dev.get_attributes()
        ctx = dev.retain_primary_context()
        ctx.push()
        try:
            free, total = drv.mem_get_info()
        finally:
            drv.Context.pop()
        props = {
            "free_memory_bytes": free, "sm_count": attrs[a.MULTIPROCESSOR_COUNT],
            "max_threads_per_block": attrs[a.MAX_THREADS_PER_BLOCK],
            "shared_memory_per_block": attrs[a.MAX_SHARED_MEMORY_PER_BLOCK],
            "tensor_cores": (major, minor) >= (7, 0),
            "driver_version": _version(drv.get_driver_version()),
            "runtime_version": ".".join(map(str, drv.get_version())),  # the CUDA pycuda was built for
        }
        devices.append(Device("cuda", i, dev.name(), vendor="NVIDIA", memory_bytes=total,
                              compute_units=attrs[a.MULTIPROCESSOR_COUNT],
                              compute_capability=f"{major}.{minor}", fp16=(major, minor) >= (6, 0),
                              bf16=(major, minor) >= (8, 0), properties=props))
    return ProbeResult(tuple(devices))
