"""The echo tier: lookups on the shared id index (:class:`~mlx_fill.core.index.EchoIndex`)
and the echo source on it.

:func:`echo_span` is the lookup: the trailing k-gram's NEAREST earlier occurrences (at most
``candidates``) are followed forward while every one of them continues with the same token
(branch-point stopping); the span stops at a fork, at ``max_span``, or right after a delimiter
token when ``delimiters`` is given. ``corroboration`` counts the occurrences that agreed over the
whole span: a single occurrence is a copy, not a pattern.

:class:`EchoSource` is the fill source (policy ``verify``; ``assert`` only for corroborated,
delimiter-ended spans whose row the evidence ledger has promoted; the session drops every
``assert`` above temperature 0).
:class:`EchoDraft` is the same lookup as a :class:`~mlx_fill.spec.base.DraftSource`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Sequence

from mlx_fill.core.index import LOOKUP_MAX_SPAN, EchoIndex, IndexedDraft
from mlx_fill.core.proposal import DecodeView, Proposal


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
    max_span: int = LOOKUP_MAX_SPAN,
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


class EchoDraft(IndexedDraft):
    """The echo lookup as a :class:`~mlx_fill.spec.base.DraftSource` over a (possibly shared)
    :class:`EchoIndex`. ``stats`` (if given) records shadow acceptance (see ``core.cost``)."""

    def __init__(self, index: EchoIndex | None = None, *, name: str = "echo",
                 anchors: Sequence[int] = (8, 4, 2), candidates: int = 4, max_span: int = LOOKUP_MAX_SPAN,
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
    """The echo tier as a fill :class:`~mlx_fill.core.proposal.ProposalSource`.

    Proposes ``verify`` spans. A span is proposed as ``assert`` only when ``assert_allowed()``
    is true (the evidence ledger promoted row ``echo:corroborated`` for this model/template)
    and the span is corroborated by >= 2 occurrences, had no
    branch stop and ends at a delimiter. Feedback on corroborated ``verify`` spans is reported
    to ``record(origin, agreed)`` (the ledger), agreement iff every id was accepted; a span the
    session cut short (at an end id or its span cap) is no evidence.
    With a ``gate`` (:class:`~mlx_fill.core.cost.CostGate`) every span is priced under its own
    key (:meth:`EchoDraft.confidence`: anchor, corroboration, delimiter end): the gate keeps
    the prefix that pays, and a span it declines is scored as a shadow draft. A cut span is
    never ``corroborated`` (it no longer ends where the occurrences agreed).
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
        self._corroborated: tuple[int, ...] = ()  # the last corroborated span proposed whole

    def propose(self, view: DecodeView) -> Proposal | None:
        if self._prompt_len < 0:
            self.draft.prefill(view.prompt)
            self._prompt_len = len(view.prompt)
        feed = view.emitted[self._seen:]
        self._seen = len(view.emitted)
        if self.gate is not None:
            self.gate.begin(feed)
        ids = self.draft.draft(feed, self.draft.max_span)
        span = self.draft.last_span
        if not ids or span is None:
            return None
        n = len(ids)
        if self.gate is not None:
            n = self.gate.offer(ids, self.draft.confidence())
            if n <= 0:
                return None
        corroborated = (n == len(span.ids) and span.corroboration >= 2 and not span.branch_stop
                        and span.at_delimiter)
        self._corroborated = span.ids if corroborated else ()
        if corroborated and self._assert_allowed():
            return Proposal(span.ids, "assert", f"{self.name}:corroborated")
        return Proposal(span.ids[:n], "verify", f"{self.name}:corroborated" if corroborated
                        else self.name)

    def withdraw(self) -> None:
        """The span just proposed was not made (another source's was): scored as a shadow."""
        if self.gate is not None:
            self.gate.withdraw()

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        if proposal.policy != "verify":
            return
        if self.gate is not None:
            self.gate.observe_proposed(len(proposal.ids), accepted)
        if (self._record is not None and proposal.origin.endswith(":corroborated")
                and proposal.ids == self._corroborated):  # evidence only for the whole span
            self._record(proposal.origin, accepted == len(proposal.ids))
