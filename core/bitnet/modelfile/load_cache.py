"""What loading a GGUF file learned from reading it whole, kept per file so the next load skips it.

Three things cost most of a warm load of a 2B-4T file and give the same answer every time for an
unchanged file: parsing the header (the 128k-token vocabulary: ~0.14 s of Python), checking every
byte of tensor data (invalid ternary codes, NaN/Inf: ~0.25 s of one core) and importing gguf to do
the parsing (~0.05 s). An entry holds the parsed metadata and where each tensor lies and, by existing
at all, says the tensor data passed the checks.

An entry belongs to one file identity: device, inode, size, mtime and ctime (in nanoseconds). Any
write to the file, a truncation or a file renamed over it changes the ctime or the inode, and ctime
cannot be set back by a user, so a changed file never matches an old entry. On top of that the
header (magic to the last tensor info) must hash to what the entry recorded, and the entry names a
stamp of the code that parsed and checked the file, so a new version never trusts an old version's
verdict. Anything wrong with an entry (truncated, corrupt, another format) makes it a miss: the file
is read whole again and a fresh entry replaces it.

Entries live in BITNET_CACHE_DIR (default ~/.cache/bitnet) under gguf-load/, one per file path,
written to a temporary file and renamed into place, so concurrent loads (parallel test workers, two
servers) never see half an entry. Only files of at least MIN_FILE_BYTES are cached: smaller ones load
in milliseconds anyway. At most MAX_ENTRIES are kept (about 5 MB each for a 128k vocabulary); the
least recently used go first (a hit marks its entry used).
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from bitnet.plugins.types import cache_dir
from bitnet.text.merges import DerivedMerges, spelled_by_ids

MIN_FILE_BYTES = 64 << 20
MAX_ENTRIES = 32
_MAGIC = b"BNLC\x01"
_TOKENS, _TYPES, _MERGES = (f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges"))
_DIGEST = 32  # sha256 (SHA-NI: 2.7x blake2b's speed on the 2-core EPYC; 5 MB in 4 ms)

Identity = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class Entry:
    identity: Identity
    header_end: int  # where the tensor data starts
    header_hash: bytes  # sha256 of bytes [0, header_end): magic, metadata, tensor infos
    metadata: dict[str, Any]
    tensors: list[tuple]  # per tensor what bitnet.modelfile.model needs to map it again


def directory() -> Path:
    return cache_dir() / "gguf-load"


def identity(path: str) -> Identity | None:
    """The file's identity, or None when it is not worth caching (small, or cannot be stat'ed)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_size < MIN_FILE_BYTES:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def header_hash(data: Any, header_end: int) -> bytes:
    return hashlib.sha256(memoryview(data)[:header_end]).digest()


def lookup(path: str, ident: Identity | None) -> Entry | None:
    """The entry for this file as it is now, else None (never raises)."""
    if ident is None:
        return None
    try:
        entry = _entry_file(path)
        raw = entry.read_bytes()
        body = memoryview(raw)[len(_MAGIC) + _DIGEST:]
        if raw[:len(_MAGIC)] != _MAGIC or raw[len(_MAGIC):len(_MAGIC) + _DIGEST] != _digest(body):
            return None
        stamp, name, ident_, header_end, hh, md, tensors = marshal.loads(body)
        if stamp != _stamp() or name != os.path.abspath(path) or tuple(ident_) != ident:
            return None
        if not (isinstance(header_end, int) and isinstance(hh, bytes) and isinstance(md, dict)
                and isinstance(tensors, list)):
            return None
        md = {k: v[1].split("\0") if isinstance(v, tuple) and v[0] == "joined" else v for k, v in md.items()}
        merges = md.get(_MERGES)
        if isinstance(merges, tuple) and merges[0] == "derived" and isinstance(merges[1], int):
            md[_MERGES] = DerivedMerges(md[_TOKENS], md.get(_TYPES), merges[1])
        used(entry)
        return Entry(ident, header_end, hh, md, tensors)
    except Exception:  # a missing, unreadable or corrupt entry is a miss, never an error
        return None


def matches(entry: Entry, path: str, data: Any) -> bool:
    """Whether the mapped `data` of `path` is the file the entry describes: the header hashes the
    same and the identity did not change while it was being opened."""
    return (len(data) >= entry.header_end and header_hash(data, entry.header_end) == entry.header_hash
            and identity(path) == entry.identity)


def store(path: str, ident: Identity | None, data: Any, header_end: int, metadata: dict[str, Any],
          tensors: list[tuple]) -> None:
    """Record a file that was parsed and checked whole. `ident` is its identity from *before* it was
    read, so a file changed meanwhile gets an entry no later load matches. Failures are ignored."""
    if ident is None:
        return
    try:
        merges = metadata.get(_MERGES)
        derived = spelled_by_ids(metadata.get(_TOKENS), metadata.get(_TYPES), merges)
        md = {k: ("derived", len(merges)) if derived and k == _MERGES else _joined(v) for k, v in metadata.items()}
        body = marshal.dumps((_stamp(), os.path.abspath(path), ident, header_end, header_hash(data, header_end),
                              md, tensors))
        write_entry(_entry_file(path), lambda f: f.write(_MAGIC + _digest(body) + body), MAX_ENTRIES)
    except (OSError, ValueError):  # unwritable cache, or metadata marshal cannot hold
        pass


def _joined(value: Any) -> Any:
    """A long array of strings without NULs (a vocabulary's tokens and merges) as ("joined", them joined by NULs),
    which `lookup` splits (metadata values are never tuples): a hit made Llama 3's 128k tokens and 280k merges in
    49 ms so, in 65 ms from marshal's lists. Anything else as it is. (Merges that the token ids spell are recorded
    as ("derived", how many): bitnet.text.merges.)"""
    if isinstance(value, list) and len(value) > 256 and set(map(type, value)) == {str}:
        joined = "\0".join(value)
        if joined.count("\0") == len(value) - 1:
            return ("joined", joined)
    return value


def _entry_file(path: str) -> Path:
    return directory() / (hashlib.blake2b(os.path.abspath(path).encode("utf-8", "surrogateescape"),
                                          digest_size=16).hexdigest() + ".bin")


def _digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def write_entry(target: Path, fill: Callable[[BinaryIO], object], keep: int) -> None:
    """Write a cache entry (fill writes its bytes) through a temporary file renamed into place, so that
    readers see the old entry or the new one, never part of one; then keep the `keep` entries of its directory
    written or `used` last. Raises OSError."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    entries = sorted(target.parent.glob("*.bin"), key=lambda p: p.stat().st_mtime_ns)
    for old in entries[:max(0, len(entries) - keep)]:
        old.unlink(missing_ok=True)


def used(entry: Path) -> None:
    """Mark a cache entry as just used, so that `write_entry` lets others go first: with the entries kept in the
    order they were written, the model a user loads every day would go before files loaded once since."""
    try:
        os.utime(entry)
    except OSError:  # a read-only cache: it is never written either
        pass


@functools.cache
def code_stamp(*sources: Path) -> bytes:
    """A hash of the source files whose code an entry depends on: a new version trusts no old entry."""
    h = hashlib.blake2b(digest_size=16)
    for source in sources:
        h.update(source.read_bytes())
    return h.digest()


def _stamp() -> bytes:
    """The code that parses and checks files."""
    here = Path(__file__).resolve().parent
    return code_stamp(*(here / name for name in ("load_cache.py", "model.py", "gguf_reader.py", "formats.py")),
                      here.parent / "text" / "merges.py")
