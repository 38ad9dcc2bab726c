"""The base-3 codes' disk cache (bitnet_cpu.base3_cache): a hit maps what a miss packed, any change to the file or
to the entry is a miss that packs again, and a cache that cannot be written still packs.

The cache is tested with a NumPy packer, the same function as int_kernels.pack_base3 (which runs on AVX-512 VBMI
hosts only, and is checked against it there)."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bitnet.modelfile import load_cache
from bitnet.modelfile.ternary import reverse_fields, unpack_codes
from bitnet_cpu import base3_cache, isa
from bitnet_cpu.dot_ir import BASE3_BLOCK, ENCODE


def ref_pack(blocks: np.ndarray, rev: bool, out: np.ndarray) -> None:
    """out = blocks' 2-bit codes (byte order `rev`) in base 3: byte l of block m is
    ENCODE[sum_s 3**s c[320m + 64s + l]]."""
    rows, nb = blocks.shape[:2]
    raw = np.ascontiguousarray(blocks).reshape(rows, nb * 64)
    codes = np.ones((rows, out.shape[1] * BASE3_BLOCK), np.int64)  # code 1 (zero) past the row
    codes[:, :nb * 256] = unpack_codes(reverse_fields(raw) if rev else raw) + 1
    out[:] = ENCODE[(codes.reshape(rows, out.shape[1], 5, 64) * 3 ** np.arange(5)[:, None]).sum(2)]


def counted(calls: list[int]) -> Callable[[np.ndarray, bool, np.ndarray], None]:
    def pack(blocks: np.ndarray, rev: bool, out: np.ndarray) -> None:
        calls.append(len(blocks))
        ref_pack(blocks, rev, out)

    return pack


def valid_codes(rng: np.random.Generator, n: int) -> np.ndarray:
    c = rng.integers(0, 3, (n, 4)).astype(np.uint8)  # codes 0-2 in every field
    return c[:, 0] | c[:, 1] << 2 | c[:, 2] << 4 | c[:, 3] << 6


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BITNET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    new_process(monkeypatch)
    return tmp_path / "cache"


def new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new process knows: no entry read, nothing packed."""
    monkeypatch.setattr(base3_cache, "_entries", {})
    monkeypatch.setattr(base3_cache, "_packed", {})


