"""Find CUDA devices through pycuda.driver, or say precisely why there are none."""

from __future__ import annotations

import os

from bitnet.backends import Device, ProbeResult


def probe() -> ProbeResult:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return ProbeResult.unavailable(f"CUDA_VISIBLE_DEVICES={visible!r} hides every device")
    try:
        import pycuda.driver as drv
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("pycuda"):
            return ProbeResult.unavailable("pycuda is not installed (pip install pycuda; it needs the CUDA driver)")
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
        return ProbeResult.unavailable(f"cuInit failed: {exc}")
    count = drv.Device.count()
    if count == 0:
        return ProbeResult.unavailable("the CUDA driver reports zero devices")
    devices = []
    for i in range(count):
        dev = drv.Device(i)
        major, minor = dev.compute_capability()
        attrs = dev.get_attributes()
        a = drv.device_attribute
        ctx = dev.retain_primary_context()
        ctx.push()
        try:
            free, total = drv.mem_get_info()
        finally:
            ctx.pop()
        props = {
            "free_memory_bytes": free, "sm_count": attrs[a.MULTIPROCESSOR_COUNT],
            "max_threads_per_block": attrs[a.MAX_THREADS_PER_BLOCK],
            "shared_memory_per_block": attrs[a.MAX_SHARED_MEMORY_PER_BLOCK],
            "tensor_cores": (major, minor) >= (7, 0),
            "driver_version": drv.get_driver_version(), "runtime_version": ".".join(map(str, drv.get_version())),
        }
        devices.append(Device("cuda", i, dev.name(), vendor="NVIDIA", memory_bytes=total,
                              compute_units=attrs[a.MULTIPROCESSOR_COUNT], compute_capability=f"{major}.{minor}",
                              fp16=(major, minor) >= (6, 0), bf16=(major, minor) >= (8, 0), properties=props))
    return ProbeResult(tuple(devices))
