"""bitnet-cpu: the CPU backend, registered through the same entry point a third party uses."""

from __future__ import annotations

import os
import platform
import sys
import threading

from bitnet import hookimpl
from bitnet.plugins.types import PRIORITY_CPU, Backend, Device, ProbeResult, host_cpu_name

__version__ = "0.1.0"




def threads() -> int:
    """BITNET_NUM_THREADS, else the cores this process may run on."""
    env = os.environ.get("BITNET_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def probe() -> ProbeResult:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    return ProbeResult((Device("cpu", 0, host_cpu_name(), vendor=platform.machine(), memory_bytes=memory,
                               compute_units=threads(), properties={"threads": threads()}),))


def open_device(device: Device):
    _import_numba()
    from .provider import CpuProvider

    return CpuProvider(device=device)


def _import_numba() -> None:
    """Import numba, without PyYAML when the working directory has no `.numba_config.yaml`.

    numba imports yaml only to read that file (at import and on a config reload), and yaml's import is
    20 ms of a 0.7 s load on the AMD EPYC (its reader compiles a large regex). Hiding yaml is safe only
    while no other thread could import it meanwhile, so only a process with one thread does it.
    """
    if "numba" in sys.modules or "yaml" in sys.modules or threading.active_count() > 1 \
            or os.path.exists(".numba_config.yaml"):
        import numba  # noqa: F401
        return
    sys.modules["yaml"] = None  # type: ignore[assignment]  # (None there makes `import yaml` fail)
    try:
        import numba  # noqa: F401
    finally:
        del sys.modules["yaml"]


@hookimpl
def bitnet_backends() -> list[Backend]:
    return [Backend("cpu", "cpu", PRIORITY_CPU, probe, open_device, aliases=("host", "numpy"),
                    description="numba SIMD kernels on the host CPU")]
