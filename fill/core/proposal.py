"""The proposal layer: what a fill source sees, what it returns, and the per-request session.

A :class:`ProposalSource` looks at the decode state (:class:`DecodeView`) after each emitted
token and may propose the ids of the next slots. ``assert`` proposals are written into the
cache without sampling (only for spans the template/schema and parser state determine);
``verify`` proposals are checked against the target's own samples and the rejected tail is
rewound. The decode loop applies both through the one append-and-rewind primitive.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import (IO, TYPE_CHECKING, Any, Callable, Collection, Literal, Protocol, Sequence,
                    runtime_checkable)

if TYPE_CHECKING:
    from .plan import DispatchPlan

Policy = Literal["assert", "verify"]
# the one refusal name for image/audio input (counted by the session and by the decode loop)
MEDIA_REFUSAL = "media"
# ids one proposal may hold (a session's cap; ``MLX_FILL_MAX_SPAN`` overrides it per process)
DEFAULT_MAX_SPAN = 64
# A session that caps in deficit (``FillSession(cap_in_deficit=True)``, as ``build_session``
# makes every request's) risks no more than its request has saved plus DEFICIT one-row forwards:
# a verify proposal holds at most the ids whose worst outcome (every id rejected that its
# round's rows are fed for) leaves the request's balance at -DEFICIT or above, and DEFICIT_SPAN
# ids whatever the balance. A long draft priced on estimates learned over other requests and
# rejected after an id or two costs several forwards at once, which a short reply never earns
# back; accepted rounds raise the balance, and the spans with it.
DEFICIT = 2.0
DEFICIT_SPAN = 4


@dataclass(frozen=True)
class DecodeView:
    """Read-only decode state handed to sources.

    ``prompt`` is the full rendered prompt (cached prefix included); ``emitted`` every token
    yielded so far in this turn, injected ones included. The next proposal's first id is for
    the slot right after ``emitted[-1]`` (or after the prompt when nothing was emitted).
    ``pending`` is True when ``emitted[-1]`` was sampled by a fill round and is not yet in the
    target's cache (it will lead the forward that checks the proposal); sources that read the
    target's hidden state at the last position must propose nothing then.
    """

    prompt: Sequence[int]
    emitted: Sequence[int]
    eos_ids: frozenset[int] = frozenset()
    pending: bool = False

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.emitted]


@dataclass(frozen=True)
class Proposal:
    """Ids for the next slots. ``origin`` names the source/row (telemetry, ledger, trace);
    ``certainty`` is a compiled strict row's class (``determined`` / ``likely``, see
    :func:`mlx_fill.strict.rows.certainty`), None for sources that are not compiled rows.
    ``yields``: a guess that gives way to any later source's proposal for the same view
    (:meth:`FillSession.propose`)."""

    ids: tuple[int, ...]
    policy: Policy
    origin: str
    certainty: str | None = None
    yields: bool = False

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError("a proposal needs at least one id")
        if self.policy not in ("assert", "verify"):
            raise ValueError(f"unknown policy {self.policy!r}")


@dataclass(frozen=True)
class Round:
    """One fill round as a plan prices it: ``chained`` (the view's last sample was still pending,
    so it leads the feed), ``policy`` (``verify`` or ``assert``), ``proposed`` ids and how many
    were ``accepted``; ``kv``: the KV length its rows were appended at, None: the plan's
    ``cost_kv``. A chained round feeds the sample and the ids and emits the sample and the kept
    ids; a view-end round (its first id in the slot whose sample is in flight) feeds the ids in
    place of that sample's plain step and emits the kept ones, or, its first id rejected by that
    sample, runs nothing and has only made decoding wait."""

    chained: bool
    policy: Policy
    proposed: int
    accepted: int
    kv: int | None = None

    @property
    def rows(self) -> int:
        """Rows its forward ran: 0 for a view-end verify draft whose first id disagreed with
        the in-flight sample (rejected before any forward)."""
        if self.policy == "verify" and not self.chained and self.accepted == 0:
            return 0
        return self.proposed + int(self.chained)

    @property
    def emitted(self) -> int:
        """Tokens the round yielded (the leading sample of a chained round included)."""
        kept = self.proposed if self.policy == "assert" else self.accepted
        return (kept + int(self.chained)) if self.rows else 0


@runtime_checkable
class ProposalSource(Protocol):
    """A fill source. ``propose`` must be cheap and must not mutate the view.

    ``feedback`` reports how many leading ids of a proposal were committed (all of an
    ``assert`` proposal that was applied; the verified prefix of a ``verify`` proposal).
    """

    name: str

    def propose(self, view: DecodeView) -> Proposal | None: ...

    def feedback(self, proposal: Proposal, accepted: int) -> None: ...


@dataclass
class Pace:
    """The rate a round must beat, in expected emitted tokens per one-row forward of cost: 1.0
    for a sequence decoding alone (plain decoding emits one token per forward). The batched
    lane raises it to what the batch's own step delivers (a side step stalls the batch). One
    per request, shared by the session and its sources' cost gates. ``round_overhead`` is what
    a round costs beyond its rows (:attr:`~mlx_fill.core.plan.DispatchPlan.round_overhead`
    in the serial loop, whose plain steps are pipelined; 0 in ``mlx_lm.server``, which waits
    for every step in both of its lanes). ``first_in_flight``: whether the proposal asked for
    now starts at the slot whose sample is in flight (a view's end, :attr:`DecodeView.pending`
    False): its first id must match that sample and buys nothing by itself
    (:func:`~mlx_fill.core.cost.choose_length`); the session sets it for every view, and
    ``kv_length``, the KV length the round's rows would be appended at (the view's prompt and
    emitted ids), which c(M) depends on (:meth:`~mlx_fill.core.plan.DispatchPlan.cost_of`)."""

    min_gain: float = 1.0
    round_overhead: float = 0.0
    first_in_flight: bool = False
    kv_length: int | None = None


@dataclass
class FillStats:
    """Per-request telemetry, reported as ``usage.fill``."""

    emitted: int = 0
    forwards: int = 0
    injected: int = 0
    events: int = 0
    wasted_samples: int = 0
    verify_proposed: int = 0
    verify_accepted: int = 0
    verify_rejected: int = 0
    refusals: Counter = field(default_factory=Counter)
    source_errors: Counter = field(default_factory=Counter)
    parse_fallbacks: int = 0
    checkpoint_ms: float = 0.0
    source_ms: float = 0.0  # wall time inside the sources' propose/feedback (the bookkeeping)
    by_origin: Counter = field(default_factory=Counter)
    by_certainty: Counter = field(default_factory=Counter)  # committed ids per strict row class
    proposed_by_origin: Counter = field(default_factory=Counter)  # ids proposed, by origin
    # offers a source's cost gate priced out (not worth the rows of a verify), by origin
    declined_by_origin: Counter = field(default_factory=Counter)

    @property
    def forwards_saved(self) -> int:
        return max(0, self.emitted - self.forwards)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["refusals"] = dict(self.refusals)
        d["source_errors"] = dict(self.source_errors)
        d["by_origin"] = dict(self.by_origin)
        d["by_certainty"] = dict(self.by_certainty)
        d["proposed_by_origin"] = dict(self.proposed_by_origin)
        d["declined_by_origin"] = dict(self.declined_by_origin)
        d["forwards_saved"] = self.forwards_saved
        d["checkpoint_ms"] = round(self.checkpoint_ms, 3)
        d["source_ms"] = round(self.source_ms, 3)
        return d


class FillSession:
    """Per-request fill state: sources in priority order, caps, telemetry and trace.

    A source that raises is disarmed for the rest of the request (counted in
    ``stats.source_errors``); generation continues without it. ``allow_assert`` is False at
    temperature > 0 unless explicitly enabled, in which case ``assert`` proposals are dropped.
    ``compete``: names of sources asked together, the model-free roster, whose gates each price
    their own draft (as far as it pays), so the longest ``verify`` proposal among them, the one
    whose evidence reaches furthest, is made (the earlier source's of equal ones), and the others
    are withdrawn (``withdraw()``: a declined draft, scored as a shadow). ``cap_in_deficit``:
    verify proposals are cut to what the request can risk (:meth:`_verify_cap`: its ``balance``
    and :data:`DEFICIT`, priced by ``plan``).
    """

    def __init__(
        self,
        sources: Sequence[ProposalSource],
        *,
        prompt_ids: Sequence[int] | None = None,
        eos_ids: Sequence[int] = (),
        plan: "DispatchPlan | None" = None,
        max_span: int = DEFAULT_MAX_SPAN,
        allow_assert: bool = True,
        trace: IO[str] | None = None,
        pace: Pace | None = None,
        compete: Collection[str] = (),
        cap_in_deficit: bool = False,
    ) -> None:
        """``prompt_ids``: the full rendered prompt (the decode loop may only see the suffix
        after a prompt-cache hit); ``plan``: the dispatch plan (``build_session`` resolves it once per
        request; None: the decode loop resolves it with ``resolve.plan_for(model)``)."""
        self.sources = list(sources)
        self.prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.plan = plan
        self.max_span = max_span
        self.allow_assert = allow_assert
        self.trace = trace
        self.pace = pace if pace is not None else Pace()
        self.compete = frozenset(compete)
        self.cap_in_deficit = cap_in_deficit
        self.stats = FillStats()
        # one-row forwards the request's verify rounds saved so far against plain decoding, as
        # the plan prices them (negative: they cost more than they emitted)
        self.balance = 0.0
        # the ids the consumer received, in order (the decode loop's list, shared: written only
        # where a token is emitted)
        self.emitted_ids: list[int] = []
        self.refused: str | None = None
        # a sharded model's agreement (:class:`~mlx_fill.core.shared.SharedRounds`), set by
        # ``build_session``; None on one machine
        self.shared: Any = None
        # gives back what the session borrowed from its server (a conversation's index), run
        # once by ``end_session``; None when it borrowed nothing
        self.release: Callable[[], None] | None = None
        self._begun = False  # whether a decode took this session (:meth:`begin`)
        for src in self.sources:  # sources that report their own counters (parse fallbacks)
            if hasattr(src, "bind_stats"):
                src.bind_stats(self.stats)

    def begin(self) -> None:
        """Take the session for its one request's decode. ValueError when a decode already
        took it: its telemetry, balance and sources' state are that request's, so a second
        decode would report both as one and propose from the first one's state."""
        if self._begun:
            raise ValueError("fill: this FillSession already served a request; build one per "
                             "request (build_session)")
        self._begun = True

    def refuse(self, reason: str) -> None:
        """Turn fill off for this request with a counted reason (e.g. ``logprobs``)."""
        self.refused = reason
        self.stats.refusals[reason] += 1

    def propose(self, view: DecodeView) -> Proposal | None:
        """The first usable proposal of the armed sources in priority order (of the competing
        sources', the longest), cut at EOS and ``max_span``; None for a view that ends with an
        end id (a chained view led by the sample that ends the sequence: nothing follows it). A
        proposal that ``yields`` is made only when no later source proposes (those sources are
        asked for this view as if it had not been made)."""
        if self.refused is not None or (view.emitted and view.emitted[-1] in view.eos_ids):
            return None
        self.pace.first_in_flight = not view.pending
        self.pace.kv_length = len(view.prompt) + len(view.emitted)
        t0 = time.perf_counter()
        try:
            return self._propose(view)
        finally:
            self.stats.source_ms += (time.perf_counter() - t0) * 1e3

    def _propose(self, view: DecodeView) -> Proposal | None:
        held = None  # the first yielding proposal, made if no later source proposes
        drafts: list[tuple[ProposalSource, Proposal]] = []  # the competing sources' verify spans
        verify_cap = self._verify_cap()
        for src in list(self.sources):
            competes = src.name in self.compete
            if drafts and not competes:
                break
            try:
                p = src.propose(view)
            except Exception as e:  # a broken source must never break generation
                self._disarm(src, e)
                continue
            if p is None:
                continue
            if p.policy == "assert" and not self.allow_assert:
                continue
            ids = list(p.ids[: verify_cap if p.policy == "verify" else self.max_span])
            for i, t in enumerate(ids):
                if t in view.eos_ids:
                    ids = ids[:i]
                    break
            if not ids:
                continue
            if p.policy == "assert" and not self._assert_pays(len(ids)):
                continue
            p = p if len(ids) == len(p.ids) else replace(p, ids=tuple(ids))
            if competes and p.policy == "verify":
                drafts.append((src, p))
            elif not p.yields:
                return self._made(p, drafts, None)
            else:
                held = held or p
        if drafts:
            maker, p = max(drafts, key=lambda d: len(d[1].ids))  # the first of equal lengths
            return self._made(p, drafts, maker)
        return held

    def _made(self, p: Proposal, drafts: list[tuple[ProposalSource, Proposal]],
              maker: ProposalSource | None) -> Proposal:
        """``p``, after withdrawing the competing drafts of every source but ``maker``."""
        for src, _ in drafts:
            withdraw = getattr(src, "withdraw", None)
            if src is maker or withdraw is None:
                continue
            try:
                withdraw()
            except Exception as e:  # a broken source must never break generation
                self._disarm(src, e)
        return p

    def _disarm(self, src: ProposalSource, err: Exception) -> None:
        """Drop ``src``, which raised ``err``, for the rest of the request, counted in
        ``stats.source_errors``."""
        self.stats.source_errors[f"{src.name}:{type(err).__name__}"] += 1
        self.sources.remove(src)

    def _drop_trace(self, err: OSError | ValueError) -> None:
        """Stop tracing after a failed write (a full disk; a file already closed, as
        :func:`~mlx_fill.session.end_session` leaves it), saying so once on stderr."""
        reason = getattr(err, "strerror", None) or str(err).rstrip(".")
        print(f"mlx-fill: trace not written ({reason}); tracing stops for this request",
              file=sys.stderr, flush=True)
        try:
            self.trace.close()
        except OSError:
            pass
        self.trace = None

    def _verify_cap(self) -> int:
        """The most ids a verify proposal may hold in this view: ``max_span``; with
        ``cap_in_deficit`` and a plan, the longest span, counting up from ``DEFICIT_SPAN``,
        whose worst outcome among rounds that run their rows (a chained round emitting only its
        pending sample, a view-end round only its first id) leaves ``balance`` at ``-DEFICIT``
        or above; ``DEFICIT_SPAN`` where none does."""
        if not self.cap_in_deficit or self.plan is None:
            return self.max_span
        worst_kept = int(self.pace.first_in_flight)

        def risks(m: int) -> bool:  # whether a span of m ids may lose more than the room
            return self.balance + self._saved(m, worst_kept) < -DEFICIT

        if not risks(self.max_span):
            return self.max_span
        m = min(self.max_span, DEFICIT_SPAN)
        while m < self.max_span and not risks(m + 1):
            m += 1
        return m

    def _saved(self, proposed: int, accepted: int) -> float:
        """One-row forwards a verify round of ``proposed`` ids in this view, ``accepted`` of
        them kept, saves against plain decoding as the plan prices it
        (:meth:`DispatchPlan.round_saving`; 0 without a plan), the round chained where the
        view ends with its pending sample."""
        if self.plan is None:
            return 0.0
        r = Round(not self.pace.first_in_flight, "verify", proposed, accepted, self.pace.kv_length)
        return self.plan.round_saving(r, self.pace.round_overhead)

    def _assert_pays(self, m: int) -> bool:
        """Whether asserting ``m`` ids (``m`` rows in the plan's chunks plus the round's
        overhead, every id emitted) beats ``pace``. Always at ``min_gain <= 1`` with no round
        overhead (feeding ``m`` ids at once costs no more than one by one); never above that
        without a plan to price it."""
        if self.pace.min_gain <= 1.0 and self.pace.round_overhead <= 0.0:
            return True
        if self.plan is None:
            return False
        rows = self.plan.rows_cost(m, self.pace.kv_length)
        return m / (rows + self.pace.round_overhead) > self.pace.min_gain

    def feedback(self, proposal: Proposal, accepted: int, position: int) -> None:
        """Record the outcome; forward it to the source that made the proposal."""
        t0 = time.perf_counter()
        s = self.stats
        s.events += 1
        s.by_origin[proposal.origin] += accepted
        s.proposed_by_origin[proposal.origin] += len(proposal.ids)
        if proposal.certainty is not None:
            s.by_certainty[proposal.certainty] += accepted
        if proposal.policy == "assert":
            s.injected += accepted
        else:
            s.verify_proposed += len(proposal.ids)
            s.verify_accepted += accepted
            s.verify_rejected += len(proposal.ids) - accepted
            s.injected += accepted
            self.balance += self._saved(len(proposal.ids), accepted)
        for src in self.sources:
            if proposal.origin == src.name or proposal.origin.startswith(src.name + ":"):
                try:
                    src.feedback(proposal, accepted)
                except Exception as e:  # a broken source must never break generation
                    self._disarm(src, e)
                break
        if self.trace is not None:
            event = {"t": time.time(), "position": position, "origin": proposal.origin,
                     "policy": proposal.policy, "ids": list(proposal.ids), "accepted": accepted}
            if proposal.certainty is not None:
                event["certainty"] = proposal.certainty
            try:
                self.trace.write(json.dumps(event) + "\n")
            except (OSError, ValueError) as e:  # a full disk, a closed file: never the generation
                self._drop_trace(e)
        s.source_ms += (time.perf_counter() - t0) * 1e3
