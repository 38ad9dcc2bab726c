"""The integer kernels: ternary BitLinear on the packed 2-bit codes (int8 activation quantization and
the dot products), and the int8 LM head.

This module is a template executed once per instruction-set level by `isa.kernels(level)`, which
sets ISA (the level of the dot products from `dot_ir`) and CACHE (whether a disk cache
directory of that level's own is in use) before running it; it is not imported by name.

Weights are read as blocks, uint8 [rows, n_blocks, 64] with any row and block stride, so
TQ2_0 runs straight from the memory-mapped file (66-byte blocks: the codes, then the scale). On the avx512vbmi level
the rows with one scale are read as base-3 blocks of RB = 320 weights instead (`pack_base3`, dot_ir), their
activations in natural column order, padded to whole blocks (`quantize_rowscale`).
A call's rows may come from several such arrays stacked (Q, K and V; gate and up). The caller splits
them into parallel tasks, a `tasks` table int64 [n_tasks, 6]: (address of its array's row 0, row
stride in bytes, the task's rows r0..r1 of that array, the array's first row in the stack and its
height); no task crosses from one array into the next (finding a row's array inside the row loop
cost prefill 25 %). One call quantizes its input once and runs one parallel region for them all,
writing each array's result [n, height] contiguous, one after the other, into a flat output (views
of one [n, all rows] result had cost 0.2 s of copies per 128-token prefill).
I2_S (each byte's fields reversed) runs from the file too: its activations are quantized into
the mirrored byte order (`rev`), so the same dot products apply.
The numba drivers parallelize over chunks of weight rows (`prange`); in prefill each chunk
runs every token through its rows, TILE tokens per pass over a row, so weights come from
memory once per call and activations from cache. Integer sums are exact; the float epilogue
follows the reference's operation order in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from bitnet_cpu import float_kernels as fk
from bitnet_cpu.dot_ir import (
    BLOCK,
    CHUNK,
    ENCODE,
    ONE_TOKEN_ROWS,
    TILE,
    VNNI,
    WIDE,
    emit_dot,
    emit_peak,
    emit_q8_dot,
    row_block,
)

try:  # set by bitnet_cpu.isa.build() before it runs this module
    ISA: str = globals()["ISA"]
    CACHE: bool = globals()["CACHE"]
except KeyError:
    raise ImportError("bitnet_cpu.int_kernels is built per instruction set: use bitnet_cpu.isa.kernels()") from None

# Weights a block of the codes of rows with one scale: 320 where they are packed in base 3 (avx512vbmi, see dot_ir),
# whose rows are padded to whole blocks (`pack_base3`). Per-block sums run on 2-bit codes at every level.
RB = row_block(ISA)
BASE3 = RB != BLOCK
_PER_BLOCK_ISA = "avx512vnni" if BASE3 else ISA


def _make_dot(tile: int, per_block: bool) -> Callable[..., Any]:
    """An intrinsic dot(w_addr, n_blocks, w_stride, q_addr, q_stride, n_tok, out_addr) -> None (see emit_dot)."""

    @intrinsic
    def dot(typingctx: Any, w_addr: Any, n_blocks: Any, w_stride: Any, q_addr: Any, q_stride: Any, n_tok: Any,
            out_addr: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            emit_dot(builder, list(args), tile, per_block, _PER_BLOCK_ISA if per_block else ISA)
            return context.get_dummy_value()

        return types.void(*[types.intp] * 7), codegen

    return dot


def _make_rows_dot(tile: int, rows: int) -> Callable[..., Any]:
    """An intrinsic dot(w_addr, n_blocks, w_stride, q_addr, q_stride, n_tok, out_addr, row_stride, pitch, add) -> None:
    `rows` rows per pass, their sums stored (or added) at out_addr [tile, pitch] (see emit_dot)."""

    @intrinsic
    def dot(typingctx: Any, w_addr: Any, n_blocks: Any, w_stride: Any, q_addr: Any, q_stride: Any, n_tok: Any,
            out_addr: Any, row_stride: Any, pitch: Any, add: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            emit_dot(builder, list(args), tile, False, ISA, rows=rows)
            return context.get_dummy_value()

        return types.void(*[types.intp] * 10), codegen

    return dot


def _make_q8_dot(tile: int, rows: int = 1) -> Callable[..., Any]:
    """An intrinsic q8dot(w_addr, n_chunks, q_addr, q_stride, n_tok, out_addr, qsum_addr, w_stride, pitch) -> None
    (see emit_q8_dot; w_stride is read only with rows=2)."""

    @intrinsic
    def q8dot(typingctx: Any, w_addr: Any, n_chunks: Any, q_addr: Any, q_stride: Any, n_tok: Any,
              out_addr: Any, qsum_addr: Any, w_stride: Any, pitch: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            emit_q8_dot(builder, list(args), tile, ISA, rows)
            return context.get_dummy_value()

        return types.void(*[types.intp] * 9), codegen

    return q8dot


@intrinsic
def _peak(typingctx: Any, n_iter: Any) -> Any:
    """peak(n_iter) -> int64 (see emit_peak; the generic level has none)."""
    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        return emit_peak(builder, args[0], ISA)

    return types.int64(types.intp), codegen


@njit(parallel=True, cache=CACHE)
def multiply_peak(n_iter: int, parts: int) -> int:
    """The multiply-add probe (dot_ir.emit_peak) run n_iter rounds on each of `parts` threads: the summed
    checksums. The benchmarks time it; dot_ir.peak_products gives the int8 products per round."""
    out = np.zeros(parts, np.int64)
    for p in prange(parts):
        out[p] = _peak(n_iter)
    return out.sum()


# One, two and TILE tokens per pass: a pass computes all of its width, so two tokens (two sequences
# decoding side by side) through the TILE kernel cost as much as TILE.
_q8_dot_1 = _make_q8_dot(1)
_q8_dot_2 = _make_q8_dot(2)
_q8_dot = _make_q8_dot(TILE)
_q8_dot_wide = _make_q8_dot(WIDE)  # from 5 tokens on: each row read once for up to WIDE of them
# VNNI, TILE tokens or more: two rows per pass (table rows here, weight rows in BitLinear) share each activation
# load (see emit_dot, emit_q8_dot).
_PAIRS = ISA in VNNI
_q8_dot_pair = _make_q8_dot(TILE, 2) if _PAIRS else _q8_dot
_q8_dot_wide_pair = _make_q8_dot(WIDE, 2) if _PAIRS else _q8_dot_wide

# -- activation quantization (float32 arithmetic exactly as the reference: no fastmath) -----------

# Adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude below 2**22 to an integer,
# half to even, in the default rounding mode (np.rint, but vectorizable).
_ROUND = np.float32(12582912.0)


@njit(inline="always", cache=CACHE)
def _quantize_block(x: np.ndarray, src: int, scale: np.float32, q: np.ndarray, dst: int, rev: bool) -> int:
    """q[dst:dst+256] = clamp(rint(x[src:src+256] * scale)) in byte order (with rev, the byte order
    of weights whose fields are reversed: field f holds the columns of field 3 - f); returns their sum."""
    for f in range(4):
        for g in range(2):
            i0, o0 = src + 128 * g + 32 * (3 - f if rev else f), dst + 64 * f + 32 * g
            for j in range(32):
                v = (x[i0 + j] * scale + _ROUND) - _ROUND
                q[o0 + j] = np.int8(min(max(v, np.float32(-128.0)), np.float32(127.0)))
    acc = np.int32(0)
    for j in range(BLOCK):
        acc += np.int32(q[dst + j])
    return acc


@njit(inline="always", cache=CACHE)
def _row_scale(x: np.ndarray) -> np.float32:
    """BitNet's per-row activation scale: 127/max|x|, 1 for a zero row."""
    amax = fk.amax(x)
    return np.float32(127.0) / amax if amax > 0 else np.float32(1.0)


