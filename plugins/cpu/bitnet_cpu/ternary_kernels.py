"""Ternary BitLinear on the packed 2-bit codes: int8 activation quantization and the dot products.

Numba types every integer expression as int64, so a plain loop over uint8 codes and int8
activations vectorizes into 64-bit lanes and runs at a tenth of the memory bandwidth. The
inner loop is therefore written in LLVM vector IR inside numba intrinsics, on whole 256-value
blocks, in one of three flavours:

- "avx512vnni": codes c in {0,1,2} times int8 activations with `vpdpbusd` (u8 x s8 -> i32,
  64 products per instruction), the operation ternary weights map onto exactly;
- "avx2": `pmaddubsw` then `pmaddwd` (no saturation: |2*q + 2*q'| <= 512 fits int16);
- "generic": portable LLVM vector IR (`reduce.add(mul(zext c, sext q))`), which LLVM lowers
  to whatever the host has.

A dot yields sum(c * q) with c the unsigned code; t = c - 1, so the drivers subtract sum(q)
per block, which the quantizer returns. Activations are stored in *byte order* (`PERM`):
within a 256-block, 64 lanes per 2-bit field s, lane l holding column 128*(l//32) + 32*s +
l%32, so each field of a block's 64 code bytes multiplies one contiguous 64-byte load.

Each block loop prefetches the codes PREFETCH_BYTES ahead: the hardware prefetcher alone left
one thread at 5 GB/s and two at 9-11 GB/s on 2B-4T shapes; with it they stream at 8-10 and
14-17 GB/s (2048 bytes was best of 256..8192 on this machine).

Weights are read as blocks, uint8 [rows, n_blocks, 64] with any row and block stride, so
TQ2_0 runs straight from the memory-mapped file (66-byte blocks: the codes, then the scale).
I2_S (each byte's fields reversed) runs from the file too: its activations are quantized into
the mirrored byte order (`rev`), so the same dot products apply.
The numba drivers parallelize over chunks of weight rows (`prange`); in prefill each chunk
runs every token through its rows, TILE tokens per pass over a row, so weights come from
memory once per call and activations from cache. Integer sums are exact; the float epilogue
follows the reference's operation order in float64.

The instruction set is fixed per process from the host CPU (or BITNET_CPU_ISA, which also
turns the disk cache off). Numba keys its disk cache by CPU name and features, so a cached
kernel never runs on a CPU that lacks its instructions, but only by this file's timestamp
for the code: that is why the IR and the kernels that inline it share one module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

ISAS = ("avx512vnni", "avx2", "generic")
BLOCK = 256
BLOCK_BYTES = 64
PREFETCH_BYTES = 2048  # how far past the block being read the codes are requested

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(t: ir.Type, n: int, v: int) -> ir.Constant:
    return ir.Constant(_vec(t, n), [ir.Constant(t, v)] * n)


def host_isa() -> str:
    """The kernel flavour for this process: BITNET_CPU_ISA if set, else the best the host runs."""
    forced = os.environ.get("BITNET_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"BITNET_CPU_ISA={forced!r}; expected one of {', '.join(ISAS)}")
        return forced
    if config.CPU_NAME and config.CPU_NAME != "host":
        return "generic"  # numba compiles for another CPU (NUMBA_CPU_NAME): no host-specific intrinsics
    from llvmlite import binding

    feats = binding.get_host_cpu_features()
    if feats.get("avx512vnni") and feats.get("avx512bw") and feats.get("avx512f"):
        return "avx512vnni"
    if feats.get("avx2"):
        return "avx2"
    return "generic"


ISA = host_isa()

# Activation index in byte order -> its column within the 256-block (see the module docstring).
_lane = np.arange(BLOCK)
PERM = 128 * ((_lane % 64) // 32) + 32 * (_lane // 64) + _lane % 32


def _declare(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


class _Block:
    """Emits one ISA's accumulator and per-256-block update."""

    def __init__(self, builder: ir.IRBuilder, isa: str) -> None:
        self.b, self.isa = builder, isa
        mod = builder.module
        if isa == "avx512vnni":
            self.acc_type: ir.Type = _vec(_I32, 16)
            self.vnni = _declare(mod, "llvm.x86.avx512.vpdpbusd.512", self.acc_type, [self.acc_type] * 3)
            self.reduce = _declare(mod, "llvm.vector.reduce.add.v16i32", _I32, [self.acc_type])
        elif isa == "avx2":
            self.acc_type = _vec(_I32, 8)
            self.maddubs = _declare(mod, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
            self.maddwd = _declare(mod, "llvm.x86.avx2.pmadd.wd", self.acc_type, [_vec(_I16, 16)] * 2)
            self.reduce = _declare(mod, "llvm.vector.reduce.add.v8i32", _I32, [self.acc_type])
        elif isa == "generic":
            self.acc_type = _I32
            self.reduce_wide = _declare(mod, "llvm.vector.reduce.add.v64i32", _I32, [_vec(_I32, 64)])
        else:
            raise ValueError(f"unknown ISA {isa!r}")

    @property
    def n_acc(self) -> int:
        # VNNI: one accumulator per 2-bit field, so the four vpdpbusd of a block do not wait on
        # each other's latency (one chain ran at half the memory bandwidth).
        return 4 if self.isa == "avx512vnni" else 1

    def zero(self) -> ir.Constant:
        return ir.Constant(self.acc_type, None)

    def prefetch(self, ptr: ir.Value, offset: int) -> None:
        """Ask for the cache line `offset` bytes past ptr (a hint: it never faults past the end)."""
        b, i32 = self.b, _I32
        fn = _declare(b.module, "llvm.prefetch.p0", ir.VoidType(), [_I8.as_pointer(), i32, i32, i32])
        where = b.gep(ptr, [ir.Constant(ir.IntType(64), offset)])
        b.call(fn, [where, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data

    def load(self, ptr: ir.Value, offset: int, n: int) -> ir.Value:
        b = self.b
        p = b.gep(ptr, [ir.Constant(ir.IntType(64), offset)]) if offset else ptr
        return b.load(b.bitcast(p, _vec(_I8, n).as_pointer()), align=1)

    def codes(self, wptr: ir.Value) -> list[ir.Value]:
        """The four 2-bit fields of one block's 64 code bytes (two 32-byte halves for AVX2)."""
        b = self.b
        if self.isa == "avx2":
            halves = [self.load(wptr, 32 * g, 32) for g in range(2)]
            return [b.and_(b.lshr(w, _splat(_I8, 32, 2 * s)), _splat(_I8, 32, 3))
                    for w in halves for s in range(4)]
        w = self.load(wptr, 0, 64)
        if self.isa == "avx512vnni":
            # Masked in place, not shifted: field s is c * 4**s <= 128, still a valid u8 operand,
            # and its accumulator is divided by 4**s exactly at the end (one op fewer per field).
            return [b.and_(w, _splat(_I8, 64, 3 << (2 * s))) for s in range(4)]
        return [b.and_(b.lshr(w, _splat(_I8, 64, 2 * s)), _splat(_I8, 64, 3)) for s in range(4)]

    def update(self, accs: list[ir.Value], codes: list[ir.Value], qptr: ir.Value) -> list[ir.Value]:
        """accs + the block's sum(c * q); qptr points at the block's 256 activations in byte order."""
        b = self.b
        if self.isa == "avx512vnni":
            v16 = _vec(_I32, 16)
            qs = [b.bitcast(self.load(qptr, 64 * s, 64), v16) for s in range(4)]
            return [b.call(self.vnni, [accs[s], b.bitcast(codes[s], v16), qs[s]]) for s in range(4)]
        acc = accs[0]
        if self.isa == "avx2":
            # Sum the eight int16 pair products first: each lane stays within 8 * 512.
            s16 = None
            for g in range(2):
                for s in range(4):
                    p = b.call(self.maddubs, [codes[4 * g + s], self.load(qptr, 64 * s + 32 * g, 32)])
                    s16 = p if s16 is None else b.add(s16, p)
            return [b.add(acc, b.call(self.maddwd, [s16, _splat(_I16, 16, 1)]))]
        v64 = _vec(_I32, 64)
        for s in range(4):
            prod = b.mul(b.zext(codes[s], v64), b.sext(self.load(qptr, 64 * s, 64), v64))
            acc = b.add(acc, b.call(self.reduce_wide, [prod]))
        return [acc]

    def total(self, accs: list[ir.Value]) -> ir.Value:
        acc = accs[0]
        for s, more in enumerate(accs[1:], start=1):
            # Every lane is a sum of multiples of 4**s (see codes()), so the shift is exact;
            # lanes stay below 2**31 for rows shorter than 2**17 columns.
            acc = self.b.add(acc, self.b.ashr(more, _splat(_I32, 16, 2 * s)))
        return acc if self.isa == "generic" else self.b.call(self.reduce, [acc])


def _make_dot(tile: int, per_block: bool, isa: str) -> Callable[..., Any]:
    """An intrinsic dot(w_addr, n_blocks, w_stride, q_addr, q_stride, n_tok, out_addr) -> None.

    One row of codes (n_blocks blocks of 64 bytes, w_stride apart, from w_addr) times `tile`
    token rows of activations
    (int8 in byte order, q_stride bytes apart), reading each weight byte once for all of
    them. Tokens past n_tok (<= tile) reuse the last row and are not stored. Writes int32
    out[t] = the row's sum(c * q) for token t, or with per_block out[t * n_blocks + b].
    """

    @intrinsic
    def dot(typingctx: Any, w_addr: Any, n_blocks: Any, w_stride: Any, q_addr: Any, q_stride: Any, n_tok: Any,
            out_addr: Any) -> Any:
        sig = types.void(*[types.intp] * 7)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            w_i, nb, wstep, q_i, stride, ntok, out_i = args
            i8p, i64 = _I8.as_pointer(), ir.IntType(64)
            blk = _Block(builder, isa)
            w0 = builder.inttoptr(w_i, i8p)
            out = builder.inttoptr(out_i, _I32.as_pointer())
            last = builder.sub(ntok, ir.Constant(i64, 1))
            qrows = []
            for t in range(tile):
                row = ir.Constant(i64, t)
                row = builder.select(builder.icmp_signed("<", row, ntok), row, last)
                qrows.append(builder.inttoptr(builder.add(q_i, builder.mul(row, stride)), i8p))
            accs = [[cgutils.alloca_once_value(builder, blk.zero()) for _ in range(blk.n_acc)]
                    for _ in range(tile)]

            def store(t: int, index: ir.Value, value: ir.Value) -> None:
                with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, t), ntok)):
                    builder.store(value, builder.gep(out, [index]))

            with cgutils.for_range(builder, nb) as loop:
                k = loop.index
                wk = builder.gep(w0, [builder.mul(k, wstep)])
                blk.prefetch(wk, PREFETCH_BYTES)
                codes = blk.codes(wk)
                qoff = builder.mul(k, ir.Constant(i64, BLOCK))
                for t in range(tile):
                    acc = blk.update([builder.load(a) for a in accs[t]], codes, builder.gep(qrows[t], [qoff]))
                    if per_block:
                        store(t, builder.add(builder.mul(ir.Constant(i64, t), nb), k), blk.total(acc))
                    else:
                        for a, v in zip(accs[t], acc, strict=True):
                            builder.store(v, a)
            if not per_block:
                for t in range(tile):
                    store(t, ir.Constant(i64, t), blk.total([builder.load(a) for a in accs[t]]))
            return context.get_dummy_value()

        return sig, codegen

    return dot


