"""Host-side structures both GPU plugins share: the handle core passes around, the device layout
of ternary weights the shared kernel source reads, the KV cache, and launch-size arithmetic.

A pool here is anything with `alloc(nbytes, tag, resident) -> buffer` and `free(buffer)`: each
plugin's BufferPool speaks its own driver and keeps the same statistics.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class Pool(Protocol):
    def alloc(self, nbytes: int, tag: str, resident: bool = False) -> Any: ...

    def free(self, buf: Any) -> None: ...


class Tensor:
    """A device array: the opaque handle core passes around. Its buffer returns to the pool when the
    handle is dropped; `resident` ones (weights, tables, caches) are not activations and never leak."""

    def __init__(self, pool: Pool, shape: tuple[int, ...], dtype: Any, tag: str,
                 resident: bool = False) -> None:
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.buf = pool.alloc(math.prod(self.shape) * self.dtype.itemsize, tag, resident)
        self._free = weakref.finalize(self, pool.free, self.buf)

    def release(self) -> None:
        """Give the buffer back now rather than when the handle is dropped (once; later calls do nothing)."""
        self._free()


@dataclass(frozen=True)
class TernaryWeight:
    """Device layout: the canonical 2-bit codes, unchanged, read as 32-bit words (16 per 256-block).
    Masking one 2-bit plane of a word gives four codes that meet four consecutive int8 activations,
    one dp4a; the per-block float32 scales stay as they are."""

    codes: Tensor  # uint32 [rows, cols // 16]
    scales: Tensor  # float32 [rows, cols // 256]
    rows: int
    cols: int


@dataclass
class KVCache:
    k: Tensor  # float32 [n_layers, n_kv_heads, n_ctx, head_dim]
    v: Tensor
    n_kv_heads: int
    n_ctx: int
    head_dim: int
    filled: list[int]  # per layer: positions 0..filled-1 hold K and V


def pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def groups(count: int, per_group: int) -> int:
    return -(-count // per_group)