# Two projections of 3 blocks a row (768 columns: the last base-3 block padded) at two places in a file; the second
# with TQ2_0's 66-byte block stride.
ROWS, NB, NB3 = (5, 7), 3, -(-768 // BASE3_BLOCK)


def write_model(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path.write_bytes(valid_codes(rng, 4096 + ROWS[0] * NB * 64 + ROWS[1] * NB * 66).tobytes())


def projections(path: Path) -> list[np.ndarray]:
    data = np.memmap(path, np.uint8, mode="r")
    a = data[4096:4096 + ROWS[0] * NB * 64].reshape(ROWS[0], NB, 64)
    at = 4096 + ROWS[0] * NB * 64
    b = data[at:at + ROWS[1] * NB * 66].reshape(ROWS[1], NB, 66)[:, :, :64]
    return [a, b]


def expected(blocks: list[np.ndarray], rev: bool) -> list[np.ndarray]:
    out = [np.empty((len(b), NB3, 64), np.uint8) for b in blocks]
    for b, o in zip(blocks, out, strict=True):
        ref_pack(b, rev, o)
    return out


def load(path: Path, rev: bool = False, calls: list[int] | None = None) -> tuple[np.ndarray, ...]:
    """A load's packing of the file's two projections, and its flush once both are placed."""
    got = base3_cache.packed(projections(path), rev, NB3, counted(calls if calls is not None else []))
    base3_cache.flush()
    base3_cache.written()
    return got


def assert_packed(got: tuple[np.ndarray, ...], path: Path, rev: bool = False) -> None:
    for g, want in zip(got, expected(projections(path), rev), strict=True):
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("rev", [False, True])
def test_a_miss_packs_and_the_next_load_maps_what_it_packed(cache: Path, tmp_path: Path, rev: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    write_model(tmp_path / "m.bin", 0)
    calls: list[int] = []
    got = base3_cache.packed(projections(tmp_path / "m.bin"), rev, NB3, counted(calls))
    assert calls == list(ROWS) and not list(cache.glob("base3/*.bin"))  # written once the load placed everything
    # Cut from one chunk (2 MB pages; arrays of their own would get 4 KB ones), each on a cache line.
    assert got[0].base is got[1].base and all(g.ctypes.data % 64 == 0 for g in got)
    base3_cache.flush()
    base3_cache.written()
    assert len(list(cache.glob("base3/*.bin"))) == 1
    assert_packed(got, tmp_path / "m.bin", rev)
    new_process(monkeypatch)
    calls.clear()
    again = load(tmp_path / "m.bin", rev, calls)
    assert calls == [1, 1] and all(isinstance(g, np.memmap) for g in again)  # one row of each checked
    assert base3_cache._entries == {}  # the arrays hold their mapping; the module holds none past a load
    assert_packed(again, tmp_path / "m.bin", rev)
    new_process(monkeypatch)
    calls.clear()  # the other byte order is other codes: packed, and the entry then holds both
    load(tmp_path / "m.bin", not rev, calls)
    assert calls == list(ROWS)
    new_process(monkeypatch)
    calls.clear()
    for order in (rev, not rev):
        assert_packed(load(tmp_path / "m.bin", order, calls), tmp_path / "m.bin", order)
    assert calls == [1, 1, 1, 1]


def test_a_process_that_ends_after_its_load_still_writes_the_entry(cache: Path, tmp_path: Path) -> None:
    # flush writes on a thread of its own (so that a first load does not wait for 0.42 GB to reach the disk); the
    # interpreter waits for it before it exits.
    write_model(tmp_path / "m.bin", 0)
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_base3_cache as t; "
            "from pathlib import Path; from bitnet_cpu import base3_cache; from bitnet.modelfile import load_cache; "
            "load_cache.MIN_FILE_BYTES = 0; "
            f"base3_cache.packed(t.projections(Path({str(tmp_path / 'm.bin')!r})), False, t.NB3, t.ref_pack); "
            "base3_cache.flush(); print(len(base3_cache._writers))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and r.stdout.split() == ["1"], r.stderr[-2000:]
    assert len(list(cache.glob("base3/*.bin"))) == 1


def test_a_changed_file_is_a_miss(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_model(tmp_path / "m.bin", 0)
    load(tmp_path / "m.bin")
    write_model(tmp_path / "m.bin", 1)  # new codes, same size and place
    new_process(monkeypatch)
    calls: list[int] = []
    assert_packed(load(tmp_path / "m.bin", calls=calls), tmp_path / "m.bin")
    assert calls == list(ROWS)


def entry_header(cache: Path) -> tuple[Path, bytes, tuple, dict]:
    """The one entry: its path, bytes, key and index (after the magic: the index's length, then key and index)."""
    (entry,) = cache.glob("base3/*.bin")
    raw = entry.read_bytes()
    key, index = marshal.loads(raw[13:13 + int.from_bytes(raw[5:13], "little")])
    return entry, raw, key, index


def test_a_damaged_entry_is_a_miss_that_packs_again(cache: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    write_model(tmp_path / "m.bin", 0)
    load(tmp_path / "m.bin")
    entry, data, _, index = entry_header(cache)
    raw = bytearray(data)
    first = min(at for at, _ in index.values())
    raw[first + (ROWS[0] // 2) * NB3 * 64] ^= 1  # the first projection's checked row
    entry.write_bytes(bytes(raw))
    new_process(monkeypatch)
    calls: list[int] = []
    got = load(tmp_path / "m.bin", calls=calls)
    assert calls == [1, ROWS[0], 1]  # the first projection packed again, the second mapped
    assert_packed(got, tmp_path / "m.bin")
    with open(entry, "r+b") as f:  # truncated
        f.truncate(first + 64)
    new_process(monkeypatch)
    calls.clear()
    assert_packed(load(tmp_path / "m.bin", calls=calls), tmp_path / "m.bin")
    assert calls == list(ROWS)


def test_an_entry_of_other_shapes_is_a_miss_and_a_load_lets_entries_go(cache: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    write_model(tmp_path / "m.bin", 0)
    load(tmp_path / "m.bin")
    entry, raw, key, index = entry_header(cache)
    index = {k: (at, (1, *shape[1:])) for k, (at, shape) in index.items()}  # one row each: a damaged index
    body = marshal.dumps((key, index))
    entry.write_bytes(raw[:5] + len(body).to_bytes(8, "little") + body + raw[5 + 8 + len(body):])
    new_process(monkeypatch)
    calls: list[int] = []
    assert_packed(load(tmp_path / "m.bin", calls=calls), tmp_path / "m.bin")
    assert calls == list(ROWS)


def test_an_unwritable_cache_still_packs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("BITNET_CACHE_DIR", str(blocker))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    new_process(monkeypatch)
    write_model(tmp_path / "m.bin", 0)
    assert_packed(load(tmp_path / "m.bin"), tmp_path / "m.bin")


def test_small_files_and_arrays_in_memory_are_not_cached(cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    write_model(tmp_path / "m.bin", 0)
    in_memory = [np.array(b) for b in projections(tmp_path / "m.bin")]
    for g, want in zip(base3_cache.packed(in_memory, False, NB3, ref_pack), expected(in_memory, False), strict=True):
        np.testing.assert_array_equal(g, want)
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", os.path.getsize(tmp_path / "m.bin") + 1)
    load(tmp_path / "m.bin")
    assert not list(cache.glob("base3/*.bin"))


def test_the_entries_of_the_newest_files_are_kept(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base3_cache, "MAX_FILES", 2)
    entries = []
    for i in range(3):
        write_model(tmp_path / f"m{i}.bin", i)
        load(tmp_path / f"m{i}.bin")
        entries.append(base3_cache._entry_file(str(tmp_path / f"m{i}.bin")))
        os.utime(entries[-1], (i + 1, i + 1))  # written in that order, whatever the file system's clock resolution
    assert sorted(cache.glob("base3/*.bin")) == sorted(entries[1:])
    new_process(monkeypatch)
    calls: list[int] = []
    load(tmp_path / "m2.bin", calls=calls)
    assert calls == [1, 1]  # the newest is a hit


def test_a_hit_keeps_its_entry_before_those_used_less_recently(cache: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base3_cache, "MAX_FILES", 2)
    entries = []
    for i in range(3):
        write_model(tmp_path / f"m{i}.bin", i)
        entries.append(base3_cache._entry_file(str(tmp_path / f"m{i}.bin")))
    for i in range(2):
        load(tmp_path / f"m{i}.bin")
        os.utime(entries[i], (i + 1, i + 1))  # in this order, whatever the clock's resolution
    new_process(monkeypatch)
    calls: list[int] = []
    load(tmp_path / "m0.bin", calls=calls)
    assert calls == [1, 1]  # a hit
    load(tmp_path / "m2.bin")
    assert sorted(cache.glob("base3/*.bin")) == sorted([entries[0], entries[2]])


@pytest.mark.skipif("avx512vbmi" not in isa.host_levels(), reason="this CPU lacks AVX-512 VBMI")
@pytest.mark.parametrize("level", ["avx512vbmi", "avx512vnni"])
def test_a_load_maps_the_codes_its_level_reads(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               level: str) -> None:
    # The base-3 level reads its own codes (from this cache from the second load on): the engine faults those in,
    # not the file's; the 2-bit levels read the file's.
    from bitnet.modelfile import model as model_module
    from bitnet.modelfile.writer import SyntheticSpec, write_model
    from bitnet.runtime.engine import load

    path = tmp_path / "m.gguf"
    write_model(path, SyntheticSpec(weight_type="i2_s", dim=512, ffn_dim=768, n_heads=4, n_kv_heads=4,
                                    vocab_size=512))
    seen: list[tuple] = []
    original = model_module.map_pages
    monkeypatch.setattr(model_module, "map_pages", lambda *a: seen.append(a) or original(*a))
    monkeypatch.setenv("BITNET_CPU_ISA", level)
    for _ in range(2):
        new_process(monkeypatch)
        engine = load(str(path), device="cpu")
        engine.close()
        base3_cache.written()
    (_, _, first_also, first_codes), (_, _, also, codes) = seen
    if level == "avx512vnni":
        assert first_codes and codes and not also
        return
    assert not first_codes and not codes
    assert not any(isinstance(a, np.memmap) for a in first_also)  # packed by this load: in memory
    assert also and all(isinstance(a, np.memmap) for a in also)  # mapped from the cache


@pytest.mark.skipif("avx512vbmi" not in isa.host_levels(), reason="this CPU lacks AVX-512 VBMI")
@pytest.mark.parametrize("rev", [False, True])
def test_the_kernels_pack_as_the_reference(tmp_path: Path, rev: bool) -> None:
    write_model(tmp_path / "m.bin", 2)
    pack = isa.kernels("avx512vbmi").pack_base3
    for b in projections(tmp_path / "m.bin"):
        got, want = np.empty((len(b), NB3, 64), np.uint8), np.empty((len(b), NB3, 64), np.uint8)
        pack(b, rev, got)
        ref_pack(b, rev, want)
        np.testing.assert_array_equal(got, want)
        one = np.empty((1, NB3, 64), np.uint8)
        for r in range(len(b)):  # a row a call, as a hit checks one (no threads started for it)
            pack(b[r:r + 1], rev, one)
            np.testing.assert_array_equal(one[0], want[r])


def test_a_hits_check_reads_its_row_typed_as_the_mapped_blocks(tmp_path: Path) -> None:
    import numba

    write_model(tmp_path / "m.bin", 3)
    for b in projections(tmp_path / "m.bin"):  # (contiguous as I2_S's, strided as TQ2_0's)
        row = base3_cache._file_row(b, 2)
        # Else the packing kernel compiles again for the first hit after an install (~1.6 s).
        assert numba.typeof(row) == numba.typeof(b)
        np.testing.assert_array_equal(row[0], b[2])
