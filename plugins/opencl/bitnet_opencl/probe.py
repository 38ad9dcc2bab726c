"""Find OpenCL devices with PyOpenCL, or say precisely why there are none."""

from __future__ import annotations

import os
from typing import Any

from bitnet.plugins.types import Device, ProbeResult

from .icd import use_installed_runtimes

# Device extension -> the feature macro of the kernel source it turns on (vendor_opencl.h maps them).
FEATURES = {"cl_khr_integer_dot_product": "HAS_DP4A", "cl_khr_subgroups": "HAS_SUBGROUP_REDUCE",
            "cl_intel_subgroups": "HAS_SUBGROUP_REDUCE", "cl_khr_fp16": "HAS_F16"}


def opencl_c_version(dev: Any) -> tuple[int, int]:
    """The OpenCL C version the device compiles ("OpenCL C 3.0 ..." -> (3, 0))."""
    major, minor = dev.opencl_c_version.split()[2].split(".")[:2]
    return int(major), int(minor)


def device_features(dev: Any) -> tuple[str, ...]:
    """The kernel source's feature macros this device has, from its extensions. The integer dot product's
    built-ins are declared from OpenCL C 3.0 on only."""
    ext = set(dev.extensions.split())
    found = {macro for name, macro in FEATURES.items() if name in ext}
    if opencl_c_version(dev) < (3, 0):
        found.discard("HAS_DP4A")
    return tuple(sorted(found))


def _props(dev: Any, platform: Any) -> dict[str, Any]:
    import pyopencl as cl

    ext = dev.extensions.split()
    props = {
        "platform": platform.name.strip(), "platform_version": platform.version.strip(),
        "driver_version": dev.driver_version, "opencl_version": dev.version,
        "max_work_group_size": dev.max_work_group_size, "local_memory_bytes": dev.local_mem_size,
        # The largest single buffer: the KV cache of a long context or a big LM head must fit in it.
        "max_mem_alloc_bytes": dev.max_mem_alloc_size,
        "max_clock_mhz": dev.max_clock_frequency, "type": cl.device_type.to_string(dev.type),
        "integer_dot_product": "cl_khr_integer_dot_product" in ext,
        "subgroups": "cl_khr_subgroups" in ext or "cl_intel_subgroups" in ext,
        # The fast paths the provider compiles in for this device (the kernel source's feature macros).
        "kernel_features": list(device_features(dev)),
    }
    return props


def probe() -> ProbeResult:
    """Every device of every OpenCL platform (those BITNET_OPENCL_PLATFORM names, if set).

    A missing pyopencl, a missing ICD, a platform filter that matches nothing or a driver error is an
    unavailable result with that reason, never an exception.
    """
    try:
        import pyopencl as cl
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "pyopencl":
            return ProbeResult.unavailable("pyopencl is not installed (pip install pyopencl; "
                                           "`pyopencl[pocl]` adds a CPU OpenCL device)")
        return ProbeResult.unavailable(f"pyopencl is not importable ({type(exc).__name__}: {exc})")
    use_installed_runtimes()
    try:
        platforms = list(enumerate(cl.get_platforms()))
    except Exception as exc:
        return ProbeResult.unavailable(
            f"no OpenCL platform: {exc} (no ICD installed? `pip install pocl-binary-distribution` gives a CPU one)")
    wanted = os.environ.get("BITNET_OPENCL_PLATFORM", "").strip()
    if wanted:
        names = [p.name.strip() for _, p in platforms]
        platforms = [(i, p) for i, p in platforms if wanted.lower() in p.name.lower()]
        if not platforms:
            return ProbeResult.unavailable(
                f"BITNET_OPENCL_PLATFORM={wanted!r} matches no platform (platforms: {', '.join(names) or 'none'})")
    devices: list[Device] = []
    errors: list[str] = []
    for p_index, platform in platforms:
        try:
            found = platform.get_devices()
        except Exception as exc:
            errors.append(f"{platform.name.strip()}: {exc}")
            continue
        for d_index, dev in enumerate(found):
            try:  # one misbehaving driver must not hide the devices of the others
                ext = dev.extensions.split()
                props = _props(dev, platform) | {"platform_index": p_index, "device_index": d_index}
                devices.append(Device(
                    "opencl", len(devices), dev.name.strip(), vendor=dev.vendor.strip(),
                    memory_bytes=dev.global_mem_size, compute_units=dev.max_compute_units,
                    fp16="cl_khr_fp16" in ext, bf16=None, properties=props,
                    kind="gpu" if dev.type & cl.device_type.GPU else "cpu"))
            except Exception as exc:
                errors.append(f"{platform.name.strip()} device {d_index}: {exc}")
    if not devices:
        searched = ", ".join(p.name.strip() for _, p in platforms)
        return ProbeResult.unavailable(f"no OpenCL device on platform(s) {searched}"
                                       + "".join(f"; {e}" for e in errors))
    return ProbeResult(tuple(devices))
