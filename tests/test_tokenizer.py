"""Tokenizer tests: round trips, llama.cpp token-id agreement, metadata validation, streaming."""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bitnet.errors import ModelError
from bitnet.text.synthetic_vocab import synthetic_tokenizer_metadata
from bitnet.text.tokenizer import Tokenizer

KINDS = ("gpt2", "llama")

# Varied text: ASCII, whitespace runs, digits (Llama-3 splits them 1-3 at a time),
# contractions, CJK, emoji (incl. ZWJ sequences and modifiers), combining marks, other
# scripts, control characters, unusual whitespace and special-token look-alikes.
TEXTS = [
    "",
    " ",
    "   ",
    "Hello world",
    "hello world",
    " leading space",
    "trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "the the the the the thethe",
    "It was the best of times, it was the worst of times;",
    "1",
    "12",
    "123",
    "1234567890",
    "3.14159 and 2024-01-01, $19.99 (9:30)",
    "I'm sure they'll say we're done, DON'T YOU'VE ALL'D?",
    "'s 't 're 've 'm 'll 'd 'S 'X",
    "a\nb",
    "\n",
    "\n\n\nthree newlines",
    "line one\r\nline two\r\n",
    "tab\tseparated\t\tvalues",
    "  a  b   c    d     ",
    "    indented code\n        more",
    "def main(): return x + y * 2 if (a == b) else [1, 2, 3]",
    "Hello, world!!! ... ??? --- ***",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 문장입니다",
    "Привет, мир! Ελληνικά",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "e\u0301 a\u0308 n\u0303 combining marks",
    "emoji 😀👍🏽 and family 👨\u200d👩\u200d👧",
    "x² + y³ = z¹⁰, ½ Ⅻ １２３",
    "\u00a0nbsp\u2003em space\u3000ideographic\u2028sep",
    "\x00\x01\x1f control \x7f chars",
    "\ufeffBOM and \ufffd replacement",
    "<|begin_of_text|>hi<|eot_id|>",
    "<s>text</s> more <unk>",
    "<|reserved_special_token_3|> <0x41> ▁ ▁▁",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
]


@pytest.fixture(scope="module", params=KINDS)
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return Tokenizer.from_metadata(synthetic_tokenizer_metadata(request.param, 1000))


# -- synthetic metadata ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_vocab", [400, 1000, 128256])
def test_synthetic_metadata_shape(kind: str, n_vocab: int) -> None:
    md = synthetic_tokenizer_metadata(kind, n_vocab)
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == n_vocab == len(md["tokenizer.ggml.token_type"])
    assert len(set(tokens)) == n_vocab
    assert md == synthetic_tokenizer_metadata(kind, n_vocab)  # deterministic
    assert md["tokenizer.ggml.add_bos_token"] is True
    tok = Tokenizer.from_metadata(md)
    assert tok.n_vocab == n_vocab and tok.add_bos
    assert tokens[tok.bos_id] in ("<s>", "<|begin_of_text|>")
    assert tok.is_eog(tok.eos_id)
    if kind == "gpt2":
        assert md["tokenizer.ggml.pre"] == "llama-bpe"
        assert tokens[tok.eot_id] == "<|eot_id|>" and tok.is_eog(tok.eot_id)
        n_learned = len(synthetic_tokenizer_metadata("gpt2", 128256)["tokenizer.ggml.merges"])
        assert n_learned > 200
        assert len(md["tokenizer.ggml.merges"]) == min(n_vocab - 256 - 3, n_learned)
    else:
        assert len(md["tokenizer.ggml.scores"]) == n_vocab
        assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    # Padding never shows up when tokenizing ordinary text.
    ids = tok.encode(" ".join(TEXTS))
    assert max(ids) < n_vocab and not any(tok.is_eog(i) for i in ids)


def test_llama3_sized_metadata() -> None:
    from bitnet.text.synthetic_vocab import LLAMA3_MERGES, LLAMA3_NORMAL

    md = synthetic_tokenizer_metadata("llama3", 128256)
    tokens, merges = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"]
    assert len(set(tokens)) == len(tokens) == 128256 and len(set(merges)) == len(merges) == LLAMA3_MERGES
    assert md["tokenizer.ggml.token_type"].count(1) == LLAMA3_NORMAL
    assert tokens[LLAMA3_NORMAL:LLAMA3_NORMAL + 3] == ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    assert md == synthetic_tokenizer_metadata("llama3", 128256)  # deterministic
    learned = synthetic_tokenizer_metadata("gpt2", 128256)["tokenizer.ggml.merges"]
    assert merges[:len(learned)] == learned  # the gpt2 vocabulary's own first
    tok = Tokenizer.from_metadata(md)
    assert (tok.bos_id, tok.eos_id, tok.eot_id) == (128000, 128001, 128002)
    ids = tok.encode(" ".join(TEXTS))
    assert ids[0] == tok.bos_id and max(ids[1:]) < LLAMA3_NORMAL
    with pytest.raises(ValueError, match="llama3"):
        synthetic_tokenizer_metadata("llama3", 1000)


