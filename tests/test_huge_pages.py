"""A model file in 2 MB pages (bitnet.modelfile.huge_pages): the share of a file's pages mapped so is read from
smaps for that file only, a file cached in small folios is dropped from the page cache on its first load (and
comes back in 2 MB folios where the kernel can), and nothing else is."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bitnet.modelfile import huge_pages, load_cache
from bitnet.modelfile.model import load_model
from bitnet.modelfile.writer import SyntheticSpec, write_model

MB = 1 << 20


def smaps_of(tmp_path: Path, mappings: list[tuple[str, int, int]]) -> str:
    """A smaps file with one mapping per (path, Rss kB, FilePmdMapped kB)."""
    lines = []
    for i, (path, rss, pmd) in enumerate(mappings):
        lines += [f"7f{i:02d}00000000-7f{i:02d}00200000 r--s 00000000 fe:00 {i + 1}{' ' * 19}{path}".rstrip(),
                  "Size:               2048 kB", f"Rss:                {rss} kB", "Pss:                   0 kB",
                  f"FilePmdMapped:      {pmd} kB", "VmFlags: rd sh mr mw me ms hg"]
    f = tmp_path / "smaps"
    f.write_text("\n".join(lines) + "\n")
    return str(f)


def test_share_counts_the_files_own_mappings_only(tmp_path: Path) -> None:
    target = str(tmp_path / "m.gguf")
    smaps = smaps_of(tmp_path, [(target, 4096, 2048), ("", 8192, 0), (str(tmp_path / "other" / "m.gguf"), 4096, 0),
                                (target, 4096, 4096), (str(tmp_path / "xm.gguf"), 2048, 2048)])
    assert huge_pages.share(target, smaps) == pytest.approx(6144 / 8192)
    assert huge_pages.share(str(tmp_path / "absent.gguf"), smaps) is None  # nothing resident: no verdict
    assert huge_pages.share(target, str(tmp_path / "no-smaps")) is None


def written_in_small_pieces(path: Path, size: int) -> Path:
    """A file written 4 KB at a time: its page cache holds the small folios those writes made."""
    block = bytes(range(256)) * 16
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
    return path


def mapped(path: Path) -> np.memmap:
    data = np.memmap(path, mode="r")
    huge_pages.advise(data)
    int(data.view(np.ndarray)[::4096].max())  # every page in
    return data


def kernel_keeps_files_in_2_mb_folios(tmp_path: Path) -> bool:
    """Whether a file read cold comes into the page cache in 2 MB folios here (ext4, xfs on recent kernels)."""
    probe = written_in_small_pieces(tmp_path / "probe.bin", 8 * MB)
    fd = os.open(probe, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    data = mapped(probe)
    got = huge_pages.share(str(probe))
    del data
    return bool(got and got >= 0.5)


def test_a_file_in_small_pages_is_dropped_and_comes_back_in_2_mb_pages(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel_keeps_files_in_2_mb_folios(tmp_path):
        pytest.skip("this kernel or file system keeps no file in 2 MB folios")
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    path = written_in_small_pieces(tmp_path / "m.bin", 16 * MB)
    data = mapped(path)
    before = huge_pages.share(str(path))
    if before is None or before >= 0.5:
        pytest.skip(f"the kernel cached the written file in 2 MB folios already (share {before})")
    assert huge_pages.recache(str(path), data)
    assert huge_pages.share(str(path)) is None  # our mapping let go of every page
    int(data.view(np.ndarray)[::4096].max())  # read again: from disk, through the advised mapping
    assert huge_pages.share(str(path)) >= 0.5
    assert not huge_pages.recache(str(path), data)  # in 2 MB pages now: left alone


def test_small_files_and_disabled_huge_pages_are_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = written_in_small_pieces(tmp_path / "m.bin", 4 * MB)
    data = mapped(path)
    assert huge_pages.share(str(path)) is not None
    assert not huge_pages.recache(str(path), data)  # below MIN_BYTES
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP", str(never))
    assert not huge_pages.recache(str(path), data)
    assert not huge_pages.recache(str(path), np.zeros(16, np.uint8))  # no mapping under it
    assert huge_pages.share(str(path)) is not None  # still mapped: nothing was dropped


def test_only_a_first_load_recaches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITNET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    calls: list[str] = []
    monkeypatch.setattr(huge_pages, "recache", lambda path, data: calls.append(os.path.basename(path)) or False)
    path = write_model(tmp_path / "m.gguf", SyntheticSpec(vocab_size=1200))
    load_model(path)
    load_model(path)  # a load-cache hit: the file was seen
    assert calls == ["m.gguf"]
    os.utime(path)  # a changed file is a miss again
    load_model(path)
    assert calls == ["m.gguf", "m.gguf"]
