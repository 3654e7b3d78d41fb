"""The model-free roster: builds ``echo``, ``ngram`` and ``suffix`` fill sources for a request.

All sources of one request share one :class:`~mlx_fill.sources.echo.EchoIndex` (the index is idempotent
under several readers of the same token stream). With a ``plan`` each source's round length is
chosen by its own :class:`~mlx_fill.core.cost.CostGate` from the plan's cost curve; with
``plan=None`` every round proposes up to ``max_span`` ids (the corpus study's oracle setting).
"""

from __future__ import annotations

from typing import Any, Collection, Hashable, Sequence

from mlx_fill.core.index import LOOKUP_MAX_SPAN, EchoIndex
from mlx_fill.sources.echo import EchoDraft, EchoSource
from mlx_fill.sources.ledger import Ledger
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import Pace, ProposalSource
from .base import DraftProposalSource, DraftSource
from mlx_fill.core.cost import CostGate, DraftAcceptance
from .ngram import NgramDraft
from .suffix import GlobalSuffixTree, SuffixDraft, SuffixParams

NAMES = ("echo", "ngram", "suffix")
ECHO_ORIGIN = "echo:corroborated"


class GatedDraft:
    """A model-free DraftSource priced per draft: every round drafts up to the gate's
    ``max_len``, the gate chooses how much of that draft pays from the estimate for its key
    (the source's ``confidence()``), a declined draft is kept as a shadow, and verified rounds
    feed the estimate of the key they were proposed under."""

    def __init__(self, source: DraftSource, gate: CostGate):
        self.source = source
        self.gate = gate
        self.name = source.name

    def prefill(self, prompt: Sequence[int]) -> None:
        self.source.prefill(prompt)

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        self.gate.begin(feed)
        ids = self.source.draft(feed, self.gate.max_len)
        if not ids:
            return []
        return ids[:min(n, self.gate.offer(ids, draft_key(self.source)))]

    def commit(self, drafted: Sequence[int], accepted: int) -> None:
        self.gate.observe_proposed(len(drafted), accepted)
        self.source.commit(drafted, accepted)

    def withdraw(self) -> None:
        self.gate.withdraw()


def draft_key(source: Any) -> Hashable:
    """The key a draft is priced under: the source's description of its last draft
    (``confidence()``), or the source-wide estimate when it gives none."""
    confidence = getattr(source, "confidence", None)
    return confidence() if confidence is not None else ()


def delimiter_ids(delimiters: Collection[int | str], tokenizer: Any) -> frozenset[int]:
    """Token ids for ``delimiters`` given as ids or as strings that encode to one token."""
    out: set[int] = set()
    for d in delimiters:
        if isinstance(d, int):
            out.add(d)
            continue
        ids = tokenizer.encode(d, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"delimiter {d!r} is not a single token ({ids})")
        out.add(int(ids[0]))
    return frozenset(out)


def make_sources(
    names: Sequence[str],
    *,
    plan: DispatchPlan | None,
    tokenizer: Any = None,
    prompt_ids: Sequence[int] = (),
    delimiters: Collection[int | str] = (),
    global_tree: GlobalSuffixTree | None = None,
    ledger: Ledger | None = None,
    index: EchoIndex | None = None,
    max_span: int = LOOKUP_MAX_SPAN,
    ngram_k: int = 10,
    acceptance: dict | None = None,
    pace: Pace | None = None,
) -> list[ProposalSource]:
    """Fill sources for ``names`` (a subset of :data:`NAMES`, in priority order).

    ``global_tree`` is the server's cross-request suffix store (create it once per server);
    ``ledger`` gates ``assert`` promotion of corroborated echo spans (row ``echo:corroborated``,
    only if the ledger lists it as eligible); ``index`` lets a caller reuse a conversation's
    index across requests (it is synced to ``prompt_ids`` here). ``acceptance`` is a
    server-lifetime dict that keeps each source's acceptance statistics across requests (the
    cost gates' estimates); without it every request starts from the prior.
    ``pace``: the request's bar, shared by the gates built here (:class:`~mlx_fill.core.proposal.Pace`).
    """
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown model-free sources {unknown}; known: {list(NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate source names in {list(names)}")
    delim = delimiter_ids(delimiters, tokenizer) if delimiters else frozenset()
    if index is None:
        index = EchoIndex()
    index.sync(prompt_ids)

    def gate(max_len: int, name: str) -> CostGate | None:
        return None if plan is None else source_gate(plan, max_len, name, acceptance=acceptance,
                                                     pace=pace)

    out: list[ProposalSource] = []
    for name in names:
        if name == "echo":
            promoted = (lambda: ledger.asserts(ECHO_ORIGIN)) if ledger is not None else (lambda: False)
            out.append(EchoSource(EchoDraft(index, max_span=max_span, delimiters=delim),
                                  gate=gate(max_span, name), assert_allowed=promoted,
                                  record=ledger.record if ledger is not None else None))
            continue
        src: DraftSource
        if name == "ngram":
            src, cap = NgramDraft(index, k=ngram_k), ngram_k
        else:
            src, cap = SuffixDraft(index, global_tree=global_tree,
                                   params=SuffixParams(max_spec=max_span)), max_span
        g = gate(cap, name)
        out.append(DraftProposalSource(src if g is None else GatedDraft(src, g),
                                       length=lambda cap=cap: cap))
    return out


def source_gate(plan: DispatchPlan, max_len: int, name: str, *, acceptance: dict | None,
                pace: Pace | None, z: float = 1.0) -> CostGate:
    """Source ``name``'s cost gate on ``plan`` against ``pace``, over its per-draft estimates
    priced ``z`` standard errors low (:class:`~mlx_fill.core.cost.DraftAcceptance`): kept in
    ``acceptance`` (a server-lifetime dict) when given, else fresh for this request."""
    kept = {} if acceptance is None else acceptance
    key = (name, "gate")
    if key not in kept:
        kept[key] = DraftAcceptance(max_len, z=z)
    return CostGate(plan, max_len, pace=pace, acceptance=kept[key])