TILE = 4  # tokens per pass over a weight row in prefill: TILE accumulators plus the codes stay in registers
ROWS_PER_TASK = 64  # weight rows per parallel task: 40 KB of codes at 2560 columns, a share of L2

_dot_row_1 = _make_dot(1, False, ISA)
_dot_row_tile = _make_dot(TILE, False, ISA)
_dot_blocks_1 = _make_dot(1, True, ISA)
_dot_blocks_tile = _make_dot(TILE, True, ISA)

_CACHE = not os.environ.get("BITNET_CPU_ISA")  # a forced ISA must not read or write kernels of another


# -- activation quantization (float32 arithmetic exactly as the reference: no fastmath) -----------

# Adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude below 2**22 to an integer,
# half to even, in the default rounding mode (np.rint, but vectorizable).
_ROUND = np.float32(12582912.0)


@njit(fastmath=True, cache=_CACHE)
def _amax(x: np.ndarray) -> np.float32:
    m = np.float32(0.0)
    for i in range(x.size):
        m = max(m, abs(x[i]))
    return m


@njit(cache=_CACHE)
def _quantize_block(x: np.ndarray, src: int, scale: np.float32, q: np.ndarray, dst: int, rev: bool) -> int:
    """q[dst:dst+256] = clamp(rint(x[src:src+256] * scale)) in byte order (with rev, the byte order
    of weights whose fields are reversed: field f holds the columns of field 3 - f); returns their sum."""
    acc = 0
    for f in range(4):
        for g in range(2):
            i0, o0 = src + 128 * g + 32 * (3 - f if rev else f), dst + 64 * f + 32 * g
            for j in range(32):
                v = (x[i0 + j] * scale + _ROUND) - _ROUND
                qi = np.int8(min(max(v, np.float32(-128.0)), np.float32(127.0)))
                q[o0 + j] = qi
                acc += qi
    return acc


