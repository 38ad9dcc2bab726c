"""Loading the disk-cached kernels without setting up numba's compiler.

numba's cache loader starts with `target_context.refresh()`: it imports numba's implementation
modules (linalg, random, typed containers, ...) and installs their typing and lowering registries,
0.3-0.4 s on the AMD EPYC, once per process. Only compiling needs them. A cached kernel is machine
code: to run it needs numba's runtime (NRT) and, for parallel loops, the threading layer that the
kernel's own reload hooks start. So our kernels' caches load with the runtime set up and nothing
more. A miss compiles as always: numba's compiler refreshes the context itself before it starts.

This reaches into numba's cache (`Dispatcher._cache`, `Cache._load_overload`); where a numba
version lacks those, the kernels load the standard way, slower and just as correct.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from numba.core.caching import Cache
from numba.core.registry import cpu_target
from numba.core.runtime import rtsys


def runtime_ready() -> None:
    """Set up numba's runtime (what a cached kernel calls into), not its compiler."""
    rtsys.initialize(cpu_target.target_context)


def load_lightly(module: ModuleType) -> None:
    """Make each disk-cached kernel of `module` load from its cache without the context refresh."""
    if not all(hasattr(Cache, name) for name in ("_load_overload", "_guard_against_spurious_io_errors")):
        return
    for obj in vars(module).values():
        cache = getattr(obj, "_cache", None)
        if isinstance(cache, Cache):
            cache.load_overload = functools.partial(_load_overload, cache)


def _load_overload(cache: Cache, sig: Any, target_context: Any) -> Any:
    runtime_ready()
    with cache._guard_against_spurious_io_errors():
        return cache._load_overload(sig, target_context)
    return None  # the guard swallowed an I/O error: compile instead, as numba's own loader does
