"""The ternary matrix-vector product at the BitNet b1.58 2B-4T shapes, per available backend.

Decoding one token is a chain of matrix-vector products over packed 2-bit weights, so it is
bound by how fast the weights stream from memory. Each figure here is measured in this run:
`bitlinear` on a [1, cols] input, synchronised by `to_host`, median of the repeats; GB/s
counts the weight bytes a call must read (rows*cols/4 packed codes plus the float32 block
scales). The reference is a memory-bandwidth probe run in the same process over an array far
larger than the caches (the best of a few ways to stream it, see bandwidth_probe).

    python benchmarks/kernel_bench.py [--backends cpu,opencl] [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np

from bitnet.modelfile.ternary import BLOCK, TernaryMatrix, pack_values
from bitnet.plugins.registry import Registry

# [rows, cols] of the 2B-4T projections: q/o, k/v (5 KV heads x 128), gate/up, down.
SHAPES = ((2560, 2560), (640, 2560), (6912, 2560), (2560, 6912))


def bandwidth_probe(mib: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth in GB/s over a float32 array of `mib` MiB (well beyond any L3), several ways.

    A plain float sum is compute-bound (pairwise summation), so the probe takes the best of
    reads that are not: max (SIMD compare), a BLAS dot product, max on every core at once, and a
    copy (STREAM's: read and write both count)."""
    a = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
    b = np.empty_like(a)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    chunks = np.array_split(a, threads)

    def best(fn: Any, nbytes: int = a.nbytes) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9

    out: dict[str, float] = {"threads": threads, "max_1_thread": best(a.max),
                             "dot": best(lambda: np.dot(a, a))}
    with ThreadPoolExecutor(threads) as pool:  # NumPy reductions release the GIL
        out["max_all_threads"] = best(lambda: list(pool.map(np.max, chunks)))
    out["copy"] = best(lambda: np.copyto(b, a), 2 * a.nbytes)
    out["gbs"] = max(v for k, v in out.items() if k != "threads")
    return out


def random_ternary(rows: int, cols: int, rng: np.random.Generator) -> TernaryMatrix:
    t = rng.integers(-1, 2, size=(rows, cols), dtype=np.int8)
    scales = np.full((rows, cols // BLOCK), 0.75, dtype=np.float32)  # one scale per tensor, like I2_S
    return TernaryMatrix(pack_values(t), scales)


def time_matvec(provider: Any, w: TernaryMatrix, repeats: int, rng: np.random.Generator) -> float:
    """Median seconds of one bitlinear on [1, cols], including the read-back that waits for it."""
    handle = provider.upload_ternary(w)
    x = provider.upload_float(rng.standard_normal((1, w.cols)).astype(np.float32))
    for _ in range(3):  # warm-up: first dispatches may compile or fault pages in
        provider.to_host(provider.bitlinear(x, handle, "row"))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        provider.to_host(provider.bitlinear(x, handle, "row"))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_backend(backend: Any, device: Any, repeats: int, probe_gbs: float) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    provider = backend.open(device)
    rows_out = []
    try:
        for rows, cols in SHAPES:
            w = random_ternary(rows, cols, rng)
            seconds = time_matvec(provider, w, repeats, rng)
            nbytes = w.packed().nbytes + w.scales.nbytes
            gbs = nbytes / seconds / 1e9
            rows_out.append({"backend": backend.name, "device": device.name, "shape": f"{rows}x{cols}",
                             "weight_bytes": nbytes, "median_us": seconds * 1e6, "gbs": gbs,
                             "fraction_of_probe": gbs / probe_gbs})
    finally:
        provider.close()
    return rows_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=None, help="comma list (default: every available real backend)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--probe-mib", type=int, default=1024)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    registry = Registry()
    wanted = [b.strip().lower() for b in args.backends.split(",")] if args.backends else None
    probe = bandwidth_probe(args.probe_mib)
    print(f"kernel bench {datetime.now(timezone.utc):%Y-%m-%d %H:%M}Z  memory probe: {probe['gbs']:.1f} GB/s "
          f"(max 1 thread {probe['max_1_thread']:.1f}, max {probe['threads']} threads "
          f"{probe['max_all_threads']:.1f}, dot {probe['dot']:.1f}, copy {probe['copy']:.1f})")
    results: list[dict[str, Any]] = []
    for backend in registry.backends():
        if wanted is not None and backend.name not in wanted:
            continue
        devices = [d for d in registry.probe(backend.name).devices if not d.fake]
        if not devices:
            reason = registry.probe(backend.name).reason or "only a fake device"
            print(f"{backend.name}: skipped: {reason}")
            continue
        try:
            results += bench_backend(backend, devices[0], args.repeats, probe["gbs"])
        except Exception as exc:  # one backend failing must not hide the others' figures
            print(f"{backend.name}: failed: {type(exc).__name__}: {exc}")
    print(f"{'BACKEND':<8} {'SHAPE':<10} {'WEIGHT MB':>9} {'MEDIAN us':>10} {'GB/s':>7} {'OF PROBE':>8}")
    for r in results:
        print(f"{r['backend']:<8} {r['shape']:<10} {r['weight_bytes'] / 1e6:>9.2f} {r['median_us']:>10.1f} "
              f"{r['gbs']:>7.2f} {r['fraction_of_probe']:>8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"probe": probe, "results": results}, f, indent=2)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
