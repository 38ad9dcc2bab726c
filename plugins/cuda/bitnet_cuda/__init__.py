"""bitnet-cuda: the CUDA backend (PyCUDA)."""

from __future__ import annotations

from bitnet import hookimpl
from bitnet.plugins.types import PRIORITY_CUDA, Backend, Device

__version__ = "0.1.0"

TILE_N = 8  # tokens per matmul thread block (the kernel source's TILE_N): weights read once per tile
# Cap on block size: static shared arrays are sized by it at build time, and the reductions here gain
# nothing from larger blocks. The device and each kernel may allow less.
MAX_LOCAL = 256


def nvcc_options(max_local: int = MAX_LOCAL) -> list[str]:
    """What the provider passes to SourceModule (and CI's compile checks to nvcc): pycuda adds
    `--cubin -arch sm_XX -I<pycuda include>`."""
    return [f"-DMAX_WG={max_local}", f"-DTILE_N={TILE_N}"]


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
