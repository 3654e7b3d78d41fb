"""The cost model: how many ids to propose this round.

A verify round over ``m`` proposed ids runs one forward of ``m + extra_rows`` rows, which costs
``plan.cost_of(m + extra_rows)`` one-row forwards (the ``qualify`` cost curve), and emits
``1 + sum_{j=1..m} prod_{i<j} q_i`` tokens in expectation, where ``q_i`` is the source's running
probability that position ``i`` is accepted given every earlier one was. Plain decoding emits one
token per one-row forward, so a round is worth running only when its expected tokens per unit
cost exceed 1; :func:`choose_length` returns the ``m`` maximizing that ratio, or 0 when no ``m``
beats plain decoding (a request never gets slower in expectation because speculation is on).

:class:`AcceptanceByPosition` keeps ``q_i`` as exponentially decayed counts with a Beta prior.
:class:`CostGate` ties the two together for one source and one request; for model-free sources
it keeps learning while proposing nothing (shadow drafts scored against what was emitted), so a
source that stopped paying can earn its way back.
"""

from __future__ import annotations

from typing import Sequence

from mlx_fill.core.plan import DispatchPlan


class AcceptanceByPosition:
    """Running conditional acceptance per draft position.

    ``reached[i]`` counts rounds that proposed position ``i`` with every earlier position
    accepted; ``accepted[i]`` those that also accepted ``i``. Counts decay by ``decay`` per
    observed round (kept lazily: a new round weighs ``decay ** -rounds``).
    ``q(i) = (accepted[i] + prior_a) / (reached[i] + prior_a + prior_b)``.
    """

    def __init__(self, max_len: int = 64, *, decay: float = 0.98, prior_a: float = 1.0,
                 prior_b: float = 1.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_len = max_len
        self.decay = decay
        self.prior_a = prior_a
        self.prior_b = prior_b
        self._reached = [0.0] * max_len
        self._accepted = [0.0] * max_len
        self._w = 1.0
        self.rounds = 0

    def observe(self, drafted: int, accepted: int) -> None:
        """A round proposed ``drafted`` ids and the first ``accepted`` were accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} outside 0..{drafted}")
        self._w /= self.decay
        if self._w > 1e150:
            self._reached = [r / self._w for r in self._reached]
            self._accepted = [a / self._w for a in self._accepted]
            self._w = 1.0
        w = self._w
        for i in range(min(drafted, accepted + 1, self.max_len)):
            self._reached[i] += w
            if i < accepted:
                self._accepted[i] += w
        self.rounds += 1

    def q(self, i: int) -> float:
        if i >= self.max_len:
            return 0.0
        w = self._w
        return (self._accepted[i] / w + self.prior_a) / (
            self._reached[i] / w + self.prior_a + self.prior_b)

    def survival(self, m: int) -> list[float]:
        """``s[j] = P(positions 0..j all accepted)`` for j < m."""
        out, p = [], 1.0
        for i in range(m):
            p *= self.q(i)
            out.append(p)
            if p < 1e-6:
                out.extend([0.0] * (m - i - 1))
                break
        return out


def expected_emitted(survival: Sequence[float], m: int) -> float:
    """Expected tokens emitted by a round proposing ``m`` ids (the correction/bonus included)."""
    return 1.0 + sum(survival[:m])


def round_costs(plan: DispatchPlan, max_len: int, extra_rows: int = 1) -> list[float]:
    """``costs[m]`` = cost of a round proposing ``m`` ids, in one-row-forward units."""
    base = plan.cost_of(1)
    return [1.0] + [plan.cost_of(m + extra_rows) / base for m in range(1, max_len + 1)]


def choose_length(plan: DispatchPlan, stats: AcceptanceByPosition, max_len: int,
                  *, extra_rows: int = 1, min_gain: float = 1.0,
                  costs: Sequence[float] | None = None) -> int:
    """The round length maximizing expected emitted tokens per unit cost; 0 when the best
    ratio does not exceed ``min_gain`` (>= 1: never slower than plain decoding in expectation).
    ``costs`` (from :func:`round_costs`) saves re-reading the plan.
    """
    max_len = min(max_len, stats.max_len)
    if costs is None:
        costs = round_costs(plan, max_len, extra_rows)
    s = stats.survival(max_len)
    best_m, best_rate, total = 0, 1.0, 1.0
    for m in range(1, max_len + 1):
        total += s[m - 1]
        rate = total / costs[m]
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m if best_rate > min_gain else 0


class CostGate:
    """Per-source, per-request length policy: ``length()`` before each draft, ``observe`` after
    each verified round, ``begin(feed)``/``shadow(ids)`` to score drafts that were not proposed
    (model-free sources only: a shadow draft costs nothing but a lookup)."""

    def __init__(self, plan: DispatchPlan, max_len: int = 32, *, extra_rows: int = 1,
                 stats: AcceptanceByPosition | None = None):
        self.plan = plan
        self.max_len = max_len
        self.extra_rows = extra_rows
        self.stats = stats if stats is not None else AcceptanceByPosition(max_len=max_len)
        self.costs = round_costs(plan, max_len, extra_rows)
        self._shadow: list[int] = []
        self._shadow_ok = 0

    def length(self) -> int:
        return choose_length(self.plan, self.stats, self.max_len, extra_rows=self.extra_rows,
                             costs=self.costs)

    def observe(self, drafted: int, accepted: int) -> None:
        self.stats.observe(drafted, accepted)

    def shadow(self, ids: Sequence[int]) -> None:
        """Remember a draft that was not proposed; it is scored by the next fed tokens."""
        if not self._shadow and ids:
            self._shadow = list(ids)
            self._shadow_ok = 0

    def begin(self, feed: Sequence[int]) -> None:
        """Score the pending shadow draft against newly committed tokens."""
        if not self._shadow:
            return
        for t in feed:
            if t != self._shadow[self._shadow_ok]:
                self._settle()
                return
            self._shadow_ok += 1
            if self._shadow_ok == len(self._shadow):
                self._settle()
                return

    def _settle(self) -> None:
        self.stats.observe(len(self._shadow), self._shadow_ok)
        self._shadow = []
        self._shadow_ok = 0
