"""The echo tier: a growing k-gram index over the request's tokens, and the echo source on it.

:class:`EchoIndex` holds one token sequence (prompt + every committed token, injected ones
included: the model cannot tell them apart, so neither does the index) and, for each anchor
length ``k``, a map from the k-gram ending at position ``i`` to the ascending list of such ``i``.
Appending is O(len(ks)) per token; :meth:`EchoIndex.sync` reuses the indexed prefix of a new
prompt (a multi-turn conversation re-sends its history), so a session is indexed once.
The same index backs ``ngram`` and the per-request tree of ``suffix``.

:func:`echo_span` is the lookup: the trailing k-gram's NEAREST earlier occurrences (at most
``candidates``) are followed forward while every one of them continues with the same token
(branch-point stopping); the span stops at a fork, at ``max_span``, or right after a delimiter
token when ``delimiters`` is given. ``corroboration`` counts the occurrences that agreed over the
whole span: a single occurrence is a copy, not a pattern.

:class:`EchoSource` is the fill source (policy ``verify``; ``assert`` only for corroborated,
delimiter-ended spans whose row the evidence ledger has promoted, and never at temperature > 0).
:class:`EchoDraft` is the same lookup as a :class:`~mlx_fill.spec.base.DraftSource`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Sequence

from .proposal import DecodeView, Proposal

DEFAULT_KS = (1, 2, 3, 4, 8)


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


@dataclass(frozen=True)
class EchoSpan:
    """One echo lookup. ``branch_stop``: the occurrences forked right after the span;
    ``at_delimiter``: the span ends with a delimiter token; ``corroboration``: occurrences that
    agreed over the whole span; ``anchor``: the k-gram length that matched."""

    ids: tuple[int, ...]
    anchor: int
    corroboration: int
    branch_stop: bool
    at_delimiter: bool


def echo_span(
    index: EchoIndex,
    *,
    anchors: Sequence[int] = (8, 4, 2),
    candidates: int = 4,
    max_span: int = 32,
    delimiters: Collection[int] = frozenset(),
) -> EchoSpan | None:
    """Branch-point-stopped continuation of the longest anchor in ``anchors`` that recurs."""
    seq = index.seq
    n = len(seq)
    for k in anchors:
        occ = index.nearest(k, candidates)
        if not occ:
            continue
        ids: list[int] = []
        live = occ
        agreed = 0
        branch = at_delim = False
        for j in range(1, max_span + 1):
            live = [e for e in live if e + j < n]
            if not live:
                break
            tok = seq[live[0] + j]
            if any(seq[e + j] != tok for e in live[1:]):
                branch = True
                break
            ids.append(tok)
            agreed = len(live)
            if tok in delimiters:
                at_delim = True
                break
        if ids:
            return EchoSpan(tuple(ids), k, agreed, branch, at_delim)
    return None


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


class EchoDraft(IndexedDraft):
    """The echo lookup as a :class:`~mlx_fill.spec.base.DraftSource` over a (possibly shared)
    :class:`EchoIndex`. ``stats`` (if given) records shadow acceptance (see ``spec.cost``)."""

    def __init__(self, index: EchoIndex | None = None, *, name: str = "echo",
                 anchors: Sequence[int] = (8, 4, 2), candidates: int = 4, max_span: int = 32,
                 delimiters: Collection[int] = frozenset()):
        super().__init__(index if index is not None else EchoIndex(), name)
        self.anchors = tuple(anchors)
        self.candidates = candidates
        self.max_span = max_span
        self.delimiters = frozenset(delimiters)
        self.last_span: EchoSpan | None = None

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        self.advance(feed)
        if n <= 0:
            self.last_span = None
            return []
        span = echo_span(self.index, anchors=self.anchors, candidates=self.candidates,
                         max_span=min(n, self.max_span), delimiters=self.delimiters)
        self.last_span = span
        return list(span.ids) if span else []

    def confidence(self) -> tuple:
        """Key of the last draft for calibrated scoring: (anchor, corroboration up to 3,
        ended at a delimiter)."""
        s = self.last_span
        return (s.anchor, min(s.corroboration, 3), s.at_delimiter) if s else ()


class EchoSource:
    """The echo tier as a fill :class:`~mlx_fill.proposal.ProposalSource`.

    Proposes ``verify`` spans. A span is proposed as ``assert`` only when ``assert_allowed()``
    is true (the evidence ledger promoted row ``echo:corroborated`` for this model/template),
    the view is at temperature 0, and the span is corroborated by >= 2 occurrences, had no
    branch stop and ends at a delimiter. Feedback on corroborated ``verify`` spans is reported
    to ``record(origin, agreed)`` (the ledger), agreement iff every id was accepted.
    With a ``gate`` (:class:`~mlx_fill.spec.cost.CostGate`) the span length is the cost
    model's choice, and rounds it declines are scored as shadow drafts.
    """

    def __init__(self, draft: EchoDraft, *, gate=None,
                 assert_allowed: Callable[[], bool] = lambda: False,
                 record: Callable[[str, bool], None] | None = None):
        self.draft = draft
        self.name = draft.name
        self.gate = gate
        self._assert_allowed = assert_allowed
        self._record = record
        self._prompt_len = -1
        self._seen = 0

    def propose(self, view: DecodeView) -> Proposal | None:
        if self._prompt_len < 0:
            self.draft.prefill(view.prompt)
            self._prompt_len = len(view.prompt)
        feed = view.emitted[self._seen:]
        self._seen = len(view.emitted)
        n = self.draft.max_span
        if self.gate is not None:
            self.gate.begin(feed)
            n = self.gate.length()
        ids = self.draft.draft(feed, n if n > 0 else self.draft.max_span)
        span = self.draft.last_span
        if n <= 0:
            self.gate.shadow(ids)
            return None
        if not ids or span is None:
            return None
        corroborated = span.corroboration >= 2 and not span.branch_stop and span.at_delimiter
        if corroborated and view.temperature == 0 and self._assert_allowed():
            return Proposal(span.ids, "assert", f"{self.name}:corroborated")
        return Proposal(span.ids, "verify", f"{self.name}:corroborated" if corroborated
                        else self.name)

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        if proposal.policy != "verify":
            return
        if self.gate is not None:
            self.gate.observe(len(proposal.ids), accepted)
        if self._record is not None and proposal.origin.endswith(":corroborated"):
            self._record(proposal.origin, accepted == len(proposal.ids))
