"""The LLVM IR of the integer dot products (ternary BitLinear, the int8 LM head), one flavour per
instruction-set level.

Numba types every integer expression as int64, so a plain loop over uint8 codes and int8
activations vectorizes into 64-bit lanes and runs at a tenth of the memory bandwidth. The
inner loop is therefore emitted here as LLVM vector IR on whole 256-value blocks:

- "avx512vbmi": the "avx512vnni" dot on codes packed five to a byte (base 3, 1.6 bits a weight) where a row has one
  scale: 64-byte blocks of 320 weights, byte l holding columns l, 64 + l, ..., 256 + l (trit s its column 64s + l,
  so each trit multiplies 64 activations in natural order). AVX-512 VBMI lookups decode a byte: two `vpermi2b` (a
  128-byte table each half of the byte range, blended on the sign bit) give trits 0-3 as 2-bit fields, one `vpermb`
  on its low six bits trit 4 (see ENCODE). One token's dot is bound by memory, and this reads 1.2-1.3x the weights
  a second of the 2-bit codes on a Zen 5 (`benchmarks/packing_probe.py`). Per-block sums (block-scaled weights)
  keep 2-bit codes;
- "avx512vnni": codes c in {0,1,2} times int8 activations with the 512-bit `vpdpbusd`
  (u8 x s8 -> i32, 64 products per instruction), the operation ternary weights map onto exactly;
- "avxvnni": the same on 256-bit vectors (`llvm.x86.avx512.vpdpbusd.256`): LLVM encodes it as
  VEX (AVX-VNNI, Alder Lake and later) or EVEX (AVX-512 VNNI with VL), whichever the CPU has;
- "avx2": `pmaddubsw` then `pmaddwd` (no saturation: |2*q + 2*q'| <= 512 fits int16); one token
  alone unpacks its codes with fewer shifts (`pairs_x4`);
- "generic": portable LLVM vector IR (`reduce.add(mul(zext c, sext q))`), which LLVM lowers
  to whatever the target has: any numba target runs it.

A dot yields sum(c * q) with c the unsigned code; t = c - 1, so the drivers subtract sum(q)
per block, which the quantizer returns. Activations are stored in *byte order* (`PERM`):
within a 256-block, 64 lanes per 2-bit field s, lane l holding column 128*(l//32) + 32*s +
l%32, so each field of a block's 64 code bytes multiplies one contiguous 64-byte load.

Each block loop prefetches the codes PREFETCH_BYTES ahead (the hardware prefetcher alone streamed half as fast; 8192
bytes beat 2048 by 15 % on a Zen 5), both ends of a block (GGUF aligns tensors to 32 bytes, TQ2_0's blocks are 66 apart:
one request a block left a line a row to the hardware, 2-5 % of an Emerald Rapids step); passes of several rows request
the same block PAIR_AHEAD rows on. The hint is the vendor's (`STREAM_LOCALITY`, README figures): AMD's `prefetchnta`
(`prefetcht0` evicted all else a step uses); Intel's `prefetcht2` (`prefetchnta` fills L1 alone there, through a few
fill buffers: an Emerald Rapids step 103 -> 63 ms).

The int8 LM head (`emit_q8_dot`) multiplies int8 table rows by int8 activations, which BitNet's
absmax quantization keeps within [-127, 127]: AVX2 and VNNI take |w| as the unsigned operand and
give q w's sign (`vpsignb`, or a select), the products `vpmaddubsw` and `vpdpbusd` expect; numba's
own loop had widened to int32 `vpmulld` and ran compute-bound at 10 GB/s on one thread.

This module only builds IR; nothing here runs. `int_kernels` wraps it in numba intrinsics
for the host, and `ir_checks.assembly()` compiles it for a named CPU, so a level the host lacks is still
checked to the instruction (like compiling CUDA without a GPU).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils


def first_cpu(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields in `cpuinfo` (vendor_id, cpu family, ...); none where it cannot be read."""
    info: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():  # the end of the first processor's block
                    break
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def stream_locality(cpuinfo: str = "/proc/cpuinfo") -> int:
    """The `llvm.prefetch` locality for bytes read once: 1 (`prefetcht2`) on Intel, else 0 (`prefetchnta`)."""
    return int(first_cpu(cpuinfo).get("vendor_id") == "GenuineIntel")


