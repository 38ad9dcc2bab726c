"""Deterministic tokenizer metadata for synthetic models (tests, benchmarks, the built-in model).

Not a tokenizer: it writes the `tokenizer.ggml.*` keys a GGUF file carries, which
bitnet.text.tokenizer (and llama.cpp) then read like any real vocabulary.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter
from typing import Any

from bitnet.text.merges import derive
from bitnet.text.pretokenizers import LLAMA3_REGEX
from bitnet.text.tokenizer import (
    SPIECE_SPACE,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    _bytes_to_unicode,
)

# Training text for the synthetic vocabularies: ordinary English with digits,
# contractions and punctuation so the learned merges look like a real tokenizer's.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst
of times; it was the age of wisdom, it was the age of foolishness. In the beginning there
was nothing, and then there was a small model that could only say a few words. We're
testing a ternary language model: every weight is -1, 0 or +1, and the activations are
quantized to eight bits. That's why the model is small and fast. You'll see that it
doesn't need much memory, and they've shown it runs well on a laptop.

Once upon a time, in a land far away, there lived a king who had three daughters. The
first daughter loved to read, the second loved to sing, and the third loved to build
machines. Every morning the king would walk through the garden and talk with the people
who worked there. "What are you making today?" he asked. "A machine that can think,"
said the youngest. The king laughed, but she was serious, and after many years of work
the machine could answer questions, write letters and count to 1000.

Numbers appear in text all the time: 1, 2, 3, 42, 100, 2024, 3.14159, 12345678 and
the year 1999. A price of $19.99 is not the same as 19.99 euros. Call 555-0100 at 9:30.
Lists have items: apples, oranges, bananas, and grapes. Questions end with a question
mark? Exclamations end with an exclamation mark! Code looks different: def main(): return
x + y * 2 if (a == b) else [1, 2, 3]; for i in range(10): print(i).

The weather is nice today. The sun is shining, the birds are singing, and the children
are playing in the park. In the evening the light turns golden and the air gets cool.
People walk their dogs, talk with their neighbours and think about the day. Tomorrow
will be another day, with new problems to solve and new things to learn. The river runs
through the town, under the old stone bridge, past the mill and into the sea. Ships
come and go, bringing news from other countries, and the market is always busy.
Learning is a process of making mistakes and then correcting them. A model learns the
same way: it predicts the next token, compares it with the real one, and changes its
weights a little. After billions of tokens it can write text that reads well. This is
the simple idea behind every large language model, and it is also why they need so
much data and so much compute to train. Inference is cheaper: it only reads the weights.
"""

_GPT2_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


def _learn_merges(words: Counter[str], max_merges: int) -> list[tuple[str, str]]:
    """Count-based BPE learner: repeatedly merge the most frequent adjacent pair.

    Ties go to the lexicographically smallest pair so the result never depends on
    hash or dict ordering. Pairs seen only once are not merged (they would just memorize
    the text).
    """
    seqs = [(list(w), n) for w, n in sorted(words.items())]
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        counts: Counter[tuple[str, str]] = Counter()
        for syms, n in seqs:
            for pair in itertools.pairwise(syms):
                counts[pair] += n
        if not counts:
            break
        best_n = max(counts.values())
        if best_n < 2:
            break
        best = min(p for p, c in counts.items() if c == best_n)
        merges.append(best)
        joined = best[0] + best[1]
        for syms, _ in seqs:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == best[0] and syms[i + 1] == best[1]:
                    syms[i : i + 2] = [joined]
                i += 1
    return merges


def _regex_pieces(regex: str, text: str) -> list[str]:
    from tokenizers import Regex, pre_tokenizers

    pre = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


def _synthetic_gpt2(vocab_size: int) -> dict[str, Any]:
    byte_chars = _bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)]
    n_learn = vocab_size - len(tokens) - len(_GPT2_SPECIALS)
    if n_learn < 0:
        raise ValueError(f"gpt2 synthetic vocab needs at least {256 + len(_GPT2_SPECIALS)} tokens")
    words: Counter[str] = Counter(
        "".join(byte_chars[b] for b in piece.encode("utf-8"))
        for piece in _regex_pieces(LLAMA3_REGEX, _TRAINING_TEXT)
    )
    merges = _learn_merges(words, n_learn)
    known = set(tokens)
    for a, b in merges:
        if a + b not in known:
            known.add(a + b)
            tokens.append(a + b)
    token_type = [TOKEN_NORMAL] * len(tokens)
    bos_id = len(tokens)
    tokens += list(_GPT2_SPECIALS)
    token_type += [TOKEN_CONTROL] * len(_GPT2_SPECIALS)
    # Llama-3 pads its vocabulary with reserved control tokens the same way.
    n_pad = vocab_size - len(tokens)
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(n_pad)]
    token_type += [TOKEN_CONTROL] * n_pad
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_type,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": bos_id,
        "tokenizer.ggml.eos_token_id": bos_id + 1,
        "tokenizer.ggml.eot_token_id": bos_id + 2,
        "tokenizer.ggml.add_bos_token": True,
    }


