"""The cost model: how many ids to propose this round, priced for the draft at hand.

A verify round over ``m`` proposed ids runs one forward of ``m + extra_rows`` rows, which costs
``plan.cost_of(m + extra_rows, kv)`` one-row forwards at the KV length ``kv`` it appends at (the
loaded model's own ``qualify`` cost curve) plus the round's fixed overhead
(``Pace.round_overhead``: a round's forward is synchronous, a plain step is pipelined), and emits
``1 + sum_{j=1..m} prod_{i<j} q_i`` tokens in expectation, where ``q_i`` is the probability
that position ``i`` of THIS draft is accepted given every earlier one was (a draft that starts
at the slot whose sample is already in flight is priced without its first id:
:func:`choose_length`). Plain decoding emits one token per one-row forward, so a round is worth
running only when its expected tokens per unit cost exceed 1 (by :data:`PRICE_MARGIN`, for the
estimates' error); :func:`choose_length` returns the ``m`` maximizing that ratio, or 0 when no
``m`` beats plain decoding (a request never gets slower in expectation because a source is on).

Acceptance is estimated per draft, not per source: a source describes each draft by a hashable
*key* (echo: anchor length, corroboration, delimiter end; n-gram: matched length; suffix: match
and score buckets; prediction: in step with the output or re-anchored, and on what). Every key
has its own :class:`AcceptanceByPosition`, whose prior is its parent's estimate: a tuple key's
parent is the key without its last element, the shortest keys' the source-wide estimate
(:class:`DraftAcceptance`: back-off, so a key seen for the first time is priced like the drafts
it shares its coarser description with, and moves away from them as its own evidence arrives;
echo's anchor length alone then prices an anchor's new corroboration or delimiter case, not the
average of every anchor). A draft is priced on each position's estimate less one standard
error of the key's evidence (:meth:`AcceptanceByPosition.q_low`): choosing among many keys on
noisy estimates proposes exactly where they happen to be high. A source with one draft and no
choice among keys (a client's prediction) is priced on the estimate itself (``z = 0``).

:class:`CostGate` ties curve and estimates together for one source and one request (the
estimates may live across requests: pass the same :class:`DraftAcceptance`). Model-free sources
keep learning while proposing nothing: a declined draft is kept as a *shadow* and scored token by
token against what was emitted, so a source that stopped paying can earn its way back. The ids
of a draft beyond the prefix it proposed are scored the same way once that prefix is accepted,
so a key proposed short learns what a longer span would have earned.

In continuous batching the bar is higher: a side step for one sequence of a batch of ``B``
stalls all ``B``, whose batched step emits ``B`` tokens for ``c(B)``. A request's sources share
one :class:`~mlx_fill.core.proposal.Pace`, whose ``min_gain`` the batch sets to
:func:`batch_min_gain` before asking for a proposal; every gate, and the session's check of
assert spans, then demand that rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

from .plan import DispatchPlan
from .proposal import Pace


# A drafted round must beat its bar by this factor. Its price rests on estimates (the draft's
# acceptance, c(M), the round overhead: each measured with noise), and a round priced within
# their error of plain decoding stands to gain next to nothing against a real risk of losing.
# On chat prose, two-id n-gram drafts at a view's end, priced 1.03 at the prior, fired for every
# new key and were mostly rejected at their first id.
PRICE_MARGIN = 1.05


def pays(rate: float, min_gain: float) -> bool:
    """Whether a drafted round of expected ``rate`` (tokens per one-row forward) is worth
    running against the bar ``min_gain`` (:data:`PRICE_MARGIN` above it)."""
    return rate > min_gain * PRICE_MARGIN


class AcceptanceByPosition:
    """Running conditional acceptance per draft position.

    ``reached[i]`` counts rounds that proposed position ``i`` with every earlier position
    accepted; ``accepted[i]`` those that also accepted ``i``. Counts decay by ``decay`` per
    round (kept lazily: a new round weighs ``decay ** -rounds``). Without a ``parent``,
    ``q(i) = (accepted[i] + prior_a) / (reached[i] + prior_a + prior_b)``; with one, the prior
    is the parent's estimate with weight ``prior_a + prior_b``:
    ``q(i) = (accepted[i] + w * parent.q(i)) / (reached[i] + w)``.

    A round is recorded at once (:meth:`observe`) or position by position as its outcome
    becomes known (:meth:`open_round`, then :meth:`record` for positions 0, 1, ... in order).
    """

    def __init__(self, max_len: int = 64, *, decay: float = 0.98, prior_a: float = 1.0,
                 prior_b: float = 1.0, parent: "AcceptanceByPosition | None" = None,
                 z: float = 1.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_len = max_len
        self.decay = decay
        self.prior_a = prior_a
        self.prior_b = prior_b
        self.parent = parent
        self.z = z
        self._reached = [0.0] * max_len
        self._accepted = [0.0] * max_len
        self._w = 1.0
        self.rounds = 0

    def open_round(self) -> None:
        """Start a round: older rounds lose weight by ``decay``."""
        self._w /= self.decay
        if self._w > 1e150:
            self._reached = [r / self._w for r in self._reached]
            self._accepted = [a / self._w for a in self._accepted]
            self._w = 1.0
        self.rounds += 1

    def record(self, i: int, accepted: bool) -> None:
        """Position ``i`` of the open round was reached (every earlier one accepted) and was
        or was not accepted."""
        if i < self.max_len:
            self._reached[i] += self._w
            if accepted:
                self._accepted[i] += self._w

    def observe(self, drafted: int, accepted: int) -> None:
        """A round proposed ``drafted`` ids and the first ``accepted`` were accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} outside 0..{drafted}")
        self.open_round()
        for i in range(min(drafted, accepted + 1, self.max_len)):
            self.record(i, i < accepted)

    def q(self, i: int) -> float:
        return self._estimate(i)[0]

    def q_low(self, i: int) -> float:
        """``q(i)`` less ``z`` standard errors of its evidence,
        ``q - z sqrt(q (1 - q) / n)`` with ``n = reached[i] + prior_a + prior_b`` (decayed
        counts), at least 0. A gate that picks, among many keys, those whose estimates are
        high is wrong more often than the estimates say (the keys whose few observations
        happened to be lucky); pricing on this bound makes a key earn a long span with
        evidence, and leaves a key seen often priced at nearly its estimate."""
        q, n = self._estimate(i)
        if i >= self.max_len:
            return q
        return max(0.0, q - self.z * math.sqrt(q * (1.0 - q) / n))

    def _estimate(self, i: int) -> tuple[float, float]:
        """``(q(i), n)``: the estimate and its evidence ``n``, its denominator (0 past
        ``max_len``, where ``q`` is 0)."""
        if i >= self.max_len:
            return 0.0, 0.0
        w = self._w
        strength = self.prior_a + self.prior_b
        prior = self.parent.q(i) if self.parent is not None else self.prior_a / max(strength, 1e-12)
        n = self._reached[i] / w + strength
        return (self._accepted[i] / w + strength * prior) / n, n

    def survival(self, m: int) -> list[float]:
        """``s[j] = P(positions 0..j all accepted)`` for j < m, as a gate prices it: the
        product of :meth:`q_low` (of :meth:`q` when ``z = 0``)."""
        out, p = [], 1.0
        for i in range(m):
            p *= self.q_low(i)
            out.append(p)
            if p < 1e-6:
                out.extend([0.0] * (m - i - 1))
                break
        return out


