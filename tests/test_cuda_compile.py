"""Every CUDA kernel, fast paths included, compiles for the architectures we ship to (no GPU needed).

The nvcc command is PyCUDA's SourceModule's (pycuda/compiler.py: `nvcc --cubin <options> -arch sm_XX
-I<pycuda include> kernel.cu`, with no_extern_c=True so the source goes in unwrapped) plus `--keep`
(SourceModule's keep=True: the PTX stays beside the cubin) and `--resource-usage` (ptxas reports
registers and spills; it changes no code). PyCUDA's include directory holds only its own headers,
which the kernels do not use, so it is left out.

CUDA 13 dropped sm_70 from nvcc. sm_70 is compiled by NVRTC 12.9 instead (PyPI wheels
nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 for its headers, in requirements-dev.txt): the
compiler nvcc 12.9 runs, through its library interface rather than SourceModule's command line.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bitnet import gpu as kernels_src
from bitnet_cuda import nvcc_options

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
ARCHS = ["sm_70", "sm_75", "sm_80", "sm_90"]
BODY_MARK = '#line 1 "bitnet_kernels.c"'
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin): the CUDA "
                                "toolkit is needed to compile-check the kernels")


def nvcc_archs() -> set[str]:
    if NVCC is None:
        return set()
    out = subprocess.run([NVCC, "--list-gpu-code"], capture_output=True, text=True).stdout
    return set(out.split())


def kernel_symbols(cubin: bytes) -> set[str]:
    """Names of the kernel entry points in a cubin (ELF64): global functions flagged STO_CUDA_ENTRY."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2, "not an ELF64 cubin"
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link]
        for pos in range(offset, offset + size, entsize):
            st_name, st_info, st_other = struct.unpack_from("<IBB", cubin, pos)
            if st_info == 0x12 and st_other & 0x10:  # GLOBAL FUNC, CUDA entry
                start = strtab[4] + st_name
                names.add(cubin[start:cubin.index(b"\0", start)].decode())
    return names


@dataclass
class Build:
    returncode: int
    log: str  # nvcc's stdout and stderr
    cubin: bytes
    ptx: str


def nvcc_build(source: str, arch: str, workdir: Path) -> Build:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "kernel.cu").write_text(source)
    cmd = [NVCC, "--cubin", *nvcc_options(), "-arch", arch, "--keep", "--resource-usage", "kernel.cu"]
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    cubin, ptx = workdir / "kernel.cubin", workdir / "kernel.ptx"
    return Build(r.returncode, r.stdout + r.stderr, cubin.read_bytes() if cubin.exists() else b"",
                 ptx.read_text() if ptx.exists() else "")


_BUILDS: dict[str, Build] = {}


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory):
    """The shipped source built for an arch, once per test process (each xdist worker has its own)."""
    def get(arch: str) -> Build:
        if arch not in _BUILDS:
            _BUILDS[arch] = nvcc_build(kernels_src.source("cuda"), arch, tmp_path_factory.mktemp(arch))
        return _BUILDS[arch]
    return get


EXPECTED = set(kernels_src.kernel_names(kernels_src.source("cuda")))


def test_expected_kernels_include_what_the_providers_launch():
    launched = {"ternary_matmul_i8", "ternary_matmul_f32", "quantize_i8", "lm_head_f16", "lm_head_bf16",
                "lm_head_f32", "convert_table", "argmax_f32", "rmsnorm_f32", "rope_neox_f32", "kv_store_f32",
                "kv_store_f16", "attention_f32", "attention_f16", "silu_mul_f32", "relu2_mul_f32", "add_f32",
                "embed_f16", "embed_f32", "zero_extend_f32"}
    assert EXPECTED == launched


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles(build, arch):
    if arch not in nvcc_archs():
        pytest.skip(f"this nvcc cannot target {arch} (CUDA 13 dropped it; sm_70 is checked through NVRTC 12)")
    b = build(arch)
    assert b.returncode == 0, f"nvcc failed for {arch}:\n{b.log}"
    # SourceModule turns any other compiler output into a warning at every load: there must be none.
    noise = [ln for ln in b.log.splitlines() if ln.strip() and not ln.startswith("ptxas info")
             and not ln.startswith("    ")]
    assert noise == [], "nvcc said more than its resource report:\n" + "\n".join(noise)
    missing = EXPECTED - kernel_symbols(b.cubin)
    assert not missing, f"{arch}: kernels missing from the cubin: {sorted(missing)}"


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_cuda_fast_paths_are_compiled_in(build, arch):
    """vendor_cuda.h turns every feature macro on (HAS_DP4A from sm_61): each fast path's instructions
    are in the PTX, so no missing macro silently routes CUDA to a portable path. (bf16 rounding is the
    same integer arithmetic on every vendor, run bit-exact on OpenCL.)"""
    ptx = build(arch).ptx
    assert "dp4a.s32.s32" in ptx, "HAS_DP4A: __dp4a (ternary int8 dot) missing"
    assert "shfl.sync.bfly" in ptx, "HAS_SUBGROUP_REDUCE: warp-shuffle reductions missing"
    assert re.search(r"ld\.global(\.nc)?\.v4\.(u32|b32|f32|s32)", ptx), "HAS_WIDE_LOADS: 128-bit loads missing"
    assert "cvt.rn.f16.f32" in ptx and "cvt.f32.f16" in ptx, "HAS_F16: f16 conversions missing"


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_no_kernel_spills_or_uses_a_stack(build, arch):
    """Register arrays (the tile's accumulators, a block's code words) must stay in registers."""
    report = build(arch).log
    frames = re.findall(
        r"Function properties for (\w+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores", report)
    assert {name for name, _, _ in frames} == EXPECTED
    bad = {name: (int(frame), int(spill)) for name, frame, spill in frames if int(frame) or int(spill)}
    assert bad == {}, f"{arch}: (stack frame, spill stores) bytes per kernel: {bad}"


