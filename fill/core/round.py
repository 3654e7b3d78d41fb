"""The round executor: one proposal applied to one sequence's cache, for both decode lanes.

A *round* starts at the slot whose target sample is known but not yet in the cache (the
in-flight sample of a plain step, or the sample a previous round drew). Both the serial loop
(:mod:`mlx_fill.core.loop`) and the batched side step
(:mod:`mlx_fill.adapters.server.batch_fill`) run every round through this module:

- :class:`Asking` decides when the session is asked and what it is shown: every emitted id ends
  a view once; a view's proposal starts at the in-flight sample's slot (a ``verify`` span must
  start with that sample, an ``assert`` span replaces it); a *chained* view ends with the
  sample itself (``pending``), which then leads the span: after a round, and after a view-end
  proposal the sample disagreed with.
- :func:`execute` appends the lead and the span with one call of the append-and-rewind
  primitive, asserts the span or verifies it row by row (the one acceptance rule,
  :mod:`mlx_fill.core.acceptance`), rewinds what is not kept and records the forwards,
  checkpoint time and wasted samples; :func:`settle` reports the outcome to the session.

Invariants: after :func:`execute` the cache holds exactly the entry state plus
:attr:`Outcome.ids`; every kept id that the proposal did not assert is a target sample; the
sample it returns is the target's sample after the last kept id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import mlx.core as mx

from .acceptance import Sampler, process_row, verify_rows
from .plan import DispatchPlan
from .primitive import Checkpoint, append, cache_offset, checkpoint, rewind
from .proposal import DecodeView, FillSession, FillStats, Proposal


@dataclass(frozen=True)
class Sample:
    """A target sample not yet in the cache: ``token`` (shape ``[1]``, possibly still being
    computed) and the log-probabilities ``[V]`` it was drawn from."""

    token: mx.array
    logprobs: mx.array

    @property
    def id(self) -> int:
        return int(self.token.item())


@dataclass(frozen=True)
class Round:
    """One proposal applied at output index ``start`` (the slot of ``sample``).

    ``sample`` is the target's sample for that slot, not in the cache. In a ``chained`` round it
    leads the span (fed first, always kept, emitted first). Otherwise an ``assert`` span
    replaces it (a wasted sample) and a ``verify`` span starts with it. ``proposal`` holds the
    ids capped to ``cap`` (what fits before the sequence's token limit; None: no limit)."""

    proposal: Proposal
    sample: Sample
    chained: bool
    start: int
    cap: int | None

    @property
    def lead(self) -> list[int]:
        """The ids fed before the proposal's: the pending sample in a chained round."""
        return [self.sample.id] if self.chained else []

    @property
    def feed(self) -> list[int]:
        return self.lead + list(self.proposal.ids)

    @property
    def position(self) -> int:
        """Output index of the proposal's first id (what feedback and traces report)."""
        return self.start + len(self.lead)

    def wants_next(self, kept: int) -> bool:
        """Whether a sample after ``kept`` proposal ids is still needed (the limit not reached)."""
        return self.cap is None or kept < self.cap


def make_round(proposal: Proposal, sample: Sample, chained: bool, start: int,
               remaining: int | None) -> Round:
    """The round for ``proposal``, its ids capped so lead and span fit ``remaining`` slots."""
    cap = None if remaining is None else remaining - int(chained)
    ids = proposal.ids if cap is None else proposal.ids[:cap]
    return Round(replace(proposal, ids=tuple(ids)), sample, chained, start, cap)


class Asking:
    """When one sequence's session is asked for a proposal, and what it is shown.

    ``shown`` is the longest output prefix (emitted ids, plus a pending sample) the session was
    shown as a whole view: every emitted id ends a view once, so a slot offered in a chained
    view is not offered again after that sample is emitted."""

    def __init__(self, session: FillSession, prompt_ids: Sequence[int],
                 propose: Callable[[DecodeView], Proposal | None] | None = None):
        self.session = session
        self.prompt_ids = prompt_ids
        self.propose = propose or session.propose
        self.shown = 0

    def at_sample(self, emitted: Sequence[int], sample: Sample,
                  remaining: int | None) -> Round | None:
        """The round for the in-flight ``sample``'s slot after ``emitted`` (not chained), or
        None. A ``verify`` proposal whose first id disagrees with the sample is reported as
        rejected here, before any forward. Reading the sample was a sync, so the chained
        round that sample leads (:meth:`after_sample`) is asked for at once: its draft is
        looked up with the sample known, and its forward replaces the step that would have
        fed the sample."""
        if self.shown >= len(emitted) or remaining == 0:
            return None
        self.shown = len(emitted)
        proposal = self.propose(DecodeView(self.prompt_ids, emitted, self.session.eos_ids))
        if proposal is None:
            return None
        rnd = make_round(proposal, sample, False, len(emitted), remaining)
        if rnd.proposal.policy == "verify" and sample.id != rnd.proposal.ids[0]:
            self.session.feedback(rnd.proposal, 0, rnd.position)
            return self.after_sample(emitted, sample, remaining)
        return rnd

    def after_sample(self, emitted: Sequence[int], sample: Sample, remaining: int | None,
                     *, pending: bool = True) -> Round | None:
        """The chained round that ``sample`` (known, not in the cache) leads, or None (also
        when no slot is left after it). ``pending`` is what the view says of that sample
        (:attr:`DecodeView.pending`, which the cost gates price by). Every rank of a sharded
        model asks alike: nothing here depends on the session's own sources or end ids."""
        if remaining is not None and remaining <= 1:
            return None
        self.shown = len(emitted) + 1
        proposal = self.propose(DecodeView(self.prompt_ids, [*emitted, sample.id],
                                           self.session.eos_ids, pending=pending))
        if proposal is None:
            return None
        return make_round(proposal, sample, True, len(emitted), remaining)


def forced_logprobs(token: int, vocab: int) -> mx.array:
    """Log-probabilities ``[V]`` of an asserted token: the policy put all mass on it (lazy)."""
    return mx.where(mx.arange(vocab) == token, 0.0, -mx.inf)


class CacheView:
    """One sequence's cache as a round sees it: the target model, the cache, the plan, the
    request's sampler and logits processors with their history, and the session's stats.

    Invariant: ``history`` ends with the last id fed to the cache (None without processors),
    exactly as in mlx-lm's ``generate_step``."""

    def __init__(self, model, cache: list, plan: DispatchPlan, stats: FillStats, *,
                 sampler: Sampler, logits_processors: list | None,
                 history: mx.array | None = None,
                 quantize: Callable[[list], None] | None = None, replay: bool = False):
        self.model = model
        self.cache = cache
        self.plan = plan
        self.stats = stats
        self.sampler = sampler
        self.logits_processors = logits_processors
        self.history = history
        self.quantize = quantize
        self.replay = replay  # rewind by restore-and-replay (every rank of a sharded model alike)

    def remember(self, ids: Sequence[int]) -> None:
        """Grow the history by ids fed to the cache."""
        if self.logits_processors:
            dtype = self.history.dtype if self.history is not None else mx.uint32
            grown = mx.array(list(ids), dtype=dtype)
            self.history = grown if self.history is None else mx.concat([self.history, grown])

    def sample(self, row: mx.array) -> Sample:
        """Sample a ``[1, V]`` logits row after the current history (the acceptance rule's
        row processing)."""
        return Sample(*process_row(row, self.history, self.sampler, self.logits_processors))

    def forward(self, feed: list[int], rows: str) -> tuple[Checkpoint, mx.array | None]:
        """Append ``feed`` in plan-sized chunks, keeping a checkpoint to rewind to; ``rows``
        selects the logits rows returned (``all``, ``last`` or ``none``)."""
        t0 = time.perf_counter()
        cp = checkpoint(self.model, self.cache, self.plan)
        cp.replay = self.replay
        self.stats.checkpoint_ms += (time.perf_counter() - t0) * 1e3
        self.stats.forwards += len(self.plan.chunks(cache_offset(self.cache), len(feed)))
        return cp, append(self.model, self.cache, feed, plan=self.plan, logits=rows, record=cp,
                          after_chunk=self.quantize)

    def rewind(self, cp: Checkpoint, keep: int) -> None:
        t0 = time.perf_counter()
        rewind(cp, keep)
        self.stats.checkpoint_ms += (time.perf_counter() - t0) * 1e3


@dataclass
class Outcome:
    """What a round committed: ``ids`` (the lead first) with the log-probabilities ``[V]`` each
    was emitted with, the checkpoint the cache can be rewound to (``checkpoint.appended`` is
    ``ids``), whether a stop sequence ended the sequence inside them (``stopped``), and the
    target's sample after them (None when stopped or the round's cap is reached). ``failure``:
    what a logits processor raised on the row after ``ids``; the cache then also holds the id
    that row follows (``checkpoint.appended`` is ``ids`` and that id), as serial decoding's
    cache does when the step that feeds it raises, and the consumer is to get the failure
    after ``ids``."""

    ids: list[int]
    logprobs: list[mx.array]
    checkpoint: Checkpoint
    stopped: bool = False
    next: Sample | None = None
    failure: Exception | None = None


def execute(view: CacheView, rnd: Round,
            stop: Callable[[Sequence[int]], int | None] | None = None) -> Outcome:
    """Apply ``rnd`` to ``view``'s cache: append the lead and the span in one call of the
    primitive, assert the span or verify it, rewind what is not kept, and sample after it.

    ``stop(ids)``: how many of the committed ids the sequence takes, through the one that ends
    it (a stop sequence), or None when none does; without it every committed id is kept. A
    logits processor that raises where serial decoding meets it too (on the row after the
    committed ids) is the round's ``failure`` (:class:`Outcome`); an exception while the rows
    are appended and checked rewinds the round before it propagates."""
    feed = rnd.feed
    cp = None
    try:
        if rnd.proposal.policy == "assert":
            if not rnd.chained:
                view.stats.wasted_samples += 1
            rows_wanted = "last" if rnd.wants_next(len(rnd.proposal.ids)) else "none"
            cp, row = view.forward(feed, rows_wanted)
            committed = feed
            vocab = rnd.sample.logprobs.shape[-1]
            logprobs = ([rnd.sample.logprobs] if rnd.chained else []) + [
                forced_logprobs(t, vocab) for t in rnd.proposal.ids]
            failure = None
        else:
            cp, rows = view.forward(feed, "all")
            verdict = verify_rows(rows, feed, view.history, view.sampler, view.logits_processors)
            committed = feed[:verdict.accepted]
            logprobs = [rnd.sample.logprobs, *verdict.row_logprobs[:verdict.accepted - 1]]
            failure = verdict.failure
    except BaseException:
        if cp is not None:
            view.rewind(cp, 0)
        raise
    fed = committed  # what the cache keeps: the emitted ids, and the one a failure's row follows
    if failure is not None:
        committed = committed[:-1]
    ended = None if stop is None else stop(committed)
    if ended is not None:
        failure = None
        committed = fed = committed[:ended]
    view.rewind(cp, len(fed))
    view.remember(fed)
    out = Outcome(committed, logprobs[:len(committed)], cp, stopped=ended is not None,
                  failure=failure)
    if out.stopped or failure is not None or not rnd.wants_next(len(committed) - len(rnd.lead)):
        return out
    if rnd.proposal.policy == "assert":
        try:
            out.next = view.sample(row)
        except Exception as e:  # serial decoding's step that feeds the last id raises alike
            out.ids, out.logprobs, out.failure = committed[:-1], out.logprobs[:-1], e
            return out
    else:
        out.next = Sample(mx.array([verdict.next_token], dtype=rnd.sample.token.dtype),
                          verdict.next_logprobs)
    mx.async_eval(out.next.token, out.next.logprobs)
    return out


def settle(session: FillSession, rnd: Round, received: int) -> None:
    """Report ``rnd``'s outcome to the session: the proposal's share of the ``received`` ids
    (the lead is the target's, not the proposal's)."""
    session.feedback(rnd.proposal, max(0, received - len(rnd.lead)), rnd.position)
