"""How the CPU plugin's kernels run in a process: numba's threading layer, what importing the plugin
costs, and loading the kernels from numba's disk cache. Most tests here start fresh interpreters: they
are about what a process does first."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numba
import numpy as np
import pytest

# -- the threading layer ------------------------------------------------------------------------------

X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"


def _fresh_process(code: str, env: dict[str, str] | None = None) -> str:
    """What `code` prints in a new interpreter (the tests here are about what a process does first); it must succeed."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _threading_layer(env: dict[str, str], before: str = "") -> list[str]:
    """numba's threading layer in a fresh process that opened a 2-thread provider, and whether libtbb is loaded."""
    code = (f"{before}import numba; from bitnet_cpu.provider import CpuProvider; CpuProvider(n_threads=2); "
            "print(numba.threading_layer(), 'libtbb.so' in open('/proc/self/maps').read())")
    return _fresh_process(code, env).split()


DEFAULT_ENV = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}


@pytest.mark.skipif(not X86_LINUX, reason="the tbb wheel is a dependency on x86-64 Linux only")
def test_the_kernels_run_on_tbb() -> None:
    # Under OpenMP a kernel waits for the share of a descheduled thread; under TBB the calling thread runs it.
    assert _threading_layer(DEFAULT_ENV) == ["tbb", "True"]


@pytest.mark.skipif(not X86_LINUX, reason="the tbb wheel is a dependency on x86-64 Linux only")
def test_numba_alone_does_not_find_the_tbb_wheel() -> None:
    # Why the provider loads the library by path: without that numba falls back to OpenMP, silently.
    hide = "import bitnet_cpu.threading_layer as t; t.installed_tbb = lambda: None; "
    assert _threading_layer(DEFAULT_ENV, hide) == ["omp", "False"]


@pytest.mark.skipif(not X86_LINUX, reason="the tbb wheel is a dependency on x86-64 Linux only")
def test_a_threading_layer_the_user_chose_is_kept() -> None:
    assert _threading_layer({**DEFAULT_ENV, "NUMBA_THREADING_LAYER": "omp"}) == ["omp", "False"]
    assert _threading_layer({**DEFAULT_ENV, "NUMBA_THREADING_LAYER": "tbb"}) == ["tbb", "True"]  # found, as by default


# -- the import cost ---------------------------------------------------------------------------------

def test_import_does_not_load_numba() -> None:
    code = "import sys, bitnet_cpu; bitnet_cpu.probe(); assert 'numba' not in sys.modules, 'numba imported'"
    _fresh_process(code)


def test_numba_comes_in_without_yaml_unless_its_config_file_is_there(tmp_path: Path) -> None:
    # numba imports PyYAML only to read .numba_config.yaml from the working directory: 20 ms of every load.
    code = ("import sys; from bitnet.plugins.selection import select; select('cpu').open(); import numba; "
            "print('yaml' in sys.modules, numba.config.CACHE_DIR == 'from-yaml')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr[-2000:]
    (tmp_path / ".numba_config.yaml").write_text("cache_dir: from-yaml\n")  # a user's numba config still counts
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stderr[-2000:]


def test_cached_kernels_run_without_numbas_compiler() -> None:
    # numba's cache loader sets its compiler's context up first: 0.3-0.4 s of imports (numba.cpython.listobj
    # among them) that running machine code never needs; and it imports the module of every numba function
    # inlined into a kernel (numba.np.arrayobj, for np.empty) to hold globals only object mode reads. A model's
    # prompt and decode steps run without either, and generate what they generate with both imported first.
    # Nor numpy.ma, which numba's typing of an array imports to check it is not a masked one (12.6 ms), nor
    # numba's extensions (a search of every package's entry points, 3-5 ms): another function's first call loads them.
    # The first process may compile (a cold cache compiles, and a compile needs the context); the others load.
    run = ("import sys, bitnet, numba; e = bitnet.load(device='cpu'); e.provider.n_threads = 2; "
           "print(repr(''.join(e.generate('To be', max_tokens=8))), "
           "*(m in sys.modules for m in ('numba.cpython.listobj', 'numba.np.arrayobj', 'numpy.ma')), "
           "numba.core.entrypoints._already_initialized, end=' '); numba.njit(lambda: 0)(); "
           "print(numba.core.entrypoints._already_initialized)")
    _fresh_process(run)
    text, *imported = _fresh_process(run).rsplit(maxsplit=5)
    assert imported == ["False", "False", "False", "False", "True"]
    assert _fresh_process("import numba.np.arrayobj, numpy.ma; " + run).rsplit(maxsplit=5) == [
        text, "False", "True", "True", "False", "True"]


def test_the_runtime_comes_from_its_file_and_a_damaged_file_is_compiled_again(tmp_path: Path) -> None:
    # numba compiles its runtime (NRT) in every process, 30 ms of a load; a kernel that allocates runs on it.
    use = ("import sys, numpy as np, numba; from bitnet_cpu import kernel_cache; "
           "kernel_cache.runtime_ready(sys.argv[1]); print(numba.njit(lambda n: np.arange(n).sum())(5))")
    no_compile = "from numba.core.runtime import nrtdynmod; nrtdynmod.create_nrt_module = None; "

    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)

    assert run(no_compile + use).returncode != 0  # (the spy works: with nothing cached, numba must compile)
    assert run(use).stdout.split() == ["10"]
    [entry] = tmp_path.glob("nrt-*.bin")
    assert run(no_compile + use).stdout.split() == ["10"]  # loaded, not compiled
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged: the digest no longer matches, so it is compiled and written again
    entry.write_bytes(bytes(data))
    assert run(use).stdout.split() == ["10"]
    assert run(no_compile + use).stdout.split() == ["10"]


