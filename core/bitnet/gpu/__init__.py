"""The one portable GPU kernel source, shared by the OpenCL and CUDA plugins (docs/design.md section 6).

`bitnet_kernels.c` is written in the C subset OpenCL C and CUDA share; `vendor_<name>.h` spells the
rest (qualifiers, index macros, barriers, math names) for one vendor. Plugins compile
`source(vendor)` and launch kernels by the names the body defines.
"""

from __future__ import annotations

import re
from importlib.resources import files

VENDORS = ("opencl", "cuda")
BODY = "bitnet_kernels.c"


def source(vendor: str) -> str:
    """The vendor header followed by the kernel body, with #line marks so build logs name the file."""
    if vendor not in VENDORS:
        raise ValueError(f"unknown kernel vendor {vendor!r}; expected one of {', '.join(VENDORS)}")
    here = files(__name__)
    header = f"vendor_{vendor}.h"
    return (f'#line 1 "{header}"\n' + here.joinpath(header).read_text(encoding="utf-8")
            + f'\n#line 1 "{BODY}"\n' + here.joinpath(BODY).read_text(encoding="utf-8"))


def kernel_names(text: str) -> list[str]:
    """The kernels a source text declares (`KERNEL name(` at the start of a line), in order. A CUDA build
    exports every one; an OpenCL build skips those inside `#ifdef __CUDACC__`."""
    return re.findall(r"^KERNEL\s+(\w+)\s*\(", text, flags=re.M)
