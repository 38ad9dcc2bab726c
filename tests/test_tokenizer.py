"""Tokenizer tests: round trips, metadata validation, streaming (llama.cpp's ids: test_tokenizer_reference)."""

from __future__ import annotations

import copy
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
    from bitnet.text.merges import spelled_by_ids
    from bitnet.text.synthetic_vocab import LLAMA3_MERGES, LLAMA3_NORMAL

    md = synthetic_tokenizer_metadata("llama3", 128256)
    tokens, merges = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"]
    assert len(set(tokens)) == len(tokens) == 128256 and len(set(merges)) == len(merges)
    assert abs(len(merges) - LLAMA3_MERGES) < LLAMA3_MERGES // 500  # as many as Llama 3's, within 0.2 %
    assert md["tokenizer.ggml.token_type"].count(1) == LLAMA3_NORMAL
    assert tokens[LLAMA3_NORMAL:LLAMA3_NORMAL + 3] == ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    assert md == synthetic_tokenizer_metadata("llama3", 128256)  # deterministic
    assert spelled_by_ids(tokens, md["tokenizer.ggml.token_type"], merges)  # written as Llama 3's are
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
