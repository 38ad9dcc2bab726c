"""Instruction-set levels of the ternary kernels: what the host runs, which one a process uses, and
one compiled kernel set per level, each with its own disk cache.

What runs where:

| level | inner loop | runs on (llvmlite's host features) |
| --- | --- | --- |
| avx512vbmi | avx512vnni's on base-3 codes, decoded by `vpermi2b` | avx512vnni's + avx512vbmi (Ice Lake, Zen 4) |
| avx512vnni | 512-bit `vpdpbusd` | avx512f + avx512bw + avx512vnni (Ice Lake / Cascade Lake Xeons and later, Zen 4) |
| avxvnni | 256-bit `vpdpbusd` | avxvnni (VEX; Alder Lake and later) or avx512vnni + avx512vl (EVEX) |
| avx2 | `vpmaddubsw` + `vpmaddwd` | avx2 |
| generic | portable LLVM vector IR | anything numba compiles for |

Numba compiles for the host, and LLVM aborts the process on an intrinsic the host cannot run, so
a level the host lacks is never compiled here; `ir_checks.assembly()` checks such a level by
compiling its IR for a CPU that has it, without running it.

`int_kernels` is executed once per level as its own module (`bitnet_cpu.int_kernels_<level>`),
so one process can hold every level its host runs (the tests compare them). Numba keys its disk cache
by the function's file, name, signature and the host CPU, not by the globals an intrinsic reads,
so each level gets a cache directory of its own: one level's machine code is never loaded as
another's. The directory name also carries a hash of `dot_ir.py`, whose IR numba inlines but
does not track.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from bitnet.errors import UsageError
from bitnet.plugins.types import host_cpu_name

from .dot_ir import LEVELS, first_cpu

_ENV = "BITNET_CPU_ISA"
_NAMES = {"avx512": "avx512vnni", **{level: level for level in LEVELS}}
_HERE = Path(__file__).resolve().parent


@functools.cache
def host_levels() -> tuple[str, ...]:
    """The levels this host runs, best first (always ending with "generic")."""
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host":
        return ("generic",)  # numba compiles for another CPU (NUMBA_CPU_NAME): no host-specific intrinsics
    from llvmlite import binding

    f = dict(binding.get_host_cpu_features())
    for flag in (config.CPU_FEATURES or "").split(","):  # numba compiles with NUMBA_CPU_FEATURES if set
        if flag[:1] in "+-" and flag[1:]:
            f[flag[1:]] = flag[0] == "+"
    has = {
        "avx512vbmi": f.get("avx512f") and f.get("avx512bw") and f.get("avx512vnni") and f.get("avx512vbmi"),
        "avx512vnni": f.get("avx512f") and f.get("avx512bw") and f.get("avx512vnni"),
        "avxvnni": f.get("avxvnni") or (f.get("avx512vnni") and f.get("avx512vl")),
        "avx2": f.get("avx2"),
        "generic": True,
    }
    return tuple(level for level in LEVELS if has[level])


@functools.cache
def l1_data_bytes(caches: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The L1 data cache of the host's first core in bytes, from sysfs; 32 KB where it does not say."""
    for index in sorted(Path(caches).glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() != "Instruction":
                size = (index / "size").read_text().strip().upper()
                return int(size.rstrip("KM")) << (20 if size.endswith("M") else 10 if size.endswith("K") else 0)
        except (OSError, ValueError):
            continue
    return 32 << 10


def float_lanes() -> int:
    """float32 lanes of the float kernels' vectors (the LM head's row dots, attention's values pass): one zmm where
    the host runs the AVX-512 level (numba's CPU overrides counted, as for the int kernels), else one ymm. Keyed
    to the host, not to BITNET_CPU_ISA: numba's disk cache keys the float kernels by the host CPU alone."""
    return 16 if "avx512vnni" in host_levels() else 8


def wide_bytes() -> int:
    """How many bytes of a row's activations a WIDE pass of BitLinear takes at a time (int_kernels.matmul_rowscale):
    two thirds of L1, the rest for the codes streaming through. At 8 tokens the 6912-column down projection then
    runs in 2 column parts on a 48 KB L1 (Zen 5: 360-364 -> 338-341 us a layer, streamed; prefill within noise)
    and 3 on a 32 KB one, where 24 KB parts had been measured best (whole rows, 55 KB, from L2: 10-40 % slower)."""
    return l1_data_bytes() * 2 // 3


def base3_by_default(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the host takes avx512vbmi (base-3 codes) by default: an AMD Zen 5 or later (cpu family 26 and up),
    whose four 512-bit pipes decode base 3 faster than memory brings it (a 2B-4T decode step 1.05-1.13x faster
    than avx512vnni's on a Zen 5 EPYC). Zen 4 runs 512-bit operations in two halves and Intel's cores on two ports,
    where the decoding may not keep up with memory: not measured there, so avx512vnni stays their default
    (`benchmarks/packing_probe.py` measures it; BITNET_CPU_ISA=avx512vbmi takes it)."""
    info = first_cpu(cpuinfo)
    family = info.get("cpu family", "")
    return info.get("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) >= 26


def default_level() -> str:
    """The best level the host runs, but avx512vbmi only where `base3_by_default`."""
    levels = host_levels()
    return levels[1] if levels[0] == "avx512vbmi" and not base3_by_default() else levels[0]


def choose(requested: str | None = None) -> str:
    """The level to use: `requested`, else BITNET_CPU_ISA, else `default_level()`.

    Raises UsageError (exit 2) for an unknown name or a level this CPU lacks, naming what it has.
    """
    raw = (requested if requested is not None else os.environ.get(_ENV, "")).strip().lower()
    levels = host_levels()
    if not raw:
        return default_level()
    level = _NAMES.get(raw)
    source = f"{_ENV}={raw}" if requested is None else f"CPU ISA level {raw!r}"
    if level is None:
        raise UsageError(f"{source} is not a level; choose one of generic, avx2, avxvnni, avx512, avx512vbmi")
    if level not in levels:
        raise UsageError(f"{source}: this CPU ({host_cpu_name()}) lacks {level}; it runs {', '.join(levels)}")
    return level


# -- one kernel module per level ------------------------------------------------------------------------

_loaded: dict[str, ModuleType] = {}
_lock = threading.Lock()
_serial = itertools.count()


def kernels(level: str) -> ModuleType:
    """The ternary kernel module of `level` (a name from LEVELS), built once per process, disk-cached."""
    mod = _loaded.get(level)
    if mod is None:
        with _lock:
            mod = _loaded.get(level) or build(level)
            _loaded[level] = mod
    return mod


def build(level: str, cache: bool = True) -> ModuleType:
    """A new instance of `int_kernels` (with `layer_regions`) for `level`; without `cache` it never touches the disk
    cache (for kernels built from patched IR, as the tests do)."""
    level = choose(level)  # a name or alias the CPU runs, else the error that names what it runs
    directory = cache_dir(level) if cache else None
    name = f"bitnet_cpu.int_kernels_{level}" + ("" if cache else f"_uncached{next(_serial)}")
    spec = importlib.util.spec_from_file_location(name, _HERE / "int_kernels.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    mod.ISA, mod.CACHE = level, directory is not None
    sys.modules[name] = mod  # numba finds a cached function's globals through its module name
    announce_compiles()
    with _numba_cache_dir(directory):
        spec.loader.exec_module(mod)
        regions = _HERE / "layer_regions.py"  # the template's second file (see there), in the same module
        exec(compile(regions.read_text(), str(regions), "exec"), mod.__dict__)
    if directory is not None:
        from . import kernel_cache

        kernel_cache.load_lightly(mod)
    return mod


# numba keys a cached function to its own file only; these are compiled into the int kernels and the layer region too
# (IR, inlined or linked callees, constants), so an edit to any of them must miss their cache.
COMPILED_IN = ("dot_ir.py", "attention.py", "float_kernels.py", "atomics.py", "stack_phases.py")


def cache_dir(level: str) -> str | None:
    """Where `level`'s kernels are cached: under NUMBA_CACHE_DIR, else this package's __pycache__,
    else the user's cache directory; None when none is writable (they compile in every process)."""
    from numba.core import config

    stamp = hashlib.sha256(b"".join((_HERE / name).read_bytes() for name in COMPILED_IN)).hexdigest()[:12]
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bitnet-cpu"
    bases = [Path(config.CACHE_DIR)] if config.CACHE_DIR else [_HERE / "__pycache__", user]
    for base in bases:
        path = base / f"int-{level}-{stamp}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError:
            continue
        return str(path)
    return None


@contextmanager
def _numba_cache_dir(path: str | None) -> Iterator[None]:
    """Numba picks a function's cache directory when it is decorated, from config.CACHE_DIR."""
    from numba.core import config

    saved = config.CACHE_DIR
    config.CACHE_DIR = path or saved
    try:
        yield
    finally:
        config.CACHE_DIR = saved


# -- the first-run announcement ---------------------------------------------------------------------------

_announced = False


@functools.cache
def announce_compiles() -> None:
    """Print one line on stderr the first time this process compiles one of the plugin's kernels.

    Numba signals "numba:compile" only on a cache miss, so a warm cache prints nothing.
    """
    from numba.core import event

    class _Announce(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            global _announced
            dispatcher = (ev.data or {}).get("dispatcher")
            module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
            if _announced or not module.startswith("bitnet_cpu."):
                return
            _announced = True
            where = "once" if getattr(sys.modules.get(module), "CACHE", True) else "no writable cache: every run"
            # How long, so a silent minute does not look like a hang (40-60 s on 2 cores of a Zen 5 EPYC).
            print(f"bitnet-cpu: compiling CPU kernels for this machine, {where} (up to a minute or two; "
                  "`bitnet-select --device cpu warmup` compiles them all ahead)", file=sys.stderr, flush=True)

        def on_end(self, ev: event.Event) -> None:
            pass

    event.register("numba:compile", _Announce())
