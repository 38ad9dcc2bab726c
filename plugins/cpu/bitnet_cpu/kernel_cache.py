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

The runtime itself is a few LLVM functions (reference counts, atomics) that numba compiles in every
process: 30 ms of every load on the EPYC. Their machine code is kept beside the kernels' cache, keyed
by numba's and llvmlite's versions and the host CPU, with a digest that must match before LLVM sees it.

This reaches into numba's cache (`Dispatcher._cache`, `Cache._load_overload`, `_rebuild_env`) and runtime
(`nrtdynmod.compile_nrt_functions`); where a numba version lacks one of those, that part loads the
standard way, slower and just as correct.
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import llvmlite
import numba
from llvmlite import binding as ll
from numba.core import config, environment
from numba.core.caching import Cache
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import cpu_target
from numba.core.runtime import nrtdynmod, rtsys

from bitnet.modelfile import load_cache

# Runtime files kept per kernel cache directory (one per numba/llvmlite/CPU key; a few in case keys alternate).
_NRT_KEEP = 4


def runtime_ready(directory: str | None = None) -> None:
    """Set up numba's runtime (what a cached kernel calls into), not its compiler; with `directory`, its
    machine code comes from (or goes to) a file there."""
    if getattr(rtsys, "_init", False):
        return
    compile_nrt = getattr(nrtdynmod, "compile_nrt_functions", None)
    if directory is None or compile_nrt is None or not hasattr(nrtdynmod, "create_nrt_module"):
        rtsys.initialize(cpu_target.target_context)
        return
    with global_compiler_lock:  # (reentrant: rtsys.initialize takes it too) no other thread sees the swap
        nrtdynmod.compile_nrt_functions = functools.partial(_nrt_library, Path(directory))
        try:
            rtsys.initialize(cpu_target.target_context)
        finally:
            nrtdynmod.compile_nrt_functions = compile_nrt


def _nrt_library(directory: Path, ctx: Any) -> Any:
    """The runtime's library from its file in `directory` when that holds what this process would compile
    (same key, intact), else compiled as numba does and written there for the next process."""
    key = " ".join((numba.__version__, llvmlite.__version__, sys.version, ll.get_host_cpu_name(),
                    ll.get_host_cpu_features().flatten(), str(config.CPU_NAME), str(config.CPU_FEATURES)))
    path = directory / f"nrt-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"
    try:
        raw = path.read_bytes()
        if raw[:32] == hashlib.sha256(raw[32:]).digest():  # a torn or altered file never reaches LLVM
            return ctx.codegen().unserialize_library(marshal.loads(raw[32:]))
    except (OSError, EOFError, ValueError, TypeError):
        pass
    ir_mod, library = nrtdynmod.create_nrt_module(ctx)
    library.enable_object_caching()  # (what keeps the machine code to write)
    library.add_ir_module(ir_mod)
    library.finalize()
    body = marshal.dumps(library.serialize_using_object_code())
    try:  # (renamed into place: a process loading it meanwhile sees all of it or none)
        load_cache.write_entry(path, lambda f: f.write(hashlib.sha256(body).digest() + body), _NRT_KEEP)
    except OSError:
        pass  # a read-only or full disk: compile again next time
    return library


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
