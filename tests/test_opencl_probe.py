"""The OpenCL probe through the real CLI: what `devices` shows, and every way OpenCL can be unavailable.

Each situation is arranged with the real mechanism wherever one exists, in a fresh process:
- no platform: the ICD loader finds no ICD. The pyopencl wheel's loader (isuruf's ocl-icd) reads
  OCL_ICD_VENDORS *and* always `$PYOPENCL_HOME/.libs`, where the wheel's PoCL sits, and pyopencl
  sets PYOPENCL_HOME on import, so no environment variable alone can hide it. A `sitecustomize` on
  PYTHONPATH points PYOPENCL_HOME at an empty directory after that import and before the first
  OpenCL call (the loader reads it then); the real loader then fails with PLATFORM_NOT_FOUND_KHR.
- no device: PoCL's own POCL_DEVICES=none (a platform with zero devices); POCL_DEVICES="pthread basic"
  gives two devices, so a device index is tested against a real multi-device platform.
- a kernel build failure: PyOpenCL's own PYOPENCL_BUILD_OPTIONS, appended to our build options, breaks
  the build exactly as a driver rejecting our source would; the device's build log reaches the user.
- pyopencl not importable: a fake `pyopencl` package first on PYTHONPATH (pyopencl is installed here).
Where Intel's CPU runtime is installed too (scripts/setup.sh installs it), BITNET_OPENCL_PLATFORM picks
the platform a test is about, and the tests that concern any platform run on each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bitnet.modelfile.writer import SyntheticSpec, write_model
from conftest import cli_env, opencl_builds, opencl_platforms, run_cli

cl = pytest.importorskip("pyopencl")

from bitnet_opencl import icd  # noqa: E402 (needs a working pyopencl)
from bitnet_opencl.probe import device_features  # noqa: E402

PLATFORMS = opencl_platforms()
POCL = "Portable Computing Language"
INTEL = "Intel(R) OpenCL"
pytestmark = [pytest.mark.opencl, pytest.mark.skipif(not PLATFORMS, reason="no OpenCL device to probe")]
needs_pocl = pytest.mark.skipif(POCL not in PLATFORMS, reason="these cases use PoCL's own POCL_DEVICES; PoCL "
                                f"{opencl_builds().get(POCL) or 'is not installed'}")
SITECUSTOMIZE = """\
import os
import pyopencl  # sets PYOPENCL_HOME to its own directory, whose .libs holds the wheel's PoCL ICD
os.environ["PYOPENCL_HOME"] = {empty!r}
"""


def summary(stdout: str) -> dict[str, str]:
    m = re.fullmatch(r"requested=(\S+) detected=\[(\S*)\] selected=(\S+)", stdout.strip())
    assert m, stdout
    return {"requested": m[1], "detected": m[2], "selected": m[3]}


def opencl_entries(env: dict[str, str]) -> list[dict]:
    r = run_cli("devices", "--json", env=env)
    assert r.returncode == 0, r.stderr
    return [e for e in json.loads(r.stdout) if e["backend"] == "opencl"]


def unavailable(env: dict[str, str], reason: str) -> None:
    """`--device opencl` exits 3 with `reason` on one line; auto goes elsewhere; devices says why."""
    r = run_cli("--device", "opencl", env=env)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert summary(r.stdout)["selected"] == "none"
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert reason in r.stderr, r.stderr
    auto = run_cli(env=env)
    assert auto.returncode == 0 and "opencl" not in summary(auto.stdout)["detected"].split(",")
    (entry,) = opencl_entries(env)
    assert entry["available"] is False and reason in entry["reason"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "m.gguf", SyntheticSpec(n_ctx=64))


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_plausible(reported: int, kind: str, driver_now: int) -> bool:
    """A CPU device's memory lies within the machine's (PoCL reports free memory, which moves between
    reads); a GPU's is the driver's answer, exactly."""
    return 0 < reported <= physical_memory() if kind == "cpu" else reported == driver_now


# -- what is found -------------------------------------------------------------------------------------
@pytest.mark.parametrize("platform_name", PLATFORMS)
def test_devices_json_shows_the_device_and_its_properties(platform_name):
    """Every property the probe reports is the driver's own answer, checked against pyopencl here. The
    memory size is not compared between two reads: PoCL reports the host's free memory, which moves
    (4600793088, then 4298803200, measured); it must lie within the machine's physical memory."""
    (entry,) = opencl_entries(cli_env(BITNET_OPENCL_PLATFORM=platform_name))
    assert entry["available"] is True and entry["priority"] == 50 and "ocl" in entry["aliases"]
    d, props = entry["device"], entry["device"]["properties"]
    platform = cl.get_platforms()[props["platform_index"]]
    dev = platform.get_devices()[props["device_index"]]
    assert platform.name.strip() == platform_name
    assert (d["name"], d["vendor"], d["compute_units"]) == (dev.name.strip(), dev.vendor.strip(),
                                                           dev.max_compute_units)
    assert d["compute_units"] >= 1
    assert memory_plausible(d["memory_bytes"], d["kind"], dev.global_mem_size), d["memory_bytes"]
    assert props["kernel_features"] == list(device_features(dev))
    assert d["fp16"] is ("cl_khr_fp16" in dev.extensions.split())
    assert props["integer_dot_product"] is ("cl_khr_integer_dot_product" in dev.extensions.split())
    assert props["opencl_version"] == dev.version and props["opencl_version"].startswith("OpenCL ")
    assert props["driver_version"] == dev.driver_version and props["platform"] == platform.name.strip()
    assert props["max_work_group_size"] == dev.max_work_group_size >= 1
    assert props["local_memory_bytes"] == dev.local_mem_size > 0
    assert 0 < props["max_mem_alloc_bytes"] == dev.max_mem_alloc_size <= d["memory_bytes"]
    expected_kind = "gpu" if dev.type & cl.device_type.GPU else "cpu"
    assert d["kind"] == expected_kind and d["fake"] is False
    table = run_cli("devices", env=cli_env(BITNET_OPENCL_PLATFORM=platform_name))
    (line,) = [ln for ln in table.stdout.splitlines() if ln.split()[1:2] == ["opencl"]]
    assert d["name"] in line and line.rstrip().endswith("available")


