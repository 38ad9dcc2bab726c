"""Tokenizers built from GGUF metadata, giving the token ids llama.cpp gives.

Two vocabulary kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE with ranked merges (Llama-3, BitNet b1.58 2B-4T). The
  pre-tokenizer regexes (llama.cpp's, chosen by ``tokenizer.ggml.pre``) run in HF ``tokenizers``;
  the rank-ordered merging is llama.cpp's ``llm_tokenizer_bpe_session``, re-implemented here: HF's
  BPE model took 0.3 s to build from a Llama-3-sized vocabulary (128k tokens, 136k merges), as
  long as llama.cpp's whole load of a 2B-4T file; a table of merge ranks, 0.04 s for 280k merges.
- ``llama``: SentencePiece-style vocabulary with scores. HF's BPE merges by merge rank,
  not by the score of the merged piece, so it cannot reproduce llama.cpp's
  ``llm_tokenizer_spm``; that algorithm is re-implemented here (it is small).

What follows llama.cpp (src/llama-vocab.cpp, checked token for token against
llama-cpp-python in tests/test_tokenizer.py):

- special tokens are split out of the text first (``tokenizer_st_partition``): longest
  first; control and unknown tokens only with ``special=True``, user-defined always.
  ``special`` defaults to False, as in llama-cpp-python's ``Llama.tokenize``;
- a missing ``tokenizer.ggml.pre`` means "default" (llama.cpp warns); an unknown one is
  an error (llama.cpp throws too). Only the pre-tokenizers listed in ``pretokenizers.PRE_TYPES`` are
  supported; other names llama.cpp knows raise ModelError naming them. ``falcon_e``, which
  llama.cpp does not know, follows bitnet.cpp's llama.cpp fork (see pretokenizers.FALCON_E_REGEXES);
- Llama-3 pre-tokenizers (``llama-bpe``...) set ``ignore_merges`` and default
  ``add_bos_token`` to true; ``gpt-2`` and ``default`` default it to false, SPM to true;
- repeated merges keep their first rank; empty tokens become ``[EMPTY_<id>]``;
  out-of-range special ids fall back to the defaults; EOT/EOM ids and the
  end-of-generation set are also detected by token text, which makes such tokens
  control tokens;
- SPM: a space is prefixed to the text and after every special token
  (``add_space_prefix``), spaces become "▁", the highest-scoring adjacent pair is merged
  first (ties: leftmost), leftovers fall back to ``<0xXX>`` byte tokens;
- a token renders as ``llama_token_to_piece(special=False)`` renders it.

Deliberate differences: ``decode`` never applies llama.cpp's ``clean_spaces`` pass (it
would turn "a ." into "a." and break round trips), and it removes the SPM prefix space
whether or not the ids start with BOS. llama.cpp's FIM-token detection and its
model-specific end-of-generation workarounds (gpt-oss, Gemma 4, PLaMo) are not copied.

``synthetic_tokenizer_metadata`` builds small deterministic vocabularies of both kinds
for the synthetic test models.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

from bitnet.errors import ModelError
from bitnet.text.merges import DerivedMerges
from bitnet.text.pretokenizers import PRE_TYPES
from bitnet.text.special_tokens import SpecialTokens

__all__ = ["Tokenizer"]

# llama.cpp's LLAMA_TOKEN_TYPE_* values (tokenizer.ggml.token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space
# Byte-level BPE words whose tokens are kept (a prompt repeats most of its words), and the longest kept (a long one is
# rarely met again, and 1 MB of one word is ~0.5M ids).
_WORD_CACHE, _WORD_CHARS = 1 << 16, 64


def _merge(text: str, priority: Callable[[str, str], float | None]) -> list[str]:
    """The pieces of `text` after llama.cpp's merge loop (its SPM and BPE sessions alike): from single characters, the
    adjacent pair of the lowest priority(left, right) merges first (ties: leftmost), until no pair has one. A pair in
    the queue is stale once either symbol merged since: symbols only grow from where they start, so two live ones
    whose lengths still add up to the pair's spell what it did."""
    n = len(text)
    length, nxt, prev = [1] * n, [*range(1, n), -1], list(range(-1, n - 1))
    heap: list[tuple[float, int, int, int]] = []

    def add_bigram(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            p = priority(text[left:left + length[left]], text[right:right + length[right]])
            if p is not None:
                heapq.heappush(heap, (p, left, right, length[left] + length[right]))

    for i in range(1, n):
        add_bigram(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
            continue
        length[left], length[right] = size, 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add_bigram(prev[left], left)
        add_bigram(left, nxt[left])
    return [text[i:i + length[i]] for i in range(n) if length[i]]


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


# llama.cpp's llama_token_attr bits. A token can carry several: llama.cpp adds CONTROL to
# end-of-generation-looking tokens whatever their declared type.
_ATTR_UNKNOWN = 1 << 0
_ATTR_UNUSED = 1 << 1
_ATTR_NORMAL = 1 << 2
_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4
_ATTR_BYTE = 1 << 5
_TYPE_TO_ATTR = {
    TOKEN_NORMAL: _ATTR_NORMAL,
    TOKEN_UNKNOWN: _ATTR_UNKNOWN,
    TOKEN_CONTROL: _ATTR_CONTROL,
    TOKEN_USER_DEFINED: _ATTR_USER_DEFINED,
    TOKEN_UNUSED: _ATTR_UNUSED,
    TOKEN_BYTE: _ATTR_BYTE,
}  # any other value (0 = undefined) -> no attribute: never rendered, like llama.cpp

# Token texts llama.cpp recognises when the GGUF does not name the token by id
# (llama_vocab::impl::load, "auto-detect special tokens by text"); first match wins here.
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
# Every token with one of these texts ends generation in llama.cpp (special_eog_ids).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})  # fmt: skip

_PREFIX = "tokenizer.ggml."


def _array(md: dict[str, Any], key: str, n: int, kind: type) -> list[Any] | None:
    """An optional per-token array; llama.cpp rejects one shorter than the token list.

    ``kind`` is numbers.Integral or numbers.Real, so NumPy scalars pass as well.
    """
    value = md.get(_PREFIX + key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ModelError(f"{_PREFIX}{key} is not an array")
    if len(value) < n:
        raise ModelError(f"{_PREFIX}{key} has {len(value)} entries for {n} tokens")
    values = list(value[:n])
    # Exact types first: GGUF arrays hold plain ints and floats, and an ABC isinstance test
    # costs ~1 us per item (0.12 s for a 128k vocabulary).
    exact = {int} if kind is numbers.Integral else {int, float}
    if set(map(type, values)) <= exact:
        return values
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise ModelError(f"{_PREFIX}{key} has entries of the wrong type")
    return values


def _flag(md: dict[str, Any], key: str, default: bool) -> bool:
    value = md.get(_PREFIX + key)
    if value is None:
        return default
    if isinstance(value, (str, bytes)) or value not in (True, False):
        raise ModelError(f"{_PREFIX}{key} is not a bool")
    return bool(value)


class Tokenizer:
    """Text <-> token ids for a GGUF model, giving the ids llama.cpp gives.

    Build it with :meth:`from_metadata`. ``encode`` follows ``llama_tokenize`` with
    llama-cpp-python's defaults (``special=False``: control tokens in the text are
    tokenized as plain text; user-defined tokens are always matched whole, as in
    llama.cpp). ``decode`` concatenates each token's piece the way ``llama_token_to_piece``
    renders it with ``special=False`` (control and unknown tokens render as nothing).
    """

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    add_bos: bool

    def __init__(
        self,
        *,
        model: str,
        tokens: list[str],
        scores: list[float],
        attrs: list[int],
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None,
        eom_id: int | None,
        unk_id: int | None,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        eog_ids: frozenset[int],
        merges: Sequence[str] | None = None,
        pre: str = "default",
        token_to_id: dict[str, int] | None = None,
    ) -> None:
        self.model = model
        self.n_vocab = len(tokens)
        self.tokens = tokens
        self.scores = scores
        self.attrs = attrs
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_id = eot_id
        self.eom_id = eom_id
        self.unk_id = unk_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.pre = pre
        self._eog_ids = eog_ids
        # Later duplicates win, as in llama.cpp's token_to_id map.
        self._token_to_id = token_to_id if token_to_id is not None else {t: i for i, t in enumerate(tokens)}
        self._special_tables: dict[bool, SpecialTokens] = {}  # built on first use, see _specials
        self._pieces: list[bytes] | None = None
        self._pre: Any = None
        if model == "gpt2":
            from tokenizers import Regex, pre_tokenizers

            regexes, self._ignore_merges, _ = PRE_TYPES[pre]
            # llama.cpp keeps the text between regex matches as pieces of its own: "isolated".
            split = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            self._pre = pre_tokenizers.Sequence([*split, byte_level])
            # Merges a tiktoken conversion wrote rank by the ids they join (text/merges.py, `_id_rank`).
            self._rank: Callable[[str, str], int | None] | None = None
            if not isinstance(merges, DerivedMerges):
                # "left right" -> rank, as the file spells each merge. A repeated merge keeps its first rank
                # (llama.cpp's bpe_ranks.emplace): the reversed pairs let the earlier one overwrite.
                merges = list(merges or ())
                ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1), strict=True))
                self._rank = lambda a, b: ranks.get(a + " " + b)
            self._words: dict[str, list[int]] = {}  # pieces tokenized so far (a bounded cache)

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (``tokenizer.ggml.*`` keys, Python values).

        Defaults are llama.cpp's (``llama_vocab::impl::load``). Raises
        :class:`bitnet.errors.ModelError` when the tokenizer data is missing or invalid.
        """
        model = md.get(_PREFIX + "model")
        if model is None:
            raise ModelError("the model has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("llama", "gpt2"):
            raise ModelError(f"unsupported tokenizer model {model!r} (supported: 'llama', 'gpt2')")
        tokens = md.get(_PREFIX + "tokens")
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or len(tokens) == 0:
            raise ModelError("the model has no token list (tokenizer.ggml.tokens)")
        # (Loops over the vocabulary run in C where they can: map(type, ...), dict(zip(...)).)
        if not set(map(type, tokens)) <= {str} and not all(isinstance(t, str) for t in tokens):
            raise ModelError("tokenizer.ggml.tokens has entries that are not strings")
        tokens = list(tokens)
        if "" in tokens:  # llama.cpp renames empty tokens so the text -> id map stays one-to-one
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        scores = _array(md, "scores", n, numbers.Real)
        types = _array(md, "token_type", n, numbers.Integral)
        attrs = [_ATTR_NORMAL] * n if types is None else list(map(_TYPE_TO_ATTR.get, types, itertools.repeat(0)))

        merges: Sequence[str] | None = None
        pre = "default"
        if model == "llama":
            bos, eos, unk = 1, 2, 0
            add_bos, add_space_prefix = True, True
        else:
            bos, eos, unk = 11, 11, None
            raw_merges = md.get(_PREFIX + "merges")
            if not isinstance(raw_merges, DerivedMerges) and (
                isinstance(raw_merges, (str, bytes))
                or not hasattr(raw_merges, "__len__")
                or not set(map(type, raw_merges)) <= {str}
            ):
                raise ModelError("gpt2 tokenizer without a tokenizer.ggml.merges string array")
            merges = raw_merges
            pre = md.get(_PREFIX + "pre") or "default"
            if pre not in PRE_TYPES:
                raise ModelError(
                    f"unknown or unsupported pre-tokenizer type {pre!r} (tokenizer.ggml.pre); "
                    f"supported: {', '.join(sorted(PRE_TYPES))}"
                )
            add_bos = PRE_TYPES[pre][2]
            add_space_prefix = False

        def special_id(key: str, default: int | None) -> int | None:
            # Out-of-range ids are ignored, as llama.cpp does (with a warning).
            if default is not None and default >= n:
                default = None
            value = md.get(_PREFIX + key)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ModelError(f"{_PREFIX}{key} is not an integer")
            return int(value) if 0 <= value < n else default

        bos_id = special_id("bos_token_id", bos)
        eos_id = special_id("eos_token_id", eos)
        unk_id = special_id("unknown_token_id", unk)
        eot_id = special_id("eot_token_id", None)
        eom_id = special_id("eom_token_id", None)
        token_to_id = dict(zip(tokens, range(n), strict=True))  # the last of duplicate texts, as llama.cpp keeps
        if eot_id is None:
            eot_id = next((token_to_id[t] for t in _EOT_TEXTS if t in token_to_id), None)
        if eom_id is None:
            eom_id = next((token_to_id[t] for t in _EOM_TEXTS if t in token_to_id), None)
        eog = {token_to_id[t] for t in _EOG_TEXTS if t in token_to_id}  # llama.cpp scans its text -> id map too
        for i in (eot_id, eom_id):
            if i is not None:
                attrs[i] |= _ATTR_CONTROL
        for i in eog:
            attrs[i] |= _ATTR_CONTROL
        eog.update(i for i in (eos_id, eot_id, eom_id) if i is not None)

        add_bos = _flag(md, "add_bos_token", add_bos)
        add_eos = _flag(md, "add_eos_token", False)
        add_space_prefix = _flag(md, "add_space_prefix", add_space_prefix)
        if add_bos and bos_id is None:
            raise ModelError("the tokenizer adds a BOS token but has none")
        if add_eos and eos_id is None:
            raise ModelError("the tokenizer adds an EOS token but has none")
        return cls(
            model=model,
            tokens=tokens,
            scores=[float(s) for s in scores] if scores is not None else [0.0] * n,
            attrs=attrs,
            bos_id=bos_id,
            eos_id=eos_id,
            eot_id=eot_id,
            eom_id=eom_id,
            unk_id=unk_id,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            eog_ids=frozenset(eog),
            merges=merges,
            pre=pre,
            token_to_id=token_to_id,
        )

    # -- encoding ------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, *, special: bool = False) -> list[int]:
        """Token ids of ``text``, as ``llama_tokenize(text, add_special=add_bos, parse_special=special)``.

        ``add_bos`` adds the BOS token only when the model asks for it
        (``tokenizer.ggml.add_bos_token``; llama.cpp's default is true for ``llama``
        vocabularies and Llama-3 style ``gpt2`` ones); likewise an EOS token when the model
        sets ``add_eos_token``. ``special=True`` turns control-token texts such as
        ``<|eot_id|>`` into their ids (for chat templates); the default, like
        llama-cpp-python's ``Llama.tokenize``, treats them as plain text.
        """
        out: list[int] = []
        if add_bos and self.add_bos:
            assert self.bos_id is not None
            out.append(self.bos_id)
        fragments = self._specials(special).partition(text)
        if self.model == "llama":
            prev_special = True  # llama.cpp prefixes a space at the start and after a special token
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_tokenize(frag.replace(" ", SPIECE_SPACE), out)
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(i for word, _ in self._pre.pre_tokenize_str(frag) for i in self._bpe_word(word))
        if add_bos and self.add_eos:
            assert self.eos_id is not None
            out.append(self.eos_id)
        return out

    def _specials(self, special: bool) -> SpecialTokens:
        """What an encode splits out: user-defined tokens, with ``special`` also control and
        unknown ones. Built on first use: a padded vocabulary can have 100k+ control tokens that a
        plain encode never looks for."""
        table = self._special_tables.get(special)
        if table is None:
            mask = _ATTR_USER_DEFINED | (_ATTR_CONTROL | _ATTR_UNKNOWN if special else 0)
            table = SpecialTokens(self.tokens, (i for i, a in enumerate(self.attrs) if a & mask))
            self._special_tables[special] = table
        return table

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm_session::tokenize on one fragment: merge first the adjacent pair whose
        concatenation is the highest-scoring token (ties: leftmost); map each piece to its token or, failing that,
        to its UTF-8 bytes' ``<0xXX>`` tokens."""
        vocab, scores = self._token_to_id, self.scores
        for piece in _merge(text, lambda a, b: -scores[t] if (t := vocab.get(a + b)) is not None else None):
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b) for b in piece.encode("utf-8"))

    def _bpe_word(self, word: str) -> list[int]:
        """llama.cpp's llm_tokenizer_bpe_session on one pre-tokenized, byte-level word: a whole-vocabulary word
        is one token (with ignore_merges); else the adjacent pair of the lowest merge rank is merged first (ties:
        leftmost), and a piece no token spells gives the tokens of its single bytes (those that have one). Kept for
        the next time (in a bounded cache)."""
        vocab, out = self._token_to_id, self._words.get(word)
        if out is not None:
            return out
        if self._ignore_merges and word in vocab:
            return [vocab[word]]
        out = []
        for piece in _merge(word, self._rank or self._id_rank):
            if piece in vocab:
                out.append(vocab[piece])
            else:  # (a byte past 0x7F alone is no UTF-8 text, so no token's)
                out.extend(vocab[chr(b)] for b in piece.encode("utf-8") if b < 0x80 and chr(b) in vocab)
        if len(word) <= _WORD_CHARS:
            if len(self._words) >= _WORD_CACHE:
                self._words.clear()
            self._words[word] = out
        return out

    def _id_rank(self, left: str, right: str) -> int | None:
        """The rank of merging two ordinary tokens into a third, as a tiktoken conversion orders its merges: by the
        merged token's id, then the left's, then the right's."""
        vocab, attrs, n = self._token_to_id, self.attrs, self.n_vocab
        if (t := vocab.get(left + right)) is None or not attrs[t] & _ATTR_NORMAL:
            return None
        a, b = vocab.get(left), vocab.get(right)
        if a is None or b is None or not attrs[a] & attrs[b] & _ATTR_NORMAL:
            return None
        return (t * n + a) * n + b

    def _byte_token(self, b: int) -> int:
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._token_to_id.get(chr(b))
        if tid is None:
            # llama.cpp throws here (std::out_of_range) and the whole tokenize call fails.
            raise ModelError(f"the vocabulary has no byte token for 0x{b:02X}")
        return tid

    # -- decoding ------------------------------------------------------------------------

    def _piece_table(self) -> list[bytes]:
        # Built on first use: 128k tokens take a noticeable fraction of a second.
        if self._pieces is None:
            self._pieces = [self._piece(i) for i in range(self.n_vocab)]
        return self._pieces

    def _piece(self, tid: int) -> bytes:
        """What llama_token_to_piece(special=False) renders for one token."""
        attr = self.attrs[tid]
        text = self.tokens[tid]
        if attr & (_ATTR_UNKNOWN | _ATTR_CONTROL):
            return b""
        if attr & _ATTR_USER_DEFINED:
            return text.encode("utf-8")
        if attr & _ATTR_NORMAL:
            if self.model == "llama":
                return text.replace(SPIECE_SPACE, " ").encode("utf-8")
            table = _unicode_to_bytes()
            # A character outside GPT-2's byte map cannot come from byte-level BPE; keep
            # its UTF-8 rather than failing.
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in text)
        if attr & _ATTR_BYTE:
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
            return bytes([int(m.group(1), 16)]) if m else b""
        return b""

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token ``tid`` renders as (empty for control tokens)."""
        return self._piece_table()[tid]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; invalid or truncated UTF-8 becomes U+FFFD.

        For ``llama`` vocabularies the space the encoder put in front of the text
        (``add_space_prefix``) is removed again, so ``decode(encode(s)) == s``.
        """
        return self._decode_bytes(ids, strip_prefix=True).decode("utf-8", errors="replace")

    def _decode_bytes(self, ids: Sequence[int], strip_prefix: bool) -> bytes:
        pieces = self._piece_table()
        out = []
        for tid in ids:
            if not 0 <= tid < self.n_vocab:
                raise ValueError(f"token id {tid} outside the vocabulary (0..{self.n_vocab - 1})")
            piece = pieces[tid]
            if strip_prefix and piece:
                # The first visible piece carries the encoder's prefix space.
                if self.add_space_prefix and piece.startswith(b" "):
                    piece = piece[1:]
                strip_prefix = False
            out.append(piece)
        return b"".join(out)

    def stream_decoder(self, *, strip_prefix: bool = False) -> Callable[[int], str]:
        """A function to feed generated ids one at a time; it returns the newly completed text.

        A multi-byte UTF-8 character split across tokens (byte-fallback tokens, byte-level
        BPE pieces) is held back until its last byte arrives. The ids are taken as a
        continuation of a prompt, so a leading ``▁`` stays a space; pass
        ``strip_prefix=True`` when streaming a text from its start (then the output
        concatenates to :meth:`decode` of the same ids).
        """
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        state = {"strip": strip_prefix}

        def feed(tid: int) -> str:
            data = self._decode_bytes([tid], strip_prefix=state["strip"])
            if data:
                state["strip"] = False
            return decoder.decode(data)

        return feed

    @property
    def eog_ids(self) -> frozenset[int]:
        """Every token that ends generation (EOS, EOT, EOM, end-of-turn tokens: llama.cpp's set)."""
        return self._eog_ids

    def has_token(self, text: str) -> bool:
        """Whether the vocabulary has a token spelled exactly `text` (e.g. "<|im_start|>")."""
        return text in self._token_to_id

    def token_text(self, tid: int) -> str:
        """The vocabulary's spelling of token `tid` (special tokens as written, e.g. "<|eot_id|>")."""
        return self.tokens[tid]

    def is_eog(self, tok: int) -> bool:
        """Whether ``tok`` ends generation: EOS, EOT, EOM or an end-of-turn token (llama.cpp's set)."""
        return tok in self._eog_ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, eot_id={self.eot_id}, add_bos={self.add_bos})"
        )
