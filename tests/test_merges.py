"""Merges that the token ids spell (bitnet.text.merges): which vocabularies have them, and that ranking by ids
tokenizes as ranking by the file's merges does."""

from __future__ import annotations

import itertools
import random

import pytest

from bitnet.text.merges import DerivedMerges, derive, spelled_by_ids
from bitnet.text.synthetic_vocab import synthetic_tokenizer_metadata
from bitnet.text.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer

# a b c ab bc abc: "abc" splits as a|bc (ids 0, 4) and ab|c (3, 2), ranked by the left piece's id.
TOKENS = ["a", "b", "c", "ab", "bc", "abc"]
MERGES = ["a b", "b c", "a bc", "ab c"]
# Made-up words, which the llama3 vocabulary's tokens of four and five short pieces (and their parts) spell.
_RNG = random.Random(7)
WORDS = " ".join("".join(_RNG.choices("etaoinshrdlucmfw", k=_RNG.randint(4, 12))) for _ in range(300))


def test_the_merges_a_tiktoken_conversion_writes() -> None:
    assert derive(TOKENS, None) == MERGES
    assert derive(["ab", "a", "b", "c", "bc", "abc"], None) == ["a b", "b c", "ab c", "a bc"]  # by id, not place
    assert derive(TOKENS, [TOKEN_NORMAL] * 6) == MERGES
    # A control token is neither split nor a piece.
    assert derive(TOKENS, [TOKEN_NORMAL] * 4 + [TOKEN_CONTROL, TOKEN_NORMAL]) == ["a b", "ab c"]


@pytest.mark.parametrize(("tokens", "why"), [(["a", "b", "ab", "ab"], "two tokens spell one text"),
                                             (["a", "", "ab"], "an empty token"),
                                             (["a", " ", "a "], "a token holds a space")])
def test_vocabularies_whose_merges_the_ids_cannot_rank(tokens: list[str], why: str) -> None:
    assert derive(tokens, None) is None, why
    assert not spelled_by_ids(tokens, None, derive(tokens[:1], None))


@pytest.mark.parametrize("tokens", [[1, 2, 12], ["a", ["b"], "ab"], []])
def test_tokens_that_are_no_strings_are_no_such_vocabulary(tokens: list) -> None:
    assert not spelled_by_ids(tokens, None, ["1 2"])  # and no error: the tokenizer refuses them in one line


@pytest.mark.parametrize("merges", [MERGES[:-1], [*MERGES, "a c"], [MERGES[1], MERGES[0], *MERGES[2:]],
                                    ["a b", "b c", "ab c", "a bc"], ("a b", "b c", "a bc", "ab c")],
                         ids=["one missing", "one more", "reordered", "reordered within a token", "not a list"])
def test_merges_that_differ_anywhere_are_not_spelled_by_ids(merges: list[str]) -> None:
    assert spelled_by_ids(TOKENS, None, MERGES)
    assert not spelled_by_ids(TOKENS, None, merges)


def test_derived_merges_read_as_the_list() -> None:
    merges = DerivedMerges(TOKENS, None, len(MERGES))
    assert len(merges) == 4 and merges == MERGES and list(merges) == MERGES and merges[1:3] == MERGES[1:3]
    with pytest.raises(ValueError, match="does not spell"):
        list(DerivedMerges(TOKENS, None, 5))


def _by_ids(md: dict) -> Tokenizer:
    tokens, types, merges = (md[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges"))
    return Tokenizer.from_metadata({**md, "tokenizer.ggml.merges": DerivedMerges(tokens, types, len(merges))})


def test_ranking_by_ids_tokenizes_as_the_files_ranks() -> None:
    md = synthetic_tokenizer_metadata("llama3", 128256)
    by_ranks, by_ids = Tokenizer.from_metadata(md), _by_ids(md)
    assert by_ids._rank is None and by_ranks._rank is not None
    want = by_ranks.encode(WORDS)
    assert by_ids.encode(WORDS) == want and sum(i > 1000 for i in want) > len(want) // 3


def test_ranking_by_ids_merges_into_ordinary_tokens_only() -> None:
    # "ab" is a control token: no merge makes it, though its pieces are ordinary.
    md = synthetic_tokenizer_metadata("gpt2", 300)
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    tokens[299], types[299] = "ab", TOKEN_CONTROL
    md["tokenizer.ggml.merges"] = derive(tokens, types)
    assert "a b" not in md["tokenizer.ggml.merges"]
    assert _by_ids(md).encode("ab cab", add_bos=False) == Tokenizer.from_metadata(md).encode("ab cab", add_bos=False)


def test_ranking_by_ids_in_any_id_order() -> None:
    """Ids that do not follow the tokens' lengths, so that long tokens can merge before their parts: every run of "a"
    and "b" up to four long in a shuffled order, and every word of up to nine."""
    md = synthetic_tokenizer_metadata("gpt2", 300)
    runs = ["".join(p) for n in range(2, 5) for p in itertools.product("ab", repeat=n)]
    random.Random(1).shuffle(runs)
    tokens = [t for t in md["tokenizer.ggml.tokens"] if len(t) == 1] + runs
    md.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [TOKEN_NORMAL] * len(tokens),
               "tokenizer.ggml.merges": derive(tokens, None), "tokenizer.ggml.pre": "gpt-2",
               "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0})
    by_ranks, by_ids = Tokenizer.from_metadata(md), _by_ids(md)
    words = ["".join(p) for n in range(1, 10) for p in itertools.product("ab", repeat=n)]
    assert [by_ids.encode(w, add_bos=False) for w in words] == [by_ranks.encode(w, add_bos=False) for w in words]
