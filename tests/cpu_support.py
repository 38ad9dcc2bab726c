"""What the CPU plugin's kernel tests share: a provider per thread count and level, the NumPy reference, and
how their results compare."""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import pytest

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