def test_the_memory_check_rejects_what_no_device_reports():
    assert memory_plausible(4298803200 % physical_memory() + 1, "cpu", 4600793088)  # a moving CPU figure
    assert not memory_plausible(0, "cpu", 0) and not memory_plausible(physical_memory() + 1, "cpu", 0)
    assert not memory_plausible(4298803200, "gpu", 4600793088)


@pytest.mark.parametrize("platform_name", PLATFORMS)
def test_platform_filter_is_a_case_insensitive_substring(platform_name):
    """The positive control of the filter test below: a part of the real name, any case, selects it."""
    r = run_cli("--device", "opencl", "devices", "--json",
                env=cli_env(BITNET_OPENCL_PLATFORM=platform_name.split()[0].upper()))
    assert r.returncode == 0, r.stderr
    platforms = {e["device"]["properties"]["platform"] for e in json.loads(r.stdout) if e["backend"] == "opencl"}
    assert platforms == {platform_name}


@needs_pocl
def test_two_devices_each_run_and_index_past_them_names_the_count(model):
    env = cli_env(POCL_DEVICES="pthread basic", BITNET_OPENCL_PLATFORM=POCL)
    assert [e["index"] for e in opencl_entries(env)] == [0, 1]
    args = ("run", "--model", str(model), "--prompt", "The cat", "--max-tokens", "6")
    outs = []
    for index in (0, 1):
        r = run_cli("--device", f"opencl:{index}", *args, env=env)
        assert r.returncode == 0 and f"requested=opencl:{index} " in r.stderr, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] == run_cli("--device", "cpu", *args, env=env).stdout
    r = run_cli("--device", "opencl:2", env=env)
    assert r.returncode == 3 and "has 2 device(s)" in r.stderr, r.stderr


# -- unavailable -----------------------------------------------------------------------------------------
def test_no_platform(tmp_path):
    empty = tmp_path / "no-icd"
    empty.mkdir()
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE.format(empty=str(empty)))
    env = cli_env(PYTHONPATH=str(shim), OCL_ICD_VENDORS=str(empty))
    unavailable(env, "no OpenCL platform: clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")


@needs_pocl
def test_no_device_on_the_platform():
    unavailable(cli_env(POCL_DEVICES="none", BITNET_OPENCL_PLATFORM=POCL), f"no OpenCL device on platform(s) {POCL}")


def test_platform_filter_matching_nothing_names_the_platforms():
    names = ", ".join(p.name.strip() for p in cl.get_platforms())
    unavailable(cli_env(BITNET_OPENCL_PLATFORM="Intel(R) OpenCL Graphics"),
                f"BITNET_OPENCL_PLATFORM='Intel(R) OpenCL Graphics' matches no platform (platforms: {names})")


@pytest.mark.parametrize("fake, reason", [
    ('raise ModuleNotFoundError("No module named \'pyopencl\'", name="pyopencl")\n',
     "pyopencl is not installed (pip install pyopencl"),
    ('raise ImportError("libOpenCL.so.1: cannot open shared object file: No such file or directory")\n',
     "pyopencl is not importable (ImportError: libOpenCL.so.1: cannot open shared object file"),
])
def test_pyopencl_not_importable(tmp_path, fake, reason):
    pkg = tmp_path / "pyopencl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(fake)
    unavailable(cli_env(PYTHONPATH=str(tmp_path)), reason)


def test_device_index_out_of_range_exits_3():
    count = sum(len(p.get_devices()) for p in cl.get_platforms())
    r = run_cli("--device", "opencl:5", env=cli_env())
    assert r.returncode == 3, r.stderr
    s = summary(r.stdout)
    assert s["selected"] == "none" and "opencl" in s["detected"].split(",")  # found, but not that index
    assert f"opencl:5: opencl has {count} device(s), index 0..{count - 1}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("platform_name", PLATFORMS)
