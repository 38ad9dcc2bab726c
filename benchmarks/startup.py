"""Startup cost of the front end: `bitnet-select --version` and `devices` next to bare Python.

Prints medians over several runs, measured in this run, and the targets of issue 2
(--version within 0.3 s of `python -c pass`, devices within 2 s with PoCL installed).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

RUNS = 7


def median_seconds(args: list[str]) -> float:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    bare = median_seconds([sys.executable, "-c", "pass"])
    version = median_seconds([sys.executable, "-m", "bitnet", "--version"])
    devices = median_seconds([sys.executable, "-m", "bitnet", "devices"])
    print(f"{'command':<28}{'median s':>10}{'minus bare':>12}  target")
    print(f"{'python -c pass':<28}{bare:>10.3f}{0:>12.3f}")
    print(f"{'bitnet-select --version':<28}{version:>10.3f}{version - bare:>12.3f}  <= 0.3 s over bare "
          f"({'ok' if version - bare <= 0.3 else 'MISSED'})")
    print(f"{'bitnet-select devices':<28}{devices:>10.3f}{devices - bare:>12.3f}  <= 2 s "
          f"({'ok' if devices <= 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
