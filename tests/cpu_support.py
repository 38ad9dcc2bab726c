"""What the CPU plugin's kernel tests share: a provider per thread count and level, the NumPy reference, how
their results compare, and random ternary weights in the file layouts."""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import pytest

from bitnet.modelfile.ternary import BLOCK, TernaryMatrix, from_values, reverse_fields
from bitnet.runtime.reference import ReferenceProvider
from bitnet_cpu.provider import CpuProvider

REF = ReferenceProvider()


def provider(threads: int, level: str | None = None) -> CpuProvider:
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"numba runs at most {numba.config.NUMBA_NUM_THREADS} threads here")
    return CpuProvider(n_threads=threads, isa=level)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))


def one_by_one(op: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """op's results for each row of x alone (batch invariance: they must equal op(x))."""
    return np.concatenate([op(x[i:i + 1]) for i in range(x.shape[0])])


def rows_at(slot: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence slots and positions of n consecutive rows of one sequence."""
    return np.full(n, slot, np.int32), np.arange(start, start + n, dtype=np.int32)


def ternary(rng: np.random.Generator, rows: int, cols: int, block_scales: bool,
            unit: bool = False) -> TernaryMatrix:
    """A random ternary matrix: one scale (unit: 1.0), a scale per 256-block or a scale per row."""
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    if unit:
        scale = np.float32(1.0)
    elif block_scales:
        scale = rng.uniform(0.5, 2.0, size=(rows, cols // BLOCK)).astype(np.float32)
    else:
        scale = rng.uniform(0.5, 2.0, size=rows).astype(np.float32)
    return from_values(t, scale)


def file_layout(rng: np.random.Generator, w: TernaryMatrix, layout: str) -> TernaryMatrix:
    """w's codes as a model file holds them: TQ2_0 blocks of 64 code bytes then 2 scale bytes (random
    here, so a kernel that ignored the block stride would read them as codes), or I2_S bytes with
    their four codes in reverse order."""
    if layout == "tq2_0":
        raw = rng.integers(0, 256, (w.rows, w.cols // BLOCK, 66), dtype=np.uint8)
        raw[:, :, :64] = w.blocks()
        return TernaryMatrix(raw[:, :, :64], w.scales)
    return TernaryMatrix(reverse_fields(w.packed()), w.scales, fields_reversed=True)