def test_synthetic_metadata_is_a_fresh_copy() -> None:
    md = synthetic_tokenizer_metadata("gpt2", 1000)
    md["tokenizer.ggml.tokens"].append("x")
    assert len(synthetic_tokenizer_metadata("gpt2", 1000)["tokenizer.ggml.tokens"]) == 1000


def test_synthetic_metadata_rejects_bad_requests() -> None:
    with pytest.raises(ValueError):
        synthetic_tokenizer_metadata("bert", 1000)
    with pytest.raises(ValueError):
        synthetic_tokenizer_metadata("gpt2", 100)


# -- round trips and behaviour -----------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    if tok.model == "llama" and "▁" in text:
        pytest.skip("SentencePiece vocabularies cannot tell a literal '▁' from a space (nor can llama.cpp)")
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    # BOS renders as nothing and does not disturb the prefix-space removal.
    assert tok.decode(tok.encode(text)) == text


def test_bos_only_when_asked(tok: Tokenizer) -> None:
    assert tok.encode("hello")[0] == tok.bos_id
    assert tok.encode("hello", add_bos=False)[0] != tok.bos_id
    assert tok.encode("", add_bos=True) == [tok.bos_id]
    assert tok.encode("", add_bos=False) == []


def test_model_without_add_bos_never_adds_it() -> None:
    md = synthetic_tokenizer_metadata("gpt2", 1000)
    md["tokenizer.ggml.add_bos_token"] = False
    tok = Tokenizer.from_metadata(md)
    assert not tok.add_bos and tok.bos_id not in tok.encode("hello", add_bos=True)


def test_add_bos_defaults_follow_llama_cpp() -> None:
    def without_add_bos(kind: str, **extra: Any) -> Tokenizer:
        md = synthetic_tokenizer_metadata(kind, 1000)
        del md["tokenizer.ggml.add_bos_token"]
        md.update(extra)
        return Tokenizer.from_metadata(md)

    assert without_add_bos("llama").add_bos
    assert without_add_bos("gpt2").add_bos  # llama-bpe
    assert not without_add_bos("gpt2", **{"tokenizer.ggml.pre": "gpt-2"}).add_bos
    assert not without_add_bos("gpt2", **{"tokenizer.ggml.pre": "default"}).add_bos


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("llama-bpe", ["123", "456", "7", "Ġ", "89"]),  # "\p{N}{1,3}": " " is not glued to digits
        ("gpt-2", ["1234567", "Ġ89"]),  # " ?\p{N}+"
        ("default", ["123", "456", "7", "Ġ", "89"]),  # " ?\p{N}+", then "\p{N}+" splits " " off
    ],
)
def test_digit_pre_tokenization(pre: str, pieces: list[str]) -> None:
    # Merges that would glue any run of digits together, so only the pre-tokenizer splits them
    # (expected pieces checked against llama.cpp).
    md = synthetic_tokenizer_metadata("gpt2", 1000)
    merges = [("1", "2"), ("12", "3"), ("123", "4"), ("1234", "5"), ("12345", "6"), ("123456", "7")]
    merges += [("4", "5"), ("45", "6"), ("8", "9"), ("Ġ", "89")]
    md["tokenizer.ggml.merges"] = [f"{a} {b}" for a, b in merges] + md["tokenizer.ggml.merges"]
    new = [a + b for a, b in merges if a + b not in md["tokenizer.ggml.tokens"]]
    md["tokenizer.ggml.tokens"] += new
    md["tokenizer.ggml.token_type"] += [1] * len(new)
    md["tokenizer.ggml.pre"] = pre
    tok = Tokenizer.from_metadata(md)
    assert [tok.tokens[i] for i in tok.encode("1234567 89", add_bos=False)] == pieces


