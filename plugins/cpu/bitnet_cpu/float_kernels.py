"""Float kernels of the decode path: the F16 LM head, the build of its int8 twin, RMSNorm, rope, the FFN
activation (attention, which shares their IR helpers, is `attention`).

The LM head is half the bytes a decode step reads (128256 x 2560 F16 = 0.66 GB for the 2B-4T
shape), so it streams the F16 table once, converting in registers: numba has no float16
type, so the dot (`emit_rows_dot`, LLVM IR) reads the uint16 bits as LLVM `half` vectors and
extends them (`vcvtph2ps` on F16C/AVX-512 hosts). The table is validated finite at load, so no
NaN/Inf special cases are needed. Each (row, token) sums in two float32 vector accumulators that
take alternate 8- or 16-column steps (a ymm, or a zmm on AVX-512 hosts) over the whole row, in an order
fixed by the IR and the same however many rows and tokens a pass takes, so a token's logits never depend
on its batch; they stay within
~1e-6 relative of the float64 reference. A pass takes one token over one row (two rows on 8 lanes), two
tokens over two rows, or four tokens over one row: each converted vector serves every token of the pass, each
token vector every row, and 8 accumulators at most leave AVX2's other registers to the operands (16 spilled). Each
step requests the next pass's rows as far along as it is, with the ternary codes' hint
(`dot_ir.STREAM_LOCALITY`: on a 2-core Emerald Rapids Xeon `prefetcht2` made one token 1.42x faster on one
thread than `prefetchnta`, which AMD keeps): one linear stream, where each row requesting its own lines ahead
streamed DRAM 15-40 % slower with several rows per pass. On a Zen 1 EPYC (2026-11, 128256 x 2560,
medians, one thread / two): one token 55 / 29 ms (54 / 28 when a row and its four tokens took a
pass of 16 accumulators), two 70 / 36 ms (131 / 70-86), eight 198 / 105 ms (256 / 131).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bitnet_cpu import dot_ir, isa


@intrinsic
def _as_float(typingctx: Any, x: Any) -> Any:
    """float32 of a stored value: F16 bits (uint16: numba has no float16 arrays) converted, float32 as it is."""
    if x == types.uint16:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    elif x == types.float32:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            return args[0]
    else:
        return None
    return types.float32(x), codegen


_ACCS = 2  # accumulators per (row, token), taking alternate lane steps: two FMA chains in flight
# (tokens, table rows) per pass, by the row dots' lanes: at most 8 of AVX2's 16 registers accumulate; the last takes
# any row count. One token reads one row a pass on 16 lanes, one stream: on the Zen 5 EPYC two rows a pass had read
# 35.2 GB/s on one thread against one row's 39.3 (four: 34.6), and decode steps with the F16 head took 3.9 % (1
# thread) and 5.5 % (2) longer; on the Emerald Rapids Xeon the two had read alike (13.8-14.3 against 14.2-14.5 GB/s,
# 2 threads 27.9 / 25.4-28.0). On 8 lanes the dot is nearer its compute bound and two rows share each token vector:
# on the Zen 5, one token 36.3 GB/s with two rows against 35.1 with one, two tokens 35.7 against 29.8.
_PASSES = {16: ((1, 1), (2, 2), (4, 1)), 8: ((1, 2), (2, 2), (4, 1))}
_STEP = 32  # columns per loop iteration: one 64-byte line of an F16 row, in lane steps of 8 or 16 columns
# float32 lanes of an accumulator: a zmm on AVX-512 hosts, where 8 lanes (a ymm) had left the F16 head below the
# stream: on the 2-core Emerald Rapids Xeon 12.2 -> 14.2 GB/s on one thread, 23-25 -> 27-28 on two (2B-4T's
# 128256 x 2560 table, alternating in one process; the int8 head's dot streams at 15.2 / 29.2 there).
_LANES = isa.float_lanes()


def as_f32(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """An F16, int8 or float32 value or vector as float32 (exact: each holds a float32's value)."""
    elem = v.type.element if isinstance(v.type, ir.VectorType) else v.type
    f32 = ir.VectorType(ir.FloatType(), v.type.count) if isinstance(v.type, ir.VectorType) else ir.FloatType()
    if isinstance(elem, ir.HalfType):
        return b.fpext(v, f32)
    return b.sitofp(v, f32) if isinstance(elem, ir.IntType) else v


def _f32_vector(b: ir.IRBuilder, row: ir.Value, at: ir.Value, lanes: int) -> ir.Value:
    """`lanes` values of a row (a pointer to F16, int8 or float32) from index `at` on, as float32."""
    elem = row.type.pointee
    v = b.load(b.bitcast(b.gep(row, [at]), ir.VectorType(elem, lanes).as_pointer()), align=_SIZE[str(elem)])
    return as_f32(b, v)


_SIZE = {"half": 2, "float": 4, "i8": 1}  # bytes of an element type (an alignment the rows keep)


def emit_rows_dot(b: ir.IRBuilder, args: list[ir.Value], rows: int, tile: int, half: bool, lanes: int) -> None:
    """The body of dot(w_addr, w_stride, n, x_addr, x_stride, n_tok, out_addr, out_stride), all i64:
    float32 out[t][r] = the sum over i < n of w_r[i] * x_t[i], for `rows` table rows w_r (F16 with
    half, else float32; w_stride bytes apart) and up to `tile` token rows x_t (float32, x_stride bytes
    apart; tokens past n_tok reuse the last and are not stored), out rows out_stride bytes apart.

    Each (row, token) sums in _ACCS vector accumulators of `lanes` floats over the whole row: the k-th
    lane step of each whole _STEP into accumulator k % _ACCS, the lane steps after the last whole _STEP
    into the first; then the accumulators added, their lanes folded in halves, and the columns past
    the last whole lane step added one by one. That order is the same for any rows x tile, so a
    token's logits are the same bits alone or in a batch (for one `lanes`: the host's). A converted F16
    vector serves all `tile` tokens, an x vector all `rows` rows.
    """
    w_i, w_stride, n, x_i, xstride, ntok, out_i, out_stride = args
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    elem, size = (ir.HalfType(), 2) if half else (f32, 4)
    vf = ir.VectorType(f32, lanes)
    mod = b.module
    fma_v = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{lanes}f32")
    i8p = ir.IntType(8).as_pointer()
    ws = [b.inttoptr(b.add(w_i, b.mul(ir.Constant(i64, r), w_stride)), elem.as_pointer()) for r in range(rows)]
    ahead = b.inttoptr(b.add(w_i, b.mul(ir.Constant(i64, rows), w_stride)), i8p)
    last = b.sub(ntok, ir.Constant(i64, 1))
    xs = []
    for t in range(tile):
        row = b.select(b.icmp_signed("<", ir.Constant(i64, t), ntok), ir.Constant(i64, t), last)
        xs.append(b.inttoptr(b.add(x_i, b.mul(row, xstride)), f32.as_pointer()))
    accs = [[[cgutils.alloca_once_value(b, ir.Constant(vf, None)) for _ in range(_ACCS)] for _ in range(tile)]
            for _ in range(rows)]

    def lane_step(i: ir.Value, a: int) -> None:
        wv = [_f32_vector(b, w, i, lanes) for w in ws]
        for t in range(tile):
            xv = b.load(b.bitcast(b.gep(xs[t], [i]), vf.as_pointer()), align=4)
            for r in range(rows):
                b.store(b.call(fma_v, [wv[r], xv, b.load(accs[r][t][a])]), accs[r][t][a])

    with cgutils.for_range(b, b.sdiv(n, ir.Constant(i64, _STEP))) as loop:
        i0 = b.mul(loop.index, ir.Constant(i64, _STEP))
        for line in range(0, rows * _STEP * size, 64):  # the next pass's rows, as far along as this pass is
            where = b.add(b.mul(i0, ir.Constant(i64, rows * size)), ir.Constant(i64, line))
            dot_ir.prefetch_at(b, ahead, where, dot_ir.STREAM_LOCALITY)
        for u in range(_STEP // lanes):
            lane_step(b.add(i0, ir.Constant(i64, u * lanes)), u % _ACCS)
    done = b.mul(b.sdiv(n, ir.Constant(i64, _STEP)), ir.Constant(i64, _STEP))
    with cgutils.for_range(b, b.sdiv(b.sub(n, done), ir.Constant(i64, lanes))) as loop:
        lane_step(b.add(done, b.mul(loop.index, ir.Constant(i64, lanes))), 0)
    done = b.mul(b.sdiv(n, ir.Constant(i64, lanes)), ir.Constant(i64, lanes))
    sums = [[None] * tile for _ in range(rows)]
    for r in range(rows):
        for t in range(tile):
            v, width = b.fadd(*[b.load(a) for a in accs[r][t]]), lanes
            while width > 1:
                width //= 2
                halves = [b.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(k, k + width))))
                          for k in (0, width)]
                v = b.fadd(*halves)
            sums[r][t] = cgutils.alloca_once_value(b, b.extract_element(v, ir.Constant(i32, 0)))
    _scalar_tail(b, done, n, ws, xs, sums)
    for t in range(tile):
        with b.if_then(b.icmp_signed("<", ir.Constant(i64, t), ntok)):
            out = b.inttoptr(b.add(out_i, b.mul(ir.Constant(i64, t), out_stride)), f32.as_pointer())
            for r in range(rows):
                b.store(b.load(sums[r][t]), b.gep(out, [ir.Constant(i64, r)]))