def _synthetic_llama(vocab_size: int) -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    token_type = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    scores = [0.0] * len(tokens)
    words = Counter(SPIECE_SPACE + w for w in _TRAINING_TEXT.split())
    chars = sorted({c for w in words for c in w})
    n_learn = vocab_size - len(tokens) - len(chars)
    if n_learn < 0:
        raise ValueError(f"llama synthetic vocab needs at least {len(tokens) + len(chars)} tokens")
    merges = _learn_merges(words, n_learn)
    # Like a SentencePiece BPE model: merged pieces first, scored by how early they were
    # learned (llama.cpp merges the highest-scoring piece first), single characters last.
    pieces: list[str] = []
    known = set(chars)
    for a, b in merges:
        if a + b not in known:
            known.add(a + b)
            pieces.append(a + b)
    pieces += chars
    tokens += pieces
    token_type += [TOKEN_NORMAL] * len(pieces)
    scores += [-float(i) for i in range(len(pieces))]
    n_pad = vocab_size - len(tokens)
    tokens += [f"<reserved_{i}>" for i in range(n_pad)]
    token_type += [TOKEN_UNUSED] * n_pad
    scores += [-1e9] * n_pad
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": token_type,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
    }


LLAMA3_NORMAL, LLAMA3_MERGES = 128000, 280147  # Llama 3's (and BitNet b1.58 2B-4T's) ordinary tokens and merges


def _synthetic_llama3(vocab_size: int) -> dict[str, Any]:
    """The gpt2 vocabulary, its ordinary tokens grown to Llama 3's count and its merges written as a tiktoken
    conversion writes Llama 3's (bitnet.text.merges): what a load reads and builds (a tokenizer of 242 merges had
    hidden 0.3 s of a 2B-4T load). The tokens past the learned ones join runs of four or five short tokens
    (pseudo-random, seeded) with every run inside them, as a real vocabulary holds a word and its parts: 279888
    merges (Llama 3: 280147)."""
    if vocab_size < LLAMA3_NORMAL + len(_GPT2_SPECIALS):
        raise ValueError(f"llama3 synthetic vocab needs at least {LLAMA3_NORMAL + len(_GPT2_SPECIALS)} tokens")
    md = _synthetic_gpt2(vocab_size)
    tokens = md["tokenizer.ggml.tokens"]
    n_learned = tokens.index(_GPT2_SPECIALS[0])
    normal = tokens[:n_learned]
    known, rng = set(normal), random.Random(3)
    short = [t for t in normal if t.isalpha() and len(t) <= 2]
    while len(normal) < LLAMA3_NORMAL:
        k = 5 if rng.random() < 0.45 else 4
        pieces = [rng.choice(short) for _ in range(k)]
        for n in range(2, k + 1):
            for i in range(k - n + 1):
                t = "".join(pieces[i:i + n])
                if t not in known and len(normal) < LLAMA3_NORMAL:
                    known.add(t)
                    normal.append(t)
    specials = tokens[n_learned:n_learned + len(_GPT2_SPECIALS)]
    md["tokenizer.ggml.tokens"] = normal + specials + [f"<|reserved_special_token_{i}|>" for i in
                                                       range(vocab_size - len(normal) - len(specials))]
    md["tokenizer.ggml.token_type"] = [TOKEN_NORMAL] * len(normal) + [TOKEN_CONTROL] * (vocab_size - len(normal))
    md["tokenizer.ggml.merges"] = derive(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"])
    for key, k in (("bos", 0), ("eos", 1), ("eot", 2)):
        md[f"tokenizer.ggml.{key}_token_id"] = len(normal) + k
    return md


@functools.cache
def _synthetic_cached(kind: str, vocab_size: int) -> dict[str, Any]:
    if kind == "gpt2":
        return _synthetic_gpt2(vocab_size)
    if kind == "llama3":
        return _synthetic_llama3(vocab_size)
    if kind == "llama":
        return _synthetic_llama(vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'gpt2', 'llama3' or 'llama')")


def synthetic_tokenizer_metadata(kind: str, vocab_size: int) -> dict[str, Any]:
    """Deterministic tokenizer metadata (GGUF ``tokenizer.ggml.*`` keys) for a synthetic model.

    ``kind`` is ``"gpt2"`` (byte-level BPE, Llama-3 style: 256 byte tokens, learned merges,
    ``<|begin_of_text|>``/``<|end_of_text|>``/``<|eot_id|>`` control tokens, pre-tokenizer
    ``llama-bpe``) or ``"llama"`` (SentencePiece style: ``<unk>``, ``<s>``, ``</s>``, 256
    ``<0xXX>`` byte tokens, scored ``▁`` pieces); ``"llama3"`` is gpt2 with Llama 3's 128000 ordinary
    tokens and as many merges, as Llama 3 writes them (see _synthetic_llama3). The vocabulary has exactly ``vocab_size``
    tokens: beyond what the built-in training text yields it is padded with tokens that
    ordinary text never produces (gpt2: ``<|reserved_special_token_N|>``, control type;
    llama: ``<reserved_N>``, unused type).

    Values are plain Python objects; write them to GGUF with these types:

    - ``tokenizer.ggml.model``, ``tokenizer.ggml.pre``: string
    - ``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges`` (gpt2): array of string
    - ``tokenizer.ggml.scores`` (llama): array of float32
    - ``tokenizer.ggml.token_type``: array of int32
    - ``tokenizer.ggml.bos_token_id``, ``eos_token_id``, ``eot_token_id`` (gpt2),
      ``unknown_token_id`` (llama): uint32
    - ``tokenizer.ggml.add_bos_token``, ``add_space_prefix`` (llama): bool

    The result is a fresh dict each call (lists copied), so callers may modify it.
    """
    md = _synthetic_cached(kind, vocab_size)
    return {k: list(v) if isinstance(v, list) else v for k, v in md.items()}
