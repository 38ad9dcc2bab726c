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

A cached library is its machine code and its LLVM bitcode; numba parses the bitcode on load to list the
symbols the library defines (how it finds a kernel's entry point) and to keep it for linking into a
later compile. For a model's 8-9 kernels that was 30 ms of the first forward pass on the Zen 5 EPYC,
more than half of it. The symbols come from the machine code's own ELF symbol table instead (the same
names), and the bitcode is parsed only when a compile links the library in.

The first call of a kernel with an array type it has not seen asks numba's Python `typeof`, which checks the array
against numpy.ma.MaskedArray; NumPy imports numpy.ma on that first use: 12.6 ms of the first forward pass (an
Emerald Rapids Xeon) of the ~30 ms it costs beyond the second. Our kernels' dispatchers read an array's type
themselves (`typeof_argument`) while numpy.ma is not imported: no masked array can exist before it is. Nor do
they load numba's extensions first (`numba_extensions` entry points: third-party types our kernels never take).

This reaches into numba's cache (`Dispatcher._cache`, `Cache._load_overload`, `_rebuild_env`), code
libraries (`CPUCodeLibrary._unserialize`'s steps), runtime (`nrtdynmod.compile_nrt_functions`) and dispatchers
(`typeof_pyval`, which numba's C dispatcher calls on a type it has not cached; `_compilation_chain_init_hook`);
where a numba version lacks one of those, that part runs the standard way, slower and just as correct.
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import llvmlite
import numba
import numpy as np
from llvmlite import binding as ll
from numba.core import config, environment, types
from numba.core.caching import Cache
from numba.core.compiler_lock import global_compiler_lock
from numba.core.errors import NumbaError
from numba.core.registry import cpu_target
from numba.core.runtime import nrtdynmod, rtsys
from numba.np import numpy_support

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
            with _from_machine_code(ctx.codegen()):
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
    """Make each disk-cached kernel of `module` load from its cache without the context refresh, and type its array
    arguments without importing numpy.ma or loading numba's extensions."""
    light = all(hasattr(Cache, name) for name in ("_load_overload", "_guard_against_spurious_io_errors"))
    for obj in vars(module).values():
        cache = getattr(obj, "_cache", None)
        if isinstance(cache, Cache):
            if light:
                cache.load_overload = functools.partial(_load_overload, cache)
            if hasattr(obj, "typeof_pyval"):
                obj.typeof_pyval = functools.partial(typeof_argument, obj.typeof_pyval)
            if hasattr(obj, "_compilation_chain_init_hook"):
                obj._compilation_chain_init_hook = _no_extensions


def _no_extensions() -> None:
    """A kernel's first call without numba's extensions loaded first: numba looks for them in every installed
    package's entry points (3-5 ms), for types our kernels never take. Another function's first call still loads
    them."""


def typeof_argument(standard: Callable[[Any], Any], val: Any) -> Any:
    """What `standard` (a dispatcher's typeof_pyval) makes of `val`, an array's type read without numba's check
    against numpy.ma.MaskedArray: its first use imports numpy.ma, and no masked array exists before that."""
    if isinstance(val, np.ndarray) and "numpy.ma" not in sys.modules:
        try:
            return types.Array(numpy_support.from_dtype(val.dtype), val.ndim, numpy_support.map_layout(val),
                               readonly=not val.flags.writeable)
        except NumbaError:  # a dtype numba has no type for: standard says what it says of those
            pass
    return standard(val)


def _load_overload(cache: Cache, sig: Any, target_context: Any) -> Any:
    runtime_ready()
    # numba calls this under its global compiler lock, so no other load sees the swapped function.
    rebuild = getattr(environment, "_rebuild_env", None)
    if rebuild is not None:
        environment._rebuild_env = functools.partial(_rebuild_env, rebuild)
    try:
        with cache._guard_against_spurious_io_errors(), _from_machine_code(target_context.codegen()):
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


@contextmanager
def _from_machine_code(codegen: Any) -> Iterator[None]:
    """Within it, `codegen` rebuilds a cached library from its machine code without parsing its bitcode
    (see the module docstring). Callers hold numba's compiler lock, so no other load sees the swap."""
    library_type = getattr(codegen, "_library_class", None)
    engine = getattr(codegen, "_engine", None)
    steps = ("create_library", "unserialize_library")
    if (not all(hasattr(codegen, name) for name in steps) or not hasattr(engine, "_defined_symbols")
            or not all(hasattr(library_type, name) for name in
                       ("enable_object_caching", "_set_compiled_object", "_finalize_final_module"))):
        yield
        return
    codegen.unserialize_library = functools.partial(_unserialize, codegen, codegen.unserialize_library)
    try:
        yield
    finally:
        del codegen.unserialize_library  # the method again


def _unserialize(codegen: Any, standard: Any, state: Any) -> Any:
    """numba's `CPUCodeLibrary._unserialize` of an "object" library, its symbols read from the machine code."""
    name, kind, data = state
    try:
        if kind != "object":
            raise ValueError(kind)
        machine_code, bitcode = data
        symbols = elf_defined_symbols(machine_code)
    except (ValueError, TypeError):
        return standard(state)
    library = codegen.create_library(name)
    library.enable_object_caching()
    library._set_compiled_object(machine_code)
    library._finalize_final_module()
    codegen._engine._defined_symbols |= symbols
    library._get_module_for_linking = functools.partial(_module_for_linking, library, bitcode)
    return library


def _module_for_linking(library: Any, bitcode: bytes) -> Any:
    """What numba's `_get_module_for_linking` returns for a cached library: its bitcode, parsed on first use."""
    if library._shared_module is None:
        library._shared_module = ll.parse_bitcode(bitcode)
    return library._shared_module


_SHT_SYMTAB, _STT_OBJECT, _STT_FUNC = 2, 1, 2


def elf_defined_symbols(obj: bytes) -> set[str]:
    """Names of the functions and data objects a 64-bit little-endian ELF object defines: what numba lists
    from the bitcode's defined functions and globals. ValueError for anything else or a damaged file."""
    if obj[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not a 64-bit little-endian ELF object")
    try:
        (shoff,) = struct.unpack_from("<Q", obj, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
        names: set[str] | None = None
        for i in range(shnum):
            header = shoff + i * shentsize
            if struct.unpack_from("<I", obj, header + 4)[0] != _SHT_SYMTAB:
                continue
            offset, size, link, _, _, entsize = struct.unpack_from("<QQIIQQ", obj, header + 0x18)
            str_offset, str_size = struct.unpack_from("<QQ", obj, shoff + link * shentsize + 0x18)
            strings = obj[str_offset:str_offset + str_size]
            if offset + size > len(obj) or str_offset + str_size > len(obj) or entsize < 24:
                raise ValueError("a table past the end of the object")
            names = set()
            for at in range(offset, offset + size, entsize):
                st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", obj, at)
                if st_shndx != 0 and st_info & 0xF in (_STT_OBJECT, _STT_FUNC):
                    names.add(strings[st_name:strings.index(b"\0", st_name)].decode())
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"damaged ELF object: {e}") from None
    if not names:
        raise ValueError("no symbol table")
    return names
