"""Peak RSS: file pages read once and kept in another form leave the resident set (release_pages), the
int8 LM head's load neither prefaults nor keeps the float table it was built from, and a KV cache becomes
resident only as its positions are written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import bitnet
from bitnet.modelfile import load_cache
from bitnet.modelfile.model import release_pages
from bitnet.modelfile.writer import SyntheticSpec, write_model
from bitnet.runtime.provider import kv_row_bytes

MB = 1 << 20


def _rss(accepts: Callable[[list[str]], bool]) -> list[int]:
    """Resident bytes of each mapping of this process whose /proc/self/smaps header line `accepts` (its fields)."""
    out: list[int] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = accepts(fields)
        elif inside and fields[0] == "Rss:":
            out.append(int(fields[1]) * 1024)
    return out


def resident(path: Path) -> int:
    """Bytes of `path`'s pages resident in this process (every mapping of it)."""
    return sum(_rss(lambda fields: len(fields) >= 6 and fields[5] == str(path)))


def resident_at(a: np.ndarray) -> int:
    """Bytes resident in the mapping that holds array `a`'s first byte."""
    address = a.__array_interface__["data"][0]

    def holds(fields: list[str]) -> bool:
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        return lo <= address < hi

    found = _rss(holds)
    assert len(found) == 1, "no mapping holds the array"
    return found[0]


@pytest.fixture
def mapped(tmp_path: Path) -> tuple[Path, np.memmap]:
    path = tmp_path / "data.bin"
    path.write_bytes(np.arange(16 * MB, dtype=np.uint8).tobytes())
    return path, np.memmap(path, mode="r", offset=4096 * 3)  # a mapping that does not start the file


def test_release_pages_drops_exactly_the_view(mapped: tuple[Path, np.memmap]) -> None:
    path, data = mapped
    table = data[:12 * MB].reshape(-1, 4096)
    int(table.max())  # every page touched
    assert resident(path) >= 12 * MB
    release_pages(table[: table.shape[0] // 2])
    assert 5.9 * MB < resident(path) < 6.1 * MB + 8192  # the other half stays, and nothing else went
    assert int(table[:2].sum()) == int(np.asarray(table[:2]).astype(np.int64).sum())  # the data re-faults
    release_pages(np.zeros(4 * MB, np.uint8))  # an array in memory: left alone, no error


def _model(tmp_path: Path) -> Path:
    # A 2B-4T-like file whose embedding (tied head) dominates: 16000 x 512 F16 = 15.6 MB.
    spec = SyntheticSpec(arch="bitnet-b1.58", weight_type="i2_s", n_layers=1, dim=512, ffn_dim=512, vocab_size=16000)
    return write_model(tmp_path / "m.gguf", spec)


def test_the_int8_head_keeps_no_float_table_resident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _model(tmp_path)
    table = 16000 * 512 * 2
    with bitnet.load(str(path), device="cpu", n_ctx=32, lm_head="f16") as eng:
        "".join(eng.generate("Hello", max_tokens=2))
        assert resident(path) >= table  # the F16 head streams the whole table every step
    # Built (and stored in the int8 head cache), then mapped from it (load_cache.MIN_FILE_BYTES keeps
    # small files out of the caches otherwise).
    monkeypatch.setenv("BITNET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    for how in ("built", "from the cache"):
        with bitnet.load(str(path), device="cpu", n_ctx=32, lm_head="q8") as eng:
            "".join(eng.generate("Hello", max_tokens=2))
            assert resident(path) < table / 4, how  # projections, norms and the embedding rows looked up
    assert len(list((tmp_path / "cache" / "q8-head").glob("*.bin"))) == 1


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8"])
def test_a_kv_cache_is_resident_only_where_written(tmp_path: Path, kv_type: str) -> None:
    """NumPy asks for 2 MB pages on large arrays: the CPU cache keeps each KV head's 4096 positions (2 MB of
    float32 at head_dim 128) together, so the first token's writes made the whole cache resident (docs/design.md
    section 6b). Two tokens must leave it at a few 4 KB pages per layer and head."""
    spec = SyntheticSpec(arch="bitnet-b1.58", n_layers=2, dim=512, n_heads=4, n_kv_heads=4, ffn_dim=256,
                         vocab_size=512, n_ctx=4096)
    cache_bytes = 2 * 4 * 4096 * kv_row_bytes(kv_type, 128)
    with bitnet.load(str(write_model(tmp_path / "m.gguf", spec)), device="cpu", kv_type=kv_type) as eng:
        assert eng.n_ctx == 4096
        "".join(eng.generate("Hello", max_tokens=2))
        cache = eng.transformer.cache
        for kv in (cache.k, cache.v):
            assert kv.nbytes == cache_bytes
            assert resident_at(kv) <= 2 * 4 * 4 * 4096, (kv_type, resident_at(kv))  # <= 4 pages a layer and head


def test_the_host_kv_cache_every_provider_inherits_grows_with_its_positions() -> None:
    from bitnet.runtime.reference import ReferenceProvider

    cache = ReferenceProvider().kv_cache(2, 4096, 4, 128)  # [layers, seqs, positions, heads, dim]: 8 MB each
    cache.k[:, 0, :8] = 1.0  # 16 KB a layer; V is untouched (K's mapping may have merged with it)
    assert resident_at(cache.k) <= 2 * 8 * 4096
    assert not cache.k[:, 0, 8:].any() and cache.k.flags.writeable