def _cached_module(monkeypatch: pytest.MonkeyPatch, cache: Path) -> ModuleType:
    """A module holding one disk-cached kernel, whose cache lives in `cache`."""
    monkeypatch.setattr(numba.core.config, "CACHE_DIR", str(cache))
    mod = ModuleType("cached")
    mod.plus_one = numba.njit(cache=True)(lambda x: x + 1)
    return mod


def test_lightly_loaded_kernels_compile_on_a_miss_and_load_on_a_hit(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    from bitnet_cpu import kernel_cache

    for expect_hits in (0, 1):  # an empty cache compiles (numba's compiler sets its context up); then it loads
        mod = _cached_module(monkeypatch, tmp_path)
        kernel_cache.load_lightly(mod)
        assert "load_overload" in vars(mod.plus_one._cache)
        assert mod.plus_one(41) == 42
        assert sum(mod.plus_one.stats.cache_hits.values()) == expect_hits


def _arrays() -> list[object]:
    readonly = np.arange(5, dtype=np.uint16)
    readonly.flags.writeable = False
    return [np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32, order="F"), np.zeros((4, 6), np.int8)[:, ::2],
            readonly, np.frombuffer(bytes(16), np.int64), np.array(1.5), np.zeros((2, 2, 2), bool)]


@pytest.mark.parametrize("value, read_here", [(a, True) for a in _arrays()] + [(np.zeros(2, np.longdouble), False),
                                                                            (7, False), ((1, 2), False)])
def test_an_arguments_type_is_numbas_and_an_arrays_is_read_without_numpy_ma(monkeypatch: pytest.MonkeyPatch,
                                                                            value: object, read_here: bool) -> None:
    from bitnet_cpu.kernel_cache import typeof_argument

    standard = numba.njit(lambda a: 0).typeof_pyval
    asked = []

    def spy(v: object) -> object:
        asked.append(v)
        return standard(v)

    monkeypatch.delitem(sys.modules, "numpy.ma", raising=False)
    assert typeof_argument(spy, value) == standard(value)
    # Arrays of the dtypes numba has types for never reach numba's typeof; a long double array and the rest do.
    assert (asked == []) == read_here


def test_a_masked_array_is_refused_as_numba_refuses_it() -> None:
    from bitnet_cpu.kernel_cache import typeof_argument

    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(numba.core.errors.NumbaError, match="MaskedArray"):
        numba.njit(lambda a: 0).typeof_pyval(masked)
    with pytest.raises(numba.core.errors.NumbaError, match="MaskedArray"):
        typeof_argument(numba.njit(lambda a: 0).typeof_pyval, masked)


def test_a_numba_without_the_cache_hooks_loads_the_standard_way(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from numba.core.caching import Cache

    from bitnet_cpu import kernel_cache

    mod = _cached_module(monkeypatch, tmp_path)
    monkeypatch.delattr(Cache, "_load_overload")
    kernel_cache.load_lightly(mod)
    assert "load_overload" not in vars(mod.plus_one._cache)


def test_a_cached_kernel_loads_from_its_machine_code_and_parses_its_bitcode_only_to_link(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # numba parses a cached library's bitcode on load, to list its symbols: 30 ms of a model's first forward pass.
    from llvmlite import binding

    from bitnet_cpu import kernel_cache

    parsed = []
    parse = binding.parse_bitcode
    monkeypatch.setattr(binding, "parse_bitcode", lambda data: parsed.append(len(data)) or parse(data))
    assert _cached_module(monkeypatch, tmp_path).plus_one(1) == 2  # compiled and written to the cache
    mod = _cached_module(monkeypatch, tmp_path)
    kernel_cache.load_lightly(mod)
    parsed.clear()
    assert mod.plus_one(41) == 42
    assert sum(mod.plus_one.stats.cache_hits.values()) == 1 and parsed == []
    twice = numba.njit(lambda x: 2 * mod.plus_one(x))  # a compile that links the loaded library in
    assert twice(20) == 42 and len(parsed) == 1


def test_a_librarys_symbols_read_from_its_machine_code_are_the_ones_numba_lists(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: Path) -> None:
    from llvmlite import binding

    from bitnet_cpu.kernel_cache import elf_defined_symbols

    mod = _cached_module(monkeypatch, tmp_path)
    assert mod.plus_one(1) == 2
    [library] = [cres.library for cres in mod.plus_one.overloads.values()]
    _, kind, (machine_code, bitcode) = library.serialize_using_object_code()
    module = binding.parse_bitcode(bitcode)
    listed = {g.name for gs in (module.functions, module.global_variables) for g in gs if not g.is_declaration}
    assert kind == "object" and elf_defined_symbols(machine_code) == listed
    no_symtab = bytearray(machine_code)
    shoff = int.from_bytes(machine_code[0x28:0x30], "little")
    for i in range(int.from_bytes(machine_code[0x3C:0x3E], "little")):  # every section's type made "program data"
        no_symtab[shoff + 64 * i + 4:shoff + 64 * i + 8] = (1).to_bytes(4, "little")
    for broken in (b"", b"junk" * 20, machine_code[:200], bytes(no_symtab)):
        with pytest.raises(ValueError):
            elf_defined_symbols(broken)


def test_a_library_whose_machine_code_cannot_be_read_loads_the_standard_way() -> None:
    from bitnet_cpu import kernel_cache

    standard = []
    for data in ((b"junk", b""), None):
        state = ("lib", "object" if data else "bitcode", data)
        kernel_cache._unserialize(None, standard.append, state)  # (codegen unused when it falls back)
    assert len(standard) == 2
