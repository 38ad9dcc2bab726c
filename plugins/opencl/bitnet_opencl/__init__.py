"""bitnet-opencl: the OpenCL backend (PyOpenCL; aimed at Intel Arc, runs on any OpenCL 1.2+ device)."""

from __future__ import annotations

from collections.abc import Sequence

from bitnet import hookimpl
from bitnet.plugins.types import PRIORITY_OPENCL, Backend, Device

__version__ = "0.1.0"


def find_devices():
    # Imported on use: pyopencl / pycuda load only when a probe runs.
    from .probe import probe

    return probe()


def open_device(device: Device):
    from .provider import OpenCLProvider

    return OpenCLProvider(device)


@hookimpl
def bitnet_backends() -> list[Backend]:
    return [Backend("opencl", "gpu", PRIORITY_OPENCL, find_devices, open_device, aliases=("ocl", "cl"),
                    description="PyOpenCL kernels from the shared portable source")]


@hookimpl
def bitnet_resolve_request(token: str, backends: Sequence[Backend]) -> list[str] | None:
    # What Intel users type for their GPUs.
    return ["opencl"] if token in ("oneapi", "intel", "arc") else None
