"""Pricing a forced decode in one-row forwards: the rounds an arm ran, and the oracle bound.

Units and the decode model are those of :mod:`mlx_fill.core.cost`: a plain step is one one-row
forward and emits one token; a round feeding ``r`` rows costs ``plan.rows_cost(r)`` plus the
plan's ``round_overhead`` (its forward is synchronous, a plain step is pipelined). A forced decode
of ``n`` recorded ids costs plain decoding ``n + 1`` forwards (the step on the prompt's last id
and one before each yield: mlx-lm's ``generate_step`` computes the next sample before it yields,
after the last yield too), so ``(n + 1) / cost`` is an arm's "x plain" as the curve prices it.

The oracle (:func:`oracle_cost`): at every output position the best span any source could have
had accepted is proposed as a chained round, and nothing else; a dynamic program chooses, for
every position, a plain step or a round of any accepted length up to what was available there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import Round


@dataclass(frozen=True)
class RoundRecord(Round):
    """A fill round as the forced replay logged it (:class:`~mlx_fill.core.proposal.Round`)
    and ``source``, the source that proposed it (its origin's first ``:`` field)."""

    source: str = ""


def round_forwards(rounds: Sequence[RoundRecord], plan: DispatchPlan) -> int:
    """Forward calls the rounds ran (their rows in the plan's chunks)."""
    return sum(len(plan.chunks(0, r.rows)) for r in rounds if r.rows)


def priced_cost(forwards: int, rounds: Sequence[RoundRecord], run_plan: DispatchPlan,
                price: DispatchPlan) -> float:
    """An arm's decode in one-row forwards under ``price``'s curve and round overhead:
    ``forwards`` (every forward call the decode ran, as ``FillStats.forwards`` counts them,
    chunked by ``run_plan``) less the rounds' own are plain steps at 1 each, and every round
    costs :meth:`~mlx_fill.core.plan.DispatchPlan.round_cost`. Over a whole reply the rounds'
    savings (:meth:`~mlx_fill.core.plan.DispatchPlan.round_saving`) are plain decoding's cost
    less this; a reply cut at a token limit inside a round also saves the step past its last
    id."""
    steps = forwards - round_forwards(rounds, run_plan)
    return float(steps) + sum(price.round_cost(r) for r in rounds)


def accepted_prefix(ids: Sequence[int], recorded: Sequence[int], start: int) -> int:
    """How many of ``ids`` agree with ``recorded[start:]`` from the first on."""
    n = 0
    for a, b in zip(ids, recorded[start:]):
        if a != b:
            break
        n += 1
    return n


def oracle_cost(available: Sequence[int], price: DispatchPlan, prompt: int | None = None) -> float:
    """The least cost of emitting ``n = len(available)`` ids, ``available[p]`` being the
    longest accepted span any source offered for the slots after ``p`` (the context holding
    the output through slot ``p``). With slot ``p``'s sample pending: a plain step (cost 1: the
    serial loop runs the next forward before it yields ``p``, after the last slot too) or a
    chained round of ``m <= available[p]`` drafted ids (``m + 1`` rows,
    ``rows_cost(m + 1) + round_overhead``, at KV length ``prompt + p + 1`` when the turn's
    ``prompt`` length is given) that emits slots ``p..p+m``. The first slot's sample
    costs one step; with no span anywhere the cost is plain decoding's ``n + 1`` forwards."""
    n = len(available)
    if n == 0:
        return 0.0
    best = [0.0] * (n + 1)  # best[p]: emit slots p..n-1 with slot p's sample pending
    for p in range(n - 1, -1, -1):
        best[p] = 1.0 + best[p + 1]
        kv = None if prompt is None else prompt + p + 1
        for m in range(1, min(available[p], n - 1 - p) + 1):
            c = price.rows_cost(m + 1, kv) + price.round_overhead + best[p + m + 1]
            if c < best[p]:
                best[p] = c
    return 1.0 + best[0]


def curve_plan(curve: Sequence[float], overhead: float = 0.0) -> DispatchPlan:
    """A plan pricing rounds by a given c(M) for M = 2..len(curve)+1 (chunks up to the
    longest measured M) and a round overhead: for projections onto other hardware."""
    if not curve or not all(math.isfinite(c) and c > 0 for c in curve):
        raise ValueError("a cost curve is positive finite numbers, c(2), c(3), ...")
    cost = {1: 1.0, **{m: float(c) for m, c in enumerate(curve, start=2)}}
    return DispatchPlan(key=None, mode="exact", max_chunk=len(curve) + 1, cost=cost,
                        qualified=True, round_overhead=overhead, note="projected curve")
