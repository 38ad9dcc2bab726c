"""Byte-level BPE merges that a vocabulary's own token ids spell, so that a load need not rank them from the file.

A vocabulary converted from tiktoken (Llama 3 and so BitNet b1.58 2B-4T, GLM-4...) has no merge list of its own:
the converter writes, for each ordinary token in id order, every split of it into two ordinary tokens, ordered by
the left piece's id and then the right's. Merging by those ranks is merging by the key (merged id, left id, right
id), which three lookups in the token map give (`Tokenizer`). Building the rank table of Llama 3's 280k merges
took 36-45 ms of a 0.31 s load, and splitting their strings out of the load cache 14 ms more.

Whether a file's merges are exactly these is checked once, when the load cache records the file (`spelled_by_ids`,
~0.3 s for Llama 3's vocabulary, and it stops at the first merge that differs); a hit then hands the tokenizer a
`DerivedMerges`, which makes the strings only if something reads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

TOKEN_NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL


def _ordinary_ids(tokens: Sequence[str], types: Sequence[int] | None) -> dict[str, int] | None:
    """The ordinary tokens' ids, by text; None when the merge keys would not be one-to-one with the merges: two tokens
    spell the same text (the token map keeps only one), one is empty, or an ordinary one holds a space (then "a b" +
    "c" and "a" + "b c" write the same merge)."""
    if types is not None and len(types) < len(tokens):
        return None
    ids = {t: i for i, t in enumerate(tokens)}
    normal = [True] * len(tokens) if types is None else [t == TOKEN_NORMAL for t in types]
    if len(ids) != len(tokens) or "" in ids or any(" " in t for t, i in ids.items() if normal[i]):
        return None
    return {t: i for t, i in ids.items() if normal[i]}


def _by_token(ordinary: dict[str, int]) -> Iterator[list[str]]:
    """Each ordinary token's merges in rank order, token by token (the map keeps its insertion order: ids')."""
    get = ordinary.get
    for t in ordinary:
        if len(t) > 1:
            splits = [(left, right, k) for k in range(1, len(t))
                      if (left := get(t[:k])) is not None and (right := get(t[k:])) is not None]
            splits.sort()
            yield [f"{t[:k]} {t[k:]}" for _, _, k in splits]


def derive(tokens: Sequence[str], types: Sequence[int] | None) -> list[str] | None:
    """The merges ("left right", in rank order) that a tiktoken conversion writes for this vocabulary (its
    normal-typed tokens; all of them without types), or None when they would not rank as their ids do."""
    ordinary = _ordinary_ids(tokens, types)
    return None if ordinary is None else [m for chunk in _by_token(ordinary) for m in chunk]


def spelled_by_ids(tokens: Any, types: Any, merges: Any) -> bool:
    """Whether `merges` is exactly `derive`'s list for these tokens (each argument as metadata holds it)."""
    if (not all(isinstance(v, list) for v in (tokens, merges)) or not isinstance(types, (list, type(None)))
            or set(map(type, tokens)) != {str}):  # (a corrupt file's tokens are the tokenizer's to refuse)
        return False
    ordinary = _ordinary_ids(tokens, types)
    if ordinary is None:
        return False
    at = 0
    for chunk in _by_token(ordinary):
        if merges[at:at + len(chunk)] != chunk:
            return False
        at += len(chunk)
    return at == len(merges)


class DerivedMerges(Sequence[str]):
    """The merges of a vocabulary whose file was checked to hold exactly `derive`'s list. The tokenizer ranks them
    by ids and never reads them; anything else that does gets them made then."""

    def __init__(self, tokens: Sequence[str], types: Sequence[int] | None, count: int) -> None:
        self.tokens, self.types, self._count = tokens, types, count
        self._list: list[str] | None = None

    def _merges(self) -> list[str]:
        if self._list is None:
            merges = derive(self.tokens, self.types)
            if merges is None or len(merges) != self._count:
                raise ValueError("the vocabulary does not spell the merges it was recorded with")
            self._list = merges
        return self._list

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self._merges()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._merges())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]
