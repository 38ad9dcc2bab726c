"""Attention of the decode and prefill path: new K/V rows into the cache, then causal grouped-query attention
over it, one parallel task per (token, KV head).

The score dots (`emit_scores`) and the weighted values (`emit_weighted_sum`) are LLVM IR, like the head's dots in
`float_kernels`, whose F16 loads, scalar column tail and prefetch hints they share; the softmax's exp is
`float_kernels.exp_shifted`. Every sum runs in an order fixed by the IR, so a row's result never depends on the
rows beside it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bitnet.runtime.provider import Q8_ROW_BYTES
from bitnet_cpu import isa
from bitnet_cpu.dot_ir import _lane_sums
from bitnet_cpu.float_kernels import _f32_vector, _q8_row, _scalar_tail, as_f32, exp_shifted, prefetch_keep


@intrinsic
def _f16_bits(typingctx: Any, x: Any) -> Any:
    """float32 x as F16 bits, rounded to nearest even (as NumPy's astype)."""
    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def _in_head_chunks(b: ir.IRBuilder, n_heads: ir.Value, emit: Any) -> None:
    """emit(first head, heads) for chunks of 4, then 2, then 1 of n_heads query heads: any group splits into
    those, so a head chunk's registers hold no head computed for nothing."""
    i64 = ir.IntType(64)
    with cgutils.for_range(b, b.sdiv(n_heads, ir.Constant(i64, 4))) as loop:
        emit(b.mul(loop.index, ir.Constant(i64, 4)), 4)
    done = cgutils.alloca_once_value(b, b.mul(b.sdiv(n_heads, ir.Constant(i64, 4)), ir.Constant(i64, 4)))
    for heads in (2, 1):
        with b.if_then(b.icmp_signed(">=", b.sub(n_heads, b.load(done)), ir.Constant(i64, heads))):
            emit(b.load(done), heads)
            b.store(b.add(b.load(done), ir.Constant(i64, heads)), done)


_SCORE_LANES = 16  # float32 lanes of a score accumulator (one zmm; two ymm on AVX2 hosts, the same sums)


def emit_scores(b: ir.IRBuilder, args: list[ir.Value], elem: ir.Type, positions: int = 1) -> None:
    """The body of scores(k_addr, k_stride, hd, q_addr, q_stride, n_heads, out_addr, out_stride), all i64: the
    scores of `positions` consecutive key rows (of elem: F16, float32, or int8 with the row's float32 scale
    after its hd values, which multiplies its dots; k_stride bytes apart) for n_heads query rows (float32,
    q_stride apart), float32 out[h * out_stride + 4 * p] for position p, a chunk of heads at a time.

    A (head, position) sums in one 16-lane accumulator over the row's whole 16-column steps, its lanes folded
    in a fixed tree (`_lane_sums`), then the columns past them one by one: the same bits whichever chunk or
    pair of positions it came in. Two positions share each query vector, and each converted key vector
    serves every head of the chunk: with 8-lane row dots (`emit_rows_dot`) a position cost ~110 cycles of a
    48-position task on a Zen 5."""
    k_i, k_stride, hd, q_i, q_stride, n_heads, out_i, out_stride = args

    def chunk(h0: ir.Value, heads: int) -> None:
        _scores_chunk(b, [k_i, k_stride, hd, b.add(q_i, b.mul(h0, q_stride)), q_stride,
                          b.add(out_i, b.mul(h0, out_stride)), out_stride], heads, positions, elem)

    _in_head_chunks(b, n_heads, chunk)


def _scores_chunk(b: ir.IRBuilder, args: list[ir.Value], heads: int, positions: int, elem: ir.Type) -> None:
    """emit_scores for `heads` heads (args without n_heads)."""
    k_i, k_stride, hd, q_i, q_stride, out_i, out_stride = args
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    n = _SCORE_LANES
    vf = ir.VectorType(f32, n)
    fma_v = cgutils.get_or_insert_function(b.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{n}f32")
    ks = [b.inttoptr(b.add(k_i, b.mul(ir.Constant(i64, p), k_stride)), elem.as_pointer()) for p in range(positions)]
    qs = [b.inttoptr(b.add(q_i, b.mul(ir.Constant(i64, h), q_stride)), f32.as_pointer()) for h in range(heads)]
    accs = [[cgutils.alloca_once_value(b, ir.Constant(vf, None)) for _ in range(heads)] for _ in range(positions)]
    steps = b.sdiv(hd, ir.Constant(i64, n))
    with cgutils.for_range(b, steps) as loop:
        at = b.mul(loop.index, ir.Constant(i64, n))
        kv = []
        for k in ks:
            kv.append(_f32_vector(b, k, at, n))
        for h in range(heads):
            qv = b.load(b.bitcast(b.gep(qs[h], [at]), vf.as_pointer()), align=4)
            for p in range(positions):
                b.store(b.call(fma_v, [kv[p], qv, b.load(accs[p][h])]), accs[p][h])
    flat = [b.load(accs[p][h]) for p in range(positions) for h in range(heads)]
    width = 1 << (len(flat) - 1).bit_length()  # a power of two of vectors: zeros fill it (their sums unused)
    folded = _lane_sums(b, flat + [ir.Constant(vf, None)] * (width - len(flat)), n, add="fadd")
    sums = [[cgutils.alloca_once_value(b, b.extract_element(folded, ir.Constant(i32, p * heads + h)))
             for h in range(heads)] for p in range(positions)]
    _scalar_tail(b, b.mul(steps, ir.Constant(i64, n)), hd, ks, qs, sums)
    scales = [_row_scale(b, k, hd) if isinstance(elem, ir.IntType) else None for k in ks]
    for h in range(heads):
        row = b.inttoptr(b.add(out_i, b.mul(ir.Constant(i64, h), out_stride)), f32.as_pointer())
        for p in range(positions):
            score = b.load(sums[p][h])
            b.store(score if scales[p] is None else b.fmul(score, scales[p]), b.gep(row, [ir.Constant(i64, p)]))


def _row_scale(b: ir.IRBuilder, row: ir.Value, hd: ir.Value) -> ir.Value:
    """The float32 scale after the hd int8 values of a q8 cache row (an i8 pointer: see provider.kv_array)."""
    return b.load(b.bitcast(b.gep(row, [hd]), ir.FloatType().as_pointer()), align=1)


def emit_weighted_sum(b: ir.IRBuilder, args: list[ir.Value], elem: ir.Type) -> None:
    """The body of wsum(v_addr, v_stride, n, n_cols, w_addr, w_stride, n_heads, o_addr, o_stride), all i64:
    o_h[c] += the sum over p < n of w_h[p] * v_p[c], for every column c < n_cols of the value rows v_p (of
    elem: F16, float32, or int8 whose row's scale, after its n_cols values, multiplies w_h[p] first; v_stride
    bytes apart) and n_heads weight rows w_h (float32, w_stride apart) into float32 rows o_h (o_stride apart),
    a chunk of heads at a time."""
    v_i, v_stride, n, n_cols, w_i, w_stride, n_heads, o_i, o_stride = args

    def chunk(h0: ir.Value, heads: int) -> None:
        _weighted_sum_chunk(b, [v_i, v_stride, n, n_cols, b.add(w_i, b.mul(h0, w_stride)), w_stride,
                                b.add(o_i, b.mul(h0, o_stride)), o_stride], heads, elem)

    _in_head_chunks(b, n_heads, chunk)


# float32 lanes of the values pass's vectors (isa.float_lanes). A vector column's sum is the same FMAs in the same
# order at either width, so a head dim that is a multiple of 16 gives the same bits on both kinds of host (the
# columns past the last whole vector are summed one by one, in an order LLVM may vectorize under fast-math: at
# 124 columns, 8 of them differ in the last bit). At 16 lanes, 16 accumulators take half the FMAs and broadcasts
# of 8 lanes' 8: F16 attention had run compute-bound, as fast from cache as from memory (Zen 5: 141 -> 118 us a
# layer at 1024 positions, one thread, from cache).
_VALUE_LANES = isa.float_lanes()


def _weighted_sum_chunk(b: ir.IRBuilder, args: list[ir.Value], heads: int, elem: ir.Type) -> None:
    """emit_weighted_sum for `heads` heads (args without n_heads).

    Each o_h[c] takes its terms one FMA at a time in position order, so a sum over positions 0..n-1 is the
    same bits in one call or in calls over consecutive blocks of them, and whichever pass its column falls
    in: 8 // heads vector columns at a time, then halves of that for what is left, then single columns. A
    converted value vector serves every head, a weight every column vector."""
    v_i, v_stride, n, n_cols, w_i, w_stride, o_i, o_stride = args
    f32, i64 = ir.FloatType(), ir.IntType(64)
    lanes = _VALUE_LANES
    vf = ir.VectorType(f32, lanes)
    fma_v = cgutils.get_or_insert_function(b.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{lanes}f32")
    fma_s = cgutils.get_or_insert_function(b.module, ir.FunctionType(f32, [f32] * 3), "llvm.fmuladd.f32")
    ws = [b.inttoptr(b.add(w_i, b.mul(ir.Constant(i64, h), w_stride)), f32.as_pointer()) for h in range(heads)]
    os_ = [b.inttoptr(b.add(o_i, b.mul(ir.Constant(i64, h), o_stride)), f32.as_pointer()) for h in range(heads)]
    col = cgutils.alloca_once_value(b, ir.Constant(i64, 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)

    def weight(h: int, row: ir.Value, p: ir.Value) -> ir.Value:
        w = b.load(b.gep(ws[h], [p]))
        return b.fmul(w, _row_scale(b, row, n_cols)) if isinstance(elem, ir.IntType) else w

    def columns(chunks: int) -> None:
        """`chunks` vector columns from col on, over all n positions; col moves past them."""
        c0 = b.load(col)
        at = [b.add(c0, ir.Constant(i64, c * lanes)) for c in range(chunks)]
        ptrs = [[b.bitcast(b.gep(o, [a]), vf.as_pointer()) for a in at] for o in os_]
        accs = [[cgutils.alloca_once_value(b, b.load(ptr, align=4)) for ptr in row] for row in ptrs]
        with cgutils.for_range(b, n) as loop:
            row = b.inttoptr(b.add(v_i, b.mul(loop.index, v_stride)), elem.as_pointer())
            vv = [_f32_vector(b, row, a, lanes) for a in at]
            for h in range(heads):
                w = weight(h, row, loop.index)
                wv = b.shuffle_vector(b.insert_element(ir.Constant(vf, None), w, ir.Constant(ir.IntType(32), 0)),
                                      ir.Constant(vf, None), zeros)
                for c in range(chunks):
                    b.store(b.call(fma_v, [wv, vv[c], b.load(accs[h][c])]), accs[h][c])
        for h in range(heads):
            for c in range(chunks):
                b.store(b.load(accs[h][c]), ptrs[h][c], align=4)
        b.store(b.add(c0, ir.Constant(i64, chunks * lanes)), col)

    chunks = lanes // heads  # as many accumulators as lanes: 8 ymm, or 16 of the 32 zmm
    with cgutils.for_range(b, b.sdiv(n_cols, ir.Constant(i64, chunks * lanes))):
        columns(chunks)
    while chunks > 1:
        chunks //= 2
        left = b.sub(n_cols, b.load(col))
        with b.if_then(b.icmp_signed(">=", left, ir.Constant(i64, chunks * lanes))):
            columns(chunks)
    with cgutils.for_range(b, b.sub(n_cols, b.load(col))) as tail:
        c = b.add(b.load(col), tail.index)
        for h in range(heads):
            acc = cgutils.alloca_once_value(b, b.load(b.gep(os_[h], [c])))
            with cgutils.for_range(b, n) as loop:
                row = b.inttoptr(b.add(v_i, b.mul(loop.index, v_stride)), elem.as_pointer())
                x = as_f32(b, b.load(b.gep(row, [c])))
                b.store(b.call(fma_s, [weight(h, row, loop.index), x, b.load(acc)]), acc)
            b.store(b.load(acc), b.gep(os_[h], [c]))


def _make_scores(elem: ir.Type, positions: int) -> Any:
    """The intrinsic scores(...) of emit_scores for rows of elem, `positions` key rows a call."""
    @intrinsic
    def scores(typingctx: Any, k_addr: Any, k_stride: Any, hd: Any, q_addr: Any, q_stride: Any, n_heads: Any,
               out_addr: Any, out_stride: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            emit_scores(builder, list(args), elem, positions)
            return context.get_dummy_value()

        return types.void(*[types.intp] * 8), codegen

    return scores


def _make_attention_loops(elem: ir.Type) -> tuple[Any, Any, Any]:
    """The intrinsics scores(...) of one and of two key rows, and wsum(...) of emit_weighted_sum, for F16,
    float32 or int8 (q8) rows."""

    @intrinsic
    def wsum(typingctx: Any, v_addr: Any, v_stride: Any, n: Any, n_cols: Any, w_addr: Any, w_stride: Any,
             n_heads: Any, o_addr: Any, o_stride: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            emit_weighted_sum(builder, list(args), elem)
            return context.get_dummy_value()

        return types.void(*[types.intp] * 9), codegen

    return _make_scores(elem, 1), _make_scores(elem, 2), wsum


((_scores_half, _scores2_half, _wsum_half), (_scores_float, _scores2_float, _wsum_float),
 (_scores_q8, _scores2_q8, _wsum_q8)) = map(_make_attention_loops, (ir.HalfType(), ir.FloatType(), ir.IntType(8)))
_KEYS_AHEAD = 8  # key rows requested ahead of the scores (see attend)
_SUM_BLOCK = 64  # positions per pass over the values: their rows stay in L1/L2 across the column passes
# Positions of a row per part at most: a longer row is split into equal parts, whose sums `_join` puts together.
# Up to SPLIT_ROWS rows (a decode step's sequences), each part is a task of its own: one decode token's 5 KV heads
# (2B-4T) had made 3 tasks on one thread and 2 on the other. A prompt's rows are many tasks already: each is
# one task, its parts run in turn (the same sums: a row's result does not depend on how it ran).
CHUNK = 256
SPLIT_ROWS = 8


@njit(parallel=True, fastmath=True, cache=True)
def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, keys: np.ndarray, values: np.ndarray, width: int,
              slots: np.ndarray, positions: np.ndarray, n_heads: int, out: np.ndarray, n_threads: int) -> None:
    """Store row t's k, v [n, n_kv*hd] at positions[t] of slot slots[t] of the cache keys/values
    [n_seqs, n_kv, n_ctx, row bytes] (see `cache_bytes`: float32, F16 or q8 rows of hd + 4 bytes, as `width`
    says); then causal grouped-query attention of q [n, n_heads*hd] over it.

    Row t reads positions 0..positions[t] of sequence slot slots[t]; query head h reads KV head
    h // (n_heads // n_kv). float32 throughout, the softmax denominator in float64. A task is a
    row and a KV head with the query heads that share it, or a part of such a row (see CHUNK): each cached key
    and value is read once for all of them (from memory, once the context outgrows the caches), not once per
    head, and each F16 vector is converted once for all of them. The scores are `emit_scores`' 16-lane dots,
    two key rows a call, and the weighted values `emit_weighted_sum`'s, in LLVM IR, for chunks of 4, 2 or 1
    query heads: numba's loops had loaded both operands of every FMA (the score dots) or the sums of every
    head (the values pass), and ran at ~9 G FMA/s on Zen 1. The parts of a row depend on its length only,
    and are joined in one order whichever task ran them, so its result never depends on the rows beside it
    or on the threads.
    """
    store_kv(k, v, keys, values, width, slots, positions)
    tasks = attention_tasks(positions, keys.shape[1])
    part_o, part_top, part_den = part_buffers(tasks, n_heads // keys.shape[1], head_dim(keys, width))
    for task in prange(len(tasks)):  # (the index as int64, as the region's: see layers_row_rowscale; 4.6 s less)
        attend(np.int64(task), tasks, q, keys, values, width, slots, positions, n_heads, out, part_o, part_top,
               part_den, n_threads)
    combine(tasks, part_o, part_top, part_den, out)


@njit(inline="always", cache=True)
def store_kv(k: np.ndarray, v: np.ndarray, keys: np.ndarray, values: np.ndarray, width: int, slots: np.ndarray,
             positions: np.ndarray) -> None:
    """Row t's k, v at positions[t] of slot slots[t] of the cache (see attention)."""
    n_kv = keys.shape[1]
    hd = k.shape[1] // n_kv
    for t in range(k.shape[0]):
        for h in range(n_kv):
            # Through 1-D views: the loops vectorize (the 4-D stores had converted one value at a time, 9 us for
            # 8 tokens of F16 against 1).
            _store_row(k[t, h * hd:(h + 1) * hd], keys[slots[t], h, positions[t]], width)
            _store_row(v[t, h * hd:(h + 1) * hd], values[slots[t], h, positions[t]], width)


@njit(inline="always", cache=True)
def _store_row(src: np.ndarray, dst: np.ndarray, width: int) -> None:
    """dst (a cache row's bytes) = float32 src as the cache holds it: float32 (width 4), F16 bits rounded to
    nearest even as NumPy's astype (2), or a q8 row (1, `_store_q8`). Plain loops: inlined into a parallel
    function, an array expression would be a parallel loop of its own."""
    if width == 1:
        _store_q8(src, dst.view(np.int8))
    elif width == 2:
        bits = dst.view(np.uint16)
        for d in range(len(src)):
            bits[d] = _f16_bits(src[d])
    else:
        floats = dst.view(np.float32)
        for d in range(len(src)):
            floats[d] = src[d]


# fastmath=False said outright: a callee left unset inherits its caller's fastmath, under which the quantizer's
# float32 arithmetic would no longer be the reference's (it had folded a rounding away).
@njit(fastmath=False, cache=True)
def _store_q8(src: np.ndarray, dst: np.ndarray) -> None:
    """dst [hd + 4] = src [hd] as a q8 cache row: the int8 head's row quantizer (`_q8_row`: q = rint(src * s),
    s = 127 / max|src|), then the bytes of d = 1 / s (bitnet.runtime.reference.q8_kv_rows)."""
    hd = len(src)
    dst[hd:].view(np.float32)[0] = np.float32(1.0) / _q8_row(src, dst[:hd])


def cache_bytes(kv: np.ndarray) -> tuple[np.ndarray, int]:
    """A cache [..., n_ctx, n_kv_heads, head_dim] (a layer, or all) as these kernels take it: in its memory's order,
    [..., n_kv_heads, n_ctx, row] (C-contiguous for the plugin's own cache, so the loops run along head_dim), as
    bytes; and the bytes of one element (4 float32, 2 F16, 1 q8). One array type for every cache type: each kernel
    that reads a cache compiles once, not once per type (the layer region had taken 56-60 s of the warmup per
    type on a Zen 5)."""
    kv = np.swapaxes(kv, -3, -2)
    return kv.view(np.uint8), kv.itemsize


@njit(inline="always", cache=True)
def head_dim(keys: np.ndarray, width: int) -> int:
    """head_dim of a cache's bytes [..., n_ctx, row bytes] (see `cache_bytes`): a q8 row holds its scale after its
    values."""
    return keys.shape[-1] - Q8_ROW_BYTES if width == 1 else keys.shape[-1] // width


@njit(inline="always", cache=True)
def _parts_of(total: int) -> int:
    return -(-total // CHUNK)


@njit(inline="always", cache=True)
def _part_start(total: int, c: int) -> int:
    """Where part c of a row of `total` positions starts (its end: part c + 1's start)."""
    return c * total // _parts_of(total)


@njit(cache=True)
def attention_tasks(positions: np.ndarray, n_kv: int) -> np.ndarray:
    """The tasks [n_tasks, 4] of attention: KV head, row, first and end position; by KV head, then row, then
    position, so a row's parts are consecutive and the tasks after one read the same head's rows. Rows in
    parts when there are up to SPLIT_ROWS of them, else whole (a plain loop: see part_buffers)."""
    n = len(positions)
    count = 0
    for t in range(n):
        count += _parts_of(positions[t] + 1) if n <= SPLIT_ROWS else 1
    tasks = np.empty((n_kv * count, 4), np.int64)
    i = 0
    for kv in range(n_kv):
        for t in range(n):
            total = positions[t] + 1
            m = _parts_of(total) if n <= SPLIT_ROWS else 1
            for c in range(m):
                tasks[i, 0], tasks[i, 1] = kv, t
                tasks[i, 2], tasks[i, 3] = (_part_start(total, c), _part_start(total, c + 1)) if m > 1 else (0, total)
                i += 1
    return tasks


@njit(inline="always", cache=True)
def part_buffers(tasks: np.ndarray, group: int, hd: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Room for what tasks that are parts of a row leave `combine`: per task and query head of the group, the
    unnormalized weighted values [n_tasks, group, hd] (float32), the scores' maximum [n_tasks, group] (float32)
    and the softmax denominator [n_tasks, group] (float64). Empty when every task is a whole row (a plain loop:
    under parallel=True an array expression is a parallel loop of its own, a fork and a join more)."""
    m = 0
    for i in range(len(tasks)):
        if tasks[i, 2] > 0:
            m = len(tasks)
    return np.empty((m, group, hd), np.float32), np.empty((m, group), np.float32), np.empty((m, group))


@njit(fastmath=True, cache=True)
def attend(task: int, tasks: np.ndarray, q: np.ndarray, keys: np.ndarray, values: np.ndarray, width: int,
           slots: np.ndarray, positions: np.ndarray, n_heads: int, out: np.ndarray, part_o: np.ndarray,
           part_top: np.ndarray, part_den: np.ndarray, n_threads: int) -> None:
    """Task `task` of attention_tasks (see attention): a KV head and a row, with the query heads that share
    the head, over the whole row (written to `out`, its parts in turn) or one part of it (its sums left in
    part_o, part_top and part_den: see part_buffers). A function of its own, called, not inlined: its
    fast-math flags stay its own in any caller."""
    n_kv, hd = keys.shape[1], head_dim(keys, width)
    group = n_heads // n_kv
    scale = np.float32(1.0 / np.sqrt(hd))
    kv, t, p0, p1 = tasks[task, 0], tasks[task, 1], tasks[task, 2], tasks[task, 3]
    total = positions[t] + 1
    ks, vs = keys[slots[t], kv], values[slots[t], kv]
    # Flat 1-D loops over views (as the stores above): 2-D indexing here had stayed scalar.
    qg, qs = np.empty(group * hd, np.float32), q[t, kv * group * hd:(kv + 1) * group * hd]
    for i in range(group * hd):
        qg[i] = qs[i] * scale
    # The key and value rows of the task this thread likely runs next (n_threads on: the others claim those
    # between; from its first row: decoding sequences are about as long, and a row's parts are) are requested
    # during this one's scores, so it starts from L2, not memory; unless it reads the same rows (a prompt's next
    # token). A B=8 step at 48 positions on a Zen 5, one thread: attention 2.7-3.1 -> 2.3-2.5 ms; one sequence at
    # 512 positions 2.6-2.8 -> 2.3-2.4 ms. The task after this one, which another thread runs, had been requested
    # whatever the threads: on 2 (Emerald Rapids) a decode step at 2048 positions took 42.2-42.7 ms, now 40.0-40.7.
    nxt = min(task + n_threads, len(tasks) - 1)
    nks = keys[slots[tasks[nxt, 1]], tasks[nxt, 0]].ctypes.data + tasks[nxt, 2] * ks.strides[0]
    nvs = values[slots[tasks[nxt, 1]], tasks[nxt, 0]].ctypes.data + tasks[nxt, 2] * vs.strides[0]
    other = nks != ks.ctypes.data + p0 * ks.strides[0]
    m = _parts_of(total) if p1 - p0 == total else 1
    o, tops, dens = np.empty((m, group, hd), np.float32), np.empty((m, group), np.float32), np.empty((m, group))
    most = min(p1 - p0, CHUNK) if m > 1 else p1 - p0  # the longest part's positions
    scores, bits, lanes = np.empty((group, most), np.float32), np.empty(most, np.int32), np.empty(16, np.float32)
    for c in range(m):
        a, b = (_part_start(total, c), _part_start(total, c + 1)) if m > 1 else (p0, p1)
        _attend_part(ks, vs, width, qg, a, b, nks + (a - p0) * ks.strides[0], nvs + (a - p0) * vs.strides[0],
                     other, scores, bits, lanes, o[c], tops[c], dens[c])
    dst = out[t, kv * group * hd:(kv + 1) * group * hd]
    if m > 1:
        _join(o, tops, dens, dst)
    elif p1 - p0 == total:
        for g in range(group):
            og, dg, ig = o[0, g], dst[g * hd:(g + 1) * hd], np.float32(1.0 / dens[0, g])
            for d in range(hd):
                dg[d] = og[d] * ig
    else:
        part_o[task], part_top[task], part_den[task] = o[0], tops[0], dens[0]


@njit(inline="always", fastmath=True, cache=True)
def _largest(x: np.ndarray, lanes: np.ndarray) -> np.float32:
    """max(x), through `lanes` (room for 16 float32): a running maximum a lane over x's 16-value steps, then the
    rest. One running maximum was a chain of dependent instructions LLVM left scalar: 5.1 -> 0.9 ns a position for
    a group of 4 heads (Emerald Rapids), a tenth of attention. The same value either way: a maximum rounds nothing."""
    lanes[:] = -np.inf
    n16 = len(x) // 16 * 16
    for p in range(0, n16, 16):
        for j in range(16):
            lanes[j] = max(lanes[j], x[p + j])
    top = np.float32(-np.inf)
    for j in range(16):
        top = max(top, lanes[j])
    for p in range(n16, len(x)):
        top = max(top, x[p])
    return top


@njit(inline="always", cache=True)
def _attend_part(ks: np.ndarray, vs: np.ndarray, width: int, qg: np.ndarray, p0: int, p1: int, nks: int, nvs: int,
                 other: bool, scores: np.ndarray, bits: np.ndarray, lanes: np.ndarray, o: np.ndarray,
                 tops: np.ndarray, dens: np.ndarray) -> None:
    """Positions p0..p1 of one KV head's rows ks, vs (their bytes, elements of `width`) for the group's scaled
    queries qg: the unnormalized weighted
    values o [group, hd], the scores' maximum tops [group] and the softmax denominators dens [group]. nks, nvs:
    the addresses of the next part's first key and value rows, requested into the caches with these if other.
    scores [group, >= p1 - p0], bits [>= p1 - p0] and lanes [16]: room."""
    (group, hd), span = o.shape, p1 - p0
    kstride, vstride, sstride = ks.strides[0], vs.strides[0], scores.strides[0]
    k0, v0 = ks.ctypes.data + p0 * kstride, vs.ctypes.data + p0 * vstride
    for p in range(0, span, 2):
        # Positions p, p + 1's value rows are requested into the caches now, with the key rows, so the
        # values pass below reads them from cache, not memory (5-10 % less attention time at 1024
        # positions); and the key rows _KEYS_AHEAD on, about 0.2 us of scores away (one row on was too
        # near to hide a miss: a B=8 step at 48 positions on a Zen 5, one thread: attention 3.0-3.5 ->
        # 2.4-2.9 ms; 16 on did as well).
        for r in range(p, p + 2):
            for c in range(0, vstride, 64):
                prefetch_keep(v0 + r * vstride + c)
                prefetch_keep(k0 + (r + _KEYS_AHEAD) * kstride + c)
                if other:
                    prefetch_keep(nks + r * kstride + c)
                    prefetch_keep(nvs + r * vstride + c)
        args = (k0 + p * kstride, kstride, hd, qg.ctypes.data, hd * 4, group, scores.ctypes.data + p * 4, sstride)
        if p + 1 == span and width == 2:
            _scores_half(*args)
        elif p + 1 == span and width == 1:
            _scores_q8(*args)
        elif p + 1 == span:
            _scores_float(*args)
        elif width == 2:
            _scores2_half(*args)
        elif width == 1:
            _scores2_q8(*args)
        else:
            _scores2_float(*args)
    for g in range(group):
        sg = scores[g, :span]
        top = _largest(sg, lanes)
        exp_shifted(sg, top, bits[:span])
        den = 0.0
        for p in range(span):
            den += sg[p]
        tops[g], dens[g] = top, den
    o[:] = 0
    for b0 in range(0, span, _SUM_BLOCK):
        args = (v0 + b0 * vstride, vstride, min(_SUM_BLOCK, span - b0), hd, scores.ctypes.data + b0 * 4, sstride,
                group, o.ctypes.data, hd * 4)
        if width == 2:
            _wsum_half(*args)
        elif width == 1:
            _wsum_q8(*args)
        else:
            _wsum_float(*args)


@njit(cache=True)
def combine(tasks: np.ndarray, part_o: np.ndarray, part_top: np.ndarray, part_den: np.ndarray,
            out: np.ndarray) -> None:
    """The rows attention ran in parts (see attend) into out, their parts joined by `_join`."""
    if len(part_o) == 0:
        return
    group, hd = part_o.shape[1], part_o.shape[2]
    i = 0
    while i < len(tasks):
        kv, t = tasks[i, 0], tasks[i, 1]
        j = i + 1
        while j < len(tasks) and tasks[j, 0] == kv and tasks[j, 1] == t:
            j += 1
        if j - i > 1:
            _join(part_o[i:j], part_top[i:j], part_den[i:j], out[t, kv * group * hd:(kv + 1) * group * hd])
        i = j


@njit(cache=True)
def _join(o: np.ndarray, tops: np.ndarray, dens: np.ndarray, dst: np.ndarray) -> None:
    """A row's parts (o [m, group, hd], tops and dens [m, group]: see _attend_part) into dst [group * hd]: each
    part's sums rescaled to the row's largest score, in float64, part by part. One function for either way a
    row ran (one task, or a task a part): the same bits."""
    m, group, hd = o.shape
    w, acc = np.empty(m), np.empty(hd)
    for g in range(group):
        top = tops[0, g]
        for c in range(1, m):
            top = max(top, tops[c, g])
        den = 0.0
        for c in range(m):
            w[c] = np.exp(np.float64(tops[c, g]) - np.float64(top))
            den += dens[c, g] * w[c]
        acc[:] = 0.0
        for c in range(m):  # each column's sum in part order; the column loop vectorizes
            oc, wc = o[c, g], w[c]
            for d in range(hd):
                acc[d] += np.float64(oc[d]) * wc
        dg = dst[g * hd:(g + 1) * hd]
        for d in range(hd):
            dg[d] = np.float32(acc[d] / den)