STREAM_LOCALITY = stream_locality()
BLOCK, BLOCK_BYTES = 256, 64  # values and code bytes a block
BASE3_BLOCK = 320  # values of a base-3 block (BLOCK_BYTES bytes, five trits each)
CHUNK = 64  # int8 values per step of the int8 dot (one 512-bit register)
PREFETCH_BYTES = 8192  # how far past the block being read one row's codes are requested
PAIR_AHEAD = 8  # two rows per pass request the same block this many rows on (2: 8-10 % slower at 8 tokens, 16: as 8)
GROUP = 7  # AVX2 blocks whose int16 sums add up before widening (see _avx2_row_loop)
TILE = 4  # tokens per pass over a weight row in prefill: TILE accumulators plus the codes stay in registers
# Tokens per pass when their activations fit in L1 (isa.wide_bytes() of a row's columns): the codes are unpacked
# once for twice as many tokens. On 2560-column rows (AVX2, 8-128 tokens) 4-7 % faster for gate/up and 1-6 % for
# the others. Wider rows go in column parts (see int_kernels.matmul_rowscale).
WIDE = 8
ONE_TOKEN_ROWS = {"avx512vnni": 4} if STREAM_LOCALITY else {}  # rows of one token's pass (Intel's: see int_kernels)

LEVELS = ("avx512vbmi", "avx512vnni", "avxvnni", "avx2", "generic")  # best first
VNNI = ("avx512vbmi", "avx512vnni", "avxvnni")


def row_block(isa: str) -> int:
    """Weights a block of a level's codes where a row has one scale (per-block sums always take BLOCK)."""
    return BASE3_BLOCK if isa == "avx512vbmi" else BLOCK


