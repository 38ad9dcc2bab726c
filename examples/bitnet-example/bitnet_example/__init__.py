"""The smallest complete third-party backend: one hookimpl, one entry point, one kernel.

Its provider (provider.py, imported only when a device is opened) implements `bitlinear` in
NumPy and nothing else; core runs every other operation on the host through its reference
kernels and counts each such call as a fallback in the run's receipt. See
docs/writing-a-backend.md.
"""

from __future__ import annotations

import bitnet


def probe() -> bitnet.ProbeResult:
    return bitnet.ProbeResult((bitnet.Device("example", 0, "example NumPy device", vendor="example.org"),))


def open_device(device: bitnet.Device) -> bitnet.KernelProvider:
    from bitnet_example.provider import ExampleProvider

    return ExampleProvider("example", device)


@bitnet.hookimpl
def bitnet_backends() -> list[bitnet.Backend]:
    # Priority 5: below the bundled cpu backend, so `auto` never picks it over real kernels.
    return [bitnet.Backend("example", "cpu", 5, probe, open_device, aliases=("ex",),
                           description="example third-party backend (NumPy bitlinear, the rest by fallback)")]
