"""The int8 LM-head cache (bitnet.runtime.q8_cache): a second load maps the table the first one built,
bit for bit; a changed file, a damaged or truncated entry and a table not mapped from a file are built."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bitnet.modelfile import load_cache
from bitnet.runtime import q8_cache
from bitnet.runtime.reference import Q8Table, q8_table

VOCAB, DIM, OFFSET = 300, 256, 96  # the table sits past a header, as in a GGUF file


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BITNET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    return q8_cache.directory()


def write_table(path: Path, seed: int) -> None:
    table = np.random.default_rng(seed).standard_normal((VOCAB, DIM)).astype(np.float16)
    table[7] = 0  # a zero row: scale 1
    path.write_bytes(b"\x01" * OFFSET + table.tobytes())


def mapped(path: Path) -> np.ndarray:
    return np.memmap(path, np.uint8, mode="r")[OFFSET:].view(np.float16).reshape(VOCAB, DIM)


class Builds:
    """q8_table, counting its calls (a call is a miss)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, table: np.ndarray) -> Q8Table:
        self.calls += 1
        return q8_table(table)


def same(a: Q8Table, b: Q8Table) -> bool:
    return np.array_equal(a.q, b.q) and np.array_equal(a.scale.view(np.uint32), b.scale.view(np.uint32))


def test_a_second_load_maps_the_table_the_first_built(cache: Path, tmp_path: Path) -> None:
    write_table(tmp_path / "m.gguf", 1)
    build = Builds()
    first = q8_cache.table(mapped(tmp_path / "m.gguf"), build)
    second = q8_cache.table(mapped(tmp_path / "m.gguf"), build)
    assert build.calls == 1 and isinstance(second.q, np.memmap) and second.q.flags.writeable
    assert same(first, second) and same(second, q8_table(mapped(tmp_path / "m.gguf")))
    assert len(list(cache.glob("*.bin"))) == 1