# The base-3 byte of five trits: i = t0 + 3 t1 + 9 t2 + 27 t3 (0-80) sits at byte 21 t4 + i // 4 + 64 (i % 4), so that
# a byte's low six bits alone give t4 (63 groups of 4 bytes, 21 a value of t4): one 64-entry `vpermb`, where a
# 256-entry lookup takes two `vpermi2b` and a blend. ENCODE[t4 * 81 + i] is the byte; TRITS[k, byte] its trit k (0
# for the 13 bytes never written).
_T = np.arange(243)
ENCODE = (21 * (_T // 81) + _T % 81 // 4 + 64 * (_T % 81 % 4)).astype(np.uint8)
TRITS = np.zeros((5, 256), np.uint8)
for _k in range(5):
    TRITS[_k, ENCODE] = (_T % 81 // 3 ** _k) % 3 if _k < 4 else _T // 81

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)

# Activation index in byte order -> its column within the 256-block (see the module docstring).
_lane = np.arange(BLOCK)
PERM = 128 * ((_lane % 64) // 32) + 32 * (_lane // 64) + _lane % 32


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(t: ir.Type, n: int, v: int) -> ir.Constant:
    return ir.Constant(_vec(t, n), [ir.Constant(t, v)] * n)


def _declare(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


def prefetch_at(b: ir.IRBuilder, ptr: ir.Value, offset: int | ir.Value, locality: int) -> None:
    """Ask for the cache line `offset` bytes past the i8 pointer ptr (a hint: it never faults past an array's end)."""
    fn = _declare(b.module, "llvm.prefetch.p0", ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
    where = b.gep(ptr, [ir.Constant(_I64, offset) if isinstance(offset, int) else offset])
    b.call(fn, [where, *(ir.Constant(_I32, v) for v in (0, locality, 1))])  # read, locality, data


def _width(isa: str) -> int:
    """Bytes per vector register of a level."""
    return 64 if isa in ("avx512vbmi", "avx512vnni", "generic") else 32


class _Block:
    """Emits one level's accumulators and per-256-block update."""

    def __init__(self, builder: ir.IRBuilder, isa: str, tile: int = 1) -> None:
        if isa not in LEVELS:
            raise ValueError(f"unknown ISA level {isa!r}")
        self.b, self.isa = builder, isa
        self.vnni = isa in VNNI
        self.base3 = isa == "avx512vbmi"
        self.fields = 5 if self.base3 else 4  # code fields a 64-byte block holds per register-wide part
        # VNNI with TILE or more tokens: their accumulators are already independent chains, and four per
        # token (8 tokens: 32 zmm) spilled to the stack in every block, so the fields share one.
        self.split = self.vnni and tile < TILE
        self.width = _width(isa)
        mod = builder.module
        if self.vnni:
            self.lanes = self.width // 4
            self.acc_type: ir.Type = _vec(_I32, self.lanes)
            self.dpbusd = _declare(mod, f"llvm.x86.avx512.vpdpbusd.{8 * self.width}", self.acc_type,
                                   [self.acc_type] * 3)
        elif isa == "avx2":
            self.lanes = 8
            self.acc_type = _vec(_I32, 8)
            self.maddubs = _declare(mod, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
            self.maddwd = _declare(mod, "llvm.x86.avx2.pmadd.wd", self.acc_type, [_vec(_I16, 16)] * 2)
        else:
            self.lanes = 1
            self.acc_type = _I32
            self.reduce_wide = _declare(mod, "llvm.vector.reduce.add.v64i32", _I32, [_vec(_I32, 64)])
        if self.lanes > 1:
            self.reduce = _declare(mod, f"llvm.vector.reduce.add.v{self.lanes}i32", _I32, [self.acc_type])

    @property
    def n_acc(self) -> int:
        # VNNI: one accumulator per 2-bit field, so the vpdpbusd of a block do not wait on each
        # other's latency (one chain ran at half the memory bandwidth).
        return self.fields if self.split else 1

    def zero(self) -> ir.Constant:
        return ir.Constant(self.acc_type, None)

    def load(self, ptr: ir.Value, offset: int, n: int) -> ir.Value:
        b = self.b
        p = b.gep(ptr, [ir.Constant(_I64, offset)]) if offset else ptr
        return b.load(b.bitcast(p, _vec(_I8, n).as_pointer()), align=1)

    def codes(self, wptr: ir.Value, x4: bool = False) -> list[ir.Value]:
        """The four 2-bit fields of each register-wide part of one block's 64 code bytes, part-major.

        x4 (AVX2, for `pairs_x4`): one shift per register, not three; fields 1 and 3 come masked in place, 4c."""
        b, n = self.b, self.width
        if self.base3:
            return self._trits(self.load(wptr, 0, n))
        out = []
        for g in range(BLOCK_BYTES // n):
            w = self.load(wptr, n * g, n)
            if x4:
                hi = b.lshr(w, _splat(_I8, n, 4))
                out += [b.and_(v, _splat(_I8, n, mask)) for v in (w, hi) for mask in (3, 12)]
                continue
            for s in range(4):
                if self.split:
                    # Masked in place, not shifted: field s is c * 4**s <= 128, still a valid u8 operand,
                    # and its accumulator is divided by 4**s exactly at the end (one op fewer per field).
                    out.append(b.and_(w, _splat(_I8, n, 3 << (2 * s))))
                else:
                    out.append(b.and_(b.lshr(w, _splat(_I8, n, 2 * s)), _splat(_I8, n, 3)))
        return out

    def _trits(self, w: ir.Value) -> list[ir.Value]:
        """The five trit fields of a base-3 block's 64 bytes: trits 0-3 from one lookup's 2-bit fields (masked in
        place when split, as `codes`), trit 4 from the other's."""
        b, v8 = self.b, _vec(_I8, 64)
        perm = _declare(b.module, "llvm.x86.avx512.vpermi2var.qi.512", v8, [v8] * 3)
        high = b.icmp_signed("<", w, ir.Constant(v8, None))  # bytes 128-242: each table's second half

        def look(table: np.ndarray) -> ir.Value:
            t = [ir.Constant(v8, [ir.Constant(_I8, int(v)) for v in table[64 * i:64 * i + 64]]) for i in range(4)]
            return b.select(high, b.call(perm, [t[2], w, t[3]]), b.call(perm, [t[0], w, t[1]]))

        low = look(TRITS[0] | TRITS[1] << 2 | TRITS[2] << 4 | TRITS[3] << 6)
        if self.split:
            out = [b.and_(low, _splat(_I8, 64, 3 << (2 * s))) for s in range(4)]
        else:
            out = [b.and_(b.lshr(low, _splat(_I8, 64, 2 * s)), _splat(_I8, 64, 3)) for s in range(4)]
        permb = _declare(b.module, "llvm.x86.avx512.permvar.qi.512", v8, [v8] * 2)
        fifth = ir.Constant(v8, [ir.Constant(_I8, int(v)) for v in TRITS[4][:64]])  # (a byte's low six bits)
        return out + [b.call(permb, [fifth, w])]

    def update(self, accs: list[list[ir.Value]], codes: list[list[ir.Value]],
               qptr: ir.Value) -> list[list[ir.Value]]:
        """Each row's accs + the block's sum(c * q) for that row's codes; qptr points at the block's 256
        activations in byte order, each loaded once for all rows (several rows: VNNI only)."""
        b, n = self.b, self.width
        if self.vnni:
            accs = [list(a) for a in accs]
            for g in range(BLOCK_BYTES // n):
                for s in range(self.fields):
                    q = b.bitcast(self.load(qptr, 64 * s + n * g, n), self.acc_type)
                    a = s if self.split else 0
                    for row, c in zip(accs, codes, strict=True):
                        row[a] = b.call(self.dpbusd, [row[a], b.bitcast(c[self.fields * g + s], self.acc_type), q])
            return accs
        (acc,), (fields,) = accs, codes
        if self.isa == "avx2":
            return [[b.add(acc[0], self.widen(self.pairs(fields, qptr)))]]
        total, v64 = acc[0], _vec(_I32, 64)
        for s in range(4):
            prod = b.mul(b.zext(fields[s], v64), b.sext(self.load(qptr, 64 * s, 64), v64))
            total = b.add(total, b.call(self.reduce_wide, [prod]))
        return [[total]]

    def pairs(self, codes: list[ir.Value], qptr: ir.Value) -> ir.Value:
        """AVX2: the block's sum(c * q) as int16 lanes, each the sum of its 8 pmaddubsw pair products
        (each within 2 * 2 * 128 = 512, so a lane stays within 8 * 512 = 4096)."""
        return _tree(self.b, self.products(codes, qptr))

    def products(self, codes: list[ir.Value], qptr: ir.Value) -> list[ir.Value]:
        """AVX2: each field's pmaddubsw pair products with its activations, in the order of `codes`."""
        b, n = self.b, self.width
        return [b.call(self.maddubs, [codes[4 * g + s], self.load(qptr, 64 * s + n * g, n)])
                for g in range(BLOCK_BYTES // n) for s in range(4)]

    def pairs_x4(self, codes: list[ir.Value], qptr: ir.Value) -> ir.Value:
        """AVX2: 4 * the block's sum(c * q) as int16 lanes, from `codes(..., x4=True)`.

        The products of fields 1 and 3 (4c <= 8: a pair within 2 * 8 * 128) and of fields 0 and 2 sum apart,
        the latter shifted up by 2 once; a lane stays within [-16384, 16256], so two blocks add up in int16
        ([-32768, 32512]) before one pmaddwd."""
        b, sums = self.b, self.products(codes, qptr)
        ones, fours = _tree(b, sums[0::2]), _tree(b, sums[1::2])
        return b.add(b.shl(ones, _splat(_I16, 16, 2)), fours)

    def widen(self, s16: ir.Value) -> ir.Value:
        """AVX2: int16 lanes summed in pairs into the int32 accumulator's lanes."""
        return self.b.call(self.maddwd, [s16, _splat(_I16, 16, 1)])

    def merged(self, accs: list[ir.Value]) -> ir.Value:
        """One (row, token)'s accumulators as one."""
        acc = accs[0]
        for s, more in enumerate(accs[1:], start=1):
            # Every lane of fields 1-3 is a sum of multiples of 4**s (see codes()), so the shift is exact;
            # lanes stay below 2**31 for rows shorter than 2**17 columns. (Base 3's trit 4 comes unshifted.)
            acc = self.b.add(acc, more if s == 4 else self.b.ashr(more, _splat(_I32, self.lanes, 2 * s)))
        return acc

    def total(self, accs: list[ir.Value]) -> ir.Value:
        acc = self.merged(accs)
        return acc if self.lanes == 1 else self.b.call(self.reduce, [acc])


def _lane_mask(lanes: list[int]) -> ir.Constant:
    return ir.Constant(_vec(_I32, len(lanes)), [ir.Constant(_I32, j) for j in lanes])


def _lane_sums(builder: ir.IRBuilder, vecs: list[ir.Value], lanes: int, add: str = "add") -> ir.Value:
    """A vector whose lane i is the sum of vecs[i]'s lanes (len(vecs) a power of two, at most `lanes`).

    Pairs fold together: the first halves of each one's lane groups plus the second halves, so each
    shuffle and add serves two sums (45 operations for 16 zmm, where 16 reductions took 144, a sixth of
    a two-row 8-token pass's operations at 2560 columns). Integer sums in any order are exact; float
    ones (add="fadd") take each vector's lanes in a fixed tree, whatever the other vectors hold."""
    k, b = len(vecs), builder
    plus = getattr(b, add)
    if k & (k - 1) or k > lanes:
        raise ValueError(f"{k} sums of {lanes} lanes")
    size = lanes  # lanes per group; each vector holds lanes // size groups, one per sum, in order
    while len(vecs) > 1:
        half, groups = size // 2, lanes // size
        lo = [g * size + i for g in range(2 * groups) for i in range(half)]  # past `lanes`: y's lanes
        mask_lo, mask_hi = _lane_mask(lo), _lane_mask([j + half for j in lo])
        vecs = [plus(b.shuffle_vector(x, y, mask_lo), b.shuffle_vector(x, y, mask_hi))
                for x, y in zip(vecs[0::2], vecs[1::2], strict=True)]
        size = half
    (v,) = vecs
    width = lanes
    while size > 1:  # fewer sums than lanes: fold the one vector on itself, narrowing it
        half = size // 2
        lo = [g * size + i for g in range(width // size) for i in range(half)]
        mask_lo, mask_hi = _lane_mask(lo), _lane_mask([j + half for j in lo])
        v = plus(b.shuffle_vector(v, v, mask_lo), b.shuffle_vector(v, v, mask_hi))
        width, size = width // 2, half
    return v


def _tree(builder: ir.IRBuilder, sums: list[ir.Value]) -> ir.Value:
    """The sum of `sums` as a tree: what a block adds to a running sum is no chain of adds."""
    while len(sums) > 1:
        sums = [builder.add(sums[i], sums[i + 1]) for i in range(0, len(sums), 2)]
    return sums[0]


def _token(builder: ir.IRBuilder, t: int, ntok: ir.Value) -> ir.Value:
    """Token t of a pass, or the last real one past n_tok (computed, never stored)."""
    row = ir.Constant(_I64, t)
    return builder.select(builder.icmp_signed("<", row, ntok), row, builder.sub(ntok, ir.Constant(_I64, 1)))


def _token_rows(builder: ir.IRBuilder, q_i: ir.Value, stride: ir.Value, ntok: ir.Value, tile: int) -> list[ir.Value]:
    """Pointers to `tile` activation rows; those past n_tok repeat the last one."""
    return [builder.inttoptr(builder.add(q_i, builder.mul(_token(builder, t, ntok), stride)), _I8.as_pointer())
            for t in range(tile)]


def _store(builder: ir.IRBuilder, out: ir.Value, ntok: ir.Value, t: int, index: ir.Value, value: ir.Value) -> None:
    """out[index] = value when token t is a real one (t < n_tok)."""
    with builder.if_then(builder.icmp_signed("<", ir.Constant(_I64, t), ntok)):
        builder.store(value, builder.gep(out, [index]))


def emit_dot(builder: ir.IRBuilder, args: list[ir.Value], tile: int, per_block: bool, isa: str, rows: int = 1) -> None:
    """The body of dot(w_addr, n_blocks, w_stride, q_addr, q_stride, n_tok, out_addr[, row_stride, pitch, add]),
    all i64.

    One row of codes (n_blocks blocks of 64 bytes, w_stride apart, from w_addr) times `tile`
    token rows of activations (int8 in byte order, q_stride bytes apart), reading each weight
    byte once for all of them. Tokens past n_tok (<= tile) reuse the last row; with per_block, or
    one token, they are not stored. Writes int32 out[t] = the row's sum(c * q) for token t, or with
    per_block out[t * n_blocks + b].

    rows > 1 (VNNI, without per_block): the rows at w_addr + r * row_stride, each activation loaded
    once for all (a pass of 8 tokens made a 64-byte load per vpdpbusd, as many as the core can issue);
    out[t * pitch + r], or added to it when add != 0, for all `tile` tokens (out must hold them).
    Straight into the driver's [token, row] sums: copying 16 sums there from a scratch vector had
    cost 6-8 % of an 8-token gate/up projection on a Zen 5.
    """
    w_i, nb, wstep, q_i, stride, ntok, out_i = args[:7]
    blk = _Block(builder, isa, tile)
    if rows > 1 and (not blk.vnni or per_block):
        raise ValueError("several rows per pass are a VNNI pass without per-block sums")
    if per_block and blk.base3:
        raise ValueError("base-3 blocks do not fall on the 256-blocks of per-block scales")
    w0 = builder.inttoptr(w_i, _I8.as_pointer())
    out = builder.inttoptr(out_i, _I32.as_pointer())
    qrows = _token_rows(builder, q_i, stride, ntok, tile)
    if isa == "avx2" and not per_block and tile == 1:
        _store(builder, out, ntok, 0, ir.Constant(_I64, 0), _avx2_one_token(builder, blk, w0, nb, wstep, qrows[0]))
        return
    w_rows = [w0] + [builder.inttoptr(builder.add(w_i, builder.mul(args[7], ir.Constant(_I64, r))), _I8.as_pointer())
                     for r in range(1, rows)]
    accs = [[[cgutils.alloca_once_value(builder, blk.zero()) for _ in range(blk.n_acc)] for _ in w_rows]
            for _ in range(tile)]
    if isa == "avx2" and not per_block:
        _avx2_row_loop(builder, blk, w0, nb, wstep, qrows, [a[0][0] for a in accs])
    else:
        # Several rows per pass: the same block PAIR_AHEAD rows on, whatever the row's length or the part of
        # it a pass takes (see int_kernels.matmul_rowscale's column parts).
        ahead = builder.mul(args[7], ir.Constant(_I64, PAIR_AHEAD)) if rows > 1 else None
        _block_loop(builder, blk, w_rows, nb, wstep, qrows, accs, out, ntok, per_block, ahead)
    if per_block:
        return
    merged = [blk.merged([builder.load(a) for a in accs[t][r]]) for t in range(tile) for r in range(rows)]
    if blk.lanes == 1 or len(merged) == 1:
        for i, acc in enumerate(merged):
            _store(builder, out, ntok, i // rows, ir.Constant(_I64, i), blk.total([acc]))
        return
    if rows == 1:
        for i in range(0, len(merged), blk.lanes):  # out holds tile sums: those past n_tok are stored too
            part = merged[i:i + blk.lanes]
            where = builder.bitcast(builder.gep(out, [ir.Constant(_I64, i)]), _vec(_I32, len(part)).as_pointer())
            builder.store(_lane_sums(builder, part, blk.lanes), where, align=4)
        return
    pair = _vec(_I32, rows)
    stores = []  # (where, value) of each token's pair of sums
    for i in range(0, len(merged), blk.lanes):
        sums = _lane_sums(builder, merged[i:i + blk.lanes], blk.lanes)
        for j in range(0, min(blk.lanes, len(merged) - i), rows):
            at = builder.gep(out, [builder.mul(args[8], ir.Constant(_I64, (i + j) // rows))])
            stores.append((builder.bitcast(at, pair.as_pointer()),
                           builder.shuffle_vector(sums, sums, _lane_mask(list(range(j, j + rows))))))
    with builder.if_else(builder.icmp_signed("!=", args[9], ir.Constant(_I64, 0))) as (add, store):
        with add:
            for where, value in stores:
                builder.store(builder.add(value, builder.load(where, align=4)), where, align=4)
        with store:
            for where, value in stores:
                builder.store(value, where, align=4)


def _block_codes(builder: ir.IRBuilder, blk: _Block, w0: ir.Value, wstep: ir.Value,
                 k: ir.Value, x4: bool = False, ahead: ir.Value | None = None) -> tuple[list[ir.Value], ir.Value]:
    """Block k's code fields (x4 as in `codes`; the block `ahead` on requested) and its activations' byte offset."""
    wk = builder.gep(w0, [builder.mul(k, wstep)])
    at = ir.Constant(_I64, PREFETCH_BYTES) if ahead is None else ahead
    for end in (0, BLOCK_BYTES - 1):  # (see the module docstring)
        prefetch_at(builder, wk, builder.add(at, ir.Constant(_I64, end)), STREAM_LOCALITY)
    return blk.codes(wk, x4=x4), builder.mul(k, ir.Constant(_I64, BASE3_BLOCK if blk.base3 else BLOCK))


def _block_loop(builder: ir.IRBuilder, blk: _Block, w_rows: list[ir.Value], nb: ir.Value, wstep: ir.Value,
                qrows: list[ir.Value], accs: list[list[list[ir.Value]]], out: ir.Value, ntok: ir.Value,
                per_block: bool, ahead: ir.Value | None = None) -> None:
    """One block per step: each row's codes, then each token's accumulators accs[t][row] updated (with
    per_block, one row, its block's sum stored instead)."""
    with cgutils.for_range(builder, nb) as loop:
        k = loop.index
        fields = [_block_codes(builder, blk, w, wstep, k, ahead=ahead) for w in w_rows]
        qoff = fields[0][1]
        for t, qrow in enumerate(qrows):
            now = [[builder.load(a) for a in row] for row in accs[t]]
            new = blk.update(now, [f[0] for f in fields], builder.gep(qrow, [qoff]))
            if per_block:
                _store(builder, out, ntok, t, builder.add(builder.mul(ir.Constant(_I64, t), nb), k), blk.total(new[0]))
                continue
            for row, vals in zip(accs[t], new, strict=True):
                for a, v in zip(row, vals, strict=True):
                    builder.store(v, a)


def _avx2_one_token(builder: ir.IRBuilder, blk: _Block, w0: ir.Value, nb: ir.Value, wstep: ir.Value,
                    qrow: ir.Value) -> ir.Value:
    """AVX2, one token: the row's sum(c * q), two blocks per step through `pairs_x4` (one token alone has no
    other token to share the unpacking of its codes with, so each op saved there is an op per block)."""
    b = builder
    acc = cgutils.alloca_once_value(b, blk.zero())

    def block(k: ir.Value) -> ir.Value:
        codes, qoff = _block_codes(b, blk, w0, wstep, k, x4=True)
        return blk.pairs_x4(codes, b.gep(qrow, [qoff]))

    two = ir.Constant(_I64, 2)
    with cgutils.for_range(b, b.sdiv(nb, two)) as loop:
        k = b.mul(loop.index, two)
        s16 = b.add(block(k), block(b.add(k, ir.Constant(_I64, 1))))
        b.store(b.add(b.load(acc), blk.widen(s16)), acc)
    with b.if_then(b.icmp_signed("!=", b.srem(nb, two), ir.Constant(_I64, 0))):
        b.store(b.add(b.load(acc), blk.widen(block(b.sub(nb, ir.Constant(_I64, 1))))), acc)
    # Every lane is a sum of multiples of 4 (see pairs_x4): the shift is exact.
    return b.ashr(blk.total([b.load(acc)]), ir.Constant(_I32, 2))


def _avx2_row_loop(builder: ir.IRBuilder, blk: _Block, w0: ir.Value, nb: ir.Value, wstep: ir.Value,
                   qrows: list[ir.Value], accs: list[ir.Value]) -> None:
    """AVX2 without per-block sums, several tokens: each token's int16 lanes run over up to GROUP blocks
    before one pmaddwd widens them (GROUP * 4096 < 2**15), a pmaddwd and an add fewer per block and
    token (5 % at 4-8 tokens). One token goes through _avx2_one_token instead."""
    b, g = builder, ir.Constant(_I64, GROUP)
    n_groups = b.sdiv(b.add(nb, ir.Constant(_I64, GROUP - 1)), g)
    with cgutils.for_range(b, n_groups) as outer:
        k0 = b.mul(outer.index, g)
        left = b.sub(nb, k0)
        s16 = [cgutils.alloca_once_value(b, ir.Constant(_vec(_I16, 16), None)) for _ in qrows]
        with cgutils.for_range(b, b.select(b.icmp_signed("<", left, g), left, g)) as inner:
            codes, qoff = _block_codes(b, blk, w0, wstep, b.add(k0, inner.index))
            for s, qrow in zip(s16, qrows, strict=True):
                b.store(b.add(b.load(s), blk.pairs(codes, b.gep(qrow, [qoff]))), s)
        for s, a in zip(s16, accs, strict=True):
            b.store(b.add(b.load(a), blk.widen(b.load(s))), a)


def emit_q8_dot(builder: ir.IRBuilder, args: list[ir.Value], tile: int, isa: str, rows: int = 1) -> None:
    """The body of q8dot(w_addr, n_chunks, q_addr, q_stride, n_tok, out_addr, qsum_addr, w_stride, pitch), all i64.

    One int8 row (n_chunks * CHUNK values from w_addr) times `tile` int8 token rows in natural
    order (q_stride bytes apart), all within [-127, 127]; int32 out[t * pitch] = sum(w * q), exact.
    Tokens past n_tok reuse the last row and are not stored. qsum_addr: int32 per token, the sum of
    its n_chunks * CHUNK values; VNNI multiplies w + 128 (w with its sign bit flipped, an unsigned
    byte) by q and subtracts 128 * that sum, so a token's chunk is one vpdpbusd and no sign work.

    rows=2 (VNNI): the rows at w_addr and w_addr + w_stride, each activation loaded once for both;
    out[t * pitch + r]. With one row a pass made a load per vpdpbusd, and a Zen 5 core ran it at half the
    multiply probe's rate.
    """
    w_i, n_chunks, q_i, stride, ntok, out_i, qsum_i = args[:7]
    b, blk = builder, _Block(builder, isa)
    if rows > 1 and not blk.vnni:
        raise ValueError("several rows per pass are a VNNI pass")
    n, v8 = blk.width, _vec(_I8, blk.width)
    if isa != "generic":
        absb = _declare(b.module, f"llvm.abs.v{n}i8", v8, [v8, ir.IntType(1)])
    if isa == "avx2":
        psign = _declare(b.module, "llvm.x86.avx2.psign.b", v8, [v8, v8])
    w_rows = [b.inttoptr(w_i if r == 0 else b.add(w_i, b.mul(args[7], ir.Constant(_I64, r))), _I8.as_pointer())
              for r in range(rows)]
    out = b.inttoptr(out_i, _I32.as_pointer())
    qrows = _token_rows(b, q_i, stride, ntok, tile)
    accs = [[cgutils.alloca_once_value(b, blk.zero()) for _ in range(rows)] for _ in range(tile)]
    with cgutils.for_range(b, n_chunks) as loop:
        off = b.mul(loop.index, ir.Constant(_I64, CHUNK))
        parts = []
        for w0 in w_rows:
            wk = b.gep(w0, [off])
            # Each row its own PREFETCH_BYTES on: the pair's rows are neighbours, one stream. PAIR_AHEAD rows on
            # (20 KB of 2560-byte rows, beside 20 KB of activations in L1) made 8 tokens on 2 threads 12 % slower.
            prefetch_at(b, wk, PREFETCH_BYTES, STREAM_LOCALITY)
            parts.append([blk.load(wk, n * g, n) for g in range(CHUNK // n)])
        if isa == "generic":
            v32 = _vec(_I32, n)
            wide = [b.sext(w, v32) for w in parts[0]]
        elif blk.vnni:
            biased = [[b.bitcast(b.xor(w, _splat(_I8, n, -128)), blk.acc_type) for w in row] for row in parts]
        else:
            mags = [b.call(absb, [w, ir.Constant(ir.IntType(1), 0)]) for w in parts[0]]
        for t in range(tile):
            qk = b.gep(qrows[t], [off])
            now = [b.load(a) for a in accs[t]]
            for g in range(CHUNK // n):
                q = blk.load(qk, n * g, n)
                if isa == "generic":
                    now[0] = b.add(now[0], b.call(blk.reduce_wide, [b.mul(wide[g], b.sext(q, _vec(_I32, n)))]))
                elif isa == "avx2":
                    p = b.call(blk.maddubs, [mags[g], b.call(psign, [q, parts[0][g]])])
                    now[0] = b.add(now[0], b.call(blk.maddwd, [p, _splat(_I16, 16, 1)]))
                else:
                    qv = b.bitcast(q, blk.acc_type)
                    now = [b.call(blk.dpbusd, [a, biased[r][g], qv]) for r, a in enumerate(now)]
            for a, v in zip(accs[t], now, strict=True):
                b.store(v, a)
    qsum = b.inttoptr(qsum_i, _I32.as_pointer())
    sums = [b.load(a) for row in accs for a in row]
    if blk.lanes > 1 and len(sums) > 1:
        folded = [_lane_sums(b, sums[i:i + blk.lanes], blk.lanes) for i in range(0, len(sums), blk.lanes)]
        totals = [b.extract_element(folded[i // blk.lanes], ir.Constant(_I32, i % blk.lanes)) for i in range(len(sums))]
    else:
        totals = [acc if blk.lanes == 1 else b.call(blk.reduce, [acc]) for acc in sums]
    for i, total in enumerate(totals):
        t = i // rows
        if blk.vnni:
            total = b.sub(total, b.shl(b.load(b.gep(qsum, [_token(b, t, ntok)])), ir.Constant(_I32, 7)))
        _store(b, out, ntok, t, b.add(b.mul(args[8], ir.Constant(_I64, t)), ir.Constant(_I64, i % rows)), total)


# -- the multiply-add probe: what a level's instruction can do on this core, for the benchmarks ----------

PEAK_CHAINS = 12  # independent accumulators: more than latency x throughput of either instruction


def peak_products(isa: str) -> int:
    """int8 products per round of emit_peak: PEAK_CHAINS instructions of the level's width."""
    return PEAK_CHAINS * _width(isa) if isa != "generic" else 0


def emit_peak(builder: ir.IRBuilder, n_iter: ir.Value, isa: str) -> ir.Value:
    """The body of peak(n_iter) -> i64: n_iter rounds of the level's int8 multiply-add on registers only,
    PEAK_CHAINS independent accumulators, so its rate is the bound its dot products cannot pass
    (prefill and batched decode are bound by it, not by memory).

    avx2: s = s + pmaddubsw(s as bytes, q) in int16 lanes; VNNI: acc = vpdpbusd(acc, acc as bytes, q).
    Each update reads its accumulator, so nothing leaves the loop; the result is the sum of every lane
    (int16 lanes wrap, as the instructions do), so nothing is dead.
    """
    if isa == "generic":
        raise ValueError("the generic level has no multiply-add instruction to probe")
    b, blk = builder, _Block(builder, isa)
    v8 = _vec(_I8, blk.width)
    acc_t = blk.acc_type if blk.vnni else _vec(_I16, 16)
    lanes = acc_t.count
    qs = [ir.Constant(v8, [ir.Constant(_I8, (7 * k + j) % 251 - 125) for j in range(blk.width)]) for k in range(2)]
    accs = [cgutils.alloca_once_value(b, ir.Constant(acc_t, [ir.Constant(acc_t.element, k + 1)] * lanes))
            for k in range(PEAK_CHAINS)]
    with cgutils.for_range(b, n_iter):
        for k, a in enumerate(accs):
            s, q = b.load(a), qs[k % 2]
            if blk.vnni:
                s = b.call(blk.dpbusd, [s, s, b.bitcast(q, acc_t)])
            else:
                s = b.add(s, b.call(blk.maddubs, [b.bitcast(s, v8), q]))
            b.store(s, a)
    reduce = _declare(b.module, f"llvm.vector.reduce.add.v{lanes}i64", _I64, [_vec(_I64, lanes)])
    total = ir.Constant(_I64, 0)
    for a in accs:
        total = b.add(total, b.call(reduce, [b.sext(b.load(a), _vec(_I64, lanes))]))
    return total

