"""``suffix``: SuffixDecoding-style drafting (Oliaro et al., arXiv 2411.04975) as a DraftSource.

Two sources of evidence, as in the paper: the request itself (prompt + output, the shared
:class:`~mlx_fill.sources.echo.EchoIndex`) and a cross-request store of earlier responses
(:class:`GlobalSuffixTree`, one per server, bounded, FIFO eviction).

The suffix tree is kept implicitly, the way a suffix array represents one: the node for a context
string ``s`` is the set of positions where ``s`` occurred, and a child's count is how many of
those occurrences continue with that token. Occurrences are gathered from the k-gram buckets of
the trailing context (nearest ``candidates``, longest anchor first; shorter anchors only while
fewer than ``candidates`` were found) and each is given its match
length (how many trailing tokens agree, up to ``max_depth``). For each of the ``max_nodes``
longest distinct match lengths ``L`` the node is the candidates matching at least ``L`` tokens;
the draft follows the most frequent child while the running product of
``count(child) / count(node)`` stays >= ``min_prob``, for at most
``min(max_spec, alpha * L + offset)`` tokens (the paper's adaptive length). The draft
with the highest score (sum of those probabilities) over all ``L`` and both stores wins.
Frequencies are therefore estimated over the nearest occurrences, not all of them: recent
evidence is what an agent repeats, and it keeps every lookup O(candidates * span).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from mlx_fill.core.index import EchoIndex, IndexedDraft

_END_BITS = 32
STORE_TOKENS = 2_000_000  # a cross-request store's default bound in ids (~0.3 GB per million)
STORE_TOKENS_CEILING = 1_000_000_000  # the largest bound a server takes (flag or environment)
STORE_IDS_PER_RESPONSE = 200  # its bound in responses: one per this many ids of its bound


@dataclass(frozen=True)
class SuffixParams:
    max_spec: int = 32
    alpha: float = 1.0
    offset: float = 0.0
    min_prob: float = 0.1
    max_depth: int = 64
    candidates: int = 8
    anchors: tuple[int, ...] = (8, 4, 2, 1)
    global_anchors: tuple[int, ...] = (8, 4, 2)
    max_nodes: int = 4


@dataclass(frozen=True)
class SuffixDraftResult:
    ids: tuple[int, ...]
    score: float
    match_len: int
    store: str  # "request" or "global"


def _match_len(seq: Sequence[int], end: int, ctx: list[int], depth: int, known: int = 0) -> int:
    """How many tokens ending at ``seq[end]`` equal the tail of ``ctx`` (at most ``depth``);
    the caller guarantees the first ``known`` agree."""
    n = len(ctx)
    limit = depth if depth < end + 1 else end + 1
    if n < limit:
        limit = n
    m = known if known < limit else limit
    while m + 8 <= limit and seq[end - m - 7:end - m + 1] == ctx[n - m - 8:n - m]:
        m += 8
    while m < limit and seq[end - m] == ctx[n - 1 - m]:
        m += 1
    return m


def _walk(node: list[tuple[Sequence[int], int]], limit: int, min_prob: float
          ) -> tuple[list[int], float]:
    """Follow the most frequent child from ``node`` (occurrence ends) while the running
    probability stays >= ``min_prob``; returns (ids, score)."""
    ids: list[int] = []
    prob = 1.0
    score = 0.0
    for j in range(1, limit + 1):
        toks = [s[e + j] for s, e in node if e + j < len(s)]
        if not toks:
            break
        tok = toks[0]
        c = toks.count(tok)
        if c != len(toks):
            tok, c = Counter(toks).most_common(1)[0]
        prob *= c / len(node)
        if prob < min_prob:
            break
        ids.append(tok)
        score += prob
        if c != len(node):
            node = [(s, e) for s, e in node if e + j < len(s) and s[e + j] == tok]
    return ids, score


def speculate(cands: list[tuple[Sequence[int], int, int]], p: SuffixParams,
              budget: int) -> tuple[list[int], float, int]:
    """Best path draft over ``cands`` = (sequence, end, match_len) triples; returns
    (ids, score, match length of the winning node)."""
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    if not cands:
        return best
    ordered = sorted(cands, key=lambda c: -c[2])
    i = 0
    tried = 0
    while i < len(ordered) and tried < p.max_nodes:
        tried += 1
        L = ordered[i][2]
        while i < len(ordered) and ordered[i][2] == L:
            i += 1
        if L <= 0:
            break
        limit = min(budget, p.max_spec, int(p.alpha * L + p.offset))
        ids, score = _walk([(s, e) for s, e, _ in ordered[:i]], limit, p.min_prob)
        if score > best[1]:
            best = (ids, score, L)
    return best


class GlobalSuffixTree:
    """Earlier responses across requests (server lifetime): bounded by ``max_responses``
    (default: one per :data:`STORE_IDS_PER_RESPONSE` ids of ``max_tokens``) and ``max_tokens``,
    oldest response evicted first. Each response is stored with the last
    ``context_tokens`` ids of its prompt in front, so the opening of a reply has context.

    Responses grow incrementally (``open``/``extend``), each in its own document, so concurrent
    requests never interleave. Bucket entries of evicted documents are skipped on lookup and
    dropped by compaction once they outnumber live ones (memory stays O(live tokens)).
    """

    def __init__(self, *, max_responses: int | None = None, max_tokens: int = STORE_TOKENS,
                 ks: Sequence[int] = (1, 2, 4, 8), context_tokens: int = 8):
        if max_responses is None:
            max_responses = max(1, max_tokens // STORE_IDS_PER_RESPONSE)
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self.ks = tuple(sorted(set(ks)))
        self.context_tokens = context_tokens
        self.docs: OrderedDict[int, list[int]] = OrderedDict()
        self._maps: dict[int, dict] = {k: {} for k in self.ks}
        self._next_id = 1
        self._tokens = 0
        self._entries = 0
        self._dead = 0
        self.generation = 0  # bumped when compaction moves bucket entries (:class:`OwnRuns`)

    def __len__(self) -> int:
        return self._tokens

    @property
    def next_doc(self) -> int:
        """The id the next :meth:`open` returns (a mark for :meth:`forget_since`)."""
        return self._next_id

    def forget_since(self, mark: int) -> None:
        """Drop every response opened since ``mark`` (a :attr:`next_doc` value): lookups then
        find what they found at the mark, less any evicted since. Ids are never reused, so
        the dropped responses' bucket entries are skipped until compaction removes them."""
        for doc_id in [d for d in self.docs if d >= mark]:
            self._drop(self.docs.pop(doc_id))
        self._evict()

    def seed(self, responses: Iterable[tuple[Sequence[int], Sequence[int]]]) -> None:
        """Add finished responses, each ``(prompt ids before it, its ids)``, in order, as if
        this server had served them (within its bounds: the oldest are evicted first)."""
        for prompt, ids in responses:
            self.extend(self.open(prompt), ids)

    def _drop(self, doc: list[int]) -> None:
        self._tokens -= len(doc)
        self._dead += sum(max(0, len(doc) - k + 1) for k in self.ks)

    def open(self, prompt_tail: Sequence[int]) -> int:
        """Start a response document; returns its id."""
        doc_id = self._next_id
        self._next_id += 1
        self.docs[doc_id] = []
        tail = list(prompt_tail[-self.context_tokens:]) if self.context_tokens else []
        self.extend(doc_id, tail)
        self._evict()
        return doc_id

    def extend(self, doc_id: int, tokens: Sequence[int]) -> None:
        doc = self.docs.get(doc_id)
        if doc is None:  # evicted while the request was still running
            return
        for t in tokens:
            doc.append(int(t))
            end = len(doc) - 1
            for k in self.ks:
                if end + 1 < k:
                    break
                key = doc[end] if k == 1 else tuple(doc[end - k + 1:])
                bucket = self._maps[k].get(key)
                if bucket is None:
                    bucket = self._maps[k][key] = array("q")
                bucket.append((doc_id << _END_BITS) | end)
                self._entries += 1
        self._tokens += len(tokens)
        self._evict()

    def _evict(self) -> None:
        while self.docs and (len(self.docs) > self.max_responses or self._tokens > self.max_tokens):
            if len(self.docs) == 1:
                break
            self._drop(self.docs.popitem(last=False)[1])
        if self._dead > max(1024, self._entries - self._dead):
            self._compact()

    def _compact(self) -> None:
        live = self.docs
        for k, m in self._maps.items():
            for key in list(m):
                kept = array("q", (v for v in m[key] if (v >> _END_BITS) in live))
                if kept:
                    m[key] = kept
                else:
                    del m[key]
        self._entries = sum(len(b) for m in self._maps.values() for b in m.values())
        self._dead = 0
        self.generation += 1

    def candidates(self, ctx: list[int], exclude: int, p: SuffixParams,
                   own: "OwnRuns | None" = None) -> list[tuple[Sequence[int], int, int]]:
        """The nearest occurrences of the trailing k-grams of ``ctx`` in other documents than
        ``exclude``, as (document, end, match length). ``own``: the excluded document's
        :class:`OwnRuns`, kept by its caller, so that its own entries (the most recent of a
        bucket while its response is decoded) are stepped over once, not on every lookup."""
        found: dict[int, tuple[Sequence[int], int, int]] = {}
        n = len(ctx)
        if own is not None and own.generation != self.generation:
            own.runs.clear()
            own.generation = self.generation
        for k in p.global_anchors:
            if k not in self._maps or n < k:
                continue
            key = ctx[-1] if k == 1 else tuple(ctx[n - k:])
            bucket = self._maps[k].get(key)
            if not bucket:
                continue
            taken = 0
            i = len(bucket) - 1
            if own is not None:
                i = own.skip((k, key), bucket, exclude)
            for i in range(i, -1, -1):
                v = bucket[i]
                doc_id = v >> _END_BITS
                if doc_id == exclude or v in found:
                    continue
                doc = self.docs.get(doc_id)
                if doc is None:
                    continue
                end = v & ((1 << _END_BITS) - 1)
                found[v] = (doc, end, _match_len(doc, end, ctx, p.max_depth, k))
                taken += 1
                if taken >= p.candidates:
                    break
            if len(found) >= p.candidates:
                break
        return list(found.values())


