"""The one portable GPU kernel source and the host layer every GPU plugin shares (docs/design.md section 6).

`bitnet_kernels.c` is written in the C subset OpenCL C and CUDA share; a vendor header spells the rest
(qualifiers, index macros, barriers, math names) and maps the feature macros (HAS_DP4A,
HAS_SUBGROUP_REDUCE, HAS_F16, HAS_WIDE_LOADS) to its built-ins. Two headers ship here; a third party
passes its own (HIP, Level Zero, Metal) to `source`. `host.GpuProvider` is the host
side: a plugin supplies allocate, free, copy, build and launch.
"""

from __future__ import annotations

import os
import re
from importlib.resources import files
from pathlib import Path

VENDORS = ("opencl", "cuda")
BODY = "bitnet_kernels.c"
TILE_N = 8  # tokens per matmul work-group (the kernel source's TILE_N): weights read once per tile
# Cap on work-group size: static local arrays are sized by it at build time, and the reductions gain
# nothing from larger groups. The device and each kernel may allow less.
MAX_LOCAL = 256


def source(vendor: str | os.PathLike[str]) -> str:
    """A bundled vendor's name ("opencl", "cuda"), a path to a header file, or a header's text, followed
    by the kernel body, with #line marks so that build logs name the file."""
    here = files(__name__)
    if isinstance(vendor, str) and vendor in VENDORS:
        name, header = f"vendor_{vendor}.h", here.joinpath(f"vendor_{vendor}.h").read_text(encoding="utf-8")
    elif isinstance(vendor, str) and "\n" in vendor:
        name, header = "vendor header", vendor
    elif Path(vendor).is_file():
        name, header = Path(vendor).name, Path(vendor).read_text(encoding="utf-8")
    else:
        raise ValueError(f"unknown kernel vendor {str(vendor)!r}: expected one of {', '.join(VENDORS)}, "
                         "a header file or a header's text")
    return (f'#line 1 "{name}"\n' + header
            + f'\n#line 1 "{BODY}"\n' + here.joinpath(BODY).read_text(encoding="utf-8"))


def build_options(max_local: int, features: tuple[str, ...] = ()) -> list[str]:
    """The -D options every vendor's compiler gets: the work-group cap, the token tile, and the feature
    macros the host found on the device (a vendor header may define more itself)."""
    return [f"-DMAX_WG={max_local}", f"-DTILE_N={TILE_N}", *(f"-D{f}=1" for f in features)]


def kernel_names(text: str) -> list[str]:
    """The kernels a source text declares (`KERNEL name(` at the start of a line), in order."""
    return re.findall(r"^KERNEL\s+(\w+)\s*\(", text, flags=re.M)