@njit(cache=_CACHE)
def quantize_rows(x: np.ndarray, q: np.ndarray, s: np.ndarray, qsum: np.ndarray, rev: bool) -> None:
    """BitNet per-row int8: s = 127/max|x| (1 for a zero row), q = clamp(rint(x*s)) in byte order,
    qsum[t, b] = sum of block b's q."""
    n, cols = x.shape
    for t in range(n):
        amax = _amax(x[t])
        st = np.float32(127.0) / amax if amax > 0 else np.float32(1.0)
        s[t] = st
        for b in range(cols // BLOCK):
            qsum[t, b] = _quantize_block(x[t], b * BLOCK, st, q[t], b * BLOCK, rev)


@njit(cache=_CACHE)
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
                q[t, base:base + BLOCK] = 0
                qsum[t, b] = 0
            else:
                iscale = np.float32(-127.0) / v
                d[t, b] = np.float32(1.0) / iscale
                qsum[t, b] = _quantize_block(x[t], base, iscale, q[t], base, rev)


# -- BitLinear drivers ----------------------------------------------------------------------------

@njit(parallel=True, cache=_CACHE)
def matmul_rowscale(codes: np.ndarray, q: np.ndarray, qsum: np.ndarray, s: np.ndarray, row_scale: np.ndarray,
                    out: np.ndarray) -> None:
    """out[t, r] = (sum(t*q) * row_scale[r]) / s[t]: "row" quantization, one weight scale per row."""
    rows, nb, n = codes.shape[0], codes.shape[1], q.shape[0]
    wstride, bstride, qstride = codes.strides[0], codes.strides[1], q.strides[0]
    qtot = np.zeros(n, np.int64)
    for t in range(n):
        for b in range(nb):
            qtot[t] += qsum[t, b]
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        isum = np.empty(TILE, np.int32)
        r0, r1 = task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)
        for t0 in range(0, n, TILE):
            nt = min(TILE, n - t0)
            qaddr = q.ctypes.data + t0 * qstride
            for r in range(r0, r1):
                waddr = codes.ctypes.data + r * wstride
                if nt == 1:
                    _dot_row_1(waddr, nb, bstride, qaddr, qstride, 1, isum.ctypes.data)
                else:
                    _dot_row_tile(waddr, nb, bstride, qaddr, qstride, nt, isum.ctypes.data)
                for i in range(nt):
                    t = t0 + i
                    out[t, r] = np.float32(np.float64(isum[i] - qtot[t]) * np.float64(row_scale[r])
                                           / np.float64(s[t]))


