"""The kernel-provider interface: what a backend implements so core's transformer runs on it.

The transformer (bitnet.runtime.transformer) is written once against this class. Handles returned by a
provider are opaque to core: a NumPy array for the CPU, a device buffer for a GPU. Weights
are uploaded once at load; activations stay as handles between operations; only `to_host`
and `argmax` bring data back, and each of them waits for exactly the work it reads.

Activations are 2-D: [n_tokens, width], float32 semantics. A batch's rows may belong to several
sequences: `rope` and `attention` take each row's position, and `attention` each row's sequence
slot in the KV cache (int32 host arrays). Every other operation is row by row, and must stay so
(batch invariance: a row's result never depends on the other rows). Every operation a provider
runs must be recorded with `self.record(kernel_name)` as it is dispatched: receipts list
these names, so they are evidence of what ran, never a fixed list.

Only `bitlinear` is required. Every other operation a provider class does not override runs
on the host CPU through the NumPy reference (bitnet.runtime.fallback), and each such call
is counted in `fallbacks` with its reason (docs/design.md section 2). The memory methods
default to host NumPy arrays, which is what a CPU backend wants; a device backend overrides
all five (`upload_ternary`, `upload_float`, `kv_cache`, `to_host`, `from_host`), and `upload_q8`
if it runs `lm_head_q8`. `upload_ternary_group` and `bitlinear_group` run projections that share an
input (Q, K, V; gate, up) together; by default they are a loop over `upload_ternary` and `bitlinear`.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bitnet.errors import UsageError
from bitnet.modelfile.ternary import TernaryMatrix

ACT_QUANT_MODES = ("row", "block256", "none")
ACTIVATIONS = ("silu", "relu2")
# The operations of a forward pass and of greedy sampling: what a provider may implement.
OPERATIONS = ("embed", "rmsnorm", "bitlinear", "rope", "attention", "act_mul", "add", "rows", "lm_head",
              "lm_head_q8", "argmax")
# The LM head a model runs with (docs/design.md section 4): its float table, or an int8 copy ("auto" picks).
LM_HEADS = ("f16", "q8", "auto")
# What the KV cache stores (docs/design.md section 4): float32, or F16 as llama.cpp keeps it by default; or "q8",
# each (position, KV head) row as int8 with its own scale (Q8_ROW_BYTES past the head_dim values).
KV_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}
KV_TYPES = (*KV_DTYPES, "q8")
Q8_ROW_BYTES = 4  # a q8 row's float32 scale d (value ~ int8 * d), after its int8 values


@dataclass
class LayerWeights:
    """One layer's weights as provider handles (sub-norms are None when a model lacks them)."""

    attn_norm: Any
    qkv: Any  # wq, wk, wv as one group (they read the same input)
    wo: Any
    attn_sub_norm: Any
    ffn_norm: Any
    gate_up: Any  # w_gate, w_up as one group
    w_down: Any
    ffn_sub_norm: Any


def kv_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed host array whose pages become resident as they are first written, 4 KB at a time.

    NumPy asks Linux for transparent huge pages on every array of 4 MB or more, so the first write to
    any 2 MB of it zeroes (and, when memory is fragmented, first compacts) all 2 MB. A KV cache is
    written a position at a time: a CPU cache keeps each KV head's positions together, so the first
    token touched every head's 2 MB and made the whole cache resident. For 2B-4T at 4096 positions
    (630 MB of float32 K and V) the first forward pass took 0.3-0.8 s longer on a 2-core Zen 3 EPYC
    and the resident set grew by the whole cache; attention over 4096 positions ran as fast on 4 KB
    pages. A private anonymous mapping without huge pages grows with the positions in use.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # (Windows: no flags; its allocator has no such pages)
        return np.zeros(shape, dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # also where huge pages are the default for every mapping
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype).reshape(shape)