class OwnRuns:
    """One document's runs of its own entries at the recent end of the store's buckets:
    ``runs[bucket key] = (start, end)``, bucket entries ``start .. end - 1`` all the document's
    (valid while the store's :attr:`GlobalSuffixTree.generation` is ``generation``: bucket
    entries move only in compaction). A lookup steps over the run in one jump, so a response
    that repeats a k-gram thousands of times costs its lookups O(new entries), not O(its
    length) each."""

    def __init__(self) -> None:
        self.runs: dict[tuple, tuple[int, int]] = {}
        self.generation = -1

    def skip(self, key: tuple, bucket: "array[int]", doc_id: int) -> int:
        """The last index of ``bucket`` below the document's own trailing entries (-1: none
        left), remembering the run for the next lookup."""
        end = len(bucket)
        i = end - 1
        start, run_end = self.runs.get(key, (0, 0))
        while i >= 0 and bucket[i] >> _END_BITS == doc_id:
            if i == run_end - 1:
                i = start - 1
                break
            i -= 1
        if i + 1 < end:
            self.runs[key] = (i + 1, end)
        return i


def request_candidates(index: EchoIndex, p: SuffixParams) -> list[tuple[Sequence[int], int, int]]:
    seq = index.seq
    found: dict[int, tuple[Sequence[int], int, int]] = {}
    for k in p.anchors:
        if k not in index.ks:
            continue
        for e in index.nearest(k, p.candidates):
            if e not in found:
                found[e] = (seq, e, _match_len(seq, e, seq, p.max_depth, k))
        if len(found) >= p.candidates:
            break
    return list(found.values())