@njit(parallel=True, cache=_CACHE)
def matmul_blockscale(codes: np.ndarray, q: np.ndarray, qsum: np.ndarray, scales: np.ndarray,
                      act_scale: np.ndarray, per_block_act: bool, out: np.ndarray) -> None:
    """Per-block weight scales and/or per-block activation scales.

    per_block_act (Q8_K, "block256"): out[t, r] = sum_b isum * scales[r, b] * act_scale[t, b];
    else ("row" with block scales): out[t, r] = sum_b (isum * scales[r, b]) / act_scale[t, 0].
    """
    rows, nb, n = codes.shape[0], codes.shape[1], q.shape[0]
    wstride, bstride, qstride = codes.strides[0], codes.strides[1], q.strides[0]
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        isum = np.empty(TILE * nb, np.int32)
        r0, r1 = task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)
        for t0 in range(0, n, TILE):
            nt = min(TILE, n - t0)
            qaddr = q.ctypes.data + t0 * qstride
            for r in range(r0, r1):
                waddr = codes.ctypes.data + r * wstride
                if nt == 1:
                    _dot_blocks_1(waddr, nb, bstride, qaddr, qstride, 1, isum.ctypes.data)
                else:
                    _dot_blocks_tile(waddr, nb, bstride, qaddr, qstride, nt, isum.ctypes.data)
                for i in range(nt):
                    t = t0 + i
                    acc = 0.0
                    for b in range(nb):
                        v = np.float64(isum[i * nb + b] - qsum[t, b]) * np.float64(scales[r, b])
                        if per_block_act:
                            v *= np.float64(act_scale[t, b])
                        acc += v
                    if not per_block_act:
                        acc /= np.float64(act_scale[t, 0])
                    out[t, r] = np.float32(acc)


