"""Operations a backend does not implement run on the host CPU through the NumPy reference.

A provider class overrides the operations it has kernels for (`bitlinear` at least); calls to
the others reach KernelProvider's defaults, which land here. Each call is counted in the
provider's `fallbacks` with its reason before it runs: receipts list it, `receipt verify
--max-fallbacks` bounds it, and BITNET_STRICT_MODE=1 refuses it. A provider that implements
every operation never reaches this module: core calls its own methods directly.

Only activations cross between the sides, through the provider's `to_host` and `from_host`.
A weight read by a fallback operation stays the host array it was in the model (a view of
the mapped file, `place_weight`), and the KV cache lives on the side that runs attention
(`kv_cache_for`): nothing large is copied per call, and the LM head never comes back from
a device.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np

from bitnet.errors import NoBackendError, UsageError
from bitnet.plugins.registry import env_flag
from bitnet.runtime.provider import KV_DTYPES, OPERATIONS, KernelProvider, native_operations
from bitnet.runtime.reference import ReferenceProvider

# How many leading arguments of each operation are activation handles; the rest (weights,
# the KV cache, token ids, numbers) are already where the reference reads them.
HANDLE_ARGS = {"embed": 0, "rmsnorm": 1, "rope": 1, "attention": 3, "act_mul": 2, "add": 2, "rows": 1,
               "lm_head": 1, "lm_head_q8": 1, "argmax": 1}


def not_implemented(backend: str) -> str:
    return f"not implemented by backend {backend!r}"


def run_on_host(provider: KernelProvider, op: str, args: Sequence[Any]) -> Any:
    """Count a fallback of `op`, then run it on the reference; the result returns as a handle
    (argmax's result is host indices anyway)."""
    provider.record_fallback(op, not_implemented(provider.backend))
    n = HANDLE_ARGS[op]
    out = getattr(host_reference(provider), op)(*(provider.to_host(a) for a in args[:n]), *args[n:])
    return out if op == "argmax" else provider.from_host(out)


def host_reference(provider: KernelProvider) -> ReferenceProvider:
    """The reference that runs this provider's fallbacks. Its own dispatch counter stays apart:
    the provider's kernel list is what ran on the device, its fallbacks what ran here."""
    ref = getattr(provider, "_host_reference", None)
    if ref is None:
        ref = ReferenceProvider(provider.device, backend=f"{provider.backend} (host fallback)")
        provider._host_reference = ref  # type: ignore[attr-defined]
    return ref


def place_weight(provider: KernelProvider, op: str, a: np.ndarray) -> Any:
    """A float weight read by `op`: uploaded when the provider runs `op`, else the host array itself.
    For lm_head_q8, the int8 copy of the table, built by that side."""
    if op == "lm_head_q8":
        return (provider if op in native_operations(provider) else host_reference(provider)).upload_q8(a)
    return provider.upload_float(a) if op in native_operations(provider) else a


def kv_cache_for(provider: KernelProvider, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int,
                 n_seqs: int = 1, kv_type: str = "f32") -> Any:
    """The KV cache, allocated by the side that runs attention."""
    owner = provider if "attention" in native_operations(provider) else host_reference(provider)
    if kv_type == "f32":
        return owner.kv_cache(n_layers, n_ctx, n_kv_heads, head_dim, n_seqs)
    if "kv_type" not in inspect.signature(owner.kv_cache).parameters:  # written before kv_type existed
        raise UsageError(f"the {provider.backend} backend keeps its KV cache in f32 only: kv_type {kv_type!r} "
                         "is not available there")
    try:
        return owner.kv_cache(n_layers, n_ctx, n_kv_heads, head_dim, n_seqs, kv_type=kv_type)
    except KeyError as exc:
        if kv_type in KV_DTYPES:
            raise
        # A provider that looks kv_type up in KV_DTYPES, written before q8 existed.
        raise UsageError(f"the {provider.backend} backend does not offer kv_type {kv_type!r}") from exc


def refuse_in_strict_mode(backend: str, ops: Sequence[str], reason: str) -> None:
    """NoBackendError (exit 3) naming the operations and the backend, if BITNET_STRICT_MODE=1."""
    if ops and env_flag("BITNET_STRICT_MODE"):
        raise NoBackendError(f"BITNET_STRICT_MODE=1 forbids CPU fallback: backend {backend!r} would run "
                             f"{', '.join(ops)} on the host ({reason})")


def refuse_partial_in_strict_mode(provider: KernelProvider, ops: Sequence[str] = OPERATIONS) -> None:
    """The load-time check: under strict mode a backend that lacks one of `ops` (what the model will
    run) fails before any compute."""
    missing = [op for op in ops if op not in native_operations(provider)]
    refuse_in_strict_mode(provider.backend, missing, not_implemented(provider.backend))