class SuffixDraft(IndexedDraft):
    """SuffixDecoding over the request's :class:`EchoIndex` and an optional server-wide
    :class:`GlobalSuffixTree`; this request's response is added to the global tree as it is
    committed (and never matched against itself there)."""

    def __init__(self, index: EchoIndex | None = None, *, global_tree: GlobalSuffixTree | None = None,
                 name: str = "suffix", params: SuffixParams = SuffixParams()):
        super().__init__(index if index is not None else EchoIndex(), name)
        self.global_tree = global_tree
        self.params = params
        self._prompt_len = 0
        self._doc: int | None = None
        self._own = OwnRuns()
        self.last: SuffixDraftResult | None = None

    def prefill(self, prompt: Sequence[int]) -> None:
        super().prefill(prompt)
        self._prompt_len = len(prompt)
        if self.global_tree is not None:
            self._doc = self.global_tree.open(prompt)
            self._own = OwnRuns()

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        self.advance(feed)
        if self._doc is not None and feed:
            out_start = max(0, len(feed) - (self._n - self._prompt_len))
            self.global_tree.extend(self._doc, feed[out_start:])
        if n <= 0:
            self.last = None
            return []
        p = self.params
        ids, score, L = speculate(request_candidates(self.index, p), p, n)
        best = SuffixDraftResult(tuple(ids), score, L, "request")
        if self.global_tree is not None:
            gids, gscore, gL = speculate(
                self.global_tree.candidates(self.index.seq, self._doc or 0, p, self._own), p, n)
            if gscore > score:
                best = SuffixDraftResult(tuple(gids), gscore, gL, "global")
        self.last = best
        return list(best.ids)

    def confidence(self) -> tuple:
        """Key of the last draft for calibrated scoring: (store, match-length bucket,
        score bucket)."""
        r = self.last
        if r is None:
            return ()
        return (r.store, min(r.match_len.bit_length(), 6), min(int(r.score), 8))
