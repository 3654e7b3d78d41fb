"""The shared id index: one token sequence (prompt + every committed id) with a k-gram index.

:class:`EchoIndex` holds one token sequence (prompt + every committed token, injected ones
included: the model cannot tell them apart, so neither does the index) and, for each anchor
length ``k``, a map from the k-gram ending at position ``i`` to the ascending list of such ``i``.
Appending is O(len(ks)) per token; :meth:`EchoIndex.sync` reuses the indexed prefix of a new
prompt (a multi-turn conversation re-sends its history), so a session is indexed once.
It backs ``echo``, ``ngram`` and the per-request tree of ``suffix``; :class:`IndexedDraft` is
the one face through which those sources keep a shared index equal to prompt + committed ids.
:class:`IndexStore` keeps a server's indexes between requests, so a conversation's next request
syncs the index its last one left instead of indexing its whole history again.
"""

from __future__ import annotations

import threading

from typing import Iterable, Sequence

DEFAULT_KS = (1, 2, 3, 4, 8)
# how far a lookup on the index follows its occurrences unless told (echo, the roster's members,
# the corpus study); a session caps every proposal at its own ``max_span`` on top
LOOKUP_MAX_SPAN = 32


class EchoIndex:
    """A growing token sequence with a k-gram -> end-positions index for each ``k`` in ``ks``.

    Invariant: for every k, ``positions(key)`` lists ascending every ``i`` (``i >= k - 1``) with
    ``seq[i-k+1:i+1] == key``. Keys of length 1 are the bare token id.
    """

    def __init__(self, ks: Iterable[int] = DEFAULT_KS, tokens: Sequence[int] = ()):
        self.ks: tuple[int, ...] = tuple(sorted(set(int(k) for k in ks)))
        if not self.ks or self.ks[0] < 1:
            raise ValueError(f"anchor lengths must be >= 1, got {ks!r}")
        self.seq: list[int] = []
        self._maps: dict[int, dict] = {k: {} for k in self.ks}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.seq)

    def _key(self, k: int, end: int):
        return self.seq[end] if k == 1 else tuple(self.seq[end - k + 1:end + 1])

    def append(self, token: int) -> None:
        seq = self.seq
        seq.append(int(token))
        end = len(seq) - 1
        for k in self.ks:
            if end + 1 < k:
                break
            key = seq[end] if k == 1 else tuple(seq[end - k + 1:])
            bucket = self._maps[k].get(key)
            if bucket is None:
                self._maps[k][key] = [end]
            else:
                bucket.append(end)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def truncate(self, n: int) -> None:
        """Drop every position ``>= n`` (O(dropped * len(ks)))."""
        while len(self.seq) > n:
            end = len(self.seq) - 1
            for k in self.ks:
                if end + 1 < k:
                    break
                m = self._maps[k]
                key = self._key(k, end)
                bucket = m[key]
                bucket.pop()
                if not bucket:
                    del m[key]
            self.seq.pop()

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest common prefix of the indexed sequence and ``tokens``."""
        lo, hi = 0, min(len(self.seq), len(tokens))
        if list(tokens[:hi]) == self.seq[:hi]:
            return hi
        while lo < hi:  # invariant: prefix of length lo agrees, of length hi+1 does not
            mid = (lo + hi + 1) // 2
            if list(tokens[lo:mid]) == self.seq[lo:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the indexed sequence equal ``tokens``, keeping the common prefix."""
        keep = self.common_prefix(tokens)
        self.truncate(keep)
        self.extend(tokens[keep:])

    def advance_to(self, length: int, feed: Sequence[int]) -> None:
        """Bring the index to ``length`` tokens whose last ``len(feed)`` are ``feed``.

        Idempotent across the sources sharing this index in one request: only the part of
        ``feed`` the index does not hold yet is appended."""
        have = len(self.seq)
        if have > length:
            raise ValueError(f"index holds {have} tokens, source expects {length}")
        missing = length - have
        if missing > len(feed):
            raise ValueError(f"index is {missing} tokens behind but the feed has {len(feed)}")
        if missing:
            self.extend(feed[len(feed) - missing:])

    def positions(self, k: int, key) -> list[int]:
        return self._maps[k].get(key, [])

    def tail_key(self, k: int):
        n = len(self.seq)
        if n < k:
            return None
        return self.seq[-1] if k == 1 else tuple(self.seq[n - k:])

    def nearest(self, k: int, limit: int) -> list[int]:
        """Up to ``limit`` earlier ends of the trailing k-gram, nearest first (the trailing
        occurrence itself excluded)."""
        key = self.tail_key(k)
        if key is None:
            return []
        bucket = self._maps[k].get(key)
        if not bucket:
            return []
        last = len(self.seq) - 1
        out = bucket[-limit - 1:]
        out.reverse()
        if out and out[0] == last:
            del out[0]
        return out[:limit]


