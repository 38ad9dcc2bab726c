"""The load cache (bitnet.modelfile.load_cache): a hit gives the model and tokenizer a full read gives,
a changed file is read whole again, a bad entry is a miss, and concurrent writers never corrupt it."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_merges import WORDS

from bitnet.errors import ModelError
from bitnet.modelfile import load_cache
from bitnet.modelfile import model as model_module
from bitnet.modelfile.model import Model, _Reader, load_model
from bitnet.modelfile.writer import SyntheticSpec, write_model
from bitnet.text.merges import DerivedMerges
from bitnet.text.tokenizer import Tokenizer

TEXTS = ["", "Hello world", "  a  b   c ", "1234567890 and 3.14", "I'm sure they'll say DON'T",
         "你好，世界！", "emoji 😀👍🏽", "a\nb\r\n\tc", "<|begin_of_text|>hi<|eot_id|>", "<s>text</s> <unk>"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of this test's own that takes files of any size."""
    monkeypatch.setenv("BITNET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    return load_cache.directory()


def write(path: Path, **spec: object) -> Path:
    return write_model(path, SyntheticSpec(**{"vocab_size": 1200, **spec}))  # type: ignore[arg-type]


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*")) if cache.is_dir() else []


def read_whole(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every full metadata parse (a miss) from here on."""
    parsed: list[str] = []
    real = model_module._metadata

    def spy(reader: _Reader) -> dict:
        parsed.append("parse")
        return real(reader)

    monkeypatch.setattr(model_module, "_metadata", spy)
    return parsed


def same_model(a: Model, b: Model) -> None:
    assert a.metadata == b.metadata and list(a.metadata) == list(b.metadata)
    assert a.config == b.config and a.weight_types == b.weight_types and a.n_params == b.n_params
    assert np.array_equal(a.token_embd, b.token_embd) and np.array_equal(a.output_norm, b.output_norm)
    for la, lb in zip(a.layers, b.layers, strict=True):
        for field in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            ma, mb = getattr(la, field), getattr(lb, field)
            assert np.array_equal(ma.packed(), mb.packed()) and np.array_equal(ma.scales, mb.scales)
            assert ma.fields_reversed == mb.fields_reversed
        assert np.array_equal(la.attn_norm, lb.attn_norm) and np.array_equal(la.ffn_sub_norm, lb.ffn_sub_norm)


@pytest.mark.parametrize(("weight_type", "tokenizer", "tied"),
                         [("tq2_0", "gpt2", True), ("i2_s", "llama", True), ("tq1_0", "gpt2", False)])
def test_hit_gives_the_model_and_tokens_a_full_read_gives(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          weight_type: str, tokenizer: str, tied: bool) -> None:
    path = write(tmp_path / "m.gguf", weight_type=weight_type, tokenizer=tokenizer, tied=tied)
    parsed = read_whole(monkeypatch)
    first = load_model(path)
    assert parsed == ["parse"] and len(entries(cache)) == 1
    second = load_model(path)
    assert parsed == ["parse"]  # the hit parsed no metadata
    same_model(first, second)
    full, cached = Tokenizer.from_metadata(first.metadata), Tokenizer.from_metadata(second.metadata)
    for text in TEXTS:
        for special in (False, True):
            assert cached.encode(text, special=special) == full.encode(text, special=special)
    ids = full.encode(" ".join(TEXTS))
    assert cached.decode(ids) == full.decode(ids)


def test_long_string_arrays_come_back_as_the_lists_they_were(cache: Path, tmp_path: Path) -> None:
    path, ident = str(tmp_path / "f.gguf"), (1, 2, 3, 4, 5)
    md = {"tokens": [f"t{i}" for i in range(300)], "with_nul": [f"t{i}" for i in range(299)] + ["a\0b"],
          "short": ["x", "y"], "mixed": ["x"] * 299 + [1], "n": 7}
    load_cache.store(path, ident, b"header", 6, md, [])  # (stored joined, see load_cache._joined)
    hit = load_cache.lookup(path, ident)
    assert hit is not None and hit.metadata == md
    assert all(type(v) is type(md[k]) for k, v in hit.metadata.items())


@pytest.mark.parametrize(("tokenizer", "kept"), [("llama3", DerivedMerges), ("gpt2", list)])
def test_merges_the_ids_spell_are_recorded_by_their_count(cache: Path, tmp_path: Path, tokenizer: str,
                                                          kept: type) -> None:
    path = write(tmp_path / "m.gguf", tokenizer=tokenizer, vocab_size=128256, dim=256, n_heads=2, n_kv_heads=1,
                 ffn_dim=256, n_layers=1)
    first, second = load_model(path), load_model(path)
    merges = second.metadata["tokenizer.ggml.merges"]
    assert type(first.metadata["tokenizer.ggml.merges"]) is list and type(merges) is kept
    full, cached = Tokenizer.from_metadata(first.metadata), Tokenizer.from_metadata(second.metadata)
    assert (cached._rank is None) == (kept is DerivedMerges)
    text = " ".join([*TEXTS, WORDS])
    assert cached.encode(text) == full.encode(text)
    assert merges == first.metadata["tokenizer.ggml.merges"]  # (made from the tokens when read)


def test_tq2_0_blocks_of_different_scales(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache keeps a TQ2_0 projection's scale only when every block shares it; one block that
    differs makes the hit read that tensor's scales from the file, as a full read does."""
    path = write(tmp_path / "m.gguf", weight_type="tq2_0")
    t = next(t for t in _Reader(path).tensors if t.name == "blk.0.attn_q.weight")
    d = np.frombuffer(path.read_bytes()[t.data_offset + 64:t.data_offset + 66], dtype=np.float16)[0]
    with open(path, "r+b") as f:
        f.seek(t.data_offset + 64)  # block 0's f16 scale d
        f.write(np.float16(d * 2).tobytes())
    first = load_model(path)
    wq, wk = first.layers[0].wq.scales, first.layers[0].wk.scales
    assert not (wq == wq.flat[0]).all() and (wk == wk.flat[0]).all()
    parsed = read_whole(monkeypatch)
    second = load_model(path)
    assert parsed == []  # a hit
    same_model(first, second)


def test_engine_tokenizes_the_same_from_the_cache(cpu_env: None, cache: Path, tmp_path: Path) -> None:
    import bitnet  # (`cache` sets a BITNET_CACHE_DIR after `own_cache_dir`: ours)

    path = write(tmp_path / "m.gguf")
    with bitnet.load(str(path)) as e:
        want = [e.tokenize(t) for t in TEXTS]
    assert len(entries(cache)) == 1
    with bitnet.load(str(path)) as e:
        assert [e.tokenize(t) for t in TEXTS] == want


def test_a_changed_file_is_read_whole_again(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "m.gguf", seed=1)
    load_model(path)
    parsed = read_whole(monkeypatch)
    write(tmp_path / "m.gguf", seed=2, vocab_size=1300)  # same path, other content
    m = load_model(path)
    assert parsed == ["parse"] and len(m.metadata["tokenizer.ggml.tokens"]) == 1300
    same_model(m, load_model(path))  # and the new entry is a hit
    assert parsed == ["parse"] and len(entries(cache)) == 1


def _embd_offset(path: Path) -> int:
    return next(t.data_offset for t in _Reader(path).tensors if t.name == "token_embd.weight")


def _proj_offset(path: Path) -> int:
    return next(t.data_offset for t in _Reader(path).tensors if t.name == "blk.0.attn_q.weight")


@pytest.mark.parametrize(("weight_type", "where", "data", "error"), [
    ("tq2_0", _embd_offset, b"\x00\x7e", "NaN or infinite"),  # an F16 NaN in the embedding
    ("i2_s", _proj_offset, b"\xff", "invalid code 0b11"),
])
def test_data_changed_in_place_is_checked_again(cache: Path, tmp_path: Path, weight_type: str, where: object,
                                                data: bytes, error: str) -> None:
    """Same path, size and mtime, one bad value in the tensor data: the ctime gives it away, and the
    checks the cache let the first load skip run again."""
    path = write(tmp_path / "m.gguf", weight_type=weight_type)
    load_model(path)
    assert load_model(path)  # a hit
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(where(path))  # type: ignore[operator]
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ModelError, match=error):
        load_model(path)


def test_header_hash_catches_what_the_identity_misses(cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a file system's times cannot tell (identity unchanged), a changed header is still seen."""
    path = write(tmp_path / "m.gguf")
    frozen = load_cache.identity(str(path))
    monkeypatch.setattr(load_cache, "identity", lambda p: frozen)
    load_model(path)
    raw = path.read_bytes()
    assert raw.count(b"<|end_of_text|>") == 1
    path.write_bytes(raw.replace(b"<|end_of_text|>", b"<|END_of_text|>"))
    m = load_model(path)
    assert "<|END_of_text|>" in m.metadata["tokenizer.ggml.tokens"]


def _corruptions(entry: Path) -> list[bytes]:
    raw = entry.read_bytes()
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x40
    body = marshal.dumps(("not", "an", "entry"))
    forged = load_cache._MAGIC + load_cache._digest(body) + body  # a valid digest over the wrong structure
    return [b"", raw[:len(raw) // 2], bytes(flipped), os.urandom(len(raw)), forged, raw[:len(load_cache._MAGIC)]]


def test_a_corrupt_entry_is_ignored_and_rebuilt(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "m.gguf")
    want = load_model(path)
    (entry,) = entries(cache)
    parsed = read_whole(monkeypatch)
    for n, bad in enumerate(_corruptions(entry), 1):
        entry.write_bytes(bad)
        same_model(load_model(path), want)
        assert len(parsed) == n  # a miss: read whole ...
        assert load_cache.lookup(str(path), load_cache.identity(str(path))) is not None  # ... and stored again
    entry.unlink()
    entry.mkdir()  # not even a file
    same_model(load_model(path), want)


def test_another_code_version_trusts_no_entry(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "m.gguf")
    load_model(path)
    assert load_cache.lookup(str(path), load_cache.identity(str(path))) is not None
    monkeypatch.setattr(load_cache, "_stamp", lambda: b"another version")
    assert load_cache.lookup(str(path), load_cache.identity(str(path))) is None


def test_no_usable_cache_directory_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("BITNET_CACHE_DIR", str(blocker))
    monkeypatch.setattr(load_cache, "MIN_FILE_BYTES", 0)
    path = write(tmp_path / "m.gguf")
    same_model(load_model(path), load_model(path))


def test_small_files_are_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITNET_CACHE_DIR", str(tmp_path / "cache"))
    load_model(write(tmp_path / "m.gguf"))  # far below MIN_FILE_BYTES
    assert not load_cache.directory().exists()


def test_old_entries_are_pruned(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_cache, "MAX_ENTRIES", 2)
    paths = [write(tmp_path / f"m{i}.gguf", seed=i) for i in range(3)]
    for p in paths:
        load_model(p)
    assert len(entries(cache)) == 2
    assert load_cache.lookup(str(paths[-1]), load_cache.identity(str(paths[-1]))) is not None


def test_a_hit_keeps_its_entry_before_those_used_less_recently(cache: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_cache, "MAX_ENTRIES", 2)
    paths = [write(tmp_path / f"m{i}.gguf", seed=i) for i in range(3)]
    for i, p in enumerate(paths[:2]):
        load_model(p)
        os.utime(load_cache._entry_file(str(p)), (i + 1, i + 1))  # in this order, whatever the clock's resolution
    parsed = read_whole(monkeypatch)
    load_model(paths[0])
    assert parsed == []  # a hit
    load_model(paths[2])
    assert entries(cache) == sorted(load_cache._entry_file(str(p)) for p in (paths[0], paths[2]))


def test_concurrent_writers_in_threads(cache: Path, tmp_path: Path) -> None:
    path = write(tmp_path / "m.gguf")
    want = load_model(path)
    for e in entries(cache):
        e.unlink()
    with ThreadPoolExecutor(8) as pool:
        models = list(pool.map(lambda _: load_model(path), range(16)))
    for m in models:
        assert m.metadata == want.metadata
    assert [e.suffix for e in entries(cache)] == [".bin"]  # one entry, no temporary file left


_WORKER = """
import sys
from bitnet.modelfile import load_cache
from bitnet.modelfile.model import load_model
from bitnet.text.tokenizer import Tokenizer
load_cache.MIN_FILE_BYTES = 0
for _ in range(4):
    m = load_model(sys.argv[1])
    print(Tokenizer.from_metadata(m.metadata).encode("Hello world, 123 times"))
"""


def test_concurrent_processes(cache: Path, tmp_path: Path) -> None:
    """Parallel test workers or servers loading one file at once: all succeed, with the same tokens."""
    path = write(tmp_path / "m.gguf")
    env = {**os.environ, "BITNET_CACHE_DIR": str(cache.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
    assert len({line for out, _ in outs for line in out.splitlines()}) == 1
    assert [e.suffix for e in entries(cache)] == [".bin"]


def test_a_hit_imports_no_gguf(cache: Path, tmp_path: Path) -> None:
    """gguf's import is ~0.05 s of a warm load: a file the cache knows is loaded without it."""
    path = write(tmp_path / "m.gguf")
    load_model(path)
    code = ("import sys; from bitnet.modelfile import load_cache; load_cache.MIN_FILE_BYTES = 0; "
            "from bitnet.modelfile.model import load_model; load_model(sys.argv[1]); "
            "assert 'gguf' not in sys.modules, 'gguf imported'")
    env = {**os.environ, "BITNET_CACHE_DIR": str(cache.parent)}
    r = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_type_names_are_gguf_s() -> None:
    from gguf import GGMLQuantizationType

    from bitnet.modelfile import formats

    for ggml_type, name in formats.GGML_TYPE_NAMES.items():
        if ggml_type != formats.GGML_I2_S:
            assert GGMLQuantizationType(ggml_type).name == name
    assert (formats.GGML_F32, formats.GGML_F16, formats.GGML_BF16, formats.GGML_TQ1_0, formats.GGML_TQ2_0) == tuple(
        int(GGMLQuantizationType[n]) for n in ("F32", "F16", "BF16", "TQ1_0", "TQ2_0"))


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_map_pages_maps_what_a_hit_did_not_read(cache: Path, tmp_path: Path) -> None:
    """A hit reads no tensor data; its page faults must not move into the first token, so map_pages
    faults in every tensor used in place, on a thread that bitnet.load joins before it returns."""
    from bitnet.modelfile.model import map_pages

    path = write(tmp_path / "m.gguf", weight_type="i2_s", dim=1024, ffn_dim=1024, n_heads=8, n_kv_heads=8,
                 vocab_size=8192)  # I2_S: nothing else in a hit reads its codes (TQ2_0's scales are read)
    load_model(path)  # a miss; its mapping goes with the model
    codes = 0
    for float_head in (False, True):
        m = load_model(path)  # a hit
        codes = sum(getattr(layer, f).codes.nbytes for layer in m.layers
                    for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
        before = _rss_file_kb()
        map_pages(m, float_head).join()
        grew = (_rss_file_kb() - before) * 1024
        if float_head:
            assert grew >= 0.9 * (codes + m.token_embd.nbytes)
        else:  # the int8 head runs: the float table (a token reads one row of it) stays out
            # (the hit's header read maps ~1 MB beyond the header already, some of it codes)
            assert 0.7 * codes <= grew < codes + m.token_embd.nbytes / 4
        del m


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_map_pages_leaves_the_codes_to_a_provider_that_reads_its_own(cache: Path, tmp_path: Path) -> None:
    """Where the provider reads codes of its own (KernelProvider.upload_ternary's `own_codes`: the CPU plugin's
    base-3 codes), the engine asks for those and not the file's, which would stay resident for nothing."""
    from bitnet.modelfile.model import map_pages

    path = write(tmp_path / "m.gguf", weight_type="i2_s", dim=1024, ffn_dim=1024, n_heads=8, n_kv_heads=8,
                 vocab_size=8192)
    load_model(path)  # a miss
    m = load_model(path)  # a hit: no code read
    codes = sum(getattr(layer, f).codes.nbytes for layer in m.layers
                for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    before = _rss_file_kb()
    map_pages(m, False, codes=False).join()
    assert (_rss_file_kb() - before) * 1024 < 0.1 * codes
    map_pages(m, False).join()  # (what the same call maps with them)
    assert (_rss_file_kb() - before) * 1024 >= 0.7 * codes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_map_pages_maps_the_int8_head_it_is_given(cache: Path, tmp_path: Path) -> None:
    """An int8 head mapped from its cache is a 2-D array of another file: map_pages faults in its every
    page too, not one row per 4 KB."""
    from bitnet.modelfile.model import map_pages

    m = load_model(write(tmp_path / "m.gguf", weight_type="i2_s", dim=256, ffn_dim=256, n_heads=4, n_kv_heads=4,
                         vocab_size=512))
    head = np.memmap(tmp_path / "head.bin", np.int8, mode="w+", shape=(4096, 2560))
    head[:] = 1
    head.flush()
    del head
    head = np.memmap(tmp_path / "head.bin", np.int8, mode="c", shape=(4096, 2560))
    map_pages(m, False).join()
    before = _rss_file_kb()
    map_pages(m, False, [head]).join()
    assert (_rss_file_kb() - before) * 1024 >= 0.9 * head.nbytes


def test_no_test_writes_into_the_users_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    from bitnet.plugins.types import cache_dir

    assert cache_dir().is_relative_to(tmp_path_factory.getbasetemp())