def kv_array(shape: tuple[int, ...], kv_type: str) -> np.ndarray:
    """A zeroed K or V cache (kv_zeros) of `shape`, whose last axis is head_dim. A q8 cache holds each row as
    head_dim int8 values and then their float32 scale's Q8_ROW_BYTES bytes, as a GGUF block holds its scale with
    its values: one array a cache, whatever its type."""
    if kv_type == "q8":
        return kv_zeros((*shape[:-1], shape[-1] + Q8_ROW_BYTES), np.dtype(np.int8))
    return kv_zeros(shape, KV_DTYPES[kv_type])


def check_kv_type(kv_type: str) -> None:
    if kv_type not in KV_TYPES:
        raise UsageError(f"unknown KV cache type {kv_type!r}; expected one of {', '.join(KV_TYPES)}")


def kv_row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes of one (position, KV head) row of K or V in a kv_type cache."""
    return head_dim + Q8_ROW_BYTES if kv_type == "q8" else KV_DTYPES[kv_type].itemsize * head_dim


class KernelProvider(ABC):
    """One opened device of one backend."""

    def __init__(self, backend: str, device: Any) -> None:
        self.backend = backend
        self.device = device
        self.dispatches: Counter[str] = Counter()
        # (operation, reason) -> times an operation ran on the host CPU instead of this device.
        self.fallbacks: Counter[tuple[str, str]] = Counter()

    def record(self, kernel: str, count: int = 1) -> None:
        self.dispatches[kernel] += count

    def record_fallback(self, op: str, reason: str, count: int = 1) -> None:
        """Count one CPU fallback of `op`, as it happens: receipts report every one with its reason.

        Under BITNET_STRICT_MODE=1 it raises NoBackendError instead, before the host computes."""
        from bitnet.runtime.fallback import refuse_in_strict_mode

        refuse_in_strict_mode(self.backend, [op], reason)
        self.fallbacks[(op, reason)] += count

    # -- memory: host NumPy arrays unless overridden ----------------------------------------------
    def upload_ternary(self, w: TernaryMatrix) -> Any:
        """Make a ternary projection resident; repack to the device's layout here, once. A handle that reads
        codes of its own in place of the file's says so with an `own_codes` attribute (the memory-mapped arrays
        it reads, or none): the engine then faults those in at load instead of the file's codes."""
        return w

    def upload_ternary_group(self, ws: list[TernaryMatrix]) -> Any:
        """Make projections that read the same input resident as one group (Q, K, V; gate, up), for
        `bitlinear_group`. Override both to run a group in one dispatch."""
        return [self.upload_ternary(w) for w in ws]

    def uploaded(self) -> None:
        """Every weight of a model is resident (the transformer calls this once it placed them): a provider that
        keeps what it built from them for the next load (a cache on disk) may write it now."""
        return None

    def upload_float(self, a: np.ndarray) -> Any:
        """Make a float tensor resident (norm weights F32; embedding / LM head F16 or F32)."""
        # Keeps an mmap'd table as a view: on the host, the page cache is the resident copy.
        return np.asarray(a)

    def upload_q8(self, table: np.ndarray) -> Any:
        """Build the int8 copy of a float [vocab, dim] LM-head table (docs/design.md section 4) and make
        it resident: what lm_head_q8 reads. The table must equal the reference's, q8_table(table).
        On the host, q8_cache keeps it for the next load of the same file."""
        from bitnet.runtime import q8_cache
        from bitnet.runtime.reference import q8_table

        return q8_cache.table(np.asarray(table), q8_table)

    def kv_cache(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, n_seqs: int = 1,
                 kv_type: str = "f32") -> Any:
        """Allocate the K and V cache of every layer for n_seqs sequence slots of n_ctx positions each
        (used only if this provider runs attention). kv_type "f16" stores K and V rounded to F16 (to
        nearest even), "q8" each row as int8 with a scale (`kv_array`), and attention reads them back as they
        were stored; a provider that cannot says so with a UsageError, and one whose kv_cache has no kv_type
        parameter is taken to offer only f32."""
        from bitnet.runtime.reference import KVCache

        shape = (n_layers, n_seqs, n_ctx, n_kv_heads, head_dim)
        return KVCache(kv_array(shape, kv_type), kv_array(shape, kv_type))

    def to_host(self, x: Any) -> np.ndarray:
        """Copy an activation back as float32 [n, width], after the work that writes it."""
        return np.array(x, dtype=np.float32)

    def from_host(self, a: np.ndarray) -> Any:
        """An activation handle holding float32 [n, width] `a`: how a host fallback's result returns."""
        return a

    def close(self) -> None:  # noqa: B027 (optional: providers without device memory need nothing)
        """Release device memory. Idempotent."""

    # -- operations: only bitlinear is required -------------------------------------------------
    def _on_host(self, op: str, *args: Any) -> Any:
        from bitnet.runtime.fallback import run_on_host

        return run_on_host(self, op, args)

    def embed(self, table: Any, ids: np.ndarray) -> Any:
        """Rows `ids` (int32 [n]) of an uploaded [vocab, dim] table, as float32 [n, dim]."""
        return self._on_host("embed", table, ids)

    def rmsnorm(self, x: Any, w: Any, eps: float) -> Any:
        """x / sqrt(mean(x^2) + eps) * w, per row."""
        return self._on_host("rmsnorm", x, w, eps)

    @abstractmethod
    def bitlinear(self, x: Any, w: Any, act_quant: str) -> Any:
        """x [n, cols] times ternary w [rows, cols] transposed -> [n, rows].

        act_quant "row": per row s = 127/max|x|, q = clamp(rint(x*s), -128, 127) (round half
        to even), y = sum(q*t) * scale / s in integer arithmetic within each block.
        "block256": llama.cpp's Q8_K, per 256 values: v = the value of largest magnitude,
        iscale = -127/v, q = rint(x*iscale), y = sum over blocks of d_w * (1/iscale) * sum(q*t).
        "none": float x times the ternary values times their scale.

        Quantization is float32 arithmetic (s = float32(127) / max|x|, then x * s, both float32),
        so that every backend makes the same rounding decisions. An all-zero row gives y = 0
        ("row"); an all-zero block contributes 0 ("block256"; llama.cpp stores d = 0). v is the
        first value of largest magnitude. A block's integer sum fits 16 bits and a row's 24 bits
        (cols < 2**17), so float32 accumulation of them is exact. The oracle is
        bitnet.runtime.reference.ReferenceProvider.
        """

    def bitlinear_group(self, x: Any, group: Any, act_quant: str) -> tuple[Any, ...]:
        """bitlinear(x, w, act_quant) for each projection w of an uploaded group, in order: the same
        results, to the bit, however a provider runs them (one quantization of x, one dispatch)."""
        return tuple(self.bitlinear(x, w, act_quant) for w in group)

    def layer_stack(self, x: Any, layers: Sequence[LayerWeights], cache: Any, slots: np.ndarray,
                    positions: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int, theta: float, eps: float,
                    act: str, act_quant: str) -> Any:
        """Every layer in turn, layer i's K and V in the cache's layer i: attention_block then ffn of each. These
        operations in this order, as those two are: a provider that runs the stack otherwise (one dispatch for a
        decode step's token, say) must give the same bits and the same cache."""
        for i, w in enumerate(layers):
            x = self.attention_block(x, w.attn_norm, w.qkv, w.attn_sub_norm, w.wo, cache, i, slots, positions,
                                     n_heads, n_kv_heads, head_dim, theta, eps, act_quant)
            x = self.ffn(x, w.ffn_norm, w.gate_up, w.ffn_sub_norm, w.w_down, eps, act, act_quant)
        return x

    def attention_block(self, x: Any, norm: Any, qkv: Any, sub_norm: Any | None, wo: Any, cache: Any, layer: int,
                        slots: np.ndarray, positions: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int,
                        theta: float, eps: float, act_quant: str) -> Any:
        """A layer's attention half: x + wo(sub_norm(attention(rope(q), rope(k), v))), q, k and v (the uploaded
        group `qkv`) of rmsnorm(x, norm); no sub-norm when sub_norm is None. These operations in this order, as
        `ffn` is: a provider that runs it otherwise must give the same bits and the same cache."""
        q, k, v = self.bitlinear_group(self.rmsnorm(x, norm, eps), qkv, act_quant)
        q = self.rope(q, n_heads, head_dim, positions, theta)
        k = self.rope(k, n_kv_heads, head_dim, positions, theta)
        a = self.attention(q, k, v, cache, layer, slots, positions, n_heads, n_kv_heads, head_dim)
        if sub_norm is not None:
            a = self.rmsnorm(a, sub_norm, eps)
        return self.add(x, self.bitlinear(a, wo, act_quant))

    def ffn(self, x: Any, norm: Any, gate_up: Any, sub_norm: Any | None, down: Any, eps: float, act: str,
            act_quant: str) -> Any:
        """A layer's feed-forward half: x + down(sub_norm(act(gate) * up)), gate and up (the uploaded group
        `gate_up`) of rmsnorm(x, norm); no sub-norm when sub_norm is None. It is these operations in this
        order, and a provider that runs it otherwise (one dispatch for a decode step's token, say) must give
        the same bits."""
        f = self.act_mul(*self.bitlinear_group(self.rmsnorm(x, norm, eps), gate_up, act_quant), act)
        if sub_norm is not None:
            f = self.rmsnorm(f, sub_norm, eps)
        return self.add(x, self.bitlinear(f, down, act_quant))

    def rope(self, x: Any, n_heads: int, head_dim: int, positions: np.ndarray, theta: float) -> Any:
        """NEOX rotary embedding (rotate halves) of [n, n_heads*head_dim]; row i is at positions[i]."""
        return self._on_host("rope", x, n_heads, head_dim, positions, theta)

    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, slots: np.ndarray, positions: np.ndarray,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> Any:
        """Store every row's k, v at (slots[i], positions[i]) of `layer` in the cache; then row i attends
        causally, grouped-query, over positions 0..positions[i] of its slot, scale 1/sqrt(head_dim).
        A sequence's rows in one batch are consecutive, in position order."""
        return self._on_host("attention", q, k, v, cache, layer, slots, positions, n_heads, n_kv_heads, head_dim)

    def act_mul(self, gate: Any, up: Any, act: str) -> Any:
        """act(gate) * up with act "silu" (x*sigmoid(x)) or "relu2" (max(x,0)^2)."""
        return self._on_host("act_mul", gate, up, act)

    def add(self, a: Any, b: Any) -> Any:
        """a + b (the residual)."""
        return self._on_host("add", a, b)

    def rows(self, x: Any, index: np.ndarray) -> Any:
        """Rows `index` (int32 [m], ascending) of x as [m, width]: only they need logits."""
        return self._on_host("rows", x, index)

    def lm_head(self, x: Any, table: Any) -> Any:
        """x [n, dim] times the uploaded [vocab, dim] table transposed -> logits [n, vocab]."""
        return self._on_host("lm_head", x, table)

    def lm_head_q8(self, x: Any, table: Any) -> Any:
        """x [n, dim] times an int8 table (from upload_q8: codes q [vocab, dim], scale [vocab]) -> logits [n, vocab].

        Each row of x is quantized as BitLinear's "row" mode does (q_x, s); y[t, r] = sum(q_x[t] * q[r])
        * scale[r] / s[t], the integer sum exact, the rest in float64 in that order, then float32.
        """
        return self._on_host("lm_head_q8", x, table)

    def argmax(self, logits: Any) -> np.ndarray:
        """Index of the largest logit of each row (first on ties), on the host as int64 [n]."""
        return self._on_host("argmax", logits)


def native_operations(provider: KernelProvider | type[KernelProvider]) -> frozenset[str]:
    """The operations a provider class implements itself; the others fall back to the host."""
    cls = provider if isinstance(provider, type) else type(provider)
    return frozenset(op for op in OPERATIONS if getattr(cls, op) is not getattr(KernelProvider, op))
