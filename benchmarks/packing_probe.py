"""Would ternary codes packed 5 to a byte (base 3, 1.6 bits a weight) decode one token faster than our 2-bit codes?

One token's BitLinear reads every weight once and is bound by memory, so a denser packing is faster exactly as long
as decoding it keeps up with the memory. This probe measured that on a Zen 5 before the CPU plugin's avx512vbmi level
was built on it; that level is the default only where it was measured faster (`isa.base3_by_default`), and this
probe says whether it would be on another host (Zen 4, Intel):

- "2-bit": the shipped one-token dot of the host's best kernel level (`bitnet_cpu.int_kernels`), 4 codes a byte;
- "base-3": a prototype dot over 64-byte blocks of 320 weights, byte l holding columns l, 64 + l, ... 256 + l
  (5 trits, base 3). Two AVX-512 VBMI lookups (`vpermi2b`, a 128-byte table each half) and a blend on the sign
  bit decode each byte: one table gives trits 0-3 as 2-bit fields, the other trit 4; then 5 `vpdpbusd`.

Both read rows of the 2B-4T widths (2560 and 6912 columns; base-3 pads 6912 to 22 blocks) from 512 MB of
codes, on 1 and 2 threads, alternating, medians of the rounds. The figure is weights a second: the format's
gain when it is above 1.0x. The prototype's sums are first checked exactly against NumPy.

    python benchmarks/packing_probe.py [--rounds 3]

Needs AVX-512 VNNI and VBMI (Ice Lake and later, Zen 4 and later); elsewhere it says so and exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bitnet_cpu import isa
from bitnet_cpu.dot_ir import PREFETCH_BYTES, STREAM_LOCALITY, prefetch_at

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V8, _V32 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16)
_B3 = 320  # weights a base-3 block of 64 bytes

_byte = np.minimum(np.arange(256), 242)
TRITS = np.stack([(_byte // 3 ** k) % 3 for k in range(5)])  # [5, 256]: byte -> its trits, trit 0 least
_LOW4 = (TRITS[0] | TRITS[1] << 2 | TRITS[2] << 4 | TRITS[3] << 6).astype(np.uint8)
_FIFTH = TRITS[4].astype(np.uint8)


def _table(values: np.ndarray) -> ir.Constant:
    return ir.Constant(_V8, [ir.Constant(_I8, int(v)) for v in values])


def _splat8(v: int) -> ir.Constant:
    return ir.Constant(_V8, [ir.Constant(_I8, v)] * 64)


@intrinsic
def _dot3(typingctx: object, w_addr: object, n_blocks: object, q_addr: object, out_addr: object) -> object:
    """dot3(w_addr, n_blocks, q_addr, out_addr): out[0] = sum(c * q) over n_blocks base-3 blocks (c in 0..2)."""

    def codegen(context: object, b: ir.IRBuilder, signature: object, args: list) -> object:
        w_i, nb, q_i, out_i = args
        mod = b.module
        perm = cgutils.get_or_insert_function(mod, ir.FunctionType(_V8, [_V8] * 3), "llvm.x86.avx512.vpermi2var.qi.512")
        dp = cgutils.get_or_insert_function(mod, ir.FunctionType(_V32, [_V32] * 3), "llvm.x86.avx512.vpdpbusd.512")
        red = cgutils.get_or_insert_function(mod, ir.FunctionType(_I32, [_V32]), "llvm.vector.reduce.add.v16i32")
        low4 = [_table(_LOW4[64 * i:64 * i + 64]) for i in range(4)]
        fifth = [_table(_FIFTH[64 * i:64 * i + 64]) for i in range(4)]
        w0, q0 = b.inttoptr(w_i, _I8.as_pointer()), b.inttoptr(q_i, _I8.as_pointer())
        accs = [cgutils.alloca_once_value(b, ir.Constant(_V32, None)) for _ in range(5)]
        with cgutils.for_range(b, nb) as loop:
            wk = b.gep(w0, [b.mul(loop.index, ir.Constant(_I64, 64))])
            prefetch_at(b, wk, PREFETCH_BYTES, STREAM_LOCALITY)
            w = b.load(b.bitcast(wk, _V8.as_pointer()), align=64)
            high = b.icmp_signed("<", w, ir.Constant(_V8, None))  # bytes 128-242 index the tables' second half

            def look(t: list[ir.Constant], w: ir.Value = w, high: ir.Value = high) -> ir.Value:
                return b.select(high, b.call(perm, [t[2], w, t[3]]), b.call(perm, [t[0], w, t[1]]))

            f = look(low4)
            fields = [b.and_(f, _splat8(3 << (2 * s))) for s in range(4)] + [look(fifth)]  # masked in place
            qk = b.gep(q0, [b.mul(loop.index, ir.Constant(_I64, _B3))])
            for s, c in enumerate(fields):
                q = b.load(b.bitcast(b.gep(qk, [ir.Constant(_I64, 64 * s)]), _V8.as_pointer()), align=64)
                b.store(b.call(dp, [b.load(accs[s]), b.bitcast(c, _V32), b.bitcast(q, _V32)]), accs[s])
        total = b.load(accs[4])
        for s in range(4):  # field s holds c * 4**s: exact shifts
            total = b.add(total, b.ashr(b.load(accs[s]), ir.Constant(_V32, [ir.Constant(_I32, 2 * s)] * 16)))
        b.store(b.call(red, [total]), b.inttoptr(out_i, _I32.as_pointer()))
        return context.get_dummy_value()

    return types.void(types.intp, types.intp, types.intp, types.intp), codegen


def _aligned(n: int, dtype: type) -> np.ndarray:
    buf = np.empty(n + 64, dtype)
    return buf[-buf.ctypes.data % 64:][:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    feats = dict(binding.get_host_cpu_features())
    if not (feats.get("avx512vbmi") and "avx512vnni" in isa.host_levels()):
        print("packing_probe: this CPU lacks AVX-512 VBMI or VNNI, which the base-3 prototype needs", file=sys.stderr)
        return 1
    two_bit = isa.build("avx512vnni", cache=False)._make_dot(1, False)

    def runner(base3: bool, parallel: bool) -> object:
        # One compiled loop per format and thread count: a loop holding both dots, or a prange of one part,
        # ran the base-3 one 15-30 % slower on one thread (Zen 5).
        loop = prange if parallel else range

        @njit(parallel=parallel)
        def run(w: np.ndarray, q: np.ndarray, out: np.ndarray, rows: int, nb: int) -> None:
            parts = 2 if parallel else 1
            for p in loop(parts):
                for r in range(p * rows // parts, (p + 1) * rows // parts):
                    if base3:
                        _dot3(w.ctypes.data + r * nb * 64, nb, q.ctypes.data, out.ctypes.data + 64 * p)
                    else:
                        two_bit(w.ctypes.data + r * nb * 64, nb, 64, q.ctypes.data, 0, 1, out.ctypes.data + 64 * p)

        return run

    runs = {(name, threads): runner(name == "base-3", threads == 2)
            for name in ("2-bit", "base-3") for threads in (1, 2)}

    rng = np.random.default_rng(0)
    out = np.zeros(64, np.int32)
    nb = 8  # the prototype against NumPy, codes every byte value 0-242
    w = _aligned(nb * 64, np.uint8)
    w[:] = np.arange(w.size) % 243
    q = _aligned(nb * _B3, np.int8)
    q[:] = rng.integers(-127, 128, q.size)
    runs["base-3", 1](w, q, out, 1, nb)
    codes = TRITS[:, w.reshape(nb, 64)].transpose(1, 0, 2).reshape(-1)
    if int(out[0]) != int((codes.astype(np.int64) * q).sum()):
        print(f"packing_probe: the base-3 prototype's sum {out[0]} is wrong", file=sys.stderr)
        return 1

    rates: dict[tuple[int, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for cols in (2560, 6912):
            for threads in (1, 2):
                for name, per_block in (("2-bit", 256), ("base-3", _B3)):
                    nb = -(-cols // per_block)
                    rows = (512 << 20) // (nb * 64) // 2 * 2
                    w = _aligned(rows * nb * 64, np.uint8)
                    w[:] = 0x55  # code 1 everywhere: valid in both formats (no byte of it is past 242)
                    q = _aligned(nb * per_block, np.int8)
                    q[:] = rng.integers(-127, 128, q.size)
                    run = runs[name, threads]
                    run(w, q, out, rows, nb)
                    best = float("inf")
                    for _ in range(3):
                        t = time.perf_counter()
                        run(w, q, out, rows, nb)
                        best = min(best, time.perf_counter() - t)
                    rates.setdefault((cols, threads, name), []).append(rows * cols / best / 1e9)
                    del w
    for (cols, threads, name), got in rates.items():
        ratio = statistics.median(got) / statistics.median(rates[(cols, threads, "2-bit")])
        print(f"{cols:>5} columns, {threads} thread(s), {name:>6}: {statistics.median(got):6.1f} G weights/s "
              f"(rounds {', '.join(f'{x:.0f}' for x in got)}), {ratio:.2f}x the 2-bit codes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
