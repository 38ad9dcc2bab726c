"""bitnet-cuda: the CUDA backend (PyCUDA)."""

from __future__ import annotations

from bitnet import hookimpl
from bitnet.backends import PRIORITY_CUDA, Backend, Device
from bitnet.errors import NoBackendError

__version__ = "0.1.0"


def find_devices():
    # Imported on use: pyopencl / pycuda load only when a probe runs.
    from .probe import probe

    return probe()


def open_device(device: Device):
    raise NoBackendError("the CUDA kernel provider is not built yet in this version of bitnet-cuda "
                         "(selection and device probing work; inference on CUDA does not)")


@hookimpl
def bitnet_backends() -> list[Backend]:
    return [Backend("cuda", "gpu", PRIORITY_CUDA, find_devices, open_device, aliases=("nvidia",),
                    description="PyCUDA kernels from the shared portable source")]
