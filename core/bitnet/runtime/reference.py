"""The plain NumPy kernel provider: every operation written straight from docs/design.md section 4.

This is the oracle the conformance kit compares other backends against, so it favours
clarity over speed (but stays vectorized). Handles are NumPy arrays. Quantization follows
the float32 arithmetic the spec prescribes, so that rounding decisions match what a device
computes; everything after the exact integer sums is accumulated in float64 and returned as
float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bitnet.errors import UsageError
from bitnet.modelfile.ternary import BLOCK, TernaryMatrix, zero_extend
from bitnet.runtime.provider import ACT_QUANT_MODES, ACTIVATIONS, Q8_ROW_BYTES, KernelProvider


@dataclass
class KVCache:
    """K and V of every layer and sequence slot: [n_layers, n_seqs, n_ctx, n_kv_heads, head_dim] each, float32
    or float16 (a kv_type "f16" cache: stores round to it); a "q8" cache's rows are `q8_kv_rows`, int8."""

    k: np.ndarray
    v: np.ndarray

    @property
    def n_seqs(self) -> int:
        return int(self.k.shape[1])

    @property
    def n_ctx(self) -> int:
        return int(self.k.shape[2])


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BitNet b1.58 per-row int8 quantization of float32 [n, cols].

    Returns q (float32 holding integers in [-128, 127]) and s (float32 [n]) with x ~ q / s.
    An all-zero row gets s = 1 so that q = 0 and the division stays finite.
    """
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=1)
    s = np.float32(127.0) / np.where(amax > 0, amax, np.float32(127.0)).astype(np.float32)
    q = np.clip(np.rint(x * s[:, None]), -128, 127).astype(np.float32)
    return q, s


def quantize_q8k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's Q8_K quantization of float32 [n, cols] per 256-value block.

    Returns q (float32 integers, [n, cols // 256, 256]) and d (float32 [n, cols // 256]) with
    x ~ q * d. v is the first value of largest magnitude; iscale = -127 / v; d = 1 / iscale.
    An all-zero block gets q = 0, d = 0 (as llama.cpp does).
    """
    x = np.asarray(x, dtype=np.float32)
    n, cols = x.shape
    xb = x.reshape(n, cols // BLOCK, BLOCK)
    at = np.argmax(np.abs(xb), axis=2)  # first index on ties, like llama.cpp's strict ">"
    v = np.take_along_axis(xb, at[:, :, None], axis=2)[:, :, 0]
    nonzero = v != 0
    iscale = np.where(nonzero, np.float32(-127.0) / np.where(nonzero, v, np.float32(1.0)), np.float32(0.0))
    iscale = iscale.astype(np.float32)
    q = np.clip(np.rint(xb * iscale[:, :, None]), -128, 127).astype(np.float32)
    d = np.where(nonzero, np.float32(1.0) / np.where(nonzero, iscale, np.float32(1.0)), np.float32(0.0))
    return q, d.astype(np.float32)


@dataclass(frozen=True)
class Q8Table:
    """An int8 LM head (docs/design.md section 4): row r of the float table ~ q[r] * scale[r]."""

    q: np.ndarray  # int8 [vocab, dim], in [-127, 127]
    scale: np.ndarray  # float32 [vocab]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)


def q8_table(table: np.ndarray) -> Q8Table:
    """The int8 copy of a float [vocab, dim] LM-head table, built at load: per row, the BitNet
    activation rule (quantize_rows), so q = clamp(rint(w * s)) with s = 127/max|w| and scale = 1/s.

    One scale per row, not per 32-value block like Q8_0: on the synthetic 2B-4T model per-block
    scales on both sides gave 2.5x less KL divergence from the F16 head (1.2e-4 vs 3.0e-4 nats, the
    same 98.4 % top-1), but their per-block float epilogue, in the fixed order that keeps results
    bit-exact, made the numba head 6x slower at batch 1 and 10x slower at batch 8.
    """
    from bitnet.modelfile.model import release_pages

    vocab = table.shape[0]
    q, scale = np.empty(table.shape, np.int8), np.empty(vocab, np.float32)
    step = 4096  # bounds the float32 temporaries of an F16 table of 128k rows
    for lo in range(0, vocab, step):
        qc, s = quantize_rows(table[lo:lo + step])
        q[lo:lo + step], scale[lo:lo + step] = qc, np.float32(1.0) / s
        release_pages(table[lo:lo + step])  # a mapped table: its float pages are spent
    return Q8Table(q, scale)


def block_sums(q: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Exact integer dot products per 256-block: q [n, nb, 256] with t [rows, nb, 256] -> [n, rows, nb].

    Done as float32 BLAS: every product and partial sum is an integer of magnitude at most
    128 * 256 < 2**24, so float32 represents each one exactly and the order does not matter.
    """
    sums = np.matmul(q.transpose(1, 0, 2), t.astype(np.float32).transpose(1, 2, 0))  # [nb, n, rows]
    return sums.transpose(1, 2, 0)


class ReferenceProvider(KernelProvider):
    """NumPy on the host; kernel names are recorded as `<prefix>.<op>` (prefix "ref")."""

    prefix = "ref"

    def __init__(self, device: Any = None, backend: str = "reference") -> None:
        super().__init__(backend, device)

    # -- memory -----------------------------------------------------------------------------
    def upload_ternary(self, w: TernaryMatrix) -> Any:
        return w

    def upload_float(self, a: np.ndarray) -> Any:
        # Keeps an mmap'd table as a view: on the host, the page cache is the resident copy.
        return np.asarray(a)

    def to_host(self, x: Any) -> np.ndarray:
        return np.array(x, dtype=np.float32)

    # -- operations -----------------------------------------------------------------------------
    def embed(self, table: Any, ids: np.ndarray) -> Any:
        self.record(f"{self.prefix}.embed")
        return np.asarray(table[np.asarray(ids, dtype=np.int64)], dtype=np.float32)

    def rmsnorm(self, x: Any, w: Any, eps: float) -> Any:
        self.record(f"{self.prefix}.rmsnorm")
        x64 = np.asarray(x, dtype=np.float64)
        inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps)
        return (x64 * inv * np.asarray(w, dtype=np.float64)).astype(np.float32)

    def bitlinear(self, x: Any, w: Any, act_quant: str) -> Any:
        self.record(f"{self.prefix}.bitlinear")
        check_act_quant(act_quant)
        x = zero_extend(np.asarray(x, dtype=np.float32), w.cols)  # widths that are not whole blocks
        n, nb = x.shape[0], w.cols // BLOCK
        t = w.values().reshape(w.rows, nb, BLOCK)
        scales = w.scales.astype(np.float64)
        if act_quant == "none":
            y = x.astype(np.float64) @ (t.astype(np.float64) * scales[:, :, None]).reshape(w.rows, w.cols).T
        elif act_quant == "row":
            q, s = quantize_rows(x)
            isum = block_sums(q.reshape(n, nb, BLOCK), t).astype(np.float64)
            y = np.einsum("nrb,rb->nr", isum, scales) / s.astype(np.float64)[:, None]
        else:
            q, d = quantize_q8k(x)
            isum = block_sums(q, t).astype(np.float64)
            y = np.einsum("nrb,rb,nb->nr", isum, scales, d.astype(np.float64))
        return y.astype(np.float32)

    def rope(self, x: Any, n_heads: int, head_dim: int, positions: np.ndarray, theta: float) -> Any:
        self.record(f"{self.prefix}.rope")
        x = np.asarray(x, dtype=np.float64)
        n, half = x.shape[0], head_dim // 2
        cos, sin = rope_angles(positions, head_dim, theta)
        xh = x.reshape(n, n_heads, head_dim)
        x1, x2 = xh[:, :, :half], xh[:, :, half:]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=2)
        return out.reshape(n, n_heads * head_dim).astype(np.float32)

    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, slots: np.ndarray, positions: np.ndarray,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> Any:
        self.record(f"{self.prefix}.attention")
        store_kv(cache, layer, slots, positions, k, v, n_kv_heads, head_dim)
        group = n_heads // n_kv_heads
        q64 = np.asarray(q, dtype=np.float64)
        out = np.empty((q64.shape[0], n_heads * head_dim), np.float32)
        for i, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
            # Query head h reads KV head h // group (llama.cpp's broadcast order).
            qh = q64[i].reshape(n_kv_heads, group, head_dim)
            keys = kv_values(cache.k[layer, slot, :pos + 1])  # [T, n_kv, hd]
            vals = kv_values(cache.v[layer, slot, :pos + 1])
            scores = np.einsum("kgd,tkd->kgt", qh, keys) / np.sqrt(head_dim)
            p = np.exp(scores - scores.max(axis=2, keepdims=True))
            p /= p.sum(axis=2, keepdims=True)
            out[i] = np.einsum("kgt,tkd->kgd", p, vals).reshape(-1)
        return out

    def act_mul(self, gate: Any, up: Any, act: str) -> Any:
        self.record(f"{self.prefix}.act_mul")
        if act not in ACTIVATIONS:
            raise UsageError(f"unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        g = np.asarray(gate, dtype=np.float64)
        a = g / (1.0 + np.exp(-g)) if act == "silu" else np.square(np.maximum(g, 0.0))
        return (a * np.asarray(up, dtype=np.float64)).astype(np.float32)

    def add(self, a: Any, b: Any) -> Any:
        self.record(f"{self.prefix}.add")
        return (np.asarray(a, dtype=np.float32) + np.asarray(b, dtype=np.float32)).astype(np.float32)

    def rows(self, x: Any, index: np.ndarray) -> Any:
        self.record(f"{self.prefix}.rows")
        return np.array(np.asarray(x)[np.asarray(index, np.int64)], dtype=np.float32)

    def lm_head(self, x: Any, table: Any) -> Any:
        self.record(f"{self.prefix}.lm_head")
        x64 = np.asarray(x, dtype=np.float64)
        vocab = table.shape[0]
        out = np.empty((x64.shape[0], vocab), dtype=np.float32)
        step = 8192  # bounds the float64 copy of an F16 table of 128k rows
        for lo in range(0, vocab, step):
            out[:, lo:lo + step] = x64 @ np.asarray(table[lo:lo + step], dtype=np.float64).T
        return out

    def lm_head_q8(self, x: Any, table: Q8Table) -> Any:
        self.record(f"{self.prefix}.lm_head_q8")
        q, s = quantize_rows(x)
        q64, inv = q.astype(np.float64), s.astype(np.float64)[:, None]
        vocab = table.shape[0]
        out = np.empty((q.shape[0], vocab), dtype=np.float32)
        step = 8192
        for lo in range(0, vocab, step):
            # Integer products and partial sums below 2**53: float64 BLAS sums them exactly in any order.
            isum = q64 @ table.q[lo:lo + step].astype(np.float64).T
            out[:, lo:lo + step] = isum * table.scale[lo:lo + step].astype(np.float64) / inv
        return out

    def argmax(self, logits: Any) -> np.ndarray:
        self.record(f"{self.prefix}.argmax")
        return np.argmax(np.asarray(logits), axis=1).astype(np.int64)


def check_act_quant(act_quant: str) -> None:
    if act_quant not in ACT_QUANT_MODES:
        raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                         f"{', '.join(ACT_QUANT_MODES)}")


def rope_angles(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, float64 [n, head_dim // 2], of positions[i] * theta ** (-2j / head_dim)."""
    freqs = float(theta) ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * freqs[None, :]
    return np.cos(angles), np.sin(angles)


def check_slots(cache: KVCache, slots: np.ndarray, positions: np.ndarray, n: int) -> None:
    if len(slots) != n or len(positions) != n:
        raise UsageError(f"{n} rows need {n} slots and positions, got {len(slots)} and {len(positions)}")
    if not n:
        return
    # As lists: every layer checks a decode step's few rows, and four NumPy reductions took 14 us.
    s, p = np.asarray(slots).tolist(), np.asarray(positions).tolist()
    if not (0 <= min(s) and max(s) < cache.n_seqs):
        raise UsageError(f"sequence slot out of range 0..{cache.n_seqs - 1}")
    if not (0 <= min(p) and max(p) < cache.n_ctx):
        raise UsageError(f"position out of range 0..{cache.n_ctx - 1} (the context is {cache.n_ctx})")


def store_kv(cache: KVCache, layer: int, slots: np.ndarray, positions: np.ndarray, k: Any, v: Any,
             n_kv_heads: int, head_dim: int) -> None:
    n = k.shape[0]
    slots, positions = np.asarray(slots, np.int64), np.asarray(positions, np.int64)
    check_slots(cache, slots, positions, n)
    for dst, x in ((cache.k, k), (cache.v, v)):
        rows = np.asarray(x, dtype=np.float32).reshape(n, n_kv_heads, head_dim)
        dst[layer, slots, positions] = q8_kv_rows(rows) if dst.dtype == np.int8 else rows


def q8_kv_rows(x: np.ndarray) -> np.ndarray:
    """float32 rows [..., head_dim] as a q8 cache holds them, int8 [..., head_dim + Q8_ROW_BYTES]: each row's
    values quantized as BitNet quantizes activations (`quantize_rows`: q = rint(x * s), s = 127 / max|x|), then
    the bytes of its float32 scale d = 1 / s (x ~ q * d)."""
    hd = x.shape[-1]
    q, s = quantize_rows(x.reshape(-1, hd))
    rows = np.empty((len(q), hd + Q8_ROW_BYTES), np.int8)
    rows[:, :hd] = q
    rows[:, hd:] = (np.float32(1.0) / s).astype(np.float32)[:, None].view(np.int8)
    return rows.reshape(*x.shape[:-1], hd + Q8_ROW_BYTES)


def kv_values(rows: np.ndarray) -> np.ndarray:
    """What cache rows hold, float64 [..., head_dim]: a q8 row's int8 values times its scale."""
    if rows.dtype != np.int8:
        return rows.astype(np.float64)
    hd = rows.shape[-1] - Q8_ROW_BYTES
    d = np.ascontiguousarray(rows[..., hd:]).view(np.float32)  # [..., 1]
    return rows[..., :hd].astype(np.float64) * d
