"""What a plugin declares: backends, the devices their probe finds, and why none were found."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bitnet.runtime.provider import KernelProvider

PRIORITY_CPU = 10
PRIORITY_OPENCL = 50
PRIORITY_CUDA = 100


@dataclass(frozen=True)
class Device:
    """One device a backend can run on. Fields a backend cannot know stay None."""

    backend: str
    index: int
    name: str
    vendor: str = ""
    memory_bytes: int | None = None
    compute_units: int | None = None
    compute_capability: str | None = None
    fp16: bool | None = None
    bf16: bool | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    fake: bool = False
    kind: str | None = None  # when it differs from the backend's (an OpenCL CPU device is "cpu")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ProbeResult:
    """Devices found, or the human-readable reason none is usable."""

    devices: tuple[Device, ...] = ()
    reason: str | None = None

    @classmethod
    def unavailable(cls, reason: str) -> ProbeResult:
        return cls((), reason)

    @property
    def available(self) -> bool:
        return bool(self.devices)


@dataclass(frozen=True)
class Backend:
    """A backend a plugin provides.

    `probe` must be cheap and must not raise for an expected absence (no driver, no device):
    it returns ProbeResult.unavailable(reason). `open(device)` returns the KernelProvider.
    Priority scale: cpu 10, opencl 50, cuda 100; higher wins, ties broken by name.
    """

    name: str
    kind: str
    priority: int
    probe: Callable[[], ProbeResult]
    open: Callable[[Device], KernelProvider]
    aliases: tuple[str, ...] = ()
    description: str = ""

    def sort_key(self) -> tuple[int, str]:
        return (-self.priority, self.name)


def host_cpu_name() -> str:
    """The host processor's marketing name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_memory_bytes() -> int | None:
    """Physical memory of the host, where the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cache_dir() -> Path:
    """Where bitnet and its plugins keep what they build once (compiled programs): BITNET_CACHE_DIR,
    default ~/.cache/bitnet."""
    return Path(os.environ.get("BITNET_CACHE_DIR") or Path.home() / ".cache" / "bitnet")
