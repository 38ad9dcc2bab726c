"""bitnet-cuda: the CUDA backend (PyCUDA)."""

from __future__ import annotations

from bitnet import hookimpl
from bitnet.gpu import MAX_LOCAL, build_options
from bitnet.plugins.types import PRIORITY_CUDA, Backend, Device

__version__ = "0.1.0"


def nvcc_options(max_local: int = MAX_LOCAL) -> list[str]:
    """What the provider passes to SourceModule (and CI's compile checks to nvcc): pycuda adds
    `--cubin -arch sm_XX -I<pycuda include>`. The feature macros come from vendor_cuda.h, per arch."""
    return build_options(max_local)


def find_devices():
    # Imported on use: pyopencl / pycuda load only when a probe runs.
    from .probe import probe

    return probe()


def open_device(device: Device):
    # pycuda (and through it libcuda) loads only when a device is opened.
    from .provider import CudaProvider

    return CudaProvider(device)


@hookimpl
def bitnet_backends() -> list[Backend]:
    return [Backend("cuda", "gpu", PRIORITY_CUDA, find_devices, open_device, aliases=("nvidia",),
                    description="PyCUDA kernels from the shared portable source")]