@njit(inline="always", cache=CACHE)
def quantize_rows(x: np.ndarray, q: np.ndarray, s: np.ndarray, qsum: np.ndarray, rev: bool) -> None:
    """BitNet per-row int8: s = 127/max|x| (1 for a zero row), q = clamp(rint(x*s)) in byte order,
    qsum[t, b] = sum of block b's q."""
    n, cols = x.shape
    for t in range(n):
        st = s[t] = _row_scale(x[t])
        for b in range(cols // BLOCK):
            qsum[t, b] = _quantize_block(x[t], b * BLOCK, st, q[t], b * BLOCK, rev)


@njit(inline="always", cache=CACHE)
def row_blocks(cols: int) -> int:
    """Blocks of RB weights a row of `cols` takes (the last one padded)."""
    return -(-cols // RB)


@njit(inline="always", cache=CACHE)
def quantize_rowscale(x: np.ndarray, q: np.ndarray, s: np.ndarray, qsum: np.ndarray, rev: bool) -> None:
    """quantize_rows for the codes of rows with one scale: on base-3 codes in natural column order, q [n,
    row_blocks(cols) * RB] zero past the columns, qsum per RB-block (rev, the I2_S byte order, is gone there)."""
    if not BASE3:
        quantize_rows(x, q, s, qsum, rev)
        return
    n, cols = x.shape
    for t in range(n):
        # Through 1-D views: the block sums' loop over q[t, j] had stayed scalar, 1.5 of the 2.0 us that a
        # 6912-wide row took (Zen 5), 0.6 us now, as the other levels' quantize_rows.
        xt, qt = x[t], q[t]
        st = s[t] = _row_scale(xt)
        for c in range(cols):
            v = (xt[c] * st + _ROUND) - _ROUND
            qt[c] = np.int8(min(max(v, np.float32(-128.0)), np.float32(127.0)))
        for c in range(cols, len(qt)):
            qt[c] = 0
        for b in range(qsum.shape[1]):
            block, acc = qt[b * RB:(b + 1) * RB], np.int32(0)
            for j in range(RB):
                acc += np.int32(block[j])
            qsum[t, b] = acc


@njit(parallel=True, cache=CACHE)
def pack_base3(blocks: np.ndarray, rev: bool, out: np.ndarray) -> None:
    """out [rows, row_blocks(cols), 64] = the 2-bit codes `blocks` [rows, cols // BLOCK, 64] (byte order; rev: I2_S's)
    packed five to a byte in base 3: byte l of block m is ENCODE[sum_s 3**s * c[320m + 64s + l]] (see dot_ir), columns
    past the row's code 1 (a zero weight; their activations are zero too)."""
    if blocks.shape[0] == 1:  # (base3_cache's check of a row: starting the threads took 25 us a call)
        _pack_base3_row(blocks, 0, rev, out)
        return
    for r in prange(blocks.shape[0]):
        _pack_base3_row(blocks, r, rev, out)


@njit(inline="always", cache=CACHE)
def _pack_base3_row(blocks: np.ndarray, r: int, rev: bool, out: np.ndarray) -> None:
    nb, nb3 = blocks.shape[1], out.shape[1]
    c = np.empty(nb3 * RB, np.uint8)  # the row's codes in column order
    for b in range(nb):
        for f in range(4):
            shift = 2 * (3 - f if rev else f)
            for g in range(2):
                at = b * BLOCK + 128 * g + 32 * f
                for j in range(32):
                    c[at + j] = (blocks[r, b, 32 * g + j] >> shift) & 3
    for i in range(nb * BLOCK, nb3 * RB):
        c[i] = 1
    for m in range(nb3):
        for j in range(64):
            i = m * RB + j
            out[r, m, j] = ENCODE[c[i] + 3 * c[i + 64] + 9 * c[i + 128] + 27 * c[i + 192] + 81 * c[i + 256]]


@njit(inline="always", cache=CACHE)
def quantize_q8k(x: np.ndarray, q: np.ndarray, d: np.ndarray, qsum: np.ndarray, rev: bool) -> None:
    """llama.cpp's Q8_K per 256-block: v the first value of largest magnitude, iscale = -127/v,
    q = clamp(rint(x*iscale)) in byte order, d = 1/iscale; an all-zero block gets q = 0, d = 0."""
    n, cols = x.shape
    for t in range(n):
        for b in range(cols // BLOCK):
            base = b * BLOCK
            amax = np.float32(-1.0)
            v = np.float32(0.0)
            for i in range(BLOCK):
                a = abs(x[t, base + i])
                if a > amax:
                    amax = a
                    v = x[t, base + i]
            if v == 0:
                d[t, b] = 0.0
                for i in range(BLOCK):
                    q[t, base + i] = 0
                qsum[t, b] = 0
            else:
                iscale = np.float32(-127.0) / v
                d[t, b] = np.float32(1.0) / iscale
                qsum[t, b] = _quantize_block(x[t], base, iscale, q[t], base, rev)


@njit(inline="always", cache=CACHE)
def int8_rows(n: int, cols: int) -> np.ndarray:
    """An empty int8 [n, cols] whose rows start on 64-byte lines (cols a multiple of 64), so no 512-bit load
    of a row spans two lines. malloc aligns to 16 bytes, and a process kept one offset for all its calls:
    a B=8 step's BitLinear took 21 or 45 ms on a Zen 5 by the luck of the process."""
    buf = np.empty(n * cols + 64, np.int8)
    off = -buf.ctypes.data % 64
    return buf[off:off + n * cols].reshape((n, cols))


# -- BitLinear drivers ----------------------------------------------------------------------------

def _make_sums(per_block: bool, wide: bool) -> Callable[..., None]:
    """sums(w0, wstride, r0, r1, nb, bstride, qaddr, qstride, nt, isum, acc, add): the integer sums of rows r0..r1
    for nt tokens into acc [nt, nb if per_block else 1, r1 - r0] (isum: nt * nb scratch), or added to it; nt <= WIDE
    with wide, else nt <= TILE.

    Row last, so the float epilogue runs over a task's rows in SIMD, apart from the dot (a scalar
    epilogue after each row's dot had cost up to 8 % of a call at 2-8 tokens; its zero-division
    check, hence error_model="numpy" on the drivers, kept LLVM from vectorizing the division: the
    divisors are 127/max|x| or 1, never 0)."""
    one, two, tile = (_make_dot(t, per_block) for t in (1, 2, TILE))
    big = _make_dot(WIDE, per_block) if wide else tile
    pairs = _PAIRS and not per_block
    tile2 = _make_rows_dot(TILE, 2) if pairs else tile
    big2 = _make_rows_dot(WIDE, 2) if pairs and wide else tile2
    # One token on Intel's AVX-512 VNNI: four rows a pass, 16 accumulator chains, one epilogue for four rows (a Xeon's
    # projections 1.6-2.5 % faster; 16 ymm would spill them). One row elsewhere: four made a Zen 5 EPYC's decode step
    # 7-11 % slower. ONE_TOKEN_ROWS follows the vendor, as the stream hint does.
    rows1 = 1 if per_block else ONE_TOKEN_ROWS.get(ISA, 1)
    if rows1 > 1:
        one_rows = _make_rows_dot(1, rows1)

        @njit(inline="always", cache=CACHE)
        def one_token(w0: int, wstride: int, r0: int, r1: int, nb: int, bstride: int, qaddr: int, qstride: int,
                      acc: np.ndarray) -> None:
            for r in range(r0, r1, rows1):
                one_rows(w0 + r * wstride, nb, bstride, qaddr, qstride, 1, acc.ctypes.data + 4 * (r - r0), wstride,
                         acc.shape[2], False)
    else:
        @njit(inline="always", cache=CACHE)
        def one_token(w0: int, wstride: int, r0: int, r1: int, nb: int, bstride: int, qaddr: int, qstride: int,
                      acc: np.ndarray) -> None:
            for r in range(r0, r1):
                one(w0 + r * wstride, nb, bstride, qaddr, qstride, 1, acc.ctypes.data + 4 * (r - r0))

    @njit(inline="always", cache=CACHE)
    def sums(w0: int, wstride: int, r0: int, r1: int, nb: int, bstride: int, qaddr: int, qstride: int, nt: int,
             isum: np.ndarray, acc: np.ndarray, add: bool = False) -> None:
        k = nb if per_block else 1
        r = r0
        if not per_block and nt == 1 and not add:
            # One token: nothing but its rows' dots in the loop, each sum stored straight into acc; the rows past
            # the last whole pass below. A Zen 5 decode step's projections, one thread, 6 alternating rounds:
            # 13.50-14.15 ms (median 13.68) through the general loop, 13.21-13.92 (13.43) so.
            r = r1 - (r1 - r0) % rows1
            one_token(w0, wstride, r0, r, nb, bstride, qaddr, qstride, acc)
        while r < r1:
            waddr = w0 + r * wstride
            if pairs and nt >= TILE and r + 1 < r1:
                at = acc.ctypes.data + 4 * (r - r0)
                if nt <= TILE:
                    tile2(waddr, nb, bstride, qaddr, qstride, nt, at, wstride, acc.shape[2], add)
                else:
                    big2(waddr, nb, bstride, qaddr, qstride, nt, at, wstride, acc.shape[2], add)
                r += 2
                continue
            if nt == 1:
                one(waddr, nb, bstride, qaddr, qstride, 1, isum.ctypes.data)
            elif nt == 2:
                two(waddr, nb, bstride, qaddr, qstride, 2, isum.ctypes.data)
            elif nt <= TILE:
                tile(waddr, nb, bstride, qaddr, qstride, nt, isum.ctypes.data)
            else:
                big(waddr, nb, bstride, qaddr, qstride, nt, isum.ctypes.data)
            for i in range(nt):
                for b in range(k):
                    acc[i, b, r - r0] = isum[i * k + b] + (acc[i, b, r - r0] if add else 0)
            r += 1

    return sums


_row_sums, _block_sums = _make_sums(False, True), _make_sums(True, False)


@njit(inline="always", cache=CACHE)
def row_totals(qsum: np.ndarray, qtot: np.ndarray) -> None:
    """qtot[t] = token t's sum of its block sums, float64: exact (|total| < 2**53), so float64(isum) - total is
    float64(isum - total)."""
    n, nb = qsum.shape
    for t in range(n):
        total = 0
        for b in range(nb):
            total += qsum[t, b]
        qtot[t] = total


@njit(inline="always", cache=CACHE)
def column_blocks(nb: int, wide_bytes: int) -> int:
    """Blocks a WIDE pass takes at a time: its tokens' activations stay in L1. A wider row (6912 columns) runs
    as a few such parts over all of a task's rows in turn, adding up exact int32 sums; whole rows of 8 tokens
    (55 KB) had come from L2 in every pass: 450 G products/s against 650 at 2560 columns."""
    parts = -(-(nb * RB * WIDE) // wide_bytes)
    return -(-nb // parts)


@njit(inline="always", cache=CACHE, error_model="numpy")
def rowscale_task(tasks: np.ndarray, task: int, nb: int, bstride: int, q: np.ndarray, qtot: np.ndarray,
                  s: np.ndarray, row_scale: np.ndarray, out: np.ndarray, kb: int, isum: np.ndarray,
                  acc: np.ndarray) -> None:
    """One task of matmul_rowscale, every token of q through its rows (isum: 2 WIDE int32 of scratch, acc:
    [WIDE, 1, at least its rows])."""
    n, qstride = q.shape[0], q.strides[0]
    w0, wstride, r0, r1 = tasks[task, 0], tasks[task, 1], tasks[task, 2], tasks[task, 3]
    first, height = tasks[task, 4], tasks[task, 5]
    scale = row_scale[first + r0:first + r1]
    t0 = 0
    while t0 < n:
        # WIDE tokens at a time while 7 or more are left (5 or 6 cost less as a TILE pass and the rest)
        nt = min(WIDE, n - t0) if n - t0 >= WIDE - 1 else min(TILE, n - t0)
        if nt <= TILE:
            _row_sums(w0, wstride, r0, r1, nb, bstride, q.ctypes.data + t0 * qstride, qstride, nt, isum, acc)
        else:
            for b0 in range(0, nb, kb):
                _row_sums(w0 + b0 * bstride, wstride, r0, r1, min(kb, nb - b0), bstride,
                          q.ctypes.data + t0 * qstride + b0 * RB, qstride, nt, isum, acc, b0 > 0)
        for i in range(nt):
            t = t0 + i
            o = out[n * first + t * height + r0:n * first + t * height + r1]
            st, qt = np.float64(s[t]), qtot[t]
            for j in range(r1 - r0):
                o[j] = np.float32((np.float64(acc[i, 0, j]) - qt) * np.float64(scale[j]) / st)
        t0 += nt


@njit(parallel=True, inline="always", cache=CACHE, error_model="numpy")
def matmul_rowscale(tasks: np.ndarray, nb: int, bstride: int, q: np.ndarray, qsum: np.ndarray, s: np.ndarray,
                    row_scale: np.ndarray, out: np.ndarray, wide_bytes: int) -> None:
    """out[t, r] = (sum(t*q) * row_scale[r]) / s[t]: "row" quantization, one weight scale per row
    (out flat, each array's [n, height] in turn; r a row of the stack)."""
    qtot, kb = np.empty(q.shape[0], np.float64), column_blocks(nb, wide_bytes)
    row_totals(qsum, qtot)
    for task in prange(tasks.shape[0]):
        isum, acc = np.empty(2 * WIDE, np.int32), np.empty((WIDE, 1, tasks[task, 3] - tasks[task, 2]), np.int32)
        rowscale_task(tasks, task, nb, bstride, q, qtot, s, row_scale, out, kb, isum, acc)


@njit(parallel=True, inline="always", cache=CACHE, error_model="numpy")
def matmul_blockscale(tasks: np.ndarray, nb: int, bstride: int, q: np.ndarray, qsum: np.ndarray, scales: np.ndarray,
                      act_scale: np.ndarray, per_block_act: bool, out: np.ndarray) -> None:
    """Per-block weight scales and/or per-block activation scales.

    per_block_act (Q8_K, "block256"): out[t, r] = sum_b isum * scales[r, b] * act_scale[t, b];
    else ("row" with block scales): out[t, r] = sum_b (isum * scales[r, b]) / act_scale[t, 0].
    """
    n, qstride = q.shape[0], q.strides[0]
    for task in prange(tasks.shape[0]):
        w0, wstride, r0, r1 = tasks[task, 0], tasks[task, 1], tasks[task, 2], tasks[task, 3]
        first, height = tasks[task, 4], tasks[task, 5]
        isum, acc = np.empty(TILE * nb, np.int32), np.empty((TILE, nb, r1 - r0), np.int32)
        scale = scales[first + r0:first + r1].T.copy()  # [nb, rows]: the epilogue runs along rows
        total = np.empty(r1 - r0, np.float64)
        for t0 in range(0, n, TILE):
            nt = min(TILE, n - t0)
            _block_sums(w0, wstride, r0, r1, nb, bstride, q.ctypes.data + t0 * qstride, qstride, nt, isum, acc)
            for i in range(nt):
                t = t0 + i
                total[:] = 0.0
                # Each row sums its blocks in order, as the reference does; a factor or divisor of 1.0
                # where the reference has none changes no bit.
                for b in range(nb):
                    qb = np.float64(qsum[t, b])
                    ab = np.float64(act_scale[t, b]) if per_block_act else 1.0
                    for j in range(r1 - r0):
                        total[j] += (np.float64(acc[i, b, j]) - qb) * np.float64(scale[b, j]) * ab
                div = 1.0 if per_block_act else np.float64(act_scale[t, 0])
                o = out[n * first + t * height + r0:n * first + t * height + r1]
                for j in range(r1 - r0):
                    o[j] = np.float32(total[j] / div)


# -- BitLinear entry points: quantize and multiply in one call from Python --------------------------
# (Decode makes 120 of these calls per token: each Python-side allocation or dispatch saved counts.)
# tasks, bstride: the stacked code arrays' parallel tasks and their block stride (see the module docstring).

@njit(parallel=True, cache=CACHE, error_model="numpy")
def bitlinear_row_rowscale(x: np.ndarray, tasks: np.ndarray, bstride: int, row_scale: np.ndarray,
                           rev: bool, wide_bytes: int) -> np.ndarray:
    """"row" quantization, one weight scale per row: y, each array's [n, its rows] in turn (flat); column parts
    of at most wide_bytes of activations per WIDE pass (isa.wide_bytes)."""
    n, nb = x.shape[0], row_blocks(x.shape[1])
    q, s = int8_rows(n, nb * RB), np.empty(n, np.float32)
    qsum = np.empty((n, nb), np.int32)
    quantize_rowscale(x, q, s, qsum, rev)
    out = np.empty(n * row_scale.shape[0], np.float32)
    matmul_rowscale(tasks, nb, bstride, q, qsum, s, row_scale, out, wide_bytes)
    return out


@njit(parallel=True, cache=CACHE, error_model="numpy")
def bitlinear_row_blockscale(x: np.ndarray, tasks: np.ndarray, bstride: int, scales: np.ndarray,
                             rev: bool) -> np.ndarray:
    """"row" quantization, a weight scale per 256-block: y as bitlinear_row_rowscale's."""
    n, cols = x.shape
    q, s = int8_rows(n, cols), np.empty((n, 1), np.float32)
    qsum = np.empty((n, cols // BLOCK), np.int32)
    quantize_rows(x, q, s[:, 0], qsum, rev)
    out = np.empty(n * scales.shape[0], np.float32)
    matmul_blockscale(tasks, cols // BLOCK, bstride, q, qsum, scales, s, False, out)
    return out


@njit(parallel=True, cache=CACHE, error_model="numpy")
def bitlinear_block256(x: np.ndarray, tasks: np.ndarray, bstride: int, scales: np.ndarray, rev: bool) -> np.ndarray:
    """"block256" (Q8_K) quantization: y as bitlinear_row_rowscale's."""
    n, cols = x.shape
    q, d = int8_rows(n, cols), np.empty((n, cols // BLOCK), np.float32)
    qsum = np.empty((n, cols // BLOCK), np.int32)
    quantize_q8k(x, q, d, qsum, rev)
    out = np.empty(n * scales.shape[0], np.float32)
    matmul_blockscale(tasks, cols // BLOCK, bstride, q, qsum, scales, d, True, out)
    return out


# -- the int8 LM head ---------------------------------------------------------------------------------

_HEAD_ROWS = 64  # rows whose sums wait for one epilogue: a few hundred cycles of it between their dots
_TOKEN_ROWS = 4096  # one token's rows a task (see lm_head_q8)


@njit(parallel=True, cache=CACHE, error_model="numpy")  # no fastmath: the float64 epilogue is the reference's
def lm_head_q8(q: np.ndarray, s: np.ndarray, table: np.ndarray, scale: np.ndarray, rows_per_task: int,
               out: np.ndarray) -> None:
    """out[t, r] = sum_i q[t, i] * table[r, i] * scale[r] / s[t]: int8 codes in [-127, 127], an exact int32 sum.

    Up to WIDE tokens share each pass over a table row (the row stays in L1); the columns past the last
    whole CHUNK are summed here. The float epilogue runs over a task's rows in SIMD once their sums
    are done (see _make_sums; s is 127/max|x| or 1, never 0). One token takes tasks of _TOKEN_ROWS rows,
    whatever rows_per_task says.
    """
    vocab, dim = table.shape
    n = q.shape[0]
    whole = dim // CHUNK
    qstride = q.strides[0]
    qsum = np.zeros(n, np.int32)  # each token's sum over the whole chunks (see emit_q8_dot)
    for t in range(n):
        for c in range(whole * CHUNK):
            qsum[t] += q[t, c]
    if n == 1:
        # One token: a task's rows through one loop of their dots, then one epilogue. Through the general loop below
        # (64-row groups) a Zen 5 thread had read 38.6-39.1 GB/s of 2B-4T's table; so, 41.2-42.5 (a plain read of
        # it: 43-44 GB/s).
        for task in prange((vocab + _TOKEN_ROWS - 1) // _TOKEN_ROWS):
            lo, hi = task * _TOKEN_ROWS, min(vocab, (task + 1) * _TOKEN_ROWS)
            acc1 = np.empty(hi - lo, np.int32)
            wstride = table.strides[0]
            for r in range(lo, hi):
                _q8_dot_1(table.ctypes.data + r * wstride, whole, q.ctypes.data, qstride, 1,
                          acc1.ctypes.data + 4 * (r - lo), qsum.ctypes.data, wstride, 1)
            if whole * CHUNK < dim:
                for r in range(lo, hi):
                    total = acc1[r - lo]
                    for c in range(whole * CHUNK, dim):
                        total += np.int32(table[r, c]) * np.int32(q[0, c])
                    acc1[r - lo] = total
            rows, o, st = scale[lo:hi], out[0, lo:hi], np.float64(s[0])
            for j in range(hi - lo):
                o[j] = np.float32(np.float64(acc1[j]) * np.float64(rows[j]) / st)
        return
    for task in prange((vocab + rows_per_task - 1) // rows_per_task):
        acc = np.empty((n, _HEAD_ROWS), np.int32)  # the passes store [token, row] sums straight into it
        wstride = table.strides[0]
        for lo in range(task * rows_per_task, min(vocab, (task + 1) * rows_per_task), _HEAD_ROWS):
            hi = min(vocab, (task + 1) * rows_per_task, lo + _HEAD_ROWS)
            r = lo
            while r < hi:
                pair = _PAIRS and n >= TILE and r + 1 < hi
                waddr = table.ctypes.data + r * wstride
                t0 = 0
                while t0 < n:
                    nt = min(WIDE, n - t0) if n - t0 > TILE else n - t0
                    qaddr, saddr = q.ctypes.data + t0 * qstride, qsum.ctypes.data + 4 * t0
                    at = acc.ctypes.data + 4 * (t0 * _HEAD_ROWS + r - lo)
                    if pair and nt > TILE:
                        _q8_dot_wide_pair(waddr, whole, qaddr, qstride, nt, at, saddr, wstride, _HEAD_ROWS)
                    elif pair:  # TILE tokens or fewer left: the TILE pass, its extra tokens not stored
                        _q8_dot_pair(waddr, whole, qaddr, qstride, nt, at, saddr, wstride, _HEAD_ROWS)
                    elif nt > TILE:
                        _q8_dot_wide(waddr, whole, qaddr, qstride, nt, at, saddr, wstride, _HEAD_ROWS)
                    elif nt == 1:
                        _q8_dot_1(waddr, whole, qaddr, qstride, 1, at, saddr, wstride, _HEAD_ROWS)
                    elif nt == 2:
                        _q8_dot_2(waddr, whole, qaddr, qstride, 2, at, saddr, wstride, _HEAD_ROWS)
                    else:
                        _q8_dot(waddr, whole, qaddr, qstride, nt, at, saddr, wstride, _HEAD_ROWS)
                    if whole * CHUNK < dim:
                        for i in range(nt):
                            for j in range(2 if pair else 1):
                                total = acc[t0 + i, r + j - lo]
                                for c in range(whole * CHUNK, dim):
                                    total += np.int32(table[r + j, c]) * np.int32(q[t0 + i, c])
                                acc[t0 + i, r + j - lo] = total
                    t0 += nt
                r += 2 if pair else 1
            rows = scale[lo:hi]
            for t in range(n):
                o, st = out[t, lo:hi], np.float64(s[t])
                for j in range(hi - lo):
                    o[j] = np.float32(np.float64(acc[t, j]) * np.float64(rows[j]) / st)
