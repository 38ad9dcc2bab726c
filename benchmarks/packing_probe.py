"""Do ternary codes packed 5 to a byte (base 3, 1.6 bits a weight) decode one token faster than 2-bit codes here?

One token's BitLinear reads every weight once and is bound by memory, so a denser packing is faster exactly as long
as decoding it keeps up with the memory. The CPU plugin's avx512vbmi level reads base-3 codes; it is the default only
where this was measured faster (a Zen 5: `isa.base3_by_default`). This probe says whether it is on another host
(Zen 4, Intel), timing the two levels' one-token dots alone:

- "2-bit": the avx512vnni level's, 4 codes a byte (`vpdpbusd`);
- "base-3": the avx512vbmi level's, 64-byte blocks of 320 weights, byte l holding columns l, 64 + l, ... 256 + l,
  each byte decoded by two `vpermi2b` lookups and a blend (dot_ir), then the same `vpdpbusd`.

Both read rows of the 2B-4T widths (2560 and 6912 columns; base 3 pads 6912 to 22 blocks) from 512 MB of codes, on
1 and 2 threads, alternating, medians of the rounds. The figure is weights a second: the format's gain when it is
above 1.0x. The base-3 dot's sum is first checked exactly against NumPy. (On the Zen 5: 1.19-1.27x.)

    python benchmarks/packing_probe.py [--rounds 3]

Needs AVX-512 VNNI and VBMI (Ice Lake and later, Zen 4 and later); elsewhere it says so and exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from numba import njit, prange

from bitnet_cpu import isa
from bitnet_cpu.dot_ir import BASE3_BLOCK, BLOCK, ENCODE, TRITS


def _aligned(n: int, dtype: type) -> np.ndarray:
    buf = np.empty(n + 64, dtype)
    return buf[-buf.ctypes.data % 64:][:n]


def _runner(dot: Callable[..., None], parallel: bool) -> Callable[..., None]:
    # One compiled loop per level and thread count: a loop holding both dots, or a prange of one part, ran the
    # base-3 one 15-30 % slower on one thread (Zen 5).
    loop = prange if parallel else range
    parts = 2 if parallel else 1

    @njit(parallel=parallel)
    def run(w: np.ndarray, q: np.ndarray, out: np.ndarray, rows: int, nb: int) -> None:
        for p in loop(parts):
            for r in range(p * rows // parts, (p + 1) * rows // parts):
                dot(w.ctypes.data + r * nb * 64, nb, 64, q.ctypes.data, 0, 1, out.ctypes.data + 64 * p)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if "avx512vbmi" not in isa.host_levels():
        print("packing_probe: this CPU lacks AVX-512 VBMI or VNNI, which the base-3 level needs", file=sys.stderr)
        return 1
    dots = {name: isa.build(level, cache=False)._make_dot(1, False)
            for name, level in (("2-bit", "avx512vnni"), ("base-3", "avx512vbmi"))}
    runs = {(name, threads): _runner(dot, threads == 2) for name, dot in dots.items() for threads in (1, 2)}

    rng = np.random.default_rng(0)
    out = np.zeros(64, np.int32)
    nb = 8  # the base-3 dot against NumPy, every byte the encoding writes
    w = _aligned(nb * 64, np.uint8)
    w[:] = ENCODE[np.arange(w.size) % 243]
    q = _aligned(nb * BASE3_BLOCK, np.int8)
    q[:] = rng.integers(-127, 128, q.size)
    runs["base-3", 1](w, q, out, 1, nb)
    codes = TRITS[:, w.reshape(nb, 64)].transpose(1, 0, 2).reshape(-1)
    if int(out[0]) != int((codes.astype(np.int64) * q).sum()):
        print(f"packing_probe: the base-3 dot's sum {out[0]} is wrong", file=sys.stderr)
        return 1

    rates: dict[tuple[int, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for cols in (2560, 6912):
            for threads in (1, 2):
                for name, per_block in (("2-bit", BLOCK), ("base-3", BASE3_BLOCK)):
                    nb = -(-cols // per_block)
                    rows = (512 << 20) // (nb * 64) // 2 * 2
                    w = _aligned(rows * nb * 64, np.uint8)
                    w[:] = 0x55  # code 1 in each 2-bit field, and a byte the base-3 encoding writes
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