def batch_min_gain(plan: DispatchPlan, batch: int) -> float:
    """Tokens per one-row forward of a batched step of ``batch`` one-token rows,
    ``batch / c(batch)`` on the plan's cost curve (1.0 alone): what a side step that stalls the
    batch must beat to not lower its throughput."""
    return batch / plan.cost_of(batch) if batch > 1 else 1.0


def round_costs(plan: DispatchPlan, max_len: int, extra_rows: int = 1,
                kv: int | None = None) -> list[float]:
    """``costs[m]`` = cost of a round proposing ``m`` ids at KV length ``kv``, in one-row-forward
    units: its ``m + extra_rows`` rows in the plan's chunks (:meth:`DispatchPlan.rows_cost`)."""
    return [1.0] + [plan.rows_cost(m + extra_rows, kv) for m in range(1, max_len + 1)]


# Round costs are priced at the KV length rounded down to a multiple of this: c(M) moves by
# well under 1% over it (it is affine in the KV length over thousands of ids).
KV_STEP = 256


class RoundCosts:
    """:func:`round_costs` of one plan, draft limit and extra rows at any KV length, computed
    once per :data:`KV_STEP` of KV length (once in all where c(M) does not depend on it)."""

    def __init__(self, plan: DispatchPlan, max_len: int, extra_rows: int = 1):
        self.plan, self.max_len, self.extra_rows = plan, max_len, extra_rows
        self._at: dict[int | None, list[float]] = {}

    def at(self, kv: int | None) -> list[float]:
        step = None if kv is None or not self.plan.kv_dependent else kv // KV_STEP * KV_STEP
        costs = self._at.get(step)
        if costs is None:
            costs = self._at[step] = round_costs(self.plan, self.max_len, self.extra_rows, step)
        return costs