def test_a_hit_keeps_its_entry_before_those_used_less_recently(cache: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(q8_cache, "MAX_ENTRIES", 2)
    tables = []
    for i in range(3):
        write_table(tmp_path / f"m{i}.gguf", i)
        tables.append(mapped(tmp_path / f"m{i}.gguf"))
    entry = [q8_cache._entry_file(q8_cache._key(t)) for t in tables]
    build = Builds()
    for i in range(2):
        q8_cache.table(tables[i], build)
        os.utime(entry[i], (i + 1, i + 1))  # in this order, whatever the clock's resolution
    q8_cache.table(tables[0], build)
    assert build.calls == 2  # a hit
    q8_cache.table(tables[2], build)
    assert sorted(cache.glob("*.bin")) == sorted([entry[0], entry[2]])


def test_a_mapped_tables_codes_start_on_a_cache_line(cache: Path, tmp_path: Path) -> None:
    # 300 rows of scales end 48 bytes into a line: the codes are padded past them.
    path = tmp_path / "m.bin"
    write_table(path, 1)
    q8_cache.table(mapped(path), Builds())
    found = q8_cache.table(mapped(path), Builds())
    assert isinstance(found.q, np.memmap) and found.q.ctypes.data % 64 == 0


def test_a_changed_file_is_built_again(cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_table(path, 1)
    build = Builds()
    q8_cache.table(mapped(path), build)
    raw = bytearray(path.read_bytes())  # same path and size; one row the hit check does not quantize again
    raw[OFFSET + 3 * DIM * 2:OFFSET + 4 * DIM * 2] = np.full(DIM, 0.5, np.float16).tobytes()
    path.write_bytes(bytes(raw))
    assert 3 not in np.linspace(0, VOCAB - 1, q8_cache.CHECK_ROWS).astype(int)
    got = q8_cache.table(mapped(path), build)
    assert build.calls == 2 and same(got, q8_table(mapped(path)))
    assert same(q8_cache.table(mapped(path), build), got) and build.calls == 2  # the new entry is a hit


@pytest.mark.parametrize("damage", ["codes", "scale", "truncated", "header"])
def test_a_damaged_entry_is_built_again(cache: Path, tmp_path: Path, damage: str) -> None:
    path = tmp_path / "m.gguf"
    write_table(path, 1)
    build = Builds()
    want = q8_cache.table(mapped(path), build)
    (entry,) = cache.glob("*.bin")
    raw = bytearray(entry.read_bytes())
    codes = len(raw) - VOCAB * DIM
    if damage == "codes":  # one code of a row the hit check quantizes again
        raw[codes + (VOCAB - 1) * DIM + 5] ^= 0x01
    elif damage == "scale":  # the last row's (the codes start on the next cache line after the scales)
        raw[q8_cache._HEADER + 4 * VOCAB - 4] ^= 0x01
    elif damage == "truncated":
        del raw[-1]
    else:
        raw[0] ^= 0xFF
    entry.write_bytes(bytes(raw))
    got = q8_cache.table(mapped(path), build)
    assert build.calls == 2 and same(got, want)


def test_tables_in_memory_or_in_small_files_are_not_cached(cache: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    write_table(tmp_path / "m.gguf", 1)
    build = Builds()
    for _ in range(2):
        q8_cache.table(np.array(mapped(tmp_path / "m.gguf")), build)
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", os.path.getsize(tmp_path / "m.gguf") + 1)
    for _ in range(2):
        q8_cache.table(mapped(tmp_path / "m.gguf"), build)
    assert build.calls == 4 and not cache.exists()


def test_an_unwritable_cache_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("BITNET_CACHE_DIR", str(blocker))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    write_table(tmp_path / "m.gguf", 1)
    build = Builds()
    got = q8_cache.table(mapped(tmp_path / "m.gguf"), build)
    assert build.calls == 1 and same(got, q8_table(mapped(tmp_path / "m.gguf")))


def test_the_cpu_engine_runs_the_same_from_the_cache(cpu_env: None, cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import bitnet
    from bitnet.modelfile.writer import SyntheticSpec, write_model
    from bitnet_cpu.provider import CpuProvider

    monkeypatch.setenv("BITNET_CACHE_DIR", str(cache.parent))  # (cpu_env set one of its own)
    path = write_model(tmp_path / "m.gguf", SyntheticSpec(vocab_size=1200))
    built = []
    real = CpuProvider._build_q8
    monkeypatch.setattr(CpuProvider, "_build_q8", lambda self, t: built.append(1) or real(self, t))
    logits = []
    for _ in range(2):
        with bitnet.load(str(path), device="cpu", lm_head="q8") as e:
            logits.append(e.transformer.forward(np.arange(3, 9, dtype=np.int32), 0, all_logits=True))
    assert built == [1] and len(list(cache.glob("*.bin"))) == 1
    np.testing.assert_array_equal(logits[0], logits[1])


def test_another_code_version_trusts_no_entry(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_table(tmp_path / "m.gguf", 1)
    build = Builds()
    q8_cache.table(mapped(tmp_path / "m.gguf"), build)
    monkeypatch.setattr(q8_cache, "_stamp", lambda: b"another version")
    q8_cache.table(mapped(tmp_path / "m.gguf"), build)
    assert build.calls == 2


def test_an_entry_leaves_the_page_cache_when_written_and_is_mapped_for_2_mb_pages(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written in 4 KB folios, an entry is dropped so that the next load reads it in 2 MB ones (huge_pages)."""
    from bitnet.modelfile import huge_pages

    dropped: list[str] = []
    real_drop = huge_pages.drop
    monkeypatch.setattr(huge_pages, "drop", lambda path: dropped.append(Path(path).name) or real_drop(path))
    write_table(tmp_path / "m.gguf", 1)
    q8_cache.table(mapped(tmp_path / "m.gguf"), Builds())
    (entry,) = cache.glob("*.bin")
    assert dropped == [entry.name]
    hit = q8_cache.table(mapped(tmp_path / "m.gguf"), Builds())
    assert dropped == [entry.name]  # a hit writes nothing
    start = hit.q.__array_interface__["data"][0] - int(hit.q.offset) % os.sysconf("SC_PAGE_SIZE")
    flags = Path("/proc/self/smaps").read_text().split(f"{start:x}-", 1)[1].split("VmFlags:", 1)[1].split("\n")[0]
    assert "hg" in flags.split()  # MADV_HUGEPAGE
