"""A mapped model file in 2 MB pages: one TLB entry for what took 512.

Decode streams every weight once a token, so with 4 KB pages each token of 2B-4T (0.85 GB read with the int8
head) walks the page tables ~200,000 times. Where the kernel keeps a file's page cache in 2 MB folios
(ext4 and xfs on recent kernels), a mapping aligned to them is mapped with 2 MB pages. On a Zen 5 EPYC,
one thread, a decode step of 2B-4T took 25.0-27.1 ms from a file cached in 2 MB folios against
26.5-27.6 from the same file cached in 4 KB pages (B=1; B=8: 50.4-52.4 against 52.4-54.0; alternating
processes on the same quiet minutes).

The folios are chosen when the pages enter the cache: reads ahead of a sequential read() or of faults in a
mapping advised MADV_HUGEPAGE come in 2 MB folios, but a file still cached from being written (downloaded,
converted, copied) stays in the small folios its writes made, until the kernel evicts it. So the first
load of a file (a load-cache miss) checks how its pages came in and, when they are mostly small, drops them
from the page cache: the next reads bring them back from disk in 2 MB folios, once (a first load of the 1.2 GB
2B-4T file took 2.8 s against 1.2 on the EPYC). Pages another process maps stay where they are. The int8
LM head's cache entry (bitnet.runtime.q8_cache) is dropped as soon as it is written, for the same reason:
from 2 MB folios the step took 25.6-26.2 ms against 26.0-27.0 (B=1) and 51.8-53.7 against 52.7-55.0 (B=8).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

MIN_BYTES = 64 << 20  # smaller files are left as they are: 4 KB pages of 16 MB fit a Zen 5's L2 TLB
_SMAPS = "/proc/self/smaps"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def advise(data: np.ndarray) -> None:
    """Ask for 2 MB folios for the pages of the mapping under `data` (an np.memmap) that enter the cache."""
    mapping = getattr(data, "_mmap", None)
    if mapping is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):  # a kernel without transparent huge pages
            pass


def share(path: str, smaps: str = _SMAPS) -> float | None:
    """Of this process's resident pages of file `path`, the share mapped in 2 MB pages; None when none are
    resident or the kernel does not say."""
    target = os.path.realpath(path)
    rss = pmd = 0
    mine = False
    try:
        with open(smaps, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(" ")
                if "-" in key and not key.endswith(":"):  # a mapping's first line: its range, ..., its path
                    mine = rest.rstrip("\n").endswith(" " + target)
                elif mine and key in ("Rss:", "FilePmdMapped:"):
                    kb = int(rest.split()[0])
                    rss, pmd = (rss + kb, pmd) if key == "Rss:" else (rss, pmd + kb)
    except (OSError, ValueError, IndexError):
        return None
    return pmd / rss if rss else None


def recache(path: str, data: np.ndarray, smaps: str = _SMAPS) -> bool:
    """When this process maps `path` (under `data`) mostly in 4 KB pages, drop the file's unmapped pages from
    the page cache so that they come back in 2 MB folios; True when it did."""
    mapping = getattr(data, "_mmap", None)
    try:
        small = os.path.getsize(path) < MIN_BYTES
    except OSError:
        return False
    got = None if mapping is None or small else share(path, smaps)
    if got is None or got >= 0.5 or not _huge_pages_allowed():
        return False
    mapping.madvise(mmap.MADV_DONTNEED)  # ours: the cache drops only pages nobody maps
    return drop(path)


def drop(path: str | os.PathLike[str]) -> bool:
    """Write the file's pages back and drop those nobody maps from the page cache, so that the next reads (through
    a mapping advised as `advise` does) bring them in 2 MB folios; False where the file system cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fdatasync(fd)  # pages still being written back would stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)
    return True


def reread(path: str) -> None:
    """Drop the file's unmapped pages from the cache and read it whole through a mapping advised MADV_HUGEPAGE: the
    file in 2 MB folios where the kernel has them, for whichever process maps it next. The benchmarks start every
    engine's file so (llama.cpp's mapping takes 2 MB pages from the same folios), and none pays a cold read."""
    drop(path)  # (where it cannot, the file is read as it is cached)
    data = np.memmap(path, mode="r")
    advise(data)
    int(data.view(np.ndarray)[::mmap.PAGESIZE].max(initial=0))


def _huge_pages_allowed() -> bool:
    try:
        return "[never]" not in Path(_THP).read_text()
    except OSError:
        return False