def best_length(stats: AcceptanceByPosition, max_len: int, costs: Sequence[float],
                *, overhead: float = 0.0, first_in_flight: bool = False) -> tuple[int, float]:
    """``(m, rate)``: the round length ``1 <= m <= max_len`` with the most expected emitted
    tokens per unit cost and that rate, a round costing ``costs[m]`` (:func:`round_costs`) plus
    ``overhead``; ``(0, 1.0)`` when no length beats plain decoding's 1.0.

    ``first_in_flight``: the draft's first id is for the slot whose sample is already being
    computed (a view's end, not a chained round). That id only has to match the sample, so a
    round of ``m`` ids runs ``m - 1 + extra_rows`` rows and gains ``1 + sum_{j=1..m-1} s_j``
    tokens over the plain step it replaces; a first id that does not match costs that plain step
    plus ``overhead`` (decoding waited for the sample). Expected cost:
    ``1 + overhead + s_0 * (costs[m - 1] - 1)``. A one-id draft never pays there.
    """
    max_len = min(max_len, stats.max_len, len(costs) - 1)
    s = stats.survival(max_len)
    best_m, best_rate, total = 0, 1.0, 1.0
    for m in range(1, max_len + 1):
        if first_in_flight:
            total += s[m - 1] if m > 1 else 0.0
            rate = total / (1.0 + overhead + s[0] * (costs[m - 1] - 1.0))
        else:
            total += s[m - 1]
            rate = total / (costs[m] + overhead)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m, best_rate


def choose_length(plan: DispatchPlan, stats: AcceptanceByPosition, max_len: int,
                  *, extra_rows: int = 1, min_gain: float = 1.0, overhead: float = 0.0,
                  costs: Sequence[float] | None = None, first_in_flight: bool = False) -> int:
    """The round length maximizing expected emitted tokens per unit cost
    (:func:`best_length`); 0 when that ratio does not pay against ``min_gain`` (:func:`pays`;
    >= 1: never slower than plain decoding in expectation, with a margin for the estimates'
    error).
    ``costs`` (from :func:`round_costs`) saves re-reading the plan."""
    max_len = min(max_len, stats.max_len)
    if costs is None:
        costs = round_costs(plan, max_len, extra_rows)
    m, rate = best_length(stats, max_len, costs, overhead=overhead, first_in_flight=first_in_flight)
    return m if pays(rate, min_gain) else 0


def _parent(key: Hashable) -> Hashable:
    """A tuple key's prefix without its last element; any other key's parent is ``()``."""
    if isinstance(key, tuple) and len(key) > 1:
        return key[:-1]
    return ()


class DraftAcceptance:
    """Acceptance estimates of one source, per draft key: ``stats(key)`` is the key's
    :class:`AcceptanceByPosition`, backed off to its parent's (:func:`_parent`; the
    source-wide one, ``stats(())``, at the root). Every round updates its key and all of the
    key's ancestors. Keep one per source for a server's lifetime to carry what was
    learned across requests (it is a pure function of the drafts and the emitted ids). ``z``:
    how many standard errors below its estimate every table prices a position
    (:meth:`AcceptanceByPosition.q_low`)."""

    def __init__(self, max_len: int = 64, *, decay: float = 0.98, z: float = 1.0):
        self.max_len = max_len
        self.decay = decay
        self.z = z
        self.source = AcceptanceByPosition(max_len=max_len, decay=decay, z=z)
        self._by_key: dict[Hashable, AcceptanceByPosition] = {}

    def stats(self, key: Hashable = ()) -> AcceptanceByPosition:
        if key == ():
            return self.source
        st = self._by_key.get(key)
        if st is None:
            parent = self.stats(_parent(key))
            st = self._by_key[key] = AcceptanceByPosition(max_len=self.max_len, decay=self.decay,
                                                          parent=parent, z=self.z)
        return st

    def tables(self, key: Hashable) -> tuple[AcceptanceByPosition, ...]:
        """The statistics one round of a ``key`` draft updates: the key's and its ancestors'."""
        out = []
        while key != ():
            out.append(self.stats(key))
            key = _parent(key)
        return (*out, self.source)

    def observe(self, key: Hashable, drafted: int, accepted: int) -> None:
        for st in self.tables(key):
            st.observe(drafted, accepted)


@dataclass
class _Shadow:
    """A draft being scored against the committed ids: ``ids`` (position 0 is the slot after
    the ids fed before it), the ``tables`` it updates, ``ok`` (its next position to score) and
    ``first`` (its first position to record: a tail's, the length its round proposed)."""

    ids: list[int]
    tables: tuple[AcceptanceByPosition, ...]
    ok: int = 0
    first: int = 0


# Shadows scored at once. Every round's draft (declined, or a proposed prefix accepted whole
# and its tail) becomes one, so a key learns its deep positions at the rate its drafts arrive;
# with one at a time, a 64-id shadow occupied ~20 rounds and a key proposed one id per round
# never learned what two would have earned. A draft arriving while all are busy is not kept.
MAX_SHADOWS = 16


