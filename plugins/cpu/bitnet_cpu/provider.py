"""The CPU kernel provider: the reference operations, with the hot paths done faster in NumPy.

Ternary weights stay packed (2 bits each). BitLinear unpacks a chunk of rows at a time
through a 256-entry table into float32 and multiplies with BLAS; integer sums of int8
activations times ternary values are exact in float32 (each is below 2**24), so the result
equals the reference's integer arithmetic. Each kernel is one method, so a compiled
(numba) version can replace one method at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bitnet.reference import (
    ReferenceProvider,
    causal_mask,
    check_act_quant,
    quantize_q8k,
    quantize_rows,
    store_kv,
)
from bitnet.ternary import BLOCK, TernaryMatrix

# Byte -> its four 2-bit codes (low bits first) decoded to -1/0/+1. Each entry's four float32
# are viewed as one complex128, so unpacking is a 1-D np.take (several times faster than
# fancy-indexing a [256, 4] table).
_LUT = (((np.arange(256)[:, None] >> np.array([0, 2, 4, 6])) & 3) - 1).astype(np.float32)
_LUT16 = _LUT.view(np.complex128).reshape(256)

# Rows unpacked per chunk: about an L2 cache of float32 (measured best of 128 KB..4 MB at n = 1 and 128).
_CHUNK_BYTES = 512 << 10
_LM_HEAD_ROWS = 4096


@dataclass(frozen=True)
class PackedTernary:
    """A resident ternary projection: the canonical codes plus what the fast paths need."""

    codes: np.ndarray  # uint8 [rows, cols // 4]
    scales: np.ndarray  # float32 [rows, cols // 256]
    row_scales: np.ndarray | None  # float32 [rows] when every block of a row shares its scale

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def cols(self) -> int:
        return int(self.codes.shape[1]) * 4


def unpack_rows(codes: np.ndarray) -> np.ndarray:
    """float32 ternary values of `codes` [r, cols // 4] in *byte order* (see permute_cols)."""
    return np.take(_LUT16, codes).view(np.float32)


def permute_cols(x: np.ndarray) -> np.ndarray:
    """Reorder the columns of x [n, cols] to the byte order unpack_rows produces.

    Byte j of each 32-byte group holds values j, j+32, j+64, j+96 of its 128 columns, so the
    table lookup yields them in that order; permuting the few activation rows is far cheaper
    than transposing the unpacked weights. Each 256-block stays contiguous.
    """
    n, cols = x.shape
    return np.ascontiguousarray(x.reshape(n, cols // 128, 4, 32).transpose(0, 1, 3, 2)).reshape(n, cols)


class CpuProvider(ReferenceProvider):
    prefix = "cpu"

    def __init__(self, device: Any = None, backend: str = "cpu") -> None:
        super().__init__(device, backend)

    def upload_ternary(self, w: TernaryMatrix) -> Any:
        return PackedTernary(np.ascontiguousarray(w.codes), np.ascontiguousarray(w.scales, dtype=np.float32),
                             w.row_scales)

    def bitlinear(self, x: Any, w: Any, act_quant: str) -> Any:
        check_act_quant(act_quant)
        x = np.asarray(x, dtype=np.float32)
        n, nb = x.shape[0], w.cols // BLOCK
        if act_quant == "row":
            q, s = quantize_rows(x)
            a = permute_cols(q)
        elif act_quant == "block256":
            q, d = quantize_q8k(x)
            a = permute_cols(q.reshape(n, w.cols))
        else:
            a = permute_cols(x)
        rowwise = w.row_scales is not None and act_quant != "block256"
        self.record(f"cpu.bitlinear_{'rowscale' if rowwise else 'blockscale'}_{act_quant}")
        y = np.empty((n, w.rows), dtype=np.float32)
        step = max(1, _CHUNK_BYTES // (4 * w.cols))
        for lo in range(0, w.rows, step):
            hi = min(lo + step, w.rows)
            t = unpack_rows(w.codes[lo:hi])
            if rowwise:
                y[:, lo:hi] = (a @ t.T) * w.row_scales[lo:hi]
                continue
            # Per-block sums [nb, n, r]; integers (exact) unless act_quant is "none".
            sums = np.matmul(a.reshape(n, nb, BLOCK).transpose(1, 0, 2),
                             t.reshape(hi - lo, nb, BLOCK).transpose(1, 2, 0))
            if act_quant == "block256":
                sums *= d.T[:, :, None]
            y[:, lo:hi] = np.einsum("bnr,rb->nr", sums, w.scales[lo:hi])
        if act_quant == "row":
            y /= s[:, None]
        return y

    def lm_head(self, x: Any, table: Any) -> Any:
        x = np.asarray(x, dtype=np.float32)
        if table.dtype == np.float32:
            self.record("cpu.lm_head_f32")
            return x @ table.T
        self.record("cpu.lm_head_f16" if table.dtype == np.float16 else f"cpu.lm_head_{table.dtype.name}")
        vocab = table.shape[0]
        out = np.empty((x.shape[0], vocab), dtype=np.float32)
        for lo in range(0, vocab, _LM_HEAD_ROWS):
            out[:, lo:lo + _LM_HEAD_ROWS] = x @ table[lo:lo + _LM_HEAD_ROWS].astype(np.float32).T
        return out

    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, pos0: int,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> Any:
        self.record("cpu.attention")
        n = q.shape[0]
        store_kv(cache, layer, pos0, k, v, n_kv_heads, head_dim)
        total, group = pos0 + n, n_heads // n_kv_heads
        # One batched matmul per KV head, its query heads and rows stacked: [n_kv, group * n, hd].
        qh = np.asarray(q, dtype=np.float32).reshape(n, n_kv_heads, group, head_dim)
        qh = qh.transpose(1, 2, 0, 3).reshape(n_kv_heads, group * n, head_dim)
        keys = cache.k[layer, :total].transpose(1, 2, 0)  # [n_kv, hd, T]
        vals = cache.v[layer, :total].transpose(1, 0, 2)  # [n_kv, T, hd]
        scores = (qh @ keys) * np.float32(1.0 / np.sqrt(head_dim))
        scores = scores.reshape(n_kv_heads, group, n, total)
        scores[:, :, ~causal_mask(pos0, n, total)] = -np.inf
        scores -= scores.max(axis=3, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=3, keepdims=True)
        out = p.reshape(n_kv_heads, group * n, total) @ vals  # [n_kv, group * n, hd]
        out = out.reshape(n_kv_heads, group, n, head_dim).transpose(2, 0, 1, 3)
        return out.reshape(n, n_heads * head_dim)