def _scalar_tail(b: ir.IRBuilder, done: ir.Value, n: ir.Value, ws: list[ir.Value], xs: list[ir.Value],
                 sums: list[list[ir.Value]]) -> None:
    """sums[r][t] += w_r[i] * x_t[i] for the columns done <= i < n, one at a time, in order (w F16, int8 or
    float32)."""
    f32 = ir.FloatType()
    fma_s = cgutils.get_or_insert_function(b.module, ir.FunctionType(f32, [f32] * 3), "llvm.fmuladd.f32")
    with cgutils.for_range(b, b.sub(n, done)) as tail:
        i = b.add(done, tail.index)
        for w, row in zip(ws, sums, strict=True):
            wi = as_f32(b, b.load(b.gep(w, [i])))
            for x, s in zip(xs, row, strict=True):
                b.store(b.call(fma_s, [wi, b.load(b.gep(x, [i])), b.load(s)]), s)


def _make_prefetch(locality: int) -> Any:
    @intrinsic
    def hint(typingctx: Any, addr: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            dot_ir.prefetch_at(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()), 0, locality)
            return context.get_dummy_value()

        return types.void(types.intp), codegen

    return hint


# Read hints for the cache line at an address (they never fault, even past an array's end): `prefetch`
# is for what is streamed once (the vendor's hint, dot_ir.STREAM_LOCALITY), `prefetch_keep` keeps the line
# (prefetcht1).
prefetch, prefetch_keep = _make_prefetch(dot_ir.STREAM_LOCALITY), _make_prefetch(2)