def test_special_tokens_parsed_only_when_asked() -> None:
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata("gpt2", 1000))
    text = "<|begin_of_text|>hi<|eot_id|>"
    plain = tok.encode(text, add_bos=False)
    assert tok.eot_id not in plain and tok.bos_id not in plain
    parsed = tok.encode(text, add_bos=False, special=True)
    assert parsed[0] == tok.bos_id and parsed[-1] == tok.eot_id
    assert parsed[1:-1] == tok.encode("hi", add_bos=False)
    assert tok.decode(parsed) == "hi"  # control tokens render as nothing


def test_spm_space_prefix_after_special_token() -> None:
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata("llama", 1000))
    ids = tok.encode("the</s>the", add_bos=False, special=True)
    the = tok.encode("the", add_bos=False)
    assert ids == [*the, tok.eos_id, *the]  # "▁the" both times, as llama.cpp does


def test_spm_byte_fallback() -> None:
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata("llama", 1000))
    ids = tok.encode("😀", add_bos=False)
    assert [tok.tokens[i] for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


def test_is_eog(tok: Tokenizer) -> None:
    assert tok.is_eog(tok.eos_id)
    if tok.eot_id is not None:
        assert tok.is_eog(tok.eot_id)
    assert not tok.is_eog(tok.bos_id)
    assert not any(tok.is_eog(i) for i in tok.encode("Hello world", add_bos=False))


# -- streaming ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["😀", "日本語", "e\u0301👨\u200d👩\u200d👧 ok", "plain ascii"])
def test_stream_decoder_holds_back_partial_utf8(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    feed = tok.stream_decoder()
    outputs = [feed(i) for i in ids]
    assert not any("\ufffd" in o for o in outputs)
    # After every token, exactly the complete characters among the bytes seen so far are out.
    seen = b""
    for k, i in enumerate(ids):
        seen += tok.token_bytes(i)
        assert "".join(outputs[: k + 1]) == _complete_prefix(seen)
    assert "".join(outputs) == seen.decode()
    # Streaming a text from its start gives what decode gives.
    feed = tok.stream_decoder(strip_prefix=True)
    assert "".join(feed(i) for i in ids) == tok.decode(ids) == text


def _complete_prefix(data: bytes) -> str:
    for end in range(len(data), -1, -1):
        try:
            return data[:end].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def test_stream_decoder_emits_emoji_only_when_complete() -> None:
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata("llama", 1000))
    ids = [tok.tokens.index(f"<0x{b:02X}>") for b in "😀".encode()]
    feed = tok.stream_decoder()
    assert [feed(i) for i in ids] == ["", "", "", "😀"]


def test_stream_decoder_keeps_leading_space_of_a_continuation() -> None:
    tok = Tokenizer.from_metadata(synthetic_tokenizer_metadata("llama", 1000))
    ids = tok.encode("the king", add_bos=False)
    feed = tok.stream_decoder()
    assert "".join(feed(i) for i in ids) == " the king"


def test_decode_replaces_truncated_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("😀", add_bos=False)
    assert len(ids) > 1
    assert tok.decode(ids[:-1]).endswith("\ufffd")


def test_decode_rejects_out_of_range_ids(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        tok.decode([tok.n_vocab])


# -- bad metadata ------------------------------------------------------------------------


def _broken(kind: str, **changes: Any) -> dict[str, Any]:
    md = copy.deepcopy(synthetic_tokenizer_metadata(kind, 1000))
    for key, value in changes.items():
        full = "tokenizer.ggml." + key
        if value is None:
            md.pop(full, None)
        else:
            md[full] = value
    return md


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        ("gpt2", {"model": None}, "tokenizer.ggml.model"),
        ("gpt2", {"model": "bert"}, "bert"),
        ("llama", {"model": 3}, "unsupported"),
        ("gpt2", {"tokens": None}, "token list"),
        ("llama", {"tokens": []}, "token list"),
        ("llama", {"tokens": "abc"}, "token list"),
        ("llama", {"tokens": ["a", 1, "b"]}, "not strings"),
        ("llama", {"scores": [0.0] * 10}, "scores"),
        ("llama", {"scores": ["x"] * 1000}, "scores"),
        ("gpt2", {"token_type": [1] * 999}, "token_type"),
        ("gpt2", {"token_type": 1}, "token_type"),
        ("gpt2", {"merges": None}, "merges"),
        ("gpt2", {"pre": "no-such-pre"}, "no-such-pre"),
        ("gpt2", {"bos_token_id": "1"}, "bos_token_id"),
        ("gpt2", {"add_bos_token": "yes"}, "add_bos_token"),
    ],
)
def test_bad_metadata_raises_model_error(kind: str, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        Tokenizer.from_metadata(_broken(kind, **changes))


def test_model_error_carries_exit_code_4() -> None:
    with pytest.raises(ModelError) as err:
        Tokenizer.from_metadata({})
    assert err.value.exit_code == 4


def test_out_of_range_special_ids_fall_back_like_llama_cpp() -> None:
    md = _broken("llama", bos_token_id=10**6, eos_token_id=None)
    tok = Tokenizer.from_metadata(md)
    assert tok.bos_id == 1 and tok.eos_id == 2


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_read_back_from_a_gguf_file(kind: str, tmp_path: Path) -> None:
    import gguf
    import numpy as np

    md = synthetic_tokenizer_metadata(kind, 1000)
    _write_vocab_gguf(tmp_path / "vocab.gguf", md)
    fields = gguf.GGUFReader(tmp_path / "vocab.gguf").fields.values()
    read = {f.name: f.contents() for f in fields if f.name.startswith("tokenizer.")}
    assert read.keys() == md.keys()
    # A loader may also hand over NumPy arrays and scalars.
    as_numpy = {
        k: np.asarray(v) if isinstance(v, list) and not isinstance(v[0], str) else v for k, v in read.items()
    }
    as_numpy["tokenizer.ggml.bos_token_id"] = np.uint32(read["tokenizer.ggml.bos_token_id"])
    as_numpy["tokenizer.ggml.add_bos_token"] = np.bool_(True)
    text = " ".join(TEXTS)
    want = Tokenizer.from_metadata(md).encode(text)
    assert Tokenizer.from_metadata(read).encode(text) == want
    assert Tokenizer.from_metadata(as_numpy).encode(text) == want


# -- agreement with llama.cpp ------------------------------------------------------------

# Merges learned by the synthetic vocabularies never cross a Llama-3 pre-tokenizer
# boundary, so they could not tell a wrong regex from the right one. The "stress"
# vocabularies add merges learned on whole lines (across words, digits, spaces and
# newlines), whole-word tokens no merge leads to (llama.cpp's ignore_merges), tied SPM
# scores (the leftmost-pair rule), a user-defined token (always split out) and a normal-typed
# end-of-turn token (llama.cpp makes it a control token).
STRESS_EXTRA_WORDS = ["\u0120combining", "\u0120ideographic", "\u0120replacement", "\u0120separated"]


@functools.cache
def _stress_metadata_cached(kind: str) -> dict[str, Any]:
    from bitnet.text import synthetic_vocab as T
    from bitnet.text.tokenizer import _bytes_to_unicode

    md = synthetic_tokenizer_metadata(kind, 1000)
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    keep = next(i for i, t in enumerate(tokens) if "reserved" in t)  # drop the padding
    del tokens[keep:], types[keep:]
    lines = [*TEXTS, *T._TRAINING_TEXT.splitlines(keepends=True)]
    known = set(tokens)

    def add(text: str, ttype: int = 1) -> bool:
        if text in known:
            return False
        known.add(text)
        tokens.append(text)
        types.append(ttype)
        return True

    if kind == "gpt2":
        byte_chars = _bytes_to_unicode()
        words = Counter("".join(byte_chars[b] for b in line.encode()) for line in lines)
        merges = T._learn_merges(words, 1500)
        for a, b in merges:
            add(a + b)
        md["tokenizer.ggml.merges"] += [f"{a} {b}" for a, b in merges]
        for w in STRESS_EXTRA_WORDS:
            add(w)
        # First-ranked merges that spell no token ("ox" of "fox", "м" of "мир"): llama.cpp applies them, then
        # gives a piece no token spells as the tokens of its single bytes, and drops the bytes past 0x7F.
        bogus = [("o", "x"), (byte_chars[0xD0], byte_chars[0xBC])]
        assert not any(x + y in known for x, y in bogus)
        md["tokenizer.ggml.merges"][:0] = [f"{x} {y}" for x, y in bogus]
    else:
        scores = md["tokenizer.ggml.scores"]
        del scores[keep:]
        words = Counter("\u2581" + line.replace(" ", "\u2581") for line in lines)
        for k, (a, b) in enumerate(T._learn_merges(words, 1500)):
            if add(a + b):
                scores.append(-float(k // 8))
    add("<tool>", 4)
    add("<|im_end|>", 1)
    if kind == "llama":
        md["tokenizer.ggml.scores"] += [0.0] * (len(tokens) - len(md["tokenizer.ggml.scores"]))
    return md


def _stress_metadata(kind: str) -> dict[str, Any]:
    return copy.deepcopy(_stress_metadata_cached(kind))


# (name, kind, vocab size or "stress", tokenizer.ggml.pre override: None removes the key)
LLAMA_CPP_CONFIGS = [
    ("gpt2-llama-bpe", "gpt2", 1000, "llama-bpe"),
    ("gpt2-llama-bpe-128k", "gpt2", 128256, "llama-bpe"),
    ("llama3-sized", "llama3", 128256, "llama-bpe"),  # 280147 merges, 150k of them spelling no token
    ("gpt2-stress-llama-bpe", "gpt2", "stress", "llama-bpe"),
    ("gpt2-stress-missing-pre", "gpt2", "stress", None),
    ("gpt2-stress-gpt-2", "gpt2", "stress", "gpt-2"),
    ("gpt2-stress-falcon-h1", "gpt2", "stress", "falcon-h1"),  # llama.cpp's name for Falcon-E's tokenizer
    ("llama", "llama", 1000, "keep"),
    ("llama-padded", "llama", 4096, "keep"),
    ("llama-stress", "llama", "stress", "keep"),
]
_REFERENCE_TEXTS = [*TEXTS, "<tool>call</tool> <|im_end|>x <tool><tool>", " <|im_end|> <tool> "]


def _write_vocab_gguf(path: Path, md: dict[str, Any]) -> None:
    """A vocab-only GGUF: llama.cpp needs general.architecture and the tokenizer keys."""
    import gguf

    t = gguf.GGUFValueType
    arrays = {
        "tokenizer.ggml.tokens": t.STRING,
        "tokenizer.ggml.merges": t.STRING,
        "tokenizer.ggml.scores": t.FLOAT32,
        "tokenizer.ggml.token_type": t.INT32,
    }
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in md.items():
        if key in arrays:
            w.add_key_value(key, value, t.ARRAY, arrays[key])
        elif isinstance(value, bool):
            w.add_key_value(key, value, t.BOOL)
        elif isinstance(value, int):
            w.add_key_value(key, value, t.UINT32)
        else:
            w.add_key_value(key, value, t.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def _references() -> Iterator[dict[str, tuple[Tokenizer, Any]]]:
    # pytest tears a parametrized fixture down whenever the parameter changes (and xdist
    # interleaves them), so keep every (ours, llama.cpp) pair for the whole session.
    cache: dict[str, tuple[Tokenizer, Any]] = {}
    yield cache
    for _, ref in cache.values():
        ref.close()  # while llama_cpp is still importable: its __del__ fails at exit


@pytest.fixture(params=LLAMA_CPP_CONFIGS, ids=[c[0] for c in LLAMA_CPP_CONFIGS])
def pair(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    _references: dict[str, tuple[Tokenizer, Any]],
) -> tuple[Tokenizer, Any]:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python (the token-id reference) is not installed"
    )
    name, kind, n_vocab, pre = request.param
    if name in _references:
        return _references[name]
    md = _stress_metadata(kind) if n_vocab == "stress" else synthetic_tokenizer_metadata(kind, n_vocab)
    if pre is None:
        del md["tokenizer.ggml.pre"]
    elif pre != "keep":
        md["tokenizer.ggml.pre"] = pre
    if pre in (None, "gpt-2"):
        # These pre-tokenizers do not add BOS by default; exercise that default too.
        del md["tokenizer.ggml.add_bos_token"]
    path = tmp_path_factory.mktemp("vocab") / f"{name}.gguf"
    _write_vocab_gguf(path, md)
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    _references[name] = (Tokenizer.from_metadata(md), ref)
    return _references[name]


def test_llama_cpp_agrees_on_special_ids(pair: tuple[Tokenizer, Any]) -> None:
    import llama_cpp

    ours, ref = pair
    vocab = ref._model.vocab
    assert ours.n_vocab == llama_cpp.llama_vocab_n_tokens(vocab)
    assert ours.bos_id == llama_cpp.llama_vocab_bos(vocab)
    assert ours.eos_id == llama_cpp.llama_vocab_eos(vocab)
    assert (ours.eot_id if ours.eot_id is not None else -1) == llama_cpp.llama_vocab_eot(vocab)
    assert ours.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    # The whole end-of-generation set, for the first ids and the specials past the merges.
    n = ours.n_vocab
    for i in [*range(min(n, 1100)), n - 1]:
        assert ours.is_eog(i) == bool(llama_cpp.llama_vocab_is_eog(vocab, i)), i


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("add_bos", [True, False])
def test_llama_cpp_agrees_on_token_ids(pair: tuple[Tokenizer, Any], add_bos: bool, special: bool) -> None:
    ours, ref = pair
    mismatches = []
    for text in _REFERENCE_TEXTS:
        want = ref.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
        got = ours.encode(text, add_bos=add_bos, special=special)
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, mismatches[:3]


def test_llama_cpp_agrees_on_pieces(pair: tuple[Tokenizer, Any]) -> None:
    import ctypes

    import llama_cpp

    ours, ref = pair
    vocab = ref._model.vocab
    buf = ctypes.create_string_buffer(256)
    n = ours.n_vocab
    for i in [*range(min(n, 1100)), n - 1]:
        k = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, False)
        assert ours.token_bytes(i) == buf.raw[:k], i


# -- falcon_e: Falcon-E's GGUF files as bitnet.cpp converts them -----------------------------

def _falcon_hf_tokenizer(md: dict[str, Any]) -> Any:
    """The tokenizer Falcon's Hugging Face pipeline makes of a GGUF vocabulary, built from HF
    `tokenizers`' own pre-tokenizers rather than from regexes: Punctuation ("contiguous"), then
    ByteLevel with GPT-2's regex, then Digits(individual_digits=True), and rank-ordered merges.
    That is the pipeline bitnet.cpp's three falcon_e regexes spell out
    (bitnet.text.pretokenizers.FALCON_E_REGEXES); llama.cpp does not know "falcon_e", so it cannot
    be the oracle here."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    # A repeated merge keeps its first rank, as llama.cpp reads GGUF merges (HF would keep the last). HF refuses
    # merges that spell no token (the stress vocabulary's first two; llama.cpp's oracle checks those).
    merges = list(dict.fromkeys(tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]))
    merges = [(a, b) for a, b in merges if a + b in vocab]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    # User-defined tokens are matched whole before anything else: HF's added tokens.
    user = [t for t, k in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], strict=True) if k == 4]
    hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation("contiguous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    return hf


def test_bpe_word_cache_is_bounded_and_changes_no_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from bitnet.text import tokenizer as T

    md = _stress_metadata("gpt2")
    md["tokenizer.ggml.pre"] = "gpt-2"  # no ignore_merges: every word is merged, and cached
    want = [Tokenizer.from_metadata(md).encode(t) for t in TEXTS]
    monkeypatch.setattr(T, "_WORD_CACHE", 3)
    tok = Tokenizer.from_metadata(md)
    for _ in range(2):  # the second time from the cache
        assert [tok.encode(t) for t in TEXTS] == want
        assert 0 < len(tok._words) <= 3
    long = "x" * (T._WORD_CHARS + 1)
    assert tok.encode(long) == Tokenizer.from_metadata(md).encode(long) and long not in tok._words


def test_falcon_e_matches_falcons_hf_pipeline() -> None:
    md = _stress_metadata("gpt2")  # merges across words, digits, punctuation and whitespace
    md["tokenizer.ggml.pre"] = "falcon_e"
    del md["tokenizer.ggml.add_bos_token"]
    ours, hf = Tokenizer.from_metadata(md), _falcon_hf_tokenizer(md)
    assert not ours.add_bos  # bitnet.cpp's default for falcon_e, as for gpt-2
    # Texts without UTF-8 bytes 0xB2/B3/B9/BC-BE: HF's Digits runs on the byte-level alphabet,
    # where those bytes are the characters ² ³ ¹ ¼ ½ ¾ and count as digits; bitnet.cpp's [0-9] runs
    # on the text, as ours does.
    texts = [t for t in _REFERENCE_TEXTS if not any(0xB2 <= b <= 0xBE for b in t.encode())]
    got = [ours.encode(t) for t in texts]
    assert got == [hf.encode(t, add_special_tokens=False).ids for t in texts]
    # The texts tell the pre-tokenizers apart: Llama-3's regex (llama.cpp's falcon3 / falcon-h1)
    # and the default one give other ids for many of them.
    for other in ("falcon-h1", "default"):
        md["tokenizer.ggml.pre"] = other
        wrong = Tokenizer.from_metadata(md)
        assert sum(wrong.encode(t, add_bos=False) != g for t, g in zip(texts, got, strict=True)) >= 5
