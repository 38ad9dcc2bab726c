"""The base-3 codes of a model file's projections, kept on disk so that the next load maps them instead of packing.

The avx512vbmi level reads ternary codes packed five to a byte (`int_kernels.pack_base3`), a pure function of the
file's 2-bit codes. Packing the 0.52 GB of 2B-4T's codes took 0.36 s on 2 threads of a Zen 5 EPYC, against 0.25 s
for the rest of a load. A load that packs keeps what it packed (`packed`); once every weight is placed (`flush`),
the file's codes go to disk as one entry, which the next load maps: one file, one mapping, its codes 2 MB into it,
so that a file system caching it in 2 MB folios maps them in 2 MB pages (one entry per projection stack, in 4 KB
pages, had cost a load 0.1 s more than the file's own codes).

An entry belongs to one file: its identity (`load_cache.identity`: device, inode, size, mtime, ctime, so any write or
replacement of the file is a miss) and a stamp of the code that packs; inside it, each projection's codes are keyed
by its byte range, shape and strides in the file, its byte order and its blocks. A hit is also checked against its
source: one row of each projection, read from the file, is packed again and must match the entry to the bit, so a
stale or damaged entry is a miss that packs again, not wrong weights. Entries are written to a temporary file and
renamed into place (concurrent loads never see half of one); at most MAX_FILES are kept, the least recently used go
first. Only files the load cache takes (load_cache.MIN_FILE_BYTES) are cached; a failure to write is ignored.
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bitnet.modelfile import huge_pages, load_cache
from bitnet.modelfile.model import mapped_span, release_pages
from bitnet.plugins.types import cache_dir

MAX_FILES = 4  # model files whose entries are kept (~0.42 GB for 2B-4T)
_MAGIC = b"BNB3\x02"
_CODES_AT = 2 << 20  # where an entry's codes start: a 2 MB page's worth of header room (a hole on disk)
_BYTES = 64  # a block's bytes
_CHUNK = 64 << 20  # packed codes' room is cut from chunks this large (see _room)

Pack = Callable[[np.ndarray, bool, np.ndarray], None]
_entries: dict[str, tuple[tuple, dict, np.ndarray] | None] = {}  # per file path: its entry's key, index, codes
_packed: dict[str, tuple[tuple, dict[tuple, np.ndarray]]] = {}  # per file path: what this process packed
_chunk: list = [np.empty(0, np.uint8), 0]  # the chunk codes are being packed into, and its first free byte
_writers: list[threading.Thread] = []


def packed(blocks: Sequence[np.ndarray], rev: bool, n_blocks: int, pack: Pack) -> tuple[np.ndarray, ...]:
    """uint8 [rows, n_blocks, 64] per projection: its 2-bit codes `blocks` [rows, blocks, 64] (byte order `rev`)
    packed by `pack` (int_kernels.pack_base3), or mapped from the entry a previous load of the same file left."""
    return tuple(_one(b, rev, n_blocks, pack) for b in blocks)


def flush() -> None:
    """Write an entry for each file whose codes this process packed (with what its entry held already), on a thread
    of its own: writing 2B-4T's 0.42 GB and syncing it had added ~1 s to a file's first load. The process waits for
    it before it exits (`written` waits now). The entries read are let go: the arrays `packed` returned keep their
    mappings as long as a model holds them, and no longer."""
    jobs = []
    while _packed:
        path, (key, fresh) = _packed.popitem()
        held = _entries.pop(path, None)
        parts = {}
        if held is not None and held[0] == key:
            parts = {k: held[2][at:at + int(np.prod(shape))].reshape(shape) for k, (at, shape) in held[1].items()}
        parts.update(fresh)
        index, at = {}, _CODES_AT
        for k, codes in parts.items():
            index[k] = (at, codes.shape)
            at += codes.nbytes
        jobs.append((path, key, index, parts))
    _entries.clear()
    _chunk[:] = np.empty(0, np.uint8), 0
    if jobs:
        writer = threading.Thread(target=lambda: [_write(*job) for job in jobs], name="bitnet-base3-cache")
        writer.start()
        _writers.append(writer)


def written() -> None:
    """Wait for the entries `flush` is writing."""
    while _writers:
        _writers.pop().join()


def directory() -> Path:
    return cache_dir() / "base3"


def _one(b: np.ndarray, rev: bool, n_blocks: int, pack: Pack) -> np.ndarray:
    span = mapped_span(b) if b.size else None
    ident = load_cache.identity(span[0].filename) if span is not None and span[0].filename else None
    if span is None or ident is None:
        return _pack(b, rev, n_blocks, pack)
    path = os.path.abspath(span[0].filename)
    key = (_stamp(), path, ident)
    where = (int(span[0].offset) + span[1], b.shape, b.strides, bool(rev), n_blocks)
    found = _lookup(path, key, where, b, rev, pack)
    if found is not None:
        # Pages of the file's codes the load mapped (reading I2_S's scale after them maps a 2 MB page a tensor):
        # the codes are read from the entry now.
        release_pages(b)
        return found
    codes = _pack(b, rev, n_blocks, pack)
    if _packed.get(path, (key,))[0] != key:  # the file changed during this process: its new codes only
        _packed.pop(path)
    _packed.setdefault(path, (key, {}))[1][where] = codes
    return codes


def _pack(b: np.ndarray, rev: bool, n_blocks: int, pack: Pack) -> np.ndarray:
    out = _room((len(b), n_blocks, _BYTES))
    pack(b, rev, out)
    release_pages(b)  # mapped codes read once: only the float path ("none") reads them again
    return out


def _room(shape: tuple[int, int, int]) -> np.ndarray:
    """An empty uint8 array of `shape` on a cache line, cut from a chunk of _CHUNK bytes. NumPy asks Linux for 2 MB
    pages for arrays from 4 MB on, and a projection's codes are 0.3-3.6 MB for 2B-4T: packed into arrays of their
    own, a 1-thread decode step's projections took 13.8-14.0 ms against 11.7-11.9 mapped from an entry (Zen 5). A
    chunk's pages that nothing packs into are never touched, so they are not resident."""
    n = int(np.prod(shape))
    chunk, at = _chunk
    if at + n > chunk.size:
        chunk = np.empty(max(_CHUNK, n) + _BYTES, np.uint8)
        at = -chunk.ctypes.data % _BYTES
    _chunk[:] = chunk, at + n  # (n is whole blocks: the next array starts on a line too)
    return chunk[at:at + n].reshape(shape)