class CostGate:
    """Per-source, per-request length policy, priced per draft against ``pace`` (shared by the
    request's gates; default: plain decoding alone): ``length(key, available)``
    for a draft of ``available`` ids described by ``key``, ``observe(drafted, accepted, key)``
    after each verified round, ``shadow(ids, key)`` to keep a declined draft (model-free sources
    only: a shadow costs nothing but a lookup) and ``begin(feed)`` to score the kept drafts
    against the newly committed ids, position by position as they arrive. ``offer(ids, key)``
    and ``observe_proposed`` wrap these for a source: the tail of a draft whose proposed prefix
    was accepted whole becomes a shadow, so its positions after the prefix are scored too.
    Up to :data:`MAX_SHADOWS` drafts are scored at once, each to its first mismatch or its end."""

    def __init__(self, plan: DispatchPlan, max_len: int = 32, *, extra_rows: int = 1,
                 acceptance: DraftAcceptance | None = None, pace: Pace | None = None):
        self.plan = plan
        self.pace = pace if pace is not None else Pace()
        self.max_len = max_len
        self.extra_rows = extra_rows
        self.acceptance = acceptance if acceptance is not None else DraftAcceptance(max_len)
        self.costs = RoundCosts(plan, max_len, extra_rows)
        self._shadows: list[_Shadow] = []
        self._proposed: Hashable = ()  # key of the last draft :meth:`offer` let through
        self._offered: list[int] = []  # that draft's ids, up to ``max_len``

    @property
    def stats(self) -> AcceptanceByPosition:
        """The source-wide estimate."""
        return self.acceptance.source

    def length(self, key: Hashable = (), available: int | None = None) -> int:
        """How many of a ``key`` draft's ``available`` ids (None: up to ``max_len``) to
        propose; 0: none pays."""
        limit = self.max_len if available is None else min(available, self.max_len)
        if limit <= 0:
            return 0
        return choose_length(self.plan, self.acceptance.stats(key), limit, extra_rows=self.extra_rows,
                             min_gain=self.pace.min_gain, overhead=self.pace.round_overhead,
                             costs=self.costs.at(self.pace.kv_length),
                             first_in_flight=self.pace.first_in_flight)

    def observe(self, drafted: int, accepted: int, key: Hashable = ()) -> None:
        self.acceptance.observe(key, drafted, accepted)

    def offer(self, ids: Sequence[int], key: Hashable = ()) -> int:
        """How many of a ``key`` draft's ``ids`` to propose (:meth:`length`); at 0 the draft is
        kept as a shadow. The key of a draft let through is what :meth:`observe_proposed`
        records its outcome under, and its ids beyond what is proposed are its *tail*."""
        n = self.length(key, len(ids))
        if n <= 0:
            self.shadow(ids, key)
        else:
            self._proposed = key
            self._offered = list(ids[:self.max_len])
        return n

    def observe_proposed(self, drafted: int, accepted: int) -> None:
        """The outcome of the last draft :meth:`offer` let through. When every proposed id was
        accepted, the draft's tail is scored as a shadow of the same round from position
        ``drafted`` on, so a key's estimates beyond the lengths it was proposed at keep
        learning (else a key proposed one id at a time would never be priced for two)."""
        self.observe(drafted, accepted, self._proposed)
        offered, self._offered = self._offered, []
        if accepted == drafted < len(offered) and len(self._shadows) < MAX_SHADOWS:
            self._shadows.append(_Shadow(offered, self.acceptance.tables(self._proposed),
                                         first=drafted))

    def withdraw(self) -> None:
        """The draft :meth:`offer` last let through was not proposed after all (another
        source's was): it is kept as a shadow, as a declined draft is."""
        offered, self._offered = self._offered, []
        self.shadow(offered, self._proposed)

    def shadow(self, ids: Sequence[int], key: Hashable = ()) -> None:
        """Keep a draft that was not proposed; the next fed ids score it (not kept while
        :data:`MAX_SHADOWS` drafts are being scored)."""
        if not ids or len(self._shadows) >= MAX_SHADOWS:
            return
        tables = self.acceptance.tables(key)
        for st in tables:
            st.open_round()
        self._shadows.append(_Shadow(list(ids[:self.max_len]), tables))

    def begin(self, feed: Sequence[int]) -> None:
        """Score the kept drafts against newly committed ids: each position from a shadow's
        ``first`` on is recorded as soon as the id for its slot is known (the positions before
        it are a proposal's accepted ids, which its round recorded); a shadow ends at its first
        mismatch or its last id."""
        for t in feed:
            if not self._shadows:
                return
            live = []
            for sh in self._shadows:
                ok = t == sh.ids[sh.ok]
                if sh.ok >= sh.first:
                    for st in sh.tables:
                        st.record(sh.ok, ok)
                sh.ok += 1
                if ok and sh.ok < len(sh.ids):
                    live.append(sh)
            self._shadows = live