def _make_rows_dot(rows: int, tile: int, half: bool, lanes: int) -> Any:
    @intrinsic
    def dot(typingctx: Any, w_addr: Any, w_stride: Any, n: Any, x_addr: Any, x_stride: Any, n_tok: Any,
            out_addr: Any, out_stride: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            emit_rows_dot(builder, list(args), rows, tile, half, lanes)
            return context.get_dummy_value()

        return types.void(*[types.intp] * 8), codegen

    return dot


def _make_pass(tile: int, rows: int, half: bool, lanes: int) -> Any:
    """Rows lo.. of the head for any number of tokens in passes of `tile` tokens and `rows` rows; returns
    the first row it left (fewer than `rows` before hi)."""
    dot = _make_rows_dot(rows, tile, half, lanes)

    @njit(inline="always")
    def rows_pass(x: np.ndarray, table: np.ndarray, lo: int, hi: int, out: np.ndarray) -> int:
        n, dim, xstride, wstride, ostride = x.shape[0], table.shape[1], x.strides[0], table.strides[0], out.strides[0]
        for r in range(lo, hi - rows + 1, rows):
            for t0 in range(0, n, tile):
                dot(table.ctypes.data + r * wstride, wstride, dim, x.ctypes.data + t0 * xstride, xstride,
                    min(tile, n - t0), out.ctypes.data + t0 * ostride + r * 4, ostride)
        return hi - (hi - lo) % rows

    return rows_pass


def _make_head(half: bool, lanes: int = _LANES) -> Any:
    """The LM head over a table of F16 bits (uint16: numba has no float16 arrays) or of float32, its row dots
    `lanes` floats wide (the host's; the tests build both widths)."""
    pass1, pass2, pass4 = (_make_pass(tile, rows, half, lanes) for tile, rows in _PASSES[lanes])

    @njit(inline="always")
    def head(x: np.ndarray, table: np.ndarray, rows_per_task: int, out: np.ndarray) -> None:
        vocab, n = table.shape[0], x.shape[0]
        for task in prange((vocab + rows_per_task - 1) // rows_per_task):
            lo, hi = task * rows_per_task, min(vocab, (task + 1) * rows_per_task)
            if n == 1:
                lo = pass1(x, table, lo, hi, out)
            elif n == 2:
                lo = pass2(x, table, lo, hi, out)
            pass4(x, table, lo, hi, out)  # one row per pass: whatever rows the others left, in the same order

    return head


_head_f16, _head_f32 = _make_head(True), _make_head(False)


@njit(parallel=True, cache=True)
def lm_head_f16(x: np.ndarray, table: np.ndarray, rows_per_task: int, out: np.ndarray) -> None:
    """out[t, v] = sum_i x[t, i] * float(table[v, i]), table the F16 bits as uint16 [vocab, dim]."""
    _head_f16(x, table, rows_per_task, out)


@njit(parallel=True, cache=True)
def lm_head_f32(x: np.ndarray, table: np.ndarray, rows_per_task: int, out: np.ndarray) -> None:
    """out[t, v] = sum_i x[t, i] * table[v, i] for a float32 table."""
    _head_f32(x, table, rows_per_task, out)


@intrinsic
def _float_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bits are the low 32 of an integer."""
    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always", cache=True)
def amax(w: np.ndarray) -> np.float32:
    """max |w| of a C-contiguous float32 array, as the largest of its bits with the sign cleared: for finite
    floats the same order. A float max stayed scalar (vmaxss) even with fastmath, 0.5 ns a value: on a
    Zen 5, 29 us of the 42 us that quantizing 8 tokens of 6912 columns took; the integer max vectorizes."""
    b = w.view(np.int32)
    m = 0
    for i in range(b.size):
        m = max(m, b[i] & 0x7FFFFFFF)
    return _float_bits(m)


@njit(inline="always")
def _q8_row(w: np.ndarray, q: np.ndarray) -> np.float32:
    """q = rint(w * s), s = 127/max|w| (1 for a zero row), in float32 as the reference's quantize_rows; returns s."""
    m = amax(w)
    s = np.float32(127.0) / m if m > 0 else np.float32(1.0)
    for i in range(w.size):
        q[i] = np.int8(np.rint(w[i] * s))  # |w * s| <= 127 (+ rounding): no clamp needed
    return s


@njit(cache=True)
def q8_rows(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> None:
    """The int8 head's input: x's rows (float32, C-contiguous) as the reference's quantize_rows gives them, q
    (int8) and s. NumPy's five calls had taken 80-120 us of a decode step: after the layers, its code and data
    come from memory (2B-4T, 2 threads, Emerald Rapids)."""
    for t in range(x.shape[0]):
        s[t] = _q8_row(x[t], q[t])


_Q8_ROWS = 256  # table rows per parallel task of the int8 table build


@njit(parallel=True, cache=True)
def q8_table_f16(table: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """The int8 LM head of an F16 table (its bits as uint16): NumPy's F16 conversion made the
    reference's build take 2-3 s for 2B-4T; this one converts in registers, in parallel."""
    vocab, dim = table.shape
    for task in prange((vocab + _Q8_ROWS - 1) // _Q8_ROWS):
        row = np.empty(dim, np.float32)
        for r in range(task * _Q8_ROWS, min(vocab, (task + 1) * _Q8_ROWS)):
            for i in range(dim):
                row[i] = _as_float(table[r, i])
            scale[r] = np.float32(1.0) / _q8_row(row, q[r])


@njit(parallel=True, cache=True)
def q8_table_f32(table: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """The int8 LM head of a float32 table (F32, or a quantized one decoded at load)."""
    for r in prange(table.shape[0]):
        scale[r] = np.float32(1.0) / _q8_row(table[r], q[r])


@njit(fastmath=True, cache=True)
def _sum_squares(x: np.ndarray) -> float:
    """sum(x^2) in float64, in any order (fastmath vectorizes it: the in-order sum was a chain of
    dependent adds, 3.6 ns per value); the reference's NumPy sum has an order of its own anyway."""
    ss = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        ss += v * v
    return ss


@njit(cache=True)
def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = x / sqrt(mean(x^2) + eps) * w per row, in float64 like the reference."""
    n, dim = x.shape
    for t in range(n):
        inv = 1.0 / np.sqrt(_sum_squares(x[t]) / dim + eps)
        for i in range(dim):
            out[t, i] = np.float32(np.float64(x[t, i]) * inv * np.float64(w[i]))


# Not no-infs: exp_shifted gives inf, whose silu is -0. error_model="numpy": python's zero-division check (1 + e is
# never 0) kept silu's division scalar; vectorized, a 6912-wide row took 5.9 us, not 10.9 (Emerald Rapids).
@njit(fastmath={"contract"}, cache=True, error_model="numpy")
def act_mul(gate: np.ndarray, up: np.ndarray, relu2: bool, out: np.ndarray) -> None:
    """act(gate) * up: silu g/(1+exp(-g)) or relu2 max(g,0)^2, in float32 (~1e-7 of the float64
    reference). silu's exp is `exp_shifted`, in loops LLVM vectorizes: numba's np.exp calls libm once
    per value, 45 us of a 6912-wide FFN row's 48 (Zen 1 EPYC).

    Serial, prefill too: rows in parallel (prange) took longer than one thread for 512 x 6912
    (relu2 9.7 vs 0.8 ms, silu 24 vs 16 ms on a shared 2-core EPYC), and cost 0.5 s of compile.
    """
    bits = np.empty(0 if relu2 else gate.shape[1], np.int32)  # (relu2 takes no exp: a 27 KB malloc for nothing)
    for t in range(gate.shape[0]):
        if relu2:
            for i in range(gate.shape[1]):
                a = max(gate[t, i], np.float32(0.0))
                out[t, i] = a * a * up[t, i]
        else:
            e = out[t]  # exp(-g), then overwritten by the result element by element
            for i in range(gate.shape[1]):
                e[i] = -gate[t, i]
            exp_shifted(e, np.float32(0.0), bits)
            for i in range(gate.shape[1]):
                out[t, i] = gate[t, i] / (np.float32(1.0) + e[i]) * up[t, i]


@njit(cache=True)
def rope_table(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [n, head_dim // 2] of the angles positions[t] * theta**(-2j/head_dim), in float64."""
    half = head_dim // 2
    cos, sin = np.empty((positions.size, half)), np.empty((positions.size, half))
    for j in range(half):
        freq = theta ** (-np.float64(j) * 2.0 / head_dim)
        for t in range(positions.size):
            angle = np.float64(positions[t]) * freq
            cos[t, j], sin[t, j] = np.cos(angle), np.sin(angle)
    return cos, sin


@njit(cache=True)
def rope(x: np.ndarray, n_heads: int, head_dim: int, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> None:
    """NEOX rotation of each head's halves of row t by the angles of rope_table (row t)."""
    n = x.shape[0]
    half = head_dim // 2
    for t in range(n):
        c, s = cos[t], sin[t]
        for h in range(n_heads):
            # 1-D views of each half: the j loop vectorizes (indexing the 2-D arrays, it ran 0.56 ns a value)
            x1, x2 = x[t, h * head_dim:h * head_dim + half], x[t, h * head_dim + half:(h + 1) * head_dim]
            o1, o2 = out[t, h * head_dim:h * head_dim + half], out[t, h * head_dim + half:(h + 1) * head_dim]
            for j in range(half):
                a, b = np.float64(x1[j]), np.float64(x2[j])
                o1[j] = np.float32(a * c[j] - b * s[j])
                o2[j] = np.float32(b * c[j] + a * s[j])


_LOG2E, _LN2_HI, _LN2_LO = np.float32(1.44269504), np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                          1.6666665459e-1, 5.0000001201e-1))


@njit(fastmath={"contract"}, cache=True)  # FMAs, but no reassociation: it would undo ln2's split
def exp_shifted(x: np.ndarray, top: np.float32, bits: np.ndarray) -> None:
    """x[:] = exp(x - top), within 2 ulp, in loops LLVM vectorizes (numba's np.exp calls libm once per
    value; this made decode attention 8-18 % faster at 160-2048 positions on AVX2).

    exp(y) = 2^n exp(r) with Cephes expf's polynomial for exp(r), |r| <= ln2/2; 2^n is built in the
    exponent bits of the scratch `bits`. y is clamped to [-87, 89]: exp(-87) is 1.6e-38, a weight lost
    in the softmax sum either way (and -inf gives 2^-126, not NaN); above 88.38, n = 128 makes the
    exponent bits inf (exact float32 overflows from 88.72), so silu(g) is -0 for g < -88.38, where
    its true value is under 3e-37."""
    c0, c1, c2, c3, c4, c5 = _EXP_POLY
    for i in range(x.shape[0]):
        y = min(max(x[i] - top, np.float32(-87.0)), np.float32(89.0))
        n = np.floor(y * _LOG2E + np.float32(0.5))
        r = y - n * _LN2_HI - n * _LN2_LO
        p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
        x[i] = p * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(n) + 127) << 23
    scale = bits.view(np.float32)
    for i in range(x.shape[0]):
        x[i] *= scale[i]
