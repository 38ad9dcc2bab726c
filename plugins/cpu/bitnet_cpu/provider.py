"""The CPU kernel provider: numba kernels on the packed weights, NumPy for the rest.

Ternary weights stay packed (2 bits each, the canonical layout is also the kernel's layout),
TQ2_0 and I2_S in place in the memory-mapped file; on the avx512vbmi level, rows with one scale are packed five to a
byte at upload (`PackedTernary.base3`, from `base3_cache` from the second load of a file on).
BitLinear quantizes activations to int8 and runs the SIMD integer kernels of
`int_kernels`, built for the instruction-set level `isa.choose()` picks; the F16 LM head,
its int8 twin and RMSNorm run in `float_kernels`, attention in `attention`. Unquantized ("none") BitLinear keeps the
NumPy path: it unpacks a chunk of rows at a time through a 256-entry table into float32 and
multiplies with BLAS. numba is imported when a provider is opened, never by `import bitnet_cpu`, and compiles
each kernel on first use into its disk cache.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from bitnet.errors import UsageError
from bitnet.modelfile.model import release_pages
from bitnet.modelfile.ternary import BLOCK, TernaryMatrix, zero_extend
from bitnet.runtime import q8_cache
from bitnet.runtime.provider import ACTIVATIONS, LayerWeights, kv_array
from bitnet.runtime.reference import KVCache, Q8Table, ReferenceProvider, check_act_quant, check_slots

from . import attention as attn
from . import base3_cache, kernel_cache, stack_phases, threading_layer, threads
from . import float_kernels as fk
from . import isa as isa_levels
from .dot_ir import BASE3_BLOCK, BLOCK_BYTES

# Byte -> its four 2-bit codes (low bits first) decoded to -1/0/+1. Each entry's four float32
# are viewed as one complex128, so unpacking is a 1-D np.take (several times faster than
# fancy-indexing a [256, 4] table).
_LUT = (((np.arange(256)[:, None] >> np.array([0, 2, 4, 6])) & 3) - 1).astype(np.float32)
_LUT16 = _LUT.view(np.complex128).reshape(256)

# Rows unpacked per chunk: about an L2 cache of float32 (measured best of 128 KB..4 MB at n = 1 and 128).
_CHUNK_BYTES = 512 << 10
# Ternary weight rows per parallel task: 40 KB of codes at 2560 columns, a share of L2.
_ROWS_PER_TASK = 64
# Tokens from which a BitLinear task (64 rows) is long enough to be handed out alone (see _use_threads):
# ~0.1 ms. At 8 tokens (8 sequences decoding) it cost 1 % on a quiet machine.
_LONG_TASK_TOKENS = 16
# Tokens a layer_stack call runs in one region (a decode step's sequences): a task's rows take them in one pass.
_STACK_TOKENS = 8
# Rows of the int8 LM head built at a time (40 MB of F16 at dim 2560), each part's file pages released after.
_Q8_BUILD_ROWS = 8192
# LM-head rows per parallel task: 2.5 MB of F16 at dim 2560, many tasks for few threads.
_LM_HEAD_ROWS = 512
# LM-head tasks a thread takes at a time (see _use_threads): the head is a decode step's longest parallel loop
# (11-25 ms for 2B-4T at 2 threads), and in shares a thread preempted mid-share held up the whole step.
_LM_HEAD_CHUNK = 4


@dataclass(frozen=True, eq=False)
class PackedTernary:
    """Resident ternary projections stacked by rows: one, or several that read the same input (Q, K, V;
    gate, up), which then run as one call. The codes stay where they are (TQ2_0 and I2_S in the mapped file), or,
    with a scale per row on a level whose codes are base 3 (see dot_ir), are packed into `base3` at upload."""

    blocks: tuple[np.ndarray, ...]  # per projection uint8 [rows, cols // 256, 64], possibly strided views
    scales: np.ndarray  # float32 [rows, cols // 256], all projections' rows (a view of row_scales when there are)
    row_scales: np.ndarray | None  # float32 [rows] when every block of a row shares its scale
    fields_reversed: bool  # I2_S byte order (see bitnet.modelfile.ternary)
    starts: tuple[int, ...]  # each projection's first row
    tasks: np.ndarray  # int64 [tasks, 6]: the kernels' parallel tasks over `blocks` (see int_kernels)
    bstride: int  # bytes from one block of a row to the next, the same in every projection
    base3: tuple[np.ndarray, ...] | None = None  # each projection's codes in base 3, [its rows, BASE3_BLOCK blocks, 64]
    base3_tasks: np.ndarray | None = None  # the tasks over `base3`

    @property
    def own_codes(self) -> tuple[np.ndarray, ...] | None:
        """The codes read in place of the file's (see KernelProvider.upload_ternary): base3, when there is one."""
        return self.base3

    @property
    def row_tasks(self) -> np.ndarray:
        """The tasks of the kernels of rows with one scale ("row" quantization): over base3 when there is one."""
        return self.tasks if self.base3_tasks is None else self.base3_tasks

    @property
    def row_bstride(self) -> int:
        return self.bstride if self.base3 is None else BLOCK_BYTES

    @classmethod
    def stack(cls, ws: list[TernaryMatrix], pack: Callable[..., None] | None = None) -> PackedTernary | None:
        """The projections stacked, or None when they cannot share a call: widths, byte orders or block
        strides differ, or some have a scale per row and some not (the float path rounds those differently).
        pack (int_kernels.pack_base3, on a base-3 level): a scale per row packs the codes in base 3."""
        blocks, row_scales = [w.blocks() for w in ws], [w.row_scales for w in ws]
        if len({(w.cols, w.fields_reversed, b.strides[1], r is None) for w, b, r in zip(ws, blocks, row_scales,
                                                                                       strict=True)}) != 1:
            return None
        starts = tuple(int(r) for r in np.cumsum([0] + [w.rows for w in ws[:-1]]))
        tasks = np.concatenate([_tasks(b, r0) for b, r0 in zip(blocks, starts, strict=True)])
        if row_scales[0] is None:
            rows, scales = None, np.concatenate([np.asarray(w.scales, np.float32) for w in ws])
        else:  # (no [rows, blocks] copy: for 2B-4T, 27 MB of fresh pages, 15 ms of load on the AMD EPYC)
            rows = np.concatenate(row_scales).astype(np.float32)
            scales = np.broadcast_to(rows[:, None], (len(rows), ws[0].cols // BLOCK))
        if pack is None or rows is None:
            return cls(tuple(blocks), scales, rows, ws[0].fields_reversed, starts, tasks, int(blocks[0].strides[1]))
        base3 = base3_cache.packed(blocks, ws[0].fields_reversed, -(-ws[0].cols // BASE3_BLOCK), pack)
        tasks3 = np.concatenate([_tasks(c, r0) for c, r0 in zip(base3, starts, strict=True)])
        return cls(tuple(blocks), scales, rows, ws[0].fields_reversed, starts, tasks, int(blocks[0].strides[1]), base3,
                   tasks3)

    @functools.cached_property
    def block_scales(self) -> np.ndarray:
        """`scales` C-contiguous, as the per-block kernels read them; built on first use when it is a view."""
        return np.ascontiguousarray(self.scales)

    @property
    def rows(self) -> int:
        return int(self.scales.shape[0])

    @property
    def cols(self) -> int:
        return int(self.scales.shape[1]) * BLOCK

    def split(self, y: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
        """The kernels' flat result (each projection's [n, its rows] in turn) as one array per projection."""
        if len(self.starts) == 1:
            return (y.reshape(n, -1),)
        ends = (*self.starts[1:], self.rows)
        return tuple(y[n * lo:n * hi].reshape(n, hi - lo) for lo, hi in zip(self.starts, ends, strict=True))


@functools.cache
def _ours(cls: type) -> bool:
    """Whether a layer's operations are CpuProvider's own in cls: the region would bypass a subclass's."""
    return all(getattr(cls, op) is getattr(CpuProvider, op)
               for op in ("rmsnorm", "bitlinear_group", "bitlinear", "add", "rope", "attention", "act_mul",
                          "attention_block", "ffn"))


def _one_region_attention(dim: int, qkv: Any, wo: Any, q_rows: int, kv_rows: int) -> bool:
    """Whether layers_row_rowscale runs an attention half of these: Q, K and V stacked in that order, wo back to dim
    columns wide, every width whole blocks, a scale per row."""
    return (isinstance(qkv, PackedTernary) and isinstance(wo, PackedTernary)
            and qkv.starts == (0, q_rows, q_rows + kv_rows) and qkv.rows == q_rows + 2 * kv_rows
            and qkv.row_scales is not None and wo.row_scales is not None
            and qkv.cols == dim == wo.rows and wo.cols == q_rows)


def _one_region_ffn(dim: int, gate_up: Any, down: Any) -> bool:
    """Whether layers_row_rowscale runs a feed-forward half of these: gate and up stacked, the same height, down
    back to dim columns wide, every width whole blocks, a scale per row."""
    return (isinstance(gate_up, PackedTernary) and isinstance(down, PackedTernary) and len(gate_up.starts) == 2
            and gate_up.row_scales is not None and down.row_scales is not None
            and gate_up.rows == 2 * gate_up.starts[1] == 2 * down.cols and gate_up.cols == dim == down.rows)


def _tasks(blocks: np.ndarray, first: int) -> np.ndarray:
    """The parallel tasks over one projection's rows, first its first row in the stack (see int_kernels)."""
    lo = np.arange(0, len(blocks), _ROWS_PER_TASK, dtype=np.int64)
    t = np.empty((len(lo), 6), np.int64)
    t[:] = blocks.ctypes.data, blocks.strides[0], 0, 0, first, len(blocks)  # (ctypes.data per row cost 25 ms of load)
    t[:, 2], t[:, 3] = lo, np.minimum(lo + _ROWS_PER_TASK, len(blocks))
    return t


def unpack_rows(codes: np.ndarray) -> np.ndarray:
    """float32 ternary values of `codes` [r, cols // 4] in *byte order* (see permute_cols)."""
    return np.take(_LUT16, codes).view(np.float32)


def permute_cols(x: np.ndarray, fields_reversed: bool = False) -> np.ndarray:
    """Reorder the columns of x [n, cols] to the byte order unpack_rows produces.

    Byte j of each 32-byte group holds values j, j+32, j+64, j+96 of its 128 columns, so the
    table lookup yields them in that order; permuting the few activation rows is far cheaper
    than transposing the unpacked weights. Each 256-block stays contiguous.
    """
    n, cols = x.shape
    fields = x.reshape(n, cols // 128, 4, 32)
    if fields_reversed:  # I2_S: the low bits of a byte hold the last of its four values
        fields = fields[:, :, ::-1]
    return np.ascontiguousarray(fields.transpose(0, 1, 3, 2)).reshape(n, cols)


@dataclass(frozen=True, eq=False)
class _LayerStack:
    """Every layer's tables for layers_row_rowscale, stacked: the norms [layers, width] (a column of ones for
    absent sub-norms) and whether the sub-norms are there, and per projection its tasks [layers, tasks, 6], block
    stride, row scales [layers, rows] and byte order. It holds the layers, whose codes the tasks point into."""

    layers: Sequence[LayerWeights]
    norms: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool, bool]
    qkv: tuple[np.ndarray, int, np.ndarray, bool]
    wo: tuple[np.ndarray, int, np.ndarray, bool]
    gate_up: tuple[np.ndarray, int, np.ndarray, bool]
    down: tuple[np.ndarray, int, np.ndarray, bool]
    hidden: int

    @classmethod
    def of(cls, layers: Sequence[LayerWeights], dim: int, q_rows: int, kv_rows: int) -> _LayerStack | None:
        """None unless every layer is alike and each half is what the region runs (see _one_region_*)."""
        if not layers or not all(_one_region_attention(dim, w.qkv, w.wo, q_rows, kv_rows)
                                 and _one_region_ffn(dim, w.gate_up, w.w_down) for w in layers):
            return None
        subs = {(w.attn_sub_norm is None, w.ffn_sub_norm is None) for w in layers}
        if len(subs) != 1:
            return None
        projections = []
        for name in ("qkv", "wo", "gate_up", "w_down"):
            ws = [getattr(w, name) for w in layers]
            if len({(w.row_tasks.shape, w.row_bstride, w.fields_reversed) for w in ws}) != 1:
                return None
            projections.append((np.stack([w.row_tasks for w in ws]), ws[0].row_bstride,
                                np.stack([w.row_scales for w in ws]).astype(np.float32), ws[0].fields_reversed))

        def norms(name: str) -> np.ndarray:
            if getattr(layers[0], name) is None:
                return np.ones((len(layers), 1), np.float32)
            return np.stack([np.asarray(getattr(w, name), np.float32) for w in layers])

        has_attn_sub, has_ffn_sub = (not absent for absent in subs.pop())
        return cls(layers, (norms("attn_norm"), norms("attn_sub_norm"), norms("ffn_norm"), norms("ffn_sub_norm"),
                            has_attn_sub, has_ffn_sub), *projections, layers[0].gate_up.starts[1])


threading_layer.configure()
kernel_cache.load_lightly(fk)
kernel_cache.load_lightly(attn)
_numba_threads = threading.local()  # the thread count and chunk size a provider last set in this thread


class CpuProvider(ReferenceProvider):
    prefix = "cpu"

    def __init__(self, device: Any = None, backend: str = "cpu", n_threads: int | None = None,
                 isa: str | None = None) -> None:
        """isa: an instruction-set level (see `isa.LEVELS`); default BITNET_CPU_ISA, else the host's best."""
        super().__init__(device, backend)
        self.isa = isa_levels.choose(isa)
        self._tk = isa_levels.kernels(self.isa)
        self._pack = self._tk.pack_base3 if self._tk.BASE3 else None
        self.wide_bytes = isa_levels.wide_bytes()  # BitLinear's column parts (see int_kernels.matmul_rowscale)
        kernel_cache.runtime_ready(isa_levels.cache_dir(self.isa))
        # numba cannot start more threads than it was configured with at import (NUMBA_NUM_THREADS).
        self.n_threads = max(1, min(n_threads or threads(), numba.config.NUMBA_NUM_THREADS))
        self._rope: tuple[tuple[bytes, int, float], np.ndarray, np.ndarray] | None = None  # the last angles
        self._stack: tuple[Sequence[LayerWeights], _LayerStack | None] | None = None  # the last layers' tables
        # The last layer_stack region's phase stamps [layers, threads, MARKS]: see stack_phases.seconds.
        self.stack_marks = np.zeros((0, 0, stack_phases.MARKS), np.int64)
        self._use_threads()

    def _use_threads(self, chunk: int = 0) -> None:
        """numba's thread count is per calling thread: set ours in whichever thread runs a kernel. What was
        set is remembered per thread: asking numba costs 2.5 us, and a decode step makes ~180 kernel calls.

        By default a parallel loop gives each thread one equal share of its tasks and returns when the
        slowest share is done. A chunk size hands them out `chunk` at a time, so a thread that a co-tenant
        slows down takes fewer; a handout costs a few microseconds, so only long loops go this way:
        prefill's BitLinear one task at a time (0.7-2 ms each at 128 tokens; on the 2-core EPYC beside one
        busy process, 2-thread prefill of 128 tokens ran 16.3 tokens/s in shares and 17.8 one task at a
        time, medians of 4; quiet, 27.9 and 27.8), the LM head _LM_HEAD_CHUNK tasks at a time.
        """
        if getattr(_numba_threads, "n", None) != self.n_threads:
            numba.set_num_threads(self.n_threads)
            _numba_threads.n = self.n_threads
        if getattr(_numba_threads, "chunk", 0) != chunk:
            numba.set_parallel_chunksize(chunk)
            _numba_threads.chunk = chunk

    def upload_ternary(self, w: TernaryMatrix) -> Any:
        return PackedTernary.stack([w], self._pack)

    def upload_ternary_group(self, ws: list[TernaryMatrix]) -> Any:
        return PackedTernary.stack(ws, self._pack) or super().upload_ternary_group(ws)

    def uploaded(self) -> None:
        base3_cache.flush()

    def bitlinear_group(self, x: Any, group: Any, act_quant: str) -> tuple[Any, ...]:
        if isinstance(group, PackedTernary):
            return self._stacked(x, group, act_quant)
        return super().bitlinear_group(x, group, act_quant)

    def bitlinear(self, x: Any, w: Any, act_quant: str) -> Any:
        return self._stacked(x, w, act_quant)[0]

    def _stacked(self, x: Any, w: PackedTernary, act_quant: str) -> tuple[np.ndarray, ...]:
        """Each stacked projection's result, contiguous."""
        check_act_quant(act_quant)
        if act_quant == "none":
            return tuple(np.ascontiguousarray(y) for y in np.hsplit(self._bitlinear_float(x, w), w.starts[1:]))
        self._use_threads(1 if len(x) >= _LONG_TASK_TOKENS else 0)
        x = zero_extend(np.ascontiguousarray(x, dtype=np.float32), w.cols)  # widths not whole blocks
        if act_quant == "block256":
            self.record("cpu.bitlinear_blockscale_block256")
            y = self._tk.bitlinear_block256(x, w.tasks, w.bstride, w.block_scales, w.fields_reversed)
        elif w.row_scales is not None:
            self.record("cpu.bitlinear_rowscale_row")
            y = self._tk.bitlinear_row_rowscale(x, w.row_tasks, w.row_bstride, w.row_scales, w.fields_reversed,
                                                self.wide_bytes)
        else:
            self.record("cpu.bitlinear_blockscale_row")
            y = self._tk.bitlinear_row_blockscale(x, w.tasks, w.bstride, w.block_scales, w.fields_reversed)
        return w.split(y, len(x))

    def layer_stack(self, x: Any, layers: Sequence[LayerWeights], cache: Any, slots: np.ndarray,
                    positions: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int, theta: float, eps: float,
                    act: str, act_quant: str) -> Any:
        """A few tokens (up to _STACK_TOKENS) with a scale per weight row ("row" quantization: I2_S, TQ2_0 with one
        scale a tensor) through every layer in one parallel region (layer_regions.layers_row_rowscale); anything
        else as the operations one by one, and so does a subclass that replaces one of them (its own act_mul,
        say), which the region would bypass."""
        (keys, width), (values, _) = attn.cache_bytes(cache.k), attn.cache_bytes(cache.v)
        stack = None
        if (_ours(type(self)) and 1 <= len(x) <= _STACK_TOKENS
                and act_quant == "row" and act in ACTIVATIONS
                and keys.flags.c_contiguous and values.flags.c_contiguous):
            stack = self._stack_of(layers, np.shape(x)[1], n_heads * head_dim, n_kv_heads * head_dim)
        if stack is None:
            return super().layer_stack(x, layers, cache, slots, positions, n_heads, n_kv_heads, head_dim, theta, eps,
                                       act, act_quant)
        self.record("cpu.layer_stack_rowscale_row")
        self._use_threads()
        slots, positions = np.ascontiguousarray(slots, np.int32), np.ascontiguousarray(positions, np.int32)
        check_slots(cache, slots, positions, len(x))
        cos, sin = self._rope_angles(positions, head_dim, theta)
        shape = (len(layers), self.n_threads, stack_phases.MARKS)
        if self.stack_marks.shape != shape:
            self.stack_marks = np.zeros(shape, np.int64)
        return self._tk.layers_row_rowscale(
            np.ascontiguousarray(x, np.float32), *stack.norms, float(eps), act == "relu2", *stack.qkv, *stack.wo,
            *stack.gate_up, *stack.down, n_heads * head_dim, n_kv_heads * head_dim, stack.hidden, cos, sin, keys,
            values, width, slots, positions, n_heads, n_kv_heads, head_dim, self.wide_bytes, self.n_threads,
            self.stack_marks)

    def _stack_of(self, layers: Sequence[LayerWeights], dim: int, q_rows: int, kv_rows: int) -> _LayerStack | None:
        """The layers' stacked tables, built on first use (a transformer passes the same list at every step)."""
        if self._stack is None or self._stack[0] is not layers:
            self._stack = (layers, _LayerStack.of(layers, dim, q_rows, kv_rows))
        return self._stack[1]

    def _bitlinear_float(self, x: Any, w: PackedTernary) -> np.ndarray:
        """Float activations times the unpacked ternary values (BLAS), a chunk of rows at a time.

        One matrix-vector product per activation row: BLAS sums a product of several rows in
        another order than a single row's, and a row's result must not depend on the batch it
        came in (5e-5 apart at n = 9 with matrix products). It is also faster: the batched
        per-block products took 10.8 s for 64 tokens of a 6912 x 2560 block-scaled matrix.
        """
        x = zero_extend(np.asarray(x, dtype=np.float32), w.cols)
        a = permute_cols(x, w.fields_reversed)
        rowwise = w.row_scales is not None
        self.record(f"cpu.bitlinear_{'rowscale' if rowwise else 'blockscale'}_none")
        y = np.empty((x.shape[0], w.rows), dtype=np.float32)
        step = max(1, _CHUNK_BYTES // (4 * w.cols))
        for blocks, r0 in zip(w.blocks, w.starts, strict=True):
            for lo in range(0, len(blocks), step):
                hi = min(lo + step, len(blocks))
                t = unpack_rows(np.ascontiguousarray(blocks[lo:hi]).reshape(hi - lo, -1))
                if not rowwise:  # -1/0/+1 times its block's scale: exact
                    t = (t.reshape(hi - lo, -1, BLOCK) * w.scales[r0 + lo:r0 + hi, :, None]).reshape(hi - lo, -1)
                for i in range(x.shape[0]):
                    y[i, r0 + lo:r0 + hi] = t @ a[i]
        if rowwise:
            y *= w.row_scales
        return y

    def lm_head(self, x: Any, table: Any) -> Any:
        self._use_threads(_LM_HEAD_CHUNK)
        x = np.ascontiguousarray(x, dtype=np.float32)
        table = np.asarray(table)
        out = np.empty((x.shape[0], table.shape[0]), dtype=np.float32)
        if table.dtype == np.float16:
            self.record("cpu.lm_head_f16")
            fk.lm_head_f16(x, np.ascontiguousarray(table).view(np.uint16), _LM_HEAD_ROWS, out)
        else:
            self.record("cpu.lm_head_f32")
            fk.lm_head_f32(x, np.ascontiguousarray(table, dtype=np.float32), _LM_HEAD_ROWS, out)
        return out

    def upload_q8(self, table: np.ndarray) -> Q8Table:
        return q8_cache.table(np.asarray(table), self._build_q8)

    def _build_q8(self, table: np.ndarray) -> Q8Table:
        self._use_threads()
        # On cache lines, as int8_rows: a table off them cost the head's dot 8-10 % (Zen 5, table in L3).
        q, scale = self._tk.int8_rows(*table.shape), np.empty(table.shape[0], np.float32)
        for lo in range(0, table.shape[0], _Q8_BUILD_ROWS):
            part, hi = table[lo:lo + _Q8_BUILD_ROWS], lo + _Q8_BUILD_ROWS
            if table.dtype == np.float16:
                fk.q8_table_f16(np.ascontiguousarray(part).view(np.uint16), q[lo:hi], scale[lo:hi])
            else:
                fk.q8_table_f32(np.ascontiguousarray(part, dtype=np.float32), q[lo:hi], scale[lo:hi])
            release_pages(part)  # a mapped table's float pages are spent: the peak RSS holds one part
        return Q8Table(q, scale)

    def lm_head_q8(self, x: Any, table: Q8Table) -> Any:
        self.record("cpu.lm_head_q8")
        self._use_threads(_LM_HEAD_CHUNK)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], table.shape[0]), dtype=np.float32)
        q8, s = self._tk.int8_rows(*x.shape), np.empty(x.shape[0], np.float32)  # rows on cache lines (see int8_rows)
        fk.q8_rows(x, q8, s)
        self._tk.lm_head_q8(q8, s, table.q, table.scale, _LM_HEAD_ROWS, out)
        return out

    def rmsnorm(self, x: Any, w: Any, eps: float) -> Any:
        self.record("cpu.rmsnorm")
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        fk.rmsnorm(x, np.ascontiguousarray(w, dtype=np.float32), float(eps), out)
        return out

    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, slots: np.ndarray, positions: np.ndarray,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> Any:
        self.record("cpu.attention")
        self._use_threads()
        slots, positions = np.ascontiguousarray(slots, np.int32), np.ascontiguousarray(positions, np.int32)
        check_slots(cache, slots, positions, len(q))
        q, k, v = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
        out = np.empty_like(q)
        (keys, width), (values, _) = attn.cache_bytes(cache.k[layer]), attn.cache_bytes(cache.v[layer])
        attn.attention(q, k, v, keys, values, width, slots, positions, n_heads, out, self.n_threads)
        return out

    def kv_cache(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, n_seqs: int = 1,
                 kv_type: str = "f32") -> Any:
        """The reference's cache, each KV head's positions contiguous in memory: attention streams them."""
        shape = (n_layers, n_seqs, n_kv_heads, n_ctx, head_dim)
        return KVCache(*(kv_array(shape, kv_type).transpose(0, 1, 3, 2, 4) for _ in "kv"))

    def act_mul(self, gate: Any, up: Any, act: str) -> Any:
        if act not in ACTIVATIONS:
            raise UsageError(f"unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        self.record("cpu.act_mul")
        self._use_threads()
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        out = np.empty_like(gate)
        fk.act_mul(gate, np.ascontiguousarray(up, dtype=np.float32), act == "relu2", out)
        return out

    def rope(self, x: Any, n_heads: int, head_dim: int, positions: np.ndarray, theta: float) -> Any:
        self.record("cpu.rope")
        x = np.ascontiguousarray(x, dtype=np.float32)
        cos, sin = self._rope_angles(np.ascontiguousarray(positions, np.int32), head_dim, theta)
        out = np.empty_like(x)
        fk.rope(x, n_heads, head_dim, cos, sin, out)
        return out

    def _rope_angles(self, positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of the positions. Every layer's Q and K turn by the same angles: computed once per
        forward pass (sin and cos were 0.3 ms of each of a 128-token prefill's 60 calls)."""
        key = (positions.tobytes(), head_dim, float(theta))
        if self._rope is None or self._rope[0] != key:
            self._rope = (key, *fk.rope_table(positions, head_dim, float(theta)))
        return self._rope[1], self._rope[2]

    def add(self, a: Any, b: Any) -> Any:
        self.record("cpu.add")
        return np.add(a, b, dtype=np.float32)