# an IndexStore's bounds: the ids its indexes hold together (an index costs 300-900 bytes an
# id: about 320 on agent transcripts, 600 on source code), and how many it keeps
STORE_INDEX_IDS = 400_000
STORE_INDEXES = 8


class IndexStore:
    """A server's conversation indexes between requests (one model's ids), most recently given
    last.

    An index is given back with the length of the prompt it served (:meth:`give`, when its
    request ends), and a request takes the index whose served prompt its own prompt extends,
    the one that keeps the most of it (:meth:`take`; the caller syncs it to the prompt): a
    conversation's next request indexes only what it added, its last reply re-indexed from where
    the prompt renders it otherwise (a template that drops reasoning from the history). An index
    whose served prompt this one departs from (another conversation sharing a system prompt, or
    a history rewritten) is left for its own conversation, and the request gets a new one. A
    taken index is out of the store until it is given back, so no two live requests share one.
    Bounded by ``max_ids`` ids and ``max_indexes`` indexes, the least recently given dropped
    first; an index over ``max_ids`` alone is not kept. Thread-safe."""

    def __init__(self, max_ids: int = STORE_INDEX_IDS, max_indexes: int = STORE_INDEXES) -> None:
        self.max_ids = max_ids
        self.max_indexes = max_indexes
        self._kept: list[tuple[EchoIndex, int]] = []  # (index, the length of its served prompt)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, prompt: Sequence[int]) -> EchoIndex:
        """The stored index whose served prompt ``prompt`` extends that keeps the most of it
        (removed from the store), or a new one where there is none."""
        with self._lock:
            best, kept = None, 0
            for place, (index, served) in enumerate(self._kept):
                keep = index.common_prefix(prompt)
                if keep >= served and keep > kept:
                    best, kept = place, keep
            return EchoIndex() if best is None else self._kept.pop(best)[0]

    def give(self, index: EchoIndex, served: int) -> None:
        """Keep ``index``, which served a prompt of ``served`` ids, for the requests that follow,
        within the bounds (an index the store holds already is not kept twice)."""
        with self._lock:
            if len(index) > self.max_ids or any(held is index for held, _ in self._kept):
                return
            self._kept.append((index, served))
            while (len(self._kept) > self.max_indexes
                   or sum(len(held) for held, _ in self._kept) > self.max_ids):
                self._kept.pop(0)


class IndexedDraft:
    """Base of the draft sources that look up a (possibly shared) :class:`EchoIndex`.

    Invariant kept here: after :meth:`prefill` and every :meth:`advance`, the index holds
    exactly prompt + every fed id (what the target has committed), even when another source
    sharing the index already advanced it or a rewind truncated it. Lookups hold no per-draft
    state that a rejection would invalidate, so :meth:`commit` has nothing to undo."""

    def __init__(self, index: EchoIndex, name: str):
        self.index = index
        self.name = name
        self._n = 0

    def prefill(self, prompt: Sequence[int]) -> None:
        self.index.sync(prompt)
        self._n = len(prompt)

    def advance(self, feed: Sequence[int]) -> None:
        """Account for ``feed`` (ids committed since the last call)."""
        self._n += len(feed)
        self.index.advance_to(self._n, feed)

    def commit(self, drafted: Sequence[int], accepted: int) -> None:
        return None
