"""A complete third-party backend: one module, one hookimpl, one entry point.

It runs bitnet's NumPy reference kernels; a real backend overrides their methods with its
own kernels (see docs/writing-a-backend.md).
"""

from __future__ import annotations

import bitnet
from bitnet.plugins.types import Backend, Device, ProbeResult


def probe() -> ProbeResult:
    return ProbeResult((Device("example", 0, "example reference device", vendor="example.org"),))


def open_device(device: Device):
    from bitnet.runtime.reference import ReferenceProvider

    return ReferenceProvider(backend="example", device=device)


@bitnet.hookimpl
def bitnet_backends() -> list[Backend]:
    # Priority 5: below the bundled cpu backend, so `auto` never picks it over real kernels.
    return [Backend("example", "cpu", 5, probe, open_device, aliases=("ex",),
                    description="example third-party backend (NumPy reference kernels)")]