def _entry_file(path: str) -> Path:
    return directory() / (hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
                          + ".bin")


def _lookup(path: str, key: tuple, where: tuple, b: np.ndarray, rev: bool, pack: Pack) -> np.ndarray | None:
    """The projection's codes from the file's entry, if it holds them and they agree with the row checked."""
    if path not in _entries or (_entries[path] is not None and _entries[path][0] != key):
        _entries[path] = _read(_entry_file(path), key)
    entry = _entries[path]
    if entry is None or where not in entry[1]:
        return None
    at, shape = entry[1][where]
    if tuple(shape) != (len(b), where[-1], _BYTES):
        return None
    codes = entry[2][at:at + int(np.prod(shape))].reshape(shape)
    row = len(b) // 2
    again = np.empty((1, *shape[1:]), np.uint8)
    pack(_file_row(b, row), rev, again)
    return codes if np.array_equal(again[0], codes[row]) else None


def _read(entry: Path, key: tuple) -> tuple[tuple, dict, np.ndarray] | None:
    try:
        with open(entry, "rb") as f:
            head = f.read(len(_MAGIC) + 8)
            size = int.from_bytes(head[len(_MAGIC):], "little")
            if head[:len(_MAGIC)] != _MAGIC or size > _CODES_AT:
                return None
            stored, index = marshal.loads(f.read(size))
            end = os.fstat(f.fileno()).st_size
        if stored != key or any(at + int(np.prod(shape)) > end for at, shape in index.values()):
            return None
        # Copy-on-write: writable arrays (the kernels' compiled signature) that never write the file.
        codes = np.memmap(entry, np.uint8, mode="c")
        huge_pages.advise(codes)
        load_cache.used(entry)
        return key, index, codes
    except Exception:  # missing, unreadable, truncated or another format: a miss, never an error
        return None


def _file_row(b: np.ndarray, row: int) -> np.ndarray:
    """Row `row` of the mapped blocks b [rows, blocks, 64], read from its file, not through the mapping: each page
    read through it would stay mapped (in 2 MB pages, all of 2B-4T's codes for a row of each projection)."""
    base, lo, _ = mapped_span(b)
    raw = np.empty((b.shape[1] - 1) * b.strides[1] + _BYTES, np.uint8)
    fd = os.open(base.filename, os.O_RDONLY)
    try:
        if os.preadv(fd, [raw], int(base.offset) + lo + row * b.strides[0]) != raw.size:
            raise OSError(f"{base.filename} is shorter than its mapping")
    finally:
        os.close(fd)
    # Read-only and strided as the mapped blocks are, so that `pack` runs the code a miss compiled (and the warmup).
    return np.lib.stride_tricks.as_strided(raw, (1, b.shape[1], _BYTES), (0, b.strides[1], 1), writeable=False)


def _write(path: str, key: tuple, index: dict, parts: dict[tuple, np.ndarray]) -> None:
    try:
        body = marshal.dumps((key, index))
        if len(_MAGIC) + 8 + len(body) > _CODES_AT:
            return

        def fill(f: BinaryIO) -> None:
            f.write(_MAGIC + len(body).to_bytes(8, "little") + body)
            for k, (at, _) in sorted(index.items(), key=lambda item: item[1][0]):
                f.seek(at)
                np.ascontiguousarray(parts[k]).tofile(f)

        entry = _entry_file(path)
        load_cache.write_entry(entry, fill, MAX_FILES)
        # Cached in the 4 KB folios of its writes: read back in 2 MB ones (on this thread), for the next load to map.
        huge_pages.reread(str(entry))
    except OSError:  # an unwritable or full cache: the next load packs again
        pass


@functools.cache
def _stamp() -> bytes:
    """The code that packs (the whole kernel template: pack_base3 and the constants it reads)."""
    here = Path(__file__).resolve().parent
    return load_cache.code_stamp(here / "base3_cache.py", here / "int_kernels.py", here / "dot_ir.py")
