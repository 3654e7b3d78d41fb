"""Fill across the ranks of a sharded model (``mlx.launch`` + ``sharded_load``).

Every rank runs the same decode loop and the forward of every rank takes part in the same
collectives, so every rank must append the same ids in the same chunks and rewind to the same
length at the same step. The rule here: **rank 0 decides, every rank follows**.

- The sources run on rank 0 only (followers get a session without sources, ledger or trace):
  the ledger file, the suffix trees, the cost gates and the strict compiler are rank 0's, and a
  source that raises there is disarmed exactly as on one machine.
- Per request, :meth:`SharedRounds.start` is one ``all_sum`` of a few ints: rank 0's session
  state (armed, ``max_span``) and every rank's cache facts (a local refusal, recurrent layers,
  rotating layers). Any rank's refusal refuses fill on all ranks; recurrent layers on any rank
  make every rank rewind by restore-and-replay (a pipeline stage whose layers are all KV would
  otherwise trim while another replays with a forward).
- Per proposal point, :meth:`SharedRounds.propose` is one ``all_sum`` of ``3 + max_span`` int32:
  rank 0's proposal (policy, length, ids) plus every rank's fault bit. A fault on any rank (its
  local proposal step raised) disarms fill on every rank at that step. Nothing is exchanged
  once the request is disarmed or when rank 0's session has nothing that could propose.
- The dispatch plan (chunk sizes) is rank 0's, shared at model load (:func:`share_plan`).

Every collective here is issued at the same point of the same program on every rank, after the
forwards already queued, so their order matches across ranks.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import mlx.core as mx

from .proposal import DecodeView, FillSession, Proposal

FAULT = "shard_fault"  # refusal counted when a rank's proposal step failed
_POLICIES = ("assert", "verify")


class Ranks:
    """One distributed group, seen from this rank."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    @property
    def root(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[int], stream: Any = None) -> list[int]:
        """Element-wise sum over ranks of an int32 vector (one collective, evaluated now) on
        ``stream`` (default: the default stream). Collectives of one process must all go on
        the stream the model's forwards use: on two streams they run concurrently, and the
        ranks can pair one rank's agreement with another's forward."""
        vec = mx.array(values, dtype=mx.int32)
        return mx.distributed.all_sum(vec, group=self.group, stream=stream).tolist()

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; two collectives); the others pass anything."""
        data = pickle.dumps(obj) if self.root else b""
        (size,) = self.sum([len(data)])
        buf = mx.array(list(data), dtype=mx.uint8) if self.root else mx.zeros(size, mx.uint8)
        out = mx.distributed.all_sum(buf, group=self.group)
        mx.eval(out)  # on every rank: a collective left lazy on one rank stalls the others
        return obj if self.root else pickle.loads(bytes(out.tolist()))

    def all(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank."""
        return self.sum([0 if ok else 1])[0] == 0


def ranks_of(group: Any) -> Ranks | None:
    """The :class:`Ranks` of ``group``; None for no group or a group of one."""
    if group is None or group.size() < 2:
        return None
    return Ranks(group)


class SharedRounds:
    """One request's agreement: :meth:`start` once before decoding, :meth:`propose` at every
    proposal point of the decode loop (in place of ``FillSession.propose``)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.stream: Any = None  # the decode loop's stream, set by :meth:`start`
        self.armed = False
        self.replay = False
        self.span = 0

    def start(self, fill: FillSession, refusal: str | None, cache_kinds: tuple[bool, bool],
              stream: Any = None) -> str | None:
        """Agree on the request: returns the refusal every rank applies (this rank's own, or
        ``shard_cache`` / ``shard_rotating`` for another rank's), else None. ``refusal``: this
        rank's cache or input refusal; a follower whose own session is refused (its build
        failed) refuses too. ``cache_kinds``: (has recurrent layers, has rotating layers) on
        this rank. ``stream``: the stream of the decode loop's forwards (every later
        collective of this request goes on it)."""
        self.stream = stream
        r = self.ranks
        armed = r.root and fill.refused is None and bool(fill.sources)
        if refusal is None and not r.root and fill.refused is not None:
            refusal = fill.refused
        recurrent, rotating = cache_kinds
        total = r.sum([int(armed), fill.max_span if r.root else 0, int(refusal is not None),
                       int(recurrent), int(rotating)], stream)
        self.span = total[1]
        fill.max_span = self.span
        self.replay = total[3] > 0
        if total[2]:
            return refusal or "shard_cache"
        if 0 < total[4] < r.size:
            return "shard_rotating"
        self.armed = bool(total[0])
        return None

    def propose(self, fill: FillSession, view: DecodeView) -> Proposal | None:
        """Rank 0's proposal, on every rank; None (and fill disarmed on every rank, counted as
        ``shard_fault``) when any rank's local step raised."""
        if not self.armed:
            return None
        local, fault = None, 0
        try:
            local = fill.propose(view)
        except Exception:  # noqa: BLE001 -- one rank's failure must disarm all, not split them
            fault = 1
        vec = [0] * (3 + self.span)
        if self.ranks.root and local is not None:
            vec[0] = 1 + _POLICIES.index(local.policy)
            vec[1] = len(local.ids)
            vec[3:3 + len(local.ids)] = local.ids
        vec[2] = fault
        total = self.ranks.sum(vec, self.stream)
        if total[2]:
            self.armed = False
            fill.refuse(FAULT)
            return None
        if total[0] == 0:
            return None
        if self.ranks.root:
            return local
        return Proposal(tuple(total[3:3 + total[1]]), _POLICIES[total[0] - 1], "rank0")


def share_plan(ranks: Ranks, lookup: Callable[[], Any], qualify: Callable[[], Any]) -> Any:
    """The dispatch plan every rank uses: rank 0's ``lookup()`` (a plan or None), shared; when
    rank 0 has none, every rank runs ``qualify()`` in lockstep (it agrees each data-dependent
    step through ``ranks``) and rank 0's result is shared."""
    found = ranks.share(lookup() if ranks.root else None)
    if found is not None:
        return found
    return ranks.share(qualify())
