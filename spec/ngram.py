"""``ngram``: prompt-lookup decoding (Saxena's PLD; vLLM/llama.cpp ``ngram``) as a DraftSource.

The longest trailing n-gram, ``n`` from ``n_max`` down to ``n_min``, that occurred earlier in
prompt + output is matched; the up to ``k`` tokens that followed that occurrence are the draft.
``occurrence="first"`` takes the earliest occurrence (the reference PLD behaviour, used for the
study's baseline row); ``"last"`` the most recent one, which suits agents that revisit what they
just read. Lookups use the shared :class:`~mlx_fill.sources.echo.EchoIndex`, so they are O(1) in the
context length (the reference implementation rescans the whole context every step).
"""

from __future__ import annotations

from typing import Literal, Sequence

from mlx_fill.core.index import EchoIndex, IndexedDraft

Occurrence = Literal["first", "last"]


def prompt_lookup(index: EchoIndex, *, n_min: int = 1, n_max: int = 3, k: int = 10,
                  occurrence: Occurrence = "last") -> list[int]:
    """The draft for the current end of ``index`` (empty when no n-gram recurs)."""
    return prompt_lookup_n(index, n_min=n_min, n_max=n_max, k=k, occurrence=occurrence)[0]


def prompt_lookup_n(index: EchoIndex, *, n_min: int, n_max: int, k: int,
                    occurrence: Occurrence) -> tuple[list[int], int]:
    """(draft, matched n-gram length); n is 0 when nothing matched."""
    seq = index.seq
    last = len(seq) - 1
    for n in range(n_max, n_min - 1, -1):
        key = index.tail_key(n)
        if key is None:
            continue
        bucket = index.positions(n, key)
        if len(bucket) < 2:
            continue
        end = bucket[0] if occurrence == "first" else (
            bucket[-2] if bucket[-1] == last else bucket[-1])
        draft = seq[end + 1:end + 1 + k]
        if draft:
            return draft, n
    return [], 0


class NgramDraft(IndexedDraft):
    """Prompt lookup over a (possibly shared) :class:`EchoIndex` whose ``ks`` include
    ``n_min..n_max``."""

    def __init__(self, index: EchoIndex | None = None, *, name: str = "ngram", n_min: int = 1,
                 n_max: int = 3, k: int = 10, occurrence: Occurrence = "last"):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}..{n_max}")
        if occurrence not in ("first", "last"):
            raise ValueError(f"occurrence must be 'first' or 'last', got {occurrence!r}")
        super().__init__(index if index is not None else EchoIndex(range(n_min, n_max + 1)), name)
        missing = set(range(n_min, n_max + 1)) - set(self.index.ks)
        if missing:
            raise ValueError(f"index lacks n-gram lengths {sorted(missing)}")
        self.n_min, self.n_max, self.k = n_min, n_max, k
        self.occurrence: Occurrence = occurrence
        self.last_n = 0

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        self.advance(feed)
        if n <= 0:
            self.last_n = 0
            return []
        ids, self.last_n = prompt_lookup_n(self.index, n_min=self.n_min, n_max=self.n_max,
                                           k=min(n, self.k), occurrence=self.occurrence)
        return ids

    def confidence(self) -> int:
        """Key of the last draft for calibrated scoring: the matched n-gram length."""
        return self.last_n
