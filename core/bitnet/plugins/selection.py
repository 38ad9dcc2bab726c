"""Request -> detection -> ranking -> selection (docs/design.md section 3).

A request is `auto`, `gpu`, a backend name or alias with an optional `:index`, or an
ordered list of those separated by commas. An explicit request never falls back silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bitnet.errors import NoBackendError, UsageError
from bitnet.plugins.registry import Registry
from bitnet.plugins.types import Backend, Device

if TYPE_CHECKING:
    from bitnet.runtime.provider import KernelProvider


@dataclass
class Selection:
    requested: str
    registry: Registry = field(repr=False)
    backend: Backend | None = None
    device: Device | None = None
    explicit_index: bool = False
    error: str | None = None

    @property
    def detected(self) -> list[Backend]:
        """Backends with a device, in priority order. Probed when first asked for: a named request
        needs only its own backends' probes (the OpenCL platform scan alone takes ~0.1 s)."""
        return self.registry.detected()

    @property
    def selected(self) -> str:
        if self.backend is None or self.device is None:
            return "none"
        return f"{self.backend.name}:{self.device.index}" if self.explicit_index else self.backend.name

    @property
    def summary(self) -> str:
        names = ",".join(b.name for b in self.detected)
        return f"requested={self.requested} detected=[{names}] selected={self.selected}"

    def require(self) -> Selection:
        if self.backend is None:
            raise NoBackendError(self.error or "no backend selected")
        return self

    def open(self) -> KernelProvider:
        """Open the selected device's kernel provider; a fake device cannot compute."""
        self.require()
        assert self.backend is not None and self.device is not None
        if self.device.fake:
            raise NoBackendError(
                f"{self.selected} is a fake device (BITNET_GPU_FAKE): it can be selected but cannot run a model")
        return self.backend.open(self.device)


def request_from_env(request: str | None) -> str:
    """--device, else BITNET_DEVICE, else auto."""
    value = request if request is not None else os.environ.get("BITNET_DEVICE") or "auto"
    return value.strip().lower()


def parse_request(request: str) -> list[tuple[str, int | None]]:
    """`cuda:1,opencl,cpu` -> [("cuda", 1), ("opencl", None), ("cpu", None)]."""
    items: list[tuple[str, int | None]] = []
    for part in request.split(","):
        token, sep, index = part.strip().partition(":")
        if not token:
            raise UsageError(f"invalid device request {request!r}: empty backend name")
        if sep and not index.isdigit():
            raise UsageError(f"invalid device request {part.strip()!r}: the index after ':' must be a number")
        items.append((token, int(index) if sep else None))
    return items


def device_kind(backend: Backend, device: Device) -> str:
    return device.kind or backend.kind


def tier(backend: Backend, device: Device) -> int:
    """Where `auto` ranks a device (docs/design.md section 3): 0 a GPU; 1 another accelerator; 2 a device of
    a CPU backend; 3 a CPU-kind device of any other backend (an OpenCL driver on the host CPU is a
    portability and test device, never the fast default)."""
    kind = device_kind(backend, device)
    if kind == "gpu":
        return 0
    if kind != "cpu":
        return 1
    return 2 if backend.kind == "cpu" else 3


def ranked(registry: Registry) -> list[tuple[Backend, Device]]:
    """Every detected device in `auto`'s order: by tier, then backend priority and name, then index."""
    pairs = [(b, d) for b in registry.detected() for d in registry.probe(b.name).devices]
    return sorted(pairs, key=lambda bd: (tier(*bd), bd[0].sort_key(), bd[1].index))


def _devices(registry: Registry, backend: Backend, gpu_only: bool) -> list[Device]:
    """A backend's devices, best first (its GPUs before its CPU-kind devices)."""
    devices = sorted(registry.probe(backend.name).devices, key=lambda d: (tier(backend, d), d.index))
    return [d for d in devices if not gpu_only or device_kind(backend, d) == "gpu"]


def _reason(registry: Registry, backend: Backend) -> str:
    probe = registry.probe(backend.name)
    if probe.devices:
        kinds = sorted({device_kind(backend, d) for d in probe.devices})
        return f"{backend.name}: no GPU device (its devices are {','.join(kinds)})"
    return f"{backend.name}: {probe.reason}"


def select(request: str | None = None, registry: Registry | None = None) -> Selection:
    """Resolve a request. The returned Selection has backend None (and an error) if unmet."""
    registry = registry or Registry()
    requested = request_from_env(request)
    items = parse_request(requested)
    sel = Selection(requested, registry)
    problems: list[str] = []
    for token, index in items:
        if token in ("auto", "gpu"):
            if index is not None:
                raise UsageError(f"invalid device request {token}:{index}: '{token}' takes no index")
            pool = [(b, d) for b, d in ranked(registry) if token == "auto" or device_kind(b, d) == "gpu"]
            if pool:
                sel.backend, sel.device = pool[0]
                return sel
            considered = [b for b in registry.backends() if token == "auto" or b.kind == "gpu"]
            problems.extend(_reason(registry, b) for b in considered)
            if not considered:
                problems.append(f"{token}: no {'GPU ' if token == 'gpu' else ''}backend is installed")
            continue
        candidates = registry.resolve(token)
        if not candidates:
            known = ", ".join(b.name for b in registry.backends()) or "none"
            problems.append(registry.clashes.get(token)
                            or f"{token}: no installed backend has that name (installed: {known})")
            continue
        for backend in candidates:
            devices = _devices(registry, backend, gpu_only=False)
            if not devices:
                problems.append(_reason(registry, backend))
                continue
            if index is not None:
                match = [d for d in devices if d.index == index]
                if not match:
                    problems.append(f"{backend.name}:{index}: {backend.name} has {len(devices)} device(s), "
                                    f"index 0..{len(devices) - 1}")
                    continue
                devices = match
            sel.backend, sel.device, sel.explicit_index = backend, devices[0], index is not None
            return sel
    found = ",".join(b.name for b in sel.detected)
    sel.error = f"no backend satisfies --device {requested}: found [{found}]; " + "; ".join(problems)
    return sel
