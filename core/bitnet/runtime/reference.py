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
from bitnet.modelfile.ternary import BLOCK, TernaryMatrix
from bitnet.runtime.provider import ACT_QUANT_MODES, ACTIVATIONS, KernelProvider


@dataclass
class KVCache:
    """K and V of every layer: float32 [n_layers, n_ctx, n_kv_heads, head_dim] each."""

    k: np.ndarray
    v: np.ndarray

    @property
    def n_ctx(self) -> int:
        return int(self.k.shape[1])


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

    def kv_cache(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int) -> Any:
        shape = (n_layers, n_ctx, n_kv_heads, head_dim)
        return KVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

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
        x = np.asarray(x, dtype=np.float32)
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

    def rope(self, x: Any, n_heads: int, head_dim: int, pos0: int, theta: float) -> Any:
        self.record(f"{self.prefix}.rope")
        x = np.asarray(x, dtype=np.float64)
        n, half = x.shape[0], head_dim // 2
        cos, sin = rope_angles(pos0, n, head_dim, theta)
        xh = x.reshape(n, n_heads, head_dim)
        x1, x2 = xh[:, :, :half], xh[:, :, half:]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=2)
        return out.reshape(n, n_heads * head_dim).astype(np.float32)

    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, pos0: int,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> Any:
        self.record(f"{self.prefix}.attention")
        n = q.shape[0]
        store_kv(cache, layer, pos0, k, v, n_kv_heads, head_dim)
        total = pos0 + n
        group = n_heads // n_kv_heads
        # Query head h reads KV head h // group (llama.cpp's broadcast order).
        qh = np.asarray(q, dtype=np.float64).reshape(n, n_kv_heads, group, head_dim)
        keys = cache.k[layer, :total].astype(np.float64)  # [T, n_kv, hd]
        vals = cache.v[layer, :total].astype(np.float64)
        scores = np.einsum("nkgd,tkd->nkgt", qh, keys) / np.sqrt(head_dim)
        scores = np.where(causal_mask(pos0, n, total)[:, None, None, :], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=3, keepdims=True))
        p /= p.sum(axis=3, keepdims=True)
        out = np.einsum("nkgt,tkd->nkgd", p, vals)
        return out.reshape(n, n_heads * head_dim).astype(np.float32)

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

    def last_row(self, x: Any) -> Any:
        self.record(f"{self.prefix}.last_row")
        return np.array(x[-1:], dtype=np.float32)

    def lm_head(self, x: Any, table: Any) -> Any:
        self.record(f"{self.prefix}.lm_head")
        x64 = np.asarray(x, dtype=np.float64)
        vocab = table.shape[0]
        out = np.empty((x64.shape[0], vocab), dtype=np.float32)
        step = 8192  # bounds the float64 copy of an F16 table of 128k rows
        for lo in range(0, vocab, step):
            out[:, lo:lo + step] = x64 @ np.asarray(table[lo:lo + step], dtype=np.float64).T
        return out

    def argmax(self, logits: Any) -> np.ndarray:
        self.record(f"{self.prefix}.argmax")
        return np.argmax(np.asarray(logits), axis=1).astype(np.int64)


def check_act_quant(act_quant: str) -> None:
    if act_quant not in ACT_QUANT_MODES:
        raise UsageError(f"unknown activation quantization {act_quant!r}; expected one of "
                         f"{', '.join(ACT_QUANT_MODES)}")


def rope_angles(pos0: int, n: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, float64 [n, head_dim // 2], of (pos0 + i) * theta ** (-2j / head_dim)."""
    freqs = float(theta) ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    angles = np.arange(pos0, pos0 + n, dtype=np.float64)[:, None] * freqs[None, :]
    return np.cos(angles), np.sin(angles)


def causal_mask(pos0: int, n: int, total: int) -> np.ndarray:
    """bool [n, total]: row i (position pos0 + i) may read positions 0..pos0 + i."""
    return np.arange(total)[None, :] <= (pos0 + np.arange(n))[:, None]


def store_kv(cache: KVCache, layer: int, pos0: int, k: Any, v: Any, n_kv_heads: int, head_dim: int) -> None:
    n = k.shape[0]
    if pos0 + n > cache.n_ctx:
        raise UsageError(f"positions {pos0}..{pos0 + n - 1} exceed the context of {cache.n_ctx}")
    cache.k[layer, pos0:pos0 + n] = np.asarray(k, dtype=np.float32).reshape(n, n_kv_heads, head_dim)
    cache.v[layer, pos0:pos0 + n] = np.asarray(v, dtype=np.float32).reshape(n, n_kv_heads, head_dim)
