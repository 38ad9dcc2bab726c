"""bitnet: BitNet b1.58 inference whose compute backends are plugins.

Importing this package stays light (no NumPy, no device libraries): `bitnet.load` and the
plugin types are imported on first use.
"""

from __future__ import annotations

from typing import Any

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("bitnet")

_LAZY = {
    "load": "runtime.engine",
    "Backend": "plugins.types",
    "Device": "plugins.types",
    "ProbeResult": "plugins.types",
    "KernelProvider": "runtime.provider",
    "LayerWeights": "runtime.provider",
    "select": "plugins.selection",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'bitnet' has no attribute {name!r}")


__all__ = ["__version__", "hookimpl", *_LAZY]