BROKEN = {
    "syntax": ("out[e] = a[e] + b[e];", "out[e] = a[e] + b[e]"),  # add_f32 loses its semicolon
    "type": ("out[e] = a[e] + b[e];", "out[e] = a + b[e];"),  # a pointer where a float belongs
}


@needs_nvcc
@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_kernel_fails_the_build_with_the_error_shown(tmp_path, kind):
    old, new = BROKEN[kind]
    source = kernels_src.source("cuda")
    assert source.count(old) == 1
    b = nvcc_build(source.replace(old, new), "sm_80", tmp_path)
    assert b.returncode != 0, "nvcc accepted a broken kernel"
    assert re.search(r"bitnet_kernels\.c\(\d+\): error", b.log), b.log  # the file and line of the error
    assert b.cubin == b""


# -- sm_70 through NVRTC 12 ------------------------------------------------------------------------------
def _nvrtc12() -> tuple[Path, Path] | None:
    try:
        nvrtc = importlib.util.find_spec("nvidia.cuda_nvrtc")
        runtime = importlib.util.find_spec("nvidia.cuda_runtime")
    except ModuleNotFoundError:
        return None
    if nvrtc is None or runtime is None:
        return None
    lib = Path(next(iter(nvrtc.submodule_search_locations))) / "lib" / "libnvrtc.so.12"
    include = Path(next(iter(runtime.submodule_search_locations))) / "include"
    return (lib, include) if lib.exists() and (include / "cuda_fp16.h").exists() else None


def nvrtc_build(source: str, arch: str) -> tuple[int, str, bytes]:
    """(result, log, cubin) of NVRTC 12 compiling `source` for `arch` with the provider's options."""
    lib_path, include = _nvrtc12()
    lib = ctypes.CDLL(str(lib_path))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}", f"-I{include}", *nvcc_options()]
    argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    result = lib.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = b""
    if result == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        cubin = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return result, log.value.decode(errors="replace"), cubin


needs_nvrtc12 = pytest.mark.skipif(_nvrtc12() is None, reason="NVRTC 12 not installed (pip install -r "
                                   "requirements-dev.txt: nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12)")


@needs_nvrtc12
def test_every_kernel_compiles_for_sm70_with_nvrtc12():
    result, log, cubin = nvrtc_build(kernels_src.source("cuda"), "sm_70")
    assert result == 0, f"NVRTC failed for sm_70:\n{log}"
    noise = [ln for ln in log.splitlines() if ln.strip() and "are deprecated" not in ln]
    assert noise == [], "NVRTC said more than the sm_70 deprecation notice:\n" + "\n".join(noise)
    missing = EXPECTED - kernel_symbols(cubin)
    assert not missing, f"sm_70: kernels missing from the cubin: {sorted(missing)}"


@needs_nvrtc12
def test_a_broken_kernel_fails_nvrtc12():
    old, new = BROKEN["type"]
    result, log, cubin = nvrtc_build(kernels_src.source("cuda").replace(old, new), "sm_70")
    assert result != 0 and cubin == b""
    assert re.search(r"bitnet_kernels\.c\(\d+\): error", log), log


# -- one source ---------------------------------------------------------------------------------------------
def test_cuda_and_opencl_builds_come_from_the_same_source_text():
    cuda, opencl = kernels_src.source("cuda"), kernels_src.source("opencl")
    head_cuda, body_cuda = cuda.split(BODY_MARK, 1)
    head_opencl, body_opencl = opencl.split(BODY_MARK, 1)
    assert body_cuda == body_opencl  # byte for byte: only the vendor header differs
    body_file = Path(kernels_src.__file__).with_name(kernels_src.BODY).read_text(encoding="utf-8")
    assert body_cuda == "\n" + body_file
    assert "vendor_cuda.h" in head_cuda and "vendor_opencl.h" in head_opencl and head_cuda != head_opencl


def test_no_plugin_carries_kernel_code_of_its_own():
    """Both providers build the shared source; no kernel text lives in a plugin."""
    root = Path(__file__).resolve().parent.parent / "plugins"
    for path in root.glob("*/bitnet_*/**/*"):
        if path.suffix in (".cl", ".cu", ".cuh", ".c", ".h"):
            pytest.fail(f"kernel source inside a plugin: {path}")
        if path.suffix == ".py":
            text = path.read_text(encoding="utf-8")
            found = [word for word in ("__global__", "__kernel", "KERNEL ") if word in text]
            assert not found, f"{found} in {path}: kernels belong in bitnet/kernels_src"
    cuda = (root / "cuda" / "bitnet_cuda" / "provider.py").read_text(encoding="utf-8")
    opencl = (root / "opencl" / "bitnet_opencl" / "provider.py").read_text(encoding="utf-8")
    assert 'kernels_src.source("cuda")' in cuda and 'kernels_src.source("opencl")' in opencl
