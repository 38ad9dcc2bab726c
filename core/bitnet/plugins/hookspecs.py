"""The pluggy hook specifications plugins implement (project name "bitnet").

A plugin is any object or module with functions decorated by `bitnet.hookimpl`, exposed
through the entry-point group `bitnet.backends`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from bitnet.plugins.types import Backend

hookspec = pluggy.HookspecMarker("bitnet")


@hookspec
def bitnet_backends() -> Sequence[Backend]:
    """Return the backends this plugin provides.

    Each Backend gives a unique name, aliases, a kind ("gpu", "cpu" or another word), an
    integer priority (cpu 10, opencl 50, cuda 100; higher wins), a cheap `probe()` and
    `open(device)`. Called once per discovery; must not touch devices (that is `probe`'s job)
    and should import nothing heavy (pyopencl, pycuda, kernels) at module import time.
    """


@hookspec
def bitnet_resolve_request(token: str, backends: Sequence[Backend]) -> Sequence[str] | None:
    """Claim a request token core does not know.

    `token` is one element of a request, lower-cased, without a `:index` suffix (for
    `oneapi:1` the token is `oneapi`). Core first matches backend names and aliases; for any
    other token every plugin is asked. Return the names of the backends the token means, in
    order of preference, or None if the token is not yours. `backends` lists every
    installed backend.
    """