def test_kernel_build_failure_shows_the_build_log(model, tmp_path, platform_name):
    """A driver that rejects the kernel source: exit 3, the device's build log with file:line of the
    portable source (the #line marks), and our build options; no traceback."""
    env = cli_env(PYOPENCL_BUILD_OPTIONS="-DTILE_N=(", XDG_CACHE_HOME=str(tmp_path),
                  BITNET_CACHE_DIR=str(tmp_path / "bitnet"), BITNET_OPENCL_PLATFORM=platform_name)
    r = run_cli("--device", "opencl", "run", "--model", str(model), "--prompt", "x", env=env)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "error: OpenCL kernel build failed on " in r.stderr
    assert re.search(r"bitnet_kernels\.c:\d+:\d+: .*expected expression", r.stderr), r.stderr
    assert "-DTILE_N=8" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_probe_survives_a_driver_error_listing_devices(tmp_path):
    """A driver that fails clGetDeviceIDs (no real one does on demand): the reason names the platform."""
    pkg = tmp_path / "pyopencl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "class Error(Exception):\n    pass\n\n"
        "class Platform:\n    name = 'Broken Vendor CL'\n\n"
        "    def get_devices(self):\n"
        "        raise Error('clGetDeviceIDs failed: OUT_OF_HOST_MEMORY')\n\n"
        "def get_platforms():\n    return [Platform()]\n")
    unavailable(cli_env(PYTHONPATH=str(tmp_path)),
                "no OpenCL device on platform(s) Broken Vendor CL; Broken Vendor CL: clGetDeviceIDs failed: "
                "OUT_OF_HOST_MEMORY")


# -- runtimes installed from PyPI: Intel's CPU runtime ------------------------------------------------------
def test_installed_runtime_gets_an_icd_file_beside_the_systems(tmp_path):
    prefix, system = tmp_path / "venv", tmp_path / "etc-vendors"
    (prefix / "lib").mkdir(parents=True)
    system.mkdir()
    (system / "nvidia.icd").write_text("libnvidia-opencl.so.1\n")
    env: dict[str, str] = {}
    assert icd.use_installed_runtimes(env, str(prefix), system) is None and env == {}  # nothing installed
    (prefix / "lib" / "libintelocl.so").write_bytes(b"")
    folder = icd.use_installed_runtimes(env, str(prefix), system)
    assert env == {"OCL_ICD_VENDORS": str(folder)} and folder == prefix / "etc" / "OpenCL" / "bitnet-vendors"
    files = {f.name: f.read_text() for f in folder.iterdir()}
    assert files == {"intel-cpu.icd": f"{prefix / 'lib' / 'libintelocl.so'}\n", "nvidia.icd": "libnvidia-opencl.so.1\n"}
    (system / "nvidia.icd").unlink()  # the system's set changed: the copy goes too
    assert icd.use_installed_runtimes({}, str(prefix), system) == folder
    assert [f.name for f in folder.iterdir()] == ["intel-cpu.icd"]
    chosen = {"OCL_ICD_VENDORS": "/the/users/choice"}
    assert icd.use_installed_runtimes(chosen, str(prefix), system) is None
    assert chosen == {"OCL_ICD_VENDORS": "/the/users/choice"}


LIST_PLATFORMS = "import pyopencl as cl; print([p.name.strip() for p in cl.get_platforms()])"


@pytest.mark.skipif(not icd.installed_runtimes(), reason="Intel's CPU OpenCL runtime is not installed in this "
                    "environment (scripts/setup.sh installs intel-opencl-rt and intel-cmplr-lib-rt)")
def test_intel_cpu_runtime_runs_beside_pocl():
    """Installed, it is a platform of every process that calls the helper first, with the features whose
    fast paths test_opencl_provider runs; a process that does not call it sees no Intel platform."""
    assert INTEL in PLATFORMS
    (intel,) = [p for p in cl.get_platforms() if p.name.strip() == INTEL]
    assert {"HAS_DP4A", "HAS_SUBGROUP_REDUCE", "HAS_F16"} <= set(device_features(intel.get_devices()[0]))
    env = {k: v for k, v in os.environ.items() if k != "OCL_ICD_VENDORS"}
    bare = subprocess.run([sys.executable, "-c", LIST_PLATFORMS], env=env, capture_output=True, text=True)
    assert bare.returncode == 0 and INTEL not in bare.stdout, bare.stdout + bare.stderr
    helped = subprocess.run([sys.executable, "-c", "from bitnet_opencl.icd import use_installed_runtimes; "
                             "use_installed_runtimes(); " + LIST_PLATFORMS], env=env, capture_output=True, text=True)
    assert helped.returncode == 0 and INTEL in helped.stdout, helped.stdout + helped.stderr
