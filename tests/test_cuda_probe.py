"""The CUDA probe's failure paths, end to end through `bitnet-select`.

Here pycuda is really absent. The other situations a user meets (pycuda present but no driver, cuInit
failing, no device) are arranged with a fake `pycuda` package first on PYTHONPATH of a fresh process,
and one fake with a device shows the same path succeeding. A fake libcuda.so.1 (built with the C
compiler) shows the cuInit code and name coming from the driver itself.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bitnet_cuda import probe as cuda_probe
from conftest import cli_env, run_cli

ROOT = Path(__file__).resolve().parent.parent

DRIVER_OK = """
class Error(Exception):
    pass

class device_attribute:
    MULTIPROCESSOR_COUNT, MAX_THREADS_PER_BLOCK, MAX_SHARED_MEMORY_PER_BLOCK = "sm", "threads", "shared"

class Context:
    def push(self):
        pass

    @staticmethod
    def pop():
        pass

COUNT = 1

class Device:
    @staticmethod
    def count():
        return COUNT

    def __init__(self, i):
        self.i = i

    def compute_capability(self):
        return (8, 6)

    def name(self):
        return "Fake RTX"

    def get_attributes(self):
        return {"sm": 46, "threads": 1024, "shared": 49152}

    def retain_primary_context(self):
        return Context()

def init():
    pass

def mem_get_info():
    return (7 << 30, 8 << 30)

def get_driver_version():
    return 12040

def get_version():
    return (12, 4, 0)
