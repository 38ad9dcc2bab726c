"""Our token ids against references: llama.cpp (llama-cpp-python) on synthetic and "stress" vocabularies, and
Falcon's Hugging Face pipeline for falcon_e, which llama.cpp does not know."""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from test_merges import WORDS
from test_tokenizer import TEXTS, _write_vocab_gguf

from bitnet.text.merges import DerivedMerges
from bitnet.text.synthetic_vocab import synthetic_tokenizer_metadata
from bitnet.text.tokenizer import Tokenizer

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
    ("llama3-sized", "llama3", 128256, "llama-bpe"),  # 280k merges, written as Llama 3's are
    ("llama3-by-ids", "llama3", 128256, "llama-bpe"),  # the same, ours ranking them by ids as a load-cache hit does
    ("gpt2-stress-llama-bpe", "gpt2", "stress", "llama-bpe"),
    ("gpt2-stress-missing-pre", "gpt2", "stress", None),
    ("gpt2-stress-gpt-2", "gpt2", "stress", "gpt-2"),
    ("gpt2-stress-falcon-h1", "gpt2", "stress", "falcon-h1"),  # llama.cpp's name for Falcon-E's tokenizer
    ("llama", "llama", 1000, "keep"),
    ("llama-padded", "llama", 4096, "keep"),
    ("llama-stress", "llama", "stress", "keep"),
]
_REFERENCE_TEXTS = [*TEXTS, "<tool>call</tool> <|im_end|>x <tool><tool>", " <|im_end|> <tool> ", WORDS]


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
    if name.endswith("-by-ids"):
        tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
        md["tokenizer.ggml.merges"] = DerivedMerges(tokens, types, len(md["tokenizer.ggml.merges"]))
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