# -- BitLinear entry points: quantize and multiply in one call from Python --------------------------
# (Decode makes 210 of these calls per token: each Python-side allocation or dispatch saved counts.)

@njit(cache=_CACHE)
def bitlinear_row_rowscale(x: np.ndarray, codes: np.ndarray, row_scale: np.ndarray, rev: bool) -> np.ndarray:
    """"row" quantization, one weight scale per row: y [n, rows]."""
    n, cols = x.shape
    q, s = np.empty((n, cols), np.int8), np.empty(n, np.float32)
    qsum = np.empty((n, cols // BLOCK), np.int32)
    quantize_rows(x, q, s, qsum, rev)
    out = np.empty((n, codes.shape[0]), np.float32)
    matmul_rowscale(codes, q, qsum, s, row_scale, out)
    return out


@njit(cache=_CACHE)
def bitlinear_row_blockscale(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, rev: bool) -> np.ndarray:
    """"row" quantization, a weight scale per 256-block: y [n, rows]."""
    n, cols = x.shape
    q, s = np.empty((n, cols), np.int8), np.empty((n, 1), np.float32)
    qsum = np.empty((n, cols // BLOCK), np.int32)
    quantize_rows(x, q, s[:, 0], qsum, rev)
    out = np.empty((n, codes.shape[0]), np.float32)
    matmul_blockscale(codes, q, qsum, scales, s, False, out)
    return out


@njit(cache=_CACHE)
def bitlinear_block256(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, rev: bool) -> np.ndarray:
    """"block256" (Q8_K) quantization: y [n, rows]."""
    n, cols = x.shape
    q, d = np.empty((n, cols), np.int8), np.empty((n, cols // BLOCK), np.float32)
    qsum = np.empty((n, cols // BLOCK), np.int32)
    quantize_q8k(x, q, d, qsum, rev)
    out = np.empty((n, codes.shape[0]), np.float32)
    matmul_blockscale(codes, q, qsum, scales, d, True, out)
    return out
