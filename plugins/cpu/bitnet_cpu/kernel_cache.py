"""Loading the disk-cached kernels without setting up numba's compiler.

numba's cache loader starts with `target_context.refresh()`: it imports numba's implementation
modules (linalg, random, typed containers, ...) and installs their typing and lowering registries,
0.3-0.4 s on the AMD EPYC, once per process. Only compiling needs them. A cached kernel is machine
code: to run it needs numba's runtime (NRT) and, for parallel loops, the threading layer that the
kernel's own reload hooks start. So our kernels' caches load with the runtime set up and nothing
more. A miss compiles as always: numba's compiler refreshes the context itself before it starts.

A cached kernel also names the environments of the numba functions inlined into it (`np.empty`'s
lives in `numba.np.arrayobj`), and unpickling one imports its module to hold its globals: 0.04-0.05 s
of imports on the EPYC (arrayobj pulls in numba's unicode, hashing and random support) in the first
forward pass. Only object-mode code reads an environment's globals, and numba's implementation
functions are all nopython, so an environment of a numba module not yet imported gets its constants
and an empty module namespace.

This reaches into numba's cache (`Dispatcher._cache`, `Cache._load_overload`, `_rebuild_env`); where a
numba version lacks one of those, that part loads the standard way, slower and just as correct.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType
from typing import Any

from numba.core import environment
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
    # numba calls this under its global compiler lock, so no other load sees the swapped function.
    rebuild = getattr(environment, "_rebuild_env", None)
    if rebuild is not None:
        environment._rebuild_env = functools.partial(_rebuild_env, rebuild)
    try:
        with cache._guard_against_spurious_io_errors():
            return cache._load_overload(sig, target_context)
    finally:
        if rebuild is not None:
            environment._rebuild_env = rebuild
    return None  # the guard swallowed an I/O error: compile instead, as numba's own loader does


def _rebuild_env(rebuild: Any, modname: str, consts: Any, env_name: str) -> Any:
    """numba's `_rebuild_env`, without importing a numba module for an environment's globals (see above)."""
    if not modname.startswith("numba.") or modname in sys.modules:
        return rebuild(modname, consts, env_name)
    env = environment.lookup_environment(env_name)
    if env is None:
        env = environment.Environment({"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        environment.Environment._memo[env_name] = env
    return env
