"""Splitting special-token texts out of a text before tokenization (llama.cpp's tokenizer_st_partition)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable


class SpecialTokens:
    """The special tokens one kind of encode matches, and the matching itself."""

    def __init__(self, tokens: list[str], ids: Iterable[int]) -> None:
        """`ids` in ascending order: the sort below is stable, so any subset keeps llama.cpp's order."""
        self.tokens = tokens
        # llama.cpp's cache_special_tokens: longest text first, so "<|eot_id|>" is split out
        # before any shorter special token it contains.
        order = sorted(ids, key=lambda i: -len(tokens[i].encode()))
        self._rank = {tid: r for r, tid in enumerate(order)}
        self._ids: defaultdict[str, list[int]] = defaultdict(list)  # text -> its ids
        for tid in order:
            self._ids[tokens[tid]].append(tid)
        # first character -> lengths of the special texts starting with it: finds which texts
        # occur without trying all of them (Llama-3 has 256, padded vocabularies 100k+).
        first: defaultdict[str, set[int]] = defaultdict(set)
        for text in self._ids:
            first[text[0]].add(len(text))
        self._lengths = {c: sorted(n) for c, n in first.items()}

    def partition(self, text: str) -> list[str | int]:
        """Text fragments and special-token ids, in order. As in llama.cpp, special tokens are
        taken longest first, each one splitting every text fragment left by the previous ones."""
        if not text:
            return []
        frags: list[str | int] = [text]
        for tid in self._occurring(text):
            needle = self.tokens[tid]
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or needle not in f:
                    new.append(f)
                    continue
                for k, part in enumerate(f.split(needle)):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _occurring(self, text: str) -> list[int]:
        """The special tokens whose text occurs in `text`, in matching order (a fragment is a
        substring of the text, so no other special token can match)."""
        found: set[int] = set()
        for pos, c in enumerate(text):
            for n in self._lengths.get(c, ()):
                found.update(self._ids.get(text[pos : pos + n], ()))
        return sorted(found, key=self._rank.__getitem__)
