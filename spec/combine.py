"""Score-based choice between model-free draft sources (one verify proposal per round).

Every round each member drafts; each draft is scored by the expected number of ids the target
will accept, ``sum_j prod_{i<=j} q_i``, from running acceptance-by-position statistics kept per
(member, confidence key) -- the key is the member's own description of its last draft
(``confidence()``: the n-gram length that matched, the suffix match-length bucket, the echo
anchor and corroboration). The best-scoring draft is proposed; the others are kept as shadow
drafts and scored against the tokens that were actually committed, so every member keeps
learning. With a cost curve the round length is cut where expected tokens per unit cost peak,
and nothing is proposed when no draft beats plain decoding.

This is SuffixDecoding's score-based choice between its two trees, generalized to any
model-free member and with scores calibrated by observed acceptance.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import DecodeView, Pace, Proposal
from mlx_fill.core.cost import AcceptanceByPosition, RoundCosts, best_length, pays


class BestOf:
    """A :class:`~mlx_fill.core.proposal.ProposalSource` over model-free DraftSources that expose
    ``confidence() -> Hashable`` for their last draft. ``plan=None``: propose the full draft
    of the best member (the corpus study's oracle setting). ``stats`` carries the calibration
    across requests (pass the same dict to every request's BestOf). Rounds are priced as the
    cost gates price them (:func:`~mlx_fill.core.cost.best_length`, against ``pace``: the
    round overhead, a view-end draft's first id)."""

    def __init__(self, members: Sequence[Any], *, plan: DispatchPlan | None = None,
                 max_len: int = 32, name: str = "best", extra_rows: int = 1,
                 stats: dict[tuple[str, Hashable], AcceptanceByPosition] | None = None,
                 pace: Pace | None = None):
        if not members:
            raise ValueError("BestOf needs at least one member")
        self.members = list(members)
        self.name = name
        self.max_len = max_len
        self.costs = RoundCosts(plan, max_len, extra_rows) if plan is not None else None
        self.stats = stats if stats is not None else {}
        self.pace = pace if pace is not None else Pace()
        self._shadow: dict[int, tuple[Hashable, list[int], int]] = {}
        self._chosen: tuple[int, Hashable] | None = None
        self._prefilled = False
        self._seen = 0

    def _stats(self, i: int, key: Hashable) -> AcceptanceByPosition:
        k = (self.members[i].name, key)
        st = self.stats.get(k)
        if st is None:
            st = self.stats[k] = AcceptanceByPosition(max_len=self.max_len)
        return st

    def _score_shadows(self, feed: Sequence[int]) -> None:
        for i, (key, ids, ok) in list(self._shadow.items()):
            done = False
            for t in feed:
                if t != ids[ok]:
                    done = True
                    break
                ok += 1
                if ok == len(ids):
                    done = True
                    break
            if done:
                self._stats(i, key).observe(len(ids), ok)
                del self._shadow[i]
            else:
                self._shadow[i] = (key, ids, ok)

    def _value(self, i: int, key: Hashable, ids: list[int], kv: int) -> tuple[float, int]:
        """(expected tokens per unit cost, length to propose) for member ``i``'s draft appended
        at KV length ``kv``; without a cost curve, (expected tokens, the whole draft)."""
        stats = self._stats(i, key)
        if self.costs is None:
            return 1.0 + sum(stats.survival(len(ids))), len(ids)
        m, rate = best_length(stats, len(ids), self.costs.at(kv),
                              overhead=self.pace.round_overhead,
                              first_in_flight=self.pace.first_in_flight)
        return rate, m

    def propose(self, view: DecodeView) -> Proposal | None:
        if not self._prefilled:
            for m in self.members:
                m.prefill(view.prompt)
            self._seen = len(view.prompt)
            self._prefilled = True
        n_prompt = len(view.prompt)
        feed = list(view.emitted[self._seen - n_prompt:])
        self._seen = n_prompt + len(view.emitted)
        self._score_shadows(feed)
        best: tuple[float, int, Hashable, list[int]] | None = None
        drafts = []
        for i, m in enumerate(self.members):
            ids = m.draft(feed, self.max_len)
            if not ids:
                continue
            key = m.confidence()
            value, length = self._value(i, key, ids, self._seen)
            drafts.append((i, key, ids))
            if length > 0 and (best is None or value > best[0]):
                best = (value, i, key, ids[:length])
        for i, key, ids in drafts:
            if (best is None or i != best[1]) and i not in self._shadow:
                self._shadow[i] = (key, ids, 0)
        if best is None or (self.costs is not None and not pays(best[0], self.pace.min_gain)):
            self._chosen = None
            return None
        _, i, key, ids = best
        self._chosen = (i, key)
        return Proposal(tuple(int(t) for t in ids), "verify", f"{self.name}:{self.members[i].name}")

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        if self._chosen is None:
            return
        i, key = self._chosen
        self._stats(i, key).observe(len(proposal.ids), accepted)
        self.members[i].commit(list(proposal.ids), accepted)
        self._chosen = None
