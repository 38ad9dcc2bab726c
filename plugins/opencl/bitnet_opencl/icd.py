"""OpenCL runtimes installed from PyPI into this Python environment, made visible to the ICD loader.

Intel's CPU runtime (`pip install intel-opencl-rt`) puts `libintelocl.so` in `<prefix>/lib`, but the ICD
file it ships names a placeholder path, so no loader finds it. The loader in pyopencl's wheel (ocl-icd)
reads the ICD files of one folder, `OCL_ICD_VENDORS` if set, else /etc/OpenCL/vendors, and besides them
the PoCL of `pyopencl[pocl]`; it reads the variable once, at the first OpenCL call of a process (no
LD_LIBRARY_PATH is needed: libintelocl.so finds its libraries beside itself). So, before that call, a
folder of our own gets an ICD file naming the real library plus copies of the system's ICD files (which
the variable would otherwise hide), and `OCL_ICD_VENDORS` points at it. A variable the user set is left
as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

ENV = "OCL_ICD_VENDORS"
SYSTEM_VENDORS = Path("/etc/OpenCL/vendors")
# (ICD file name, library under <prefix>/lib) of the runtimes a wheel can bring.
RUNTIMES = (("intel-cpu.icd", "libintelocl.so"),)


def installed_runtimes(prefix: str = sys.prefix) -> dict[str, Path]:
    """ICD file name -> library, for each runtime present in the environment at `prefix`."""
    lib = Path(prefix) / "lib"
    return {icd: lib / name for icd, name in RUNTIMES if (lib / name).is_file()}


def vendors_dir(prefix: str = sys.prefix) -> Path:
    return Path(prefix) / "etc" / "OpenCL" / "bitnet-vendors"


def _write(path: Path, text: str) -> None:
    """Atomically, and only when different: parallel processes may write the same file."""
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def use_installed_runtimes(environ: MutableMapping[str, str] = os.environ, prefix: str = sys.prefix,
                           system: Path = SYSTEM_VENDORS) -> Path | None:
    """Point OCL_ICD_VENDORS at a folder naming the runtimes installed here and the system's; the folder,
    or None when there is nothing to add or the user chose the variable."""
    runtimes = installed_runtimes(prefix)
    if ENV in environ or not runtimes:
        return None
    folder = vendors_dir(prefix)
    folder.mkdir(parents=True, exist_ok=True)
    wanted = {icd.name: icd.read_text() for icd in sorted(system.glob("*.icd"))} if system.is_dir() else {}
    wanted |= {icd: f"{lib}\n" for icd, lib in runtimes.items()}
    for name, text in wanted.items():
        _write(folder / name, text)
    for stale in folder.glob("*.icd"):
        if stale.name not in wanted:
            stale.unlink(missing_ok=True)
    environ[ENV] = str(folder)
    return folder
