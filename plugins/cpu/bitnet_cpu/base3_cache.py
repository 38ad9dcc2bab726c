"""The base-3 codes of a model file's projections, kept on disk so that the next load maps them instead of packing.

The avx512vbmi level reads ternary codes packed five to a byte (`int_kernels.pack_base3`), a pure function of the
file's 2-bit codes. Packing the 0.52 GB of 2B-4T's codes took 0.36 s on 2 threads of a Zen 5 EPYC, against 0.19 s
for the rest of a load; mapped from here, the packed codes come in as the first token reads them, as the file's
would.

An entry holds one stack of projections (Q, K and V; gate and up; or one alone) of one file, keyed by the file's
identity (`load_cache.identity`: device, inode, size, mtime, ctime, so any write or replacement of the file is a
miss), each projection's byte range, shape and strides in it, their byte order, and a stamp of the code that
packs. A hit is also checked against its source: three rows of each projection are packed again and must match the
entry to the bit, so a stale or damaged entry is a miss that packs again, not wrong weights. A file's entries share a
directory; the directories of at most MAX_FILES files are kept, the oldest go first. Entries are written to a
temporary file and renamed into place (concurrent loads never see half of one). Only files the load cache takes
(load_cache.MIN_FILE_BYTES) are cached; a failure to write is ignored.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bitnet.modelfile import huge_pages, load_cache
from bitnet.modelfile.model import mapped_span, release_pages
from bitnet.plugins.types import cache_dir

MAX_FILES = 4  # model files whose entries are kept (~0.42 GB for 2B-4T)
_MAX_ENTRIES = 4096  # entries of one file (2B-4T has 120 stacks)
_MAGIC = b"BNB3\x01"
_HEADER = 4096  # the header's room: the codes start page-aligned after it
_BYTES = 64  # a block's bytes

Pack = Callable[[np.ndarray, bool, np.ndarray], None]


def packed(blocks: Sequence[np.ndarray], rev: bool, n_blocks: int, pack: Pack) -> np.ndarray:
    """uint8 [rows, n_blocks, 64]: each projection's 2-bit codes `blocks` [its rows, blocks, 64] (byte order `rev`)
    packed by `pack` (int_kernels.pack_base3), stacked; or the entry a previous load of the same file left."""
    rows = sum(len(b) for b in blocks)
    key = _key(blocks, rev, n_blocks)
    entry = _entry_file(key) if key is not None else None
    if entry is not None:
        found = _read(entry, key, blocks, rev, pack, (rows, n_blocks, _BYTES))
        if found is not None:
            return found
    out = huge_pages.anonymous((rows, n_blocks, _BYTES))
    r0 = 0
    for b in blocks:
        pack(b, rev, out[r0:r0 + len(b)])
        release_pages(b)  # mapped codes read once: only the float path ("none") reads them again
        r0 += len(b)
    if entry is not None:
        _write(entry, key, out)
    return out


def directory() -> Path:
    return cache_dir() / "base3"


def _key(blocks: Sequence[np.ndarray], rev: bool, n_blocks: int) -> tuple | None:
    spans = [mapped_span(b) if b.size else None for b in blocks]
    if any(s is None or s[0].filename is None for s in spans):
        return None
    paths = {os.path.abspath(s[0].filename) for s in spans}
    if len(paths) != 1:
        return None
    path = paths.pop()
    ident = load_cache.identity(path)
    if ident is None:
        return None
    where = tuple((int(s[0].offset) + s[1], b.shape, b.strides) for s, b in zip(spans, blocks, strict=True))
    return (_stamp(), path, ident, where, bool(rev), n_blocks)


def _entry_file(key: tuple) -> Path:
    def name(text: str) -> str:
        return hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()

    path, where = key[1], key[3]
    return directory() / name(path) / f"{name(repr(where))}.bin"


def _read(entry: Path, key: tuple, blocks: Sequence[np.ndarray], rev: bool, pack: Pack,
          shape: tuple[int, int, int]) -> np.ndarray | None:
    """The entry's codes if it is this key's and agrees with the rows it is checked on, else None."""
    try:
        with open(entry, "rb") as f:
            header = f.read(_HEADER)
            size = os.fstat(f.fileno()).st_size
        if header[:len(_MAGIC)] != _MAGIC or marshal.loads(header[len(_MAGIC):]) != key:
            return None
        if size != _HEADER + int(np.prod(shape)):
            return None
        # Copy-on-write: a writable array (the kernels' compiled signature) that never writes the file.
        codes = np.memmap(entry, np.uint8, mode="c", offset=_HEADER, shape=shape)
        huge_pages.advise(codes)
    except Exception:  # missing, unreadable, truncated or another format: a miss, never an error
        return None
    r0 = 0
    for b in blocks:
        rows = np.unique(np.array([0, len(b) // 2, len(b) - 1], np.intp))
        again = np.empty((len(rows), shape[1], _BYTES), np.uint8)
        pack(np.ascontiguousarray(b[rows]), rev, again)
        if not np.array_equal(again, codes[r0 + rows]):
            return None
        r0 += len(b)
    return codes


def _write(entry: Path, key: tuple, codes: np.ndarray) -> None:
    try:
        header = _MAGIC + marshal.dumps(key)
        if len(header) > _HEADER:
            return

        def fill(f: BinaryIO) -> None:
            f.write(header.ljust(_HEADER, b"\0"))
            codes.tofile(f)

        load_cache.write_entry(entry, fill, _MAX_ENTRIES)
        huge_pages.drop(entry)  # cached in the 4 KB folios of its writes: the next load reads it in 2 MB ones
        files = sorted((d for d in directory().iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime_ns)
        for old in files[:max(0, len(files) - MAX_FILES)]:
            if old != entry.parent:
                shutil.rmtree(old, ignore_errors=True)
    except OSError:  # an unwritable or full cache: the next load packs again
        pass


def _stamp() -> bytes:
    """The code that packs (the whole kernel template: pack_base3 and the constants it reads)."""
    here = Path(__file__).resolve().parent
    return load_cache.code_stamp(here / "base3_cache.py", here / "int_kernels.py", here / "dot_ir.py")