"""

FAKES = {
    "absent": ("__init__.py", 'raise ModuleNotFoundError("No module named \'pycuda\'", name="pycuda")\n'),
    "no-libcuda": ("driver.py", 'raise ImportError("libcuda.so.1: cannot open shared object file: '
                                'No such file or directory")\n'),
    "cuinit": ("driver.py", DRIVER_OK + '\ndef init():\n    raise Error("cuInit failed: '
                                        'no CUDA-capable device is detected")\n'),
    "cuinit-unknown": ("driver.py", DRIVER_OK + '\ndef init():\n'
                                                '    raise Error("cuInit failed: unknown error")\n'),
    "zero": ("driver.py", DRIVER_OK + "\nCOUNT = 0\n"),
    "one-device": ("driver.py", DRIVER_OK),
}
REASONS = {
    "absent": "pycuda is not installed",
    "no-libcuda": "libcuda not found (no NVIDIA driver): libcuda.so.1: cannot open shared object file",
    "cuinit": "cuInit failed with CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected",
    "cuinit-unknown": "cuInit failed with CUDA_ERROR_UNKNOWN (999): unknown error",
    "zero": "the CUDA driver reports zero devices",
}


def fake_env(tmp_path: Path, kind: str, **extra: str) -> dict[str, str]:
    """Environment of a process whose `import pycuda` finds the fake `kind`."""
    pkg = tmp_path / kind / "pycuda"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    name, text = FAKES[kind]
    (pkg / name).write_text(text)
    env = cli_env(PYTHONPATH=str(pkg.parent), **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def summary(stdout: str) -> dict[str, str]:
    m = re.fullmatch(r"requested=(\S+) detected=\[(\S*)\] selected=(\S+)", stdout.strip())
    assert m, stdout
    return {"requested": m[1], "detected": m[2], "selected": m[3]}


def test_pycuda_absent_here_is_the_reason(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pycuda", None)  # import fails as if not installed, even where it is
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    result = cuda_probe.probe()
    assert not result.devices and result.reason.startswith("pycuda is not installed")


def requirement_names(requirements: list[str]) -> list[str]:
    return [re.match(r"[A-Za-z0-9_.-]+", r)[0].lower() for r in requirements]


def test_pycuda_is_an_extra_and_the_reason_names_the_command_that_adds_it(monkeypatch):
    """`pip install ./plugins/cuda` installs without the CUDA toolkit (decided on purpose): pycuda is no
    hard dependency, neither in the pyproject nor in the installed distribution, and the probe's reason
    is the pip command whose extra brings it."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "plugins" / "cuda" / "pyproject.toml").read_text())["project"]
    assert "pycuda" not in requirement_names(project["dependencies"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    reason = cuda_probe.probe().reason
    m = re.search(r'\(pip install "bitnet-cuda\[(\w+)\]";', reason)
    assert m, reason
    assert "pycuda" in requirement_names(project["optional-dependencies"][m[1]])
    installed = importlib.metadata.requires("bitnet-cuda") or []
    assert [r for r in installed if r.startswith("pycuda") and f'extra == "{m[1]}"' not in r] == []


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_device_cuda_exits_3_with_the_reason(tmp_path, kind):
    r = run_cli("--device", "cuda", env=fake_env(tmp_path, kind))
    assert r.returncode == 3, r.stderr
    assert summary(r.stdout)["selected"] == "none"
    assert REASONS[kind] in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", ["absent", "cuinit"])
def test_auto_selects_the_next_backend_and_devices_shows_the_reason(tmp_path, kind):
    env = fake_env(tmp_path, kind)
    r = run_cli(env=env)
    assert r.returncode == 0, r.stderr
    s = summary(r.stdout)
    # Which of the others auto takes is the ranking's business (tests/test_selection.py).
    assert "cuda" not in s["detected"].split(",") and s["selected"] in s["detected"].split(",")
    listing = run_cli("devices", env=env)
    assert listing.returncode == 0
    (line,) = [ln for ln in listing.stdout.splitlines() if ln.split()[1:2] == ["cuda"]]
    assert f"unavailable: {REASONS[kind]}" in line
    (entry,) = [e for e in json.loads(run_cli("devices", "--json", env=env).stdout) if e["backend"] == "cuda"]
    assert entry["available"] is False and entry["reason"].startswith(REASONS[kind])


def test_a_fake_device_is_found_and_auto_picks_cuda(tmp_path):
    """The positive control: the same fakes with a device, so the failures above are the probe's."""
    env = fake_env(tmp_path, "one-device")
    assert summary(run_cli(env=env).stdout)["selected"] == "cuda"
    (entry,) = [e for e in json.loads(run_cli("devices", "--json", env=env).stdout) if e["backend"] == "cuda"]
    d = entry["device"]
    assert (d["name"], d["compute_capability"], d["fp16"], d["bf16"], d["memory_bytes"]) == \
        ("Fake RTX", "8.6", True, True, 8 << 30)
    assert d["properties"] == {"free_memory_bytes": 7 << 30, "sm_count": 46, "max_threads_per_block": 1024,
                               "shared_memory_per_block": 49152, "tensor_cores": True,
                               "driver_version": "12.4", "runtime_version": "12.4.0"}


@pytest.mark.parametrize("visible", ["", "-1"])
def test_cuda_visible_devices_hides_every_device(tmp_path, visible):
    r = run_cli("--device", "cuda", env=fake_env(tmp_path, "one-device", CUDA_VISIBLE_DEVICES=visible))
    assert r.returncode == 3
    assert f"CUDA_VISIBLE_DEVICES={visible!r} hides every device" in r.stderr


FAKE_LIBCUDA = r"""
static const char *no_device = "CUDA_ERROR_NO_DEVICE";
int cuInit(unsigned int flags) { return 100; }
int cuGetErrorName(int code, const char **name) { *name = no_device; return 0; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a fake libcuda.so.1")
def test_cuinit_code_and_name_come_from_the_driver(tmp_path):
    """pycuda's error says only "unknown error"; the driver, asked directly, names the real cause."""
    src = tmp_path / "libcuda.c"
    src.write_text(FAKE_LIBCUDA)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(src)], check=True)
    env = fake_env(tmp_path, "cuinit-unknown", LD_LIBRARY_PATH=str(tmp_path))
    r = run_cli("--device", "cuda", env=env)
    assert r.returncode == 3
    assert "cuInit failed with CUDA_ERROR_NO_DEVICE (100): unknown error" in r.stderr


def test_probe_of_an_unexpected_driver_error_during_enumeration_is_a_reason(tmp_path):
    env = fake_env(tmp_path, "one-device")
    pkg = Path(env["PYTHONPATH"]) / "pycuda" / "driver.py"
    pkg.write_text(pkg.read_text() + textwrap.dedent("""
        def mem_get_info():
            raise Error("cuMemGetInfo failed: device busy")
    """))
    r = run_cli("--device", "cuda", env=env)
    assert r.returncode == 3 and "CUDA device query failed: cuMemGetInfo failed: device busy" in r.stderr
