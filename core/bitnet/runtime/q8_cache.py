"""The int8 LM head of a model file, kept on disk so that the next load maps it instead of building it.

Building the int8 copy of a 2B-4T F16 head reads 657 MB of F16 and quantizes 328 M values: 0.2-0.5 s
of a load that otherwise takes about as long. The copy is a pure function of the table's bytes
(reference.q8_table: one scale per row), so it is kept beside the load cache and mapped on the next
load; its pages come in as the first token reads them, as the F16 table's would.

An entry belongs to one table of one file: the file's identity (load_cache.identity: device, inode,
size, mtime, ctime, so any write or replacement of the file is a miss), the table's byte range in it,
its shape and dtype, and a stamp of the code that defines the quantization. A hit is also checked
against its source: a spread of rows is quantized again with the reference's rule and must match the
entry to the bit, so a stale or damaged entry is a miss that rebuilds it, not a wrong head. Entries
are written to a temporary file and renamed into place (concurrent loads never see half of one);
at most MAX_ENTRIES are kept, the least recently used go first. Only tables of files the load cache would take
(load_cache.MIN_FILE_BYTES) are cached; a failure to write is ignored.
"""

from __future__ import annotations

import hashlib
import marshal
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bitnet.modelfile import huge_pages, load_cache
from bitnet.modelfile.model import mapped_span, release_pages
from bitnet.plugins.types import cache_dir
from bitnet.runtime.reference import Q8Table, q8_table

MAX_ENTRIES = 4  # ~330 MB each for a 2B-4T head
CHECK_ROWS = 64  # rows quantized again on every hit
_MAGIC = b"BNQ8\x01"
_HEADER = 4096  # the header's room: the scales start page-aligned after it
_LINE = 64  # the codes start on a cache line: a table off its lines cost the int8 dot 8-10 % (Zen 5)


def table(head: np.ndarray, build: Callable[[np.ndarray], Q8Table]) -> Q8Table:
    """build(head), the int8 copy of a float LM-head table, or the one a previous load of the same file
    left in the cache (the codes memory-mapped)."""
    key = _key(head)
    if key is None:
        return build(head)
    entry = _entry_file(key)
    found = _read(entry, key, head)
    if found is not None:
        return found
    built = build(head)
    _write(entry, key, built)
    return built


def directory() -> Path:
    return cache_dir() / "q8-head"


def _key(head: np.ndarray) -> tuple | None:
    span = mapped_span(head) if head.ndim == 2 and head.size else None
    if span is None or span[0].filename is None:
        return None
    path = os.path.abspath(span[0].filename)
    ident = load_cache.identity(path)
    if ident is None:
        return None
    return (_stamp(), path, ident, int(span[0].offset) + span[1], tuple(head.shape), head.dtype.str)


def _entry_file(key: tuple) -> Path:
    path, offset = key[1], key[3]
    name = hashlib.blake2b(f"{offset}:{path}".encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    return directory() / f"{name}.bin"


def _read(entry: Path, key: tuple, head: np.ndarray) -> Q8Table | None:
    """The entry's table if it is this key's and agrees with the source rows it is checked on, else None."""
    vocab, dim = head.shape
    try:
        with open(entry, "rb") as f:
            header = f.read(_HEADER)
            size = os.fstat(f.fileno()).st_size
        if header[:len(_MAGIC)] != _MAGIC or marshal.loads(header[len(_MAGIC):]) != key:
            return None
        if size != _codes_at(vocab) + vocab * dim:
            return None
        scale = np.fromfile(entry, np.float32, vocab, offset=_HEADER)
        # Copy-on-write: a writable array (the kernels' compiled signature) that never writes the file.
        q = np.memmap(entry, np.int8, mode="c", offset=_codes_at(vocab), shape=(vocab, dim))
        huge_pages.advise(q)
    except Exception:  # missing, unreadable, truncated or another format: a miss, never an error
        return None
    rows = np.array(sorted(set(np.linspace(0, vocab - 1, min(vocab, CHECK_ROWS)).astype(np.intp).tolist())), np.intp)
    ref = q8_table(np.asarray(head[rows]))
    release_pages(head)  # the rows read, and the pages the kernel's read-around mapped beside them
    if not (np.array_equal(ref.q, q[rows]) and np.array_equal(ref.scale.view(np.uint32), scale[rows].view(np.uint32))):
        return None
    load_cache.used(entry)
    return Q8Table(q, scale)


def _write(entry: Path, key: tuple, built: Q8Table) -> None:
    try:
        header = _MAGIC + marshal.dumps(key)
        if len(header) > _HEADER:
            return

        def fill(f: BinaryIO) -> None:
            f.write(header.ljust(_HEADER, b"\0"))
            scale = np.ascontiguousarray(built.scale, np.float32).tobytes()
            f.write(scale.ljust(_codes_at(len(built.scale)) - _HEADER, b"\0"))
            np.ascontiguousarray(built.q, np.int8).tofile(f)

        load_cache.write_entry(entry, fill, MAX_ENTRIES)
        huge_pages.drop(entry)  # cached in the 4 KB folios of its writes: the next load reads it in 2 MB ones
    except OSError:  # an unwritable or full cache: the next load builds again
        pass


def _codes_at(vocab: int) -> int:
    """Where an entry's codes start: after the header and the scales, on a cache line."""
    return -(-(_HEADER + 4 * vocab) // _LINE) * _LINE


def _stamp() -> bytes:
    """The code that defines the int8 table."""
    here = Path(__file__).resolve().parent
    return load_cache.code_stamp(here / "q8_cache.py", here / "reference.py")
