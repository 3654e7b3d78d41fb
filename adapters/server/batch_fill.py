"""Fill inside mlx-lm's continuous batching (``BatchGenerator``, mlx-lm 0.32.x): the side step.

Mechanism, per :meth:`GenerationBatch.next` call (one decode step of the whole batch):

1. The stock step runs untouched: one batched one-token forward for every sequence, exactly
   the rows stock batching computes; each sequence's token is emitted and the next samples are
   in flight.
2. For each sequence that has a fill session (:class:`SeqFill`), its in-flight sample is read
   (a sync) and the session is asked through the same :class:`~mlx_fill.core.round.Asking` as
   the serial loop (:func:`_round`): a token the session has not yet seen as the end of a view
   is shown first (its proposal starts at the in-flight sample's slot); otherwise, or when that
   yields nothing, the in-flight sample *leads* the round, as the pending sample leads a chained
   round of the serial loop. With a round, a *side step* on the sequence's own slice of the
   batch cache: the sequence's caches are extracted (``BatchKVCache.extract`` /
   ``ArraysCache.extract``, copies of that row) and the round runs through the one round
   executor (:func:`mlx_fill.core.round.execute`: one append of the lead and the span under
   the dispatch plan, assert or verify, rewind), cut where a stop sequence ends the sequence;
   the result is written back into that row of the batch cache (:func:`_write_back`). The
   lead and the kept ids join the step's responses, in order, after its stock token; the
   sample after them becomes its next input.

Exactness. Every other sequence's cache rows and samples are the stock step's, untouched. The
filled sequence's rows hold the serial primitive's keys and values, which equal serial
single-sequence decoding under the plan (the primitive's contract). They equal that sequence's
plain *batched* decoding only where batched one-token rows equal single-sequence rows, which
is a property of the backend: measured bit-identical (logprobs and tokens) on this CPU for the
``qwen3-json`` fixture (float32 and bfloat16) and SmolLM2-135M float32 in batches of 1 and 4
(CHANGELOG). Where it does not hold, stock batching is itself not reproducible across batch
compositions, and fill's promise is the serial one.

A sequence alone in its batch (no padding) skips the copies: its single-sequence caches take
over the batch's buffers for the side step and hand them back (:func:`_take_alone`), so a
round costs its forward and nothing else. In a larger batch, write-back keeps
``BatchKVCache``'s layout (left padding, one shared ``_idx``): the row is
shifted left into its own padding; when a sequence's padding is too short, every row gets the
missing padding first, rounded up to :data:`PAD_GROWTH`, with room left on the right for the
next batched step (one copy of the batch cache, as mlx-lm's own ``extend`` does).
``BatchRotatingKVCache`` and ``CacheList`` batches are not handled: :func:`supported` says so
and the server keeps those models' fill requests in the serial lane.

One round per sequence per step: a led span of ``m`` ids costs ``m + 1`` rows, as the gates
price it. Reading the lead gives up the stock step's overlap of the next forward with
the server's per-token work, for the sequences that have a session only.

Pricing. A side step stalls the whole batch, whose step emits ``B`` tokens for ``c(B)``; before
asking a sequence's session for a proposal the step sets its pace to ``B / c(B)``
(:func:`~mlx_fill.core.cost.batch_min_gain`), so its cost gates, and its assert spans, fire only
where the side step emits more tokens per unit of cost than the batch would have meanwhile.
A side step is priced by its rows alone: ``mlx_lm.server`` opens its sessions with no round
overhead (:mod:`mlx_fill.adapters.server_patch`), because it waits for every batched step.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.primitive import Unsupported
from mlx_fill.core.proposal import FillSession, FillStats
from mlx_fill.core.resolve import plan_for
from mlx_fill.core.round import Asking, CacheView, Outcome, Round, Sample, execute, settle
from mlx_fill.adapters import mlx_lm_seam as seam
from mlx_fill.core.cost import batch_min_gain

log = logging.getLogger("mlx_fill")


@dataclass
class SeqFill:
    """One batched sequence's fill: its session, the full prompt ids, the ids emitted so far,
    the largest generation batch it decoded in (``batch_peak``: proof the batch was used),
    ``rounds`` applied and ``on_end`` (called once when the sequence leaves the batch)."""

    session: FillSession
    prompt_ids: list[int]
    emitted: list[int] = field(default_factory=list)
    batch_peak: int = 0
    rounds: int = 0
    on_end: Callable[[], None] | None = None
    asking: Asking = field(init=False)  # when the session is asked (shared with the serial loop)

    def __post_init__(self) -> None:
        self.asking = Asking(self.session, self.prompt_ids)
        self.session.emitted_ids = self.emitted

    def end(self) -> None:
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()


# the registry of the BatchGenerator whose step (``seam.BATCH_STEP``) is running (uid -> SeqFill)
_active: contextvars.ContextVar[dict[int, SeqFill] | None] = contextvars.ContextVar(
    "mlx_fill_batch", default=None)


def registry(batch_generator: Any) -> dict[int, SeqFill]:
    """The uid -> :class:`SeqFill` map of ``batch_generator`` (created on first use)."""
    reg = batch_generator.__dict__.get("_mlx_fill")
    if reg is None:
        reg = batch_generator.__dict__["_mlx_fill"] = {}
    return reg


def supported(model: Any) -> bool:
    """Whether batched fill handles ``model``'s caches: every layer a ``KVCache`` (batched as
    ``BatchKVCache``) or an ``ArraysCache`` (recurrent layers of hybrid models)."""
    caches = model.make_cache() if hasattr(model, "make_cache") else [C.KVCache() for _ in model.layers]
    return all(type(c) in (C.KVCache, C.ArraysCache) for c in caches)


# left padding added at once when a filled row outgrows its own (one copy of the batch cache
# per PAD_GROWTH ids instead of per side step; padded columns are masked)
PAD_GROWTH = 32


def _take_alone(batch_cache: list[Any]) -> list[Any] | None:
    """The caches of a batch of one unpadded sequence as single-sequence caches that *take
    over* the batch's buffers (no copy; the batch holds None until :func:`_give_back`); None
    when the batch has another row or padding, or a layer is not a ``BatchKVCache`` /
    ``ArraysCache``."""
    single = []
    for bc in batch_cache:
        if isinstance(bc, C.ArraysCache):
            single.append(bc.extract(0))  # recurrent states: small, copied as extract does
            continue
        if type(bc) is not C.BatchKVCache or bc.keys is None or bc.keys.shape[0] != 1:
            return None
        if int(bc.left_padding[0].item()) != 0:
            return None
        sc = C.KVCache()
        sc.offset = seam.kv_end(bc)
        single.append(sc)
    for bc, sc in zip(batch_cache, single):
        if isinstance(sc, C.KVCache):  # moved, not shared: appends may then update in place
            sc.keys, sc.values, bc.keys, bc.values = bc.keys, bc.values, None, None
    return single


def _give_back(batch_cache: list[Any], single: list[Any]) -> None:
    """Return :func:`_take_alone`'s buffers to the batch, at the single caches' lengths."""
    for bc, sc in zip(batch_cache, single):
        if isinstance(bc, C.ArraysCache):
            bc.cache = list(sc.cache)
            continue
        bc.keys, bc.values = sc.keys, sc.values
        bc.offset = bc.offset + (sc.offset - seam.kv_end(bc))
        seam.set_kv_end(bc, sc.offset)


def _write_back(batch_cache: list[Any], i: int, single: list[Any], added: int) -> None:
    """Put sequence ``i``'s extracted caches (``added`` ids longer than its batch row) back
    into the batch caches, keeping the left-padded layout."""
    for bc, sc in zip(batch_cache, single):
        if isinstance(bc, C.ArraysCache):
            bc.cache = [None if a is None else mx.concatenate([a[:i], s, a[i + 1:]])
                        for a, s in zip(bc.cache, sc.cache)]
            continue
        if added == 0:
            continue
        pad = int(bc.left_padding[i].item())
        end = seam.kv_end(bc)
        if added > pad:  # grow every row's left padding by the shortfall, rounded up
            grow = -(-(added - pad) // PAD_GROWTH) * PAD_GROWTH
            # and keep room on the right, so the next batched step does not copy again
            spare = -(end + grow) % bc.step
            widths = [(0, 0), (0, 0), (grow, spare), (0, 0)]
            bc.keys = mx.pad(bc.keys[..., :end, :], widths)
            bc.values = mx.pad(bc.values[..., :end, :], widths)
            bc.left_padding = bc.left_padding + grow
            end += grow
            seam.set_kv_end(bc, end)
            pad += grow
        start = pad - added
        bc.keys[i:i + 1, :, start:end, :] = sc.keys[..., :sc.offset, :]
        bc.values[i:i + 1, :, start:end, :] = sc.values[..., :sc.offset, :]
        onehot = (mx.arange(bc.left_padding.size) == i).astype(bc.left_padding.dtype) * added
        bc.left_padding = bc.left_padding - onehot
        bc.offset = bc.offset + onehot.astype(bc.offset.dtype)


def _stop(gb: Any, i: int, ids: list[int]) -> int | None:
    """How many of ``ids`` sequence ``i`` takes through the one that completes a stop
    sequence (advancing its stop matcher over exactly those), or None when none does."""
    for n, t in enumerate(ids, start=1):
        if seam.stops(gb, i, t):
            return n
    return None


def _side_step(gb: Any, i: int, rnd: Round, plan: DispatchPlan, stats: FillStats) -> Outcome:
    """Run ``rnd`` (:func:`~mlx_fill.core.round.execute`) on sequence ``i`` of generation batch
    ``gb``, on its own caches: taken over from the batch when it is alone, else extracted and
    written back before returning."""
    sampler = (gb.samplers[i] if gb.samplers and gb.samplers[i] is not None
               else gb.fallback_sampler)
    processors = gb.logits_processors[i] if gb.logits_processors else None
    alone = _take_alone(gb.prompt_cache) if len(gb.uids) == 1 else None
    single = alone if alone is not None else [c.extract(i) for c in gb.prompt_cache]
    view = CacheView(gb.model, single, plan, stats, sampler=sampler,
                     logits_processors=processors, history=seam.history(gb, i))
    try:
        out = execute(view, rnd, stop=lambda ids: _stop(gb, i, ids))
    finally:  # also when the primitive refuses: the batch must get its buffers back
        if alone is not None:
            _give_back(gb.prompt_cache, single)
    if alone is None:
        _write_back(gb.prompt_cache, i, single, len(out.ids))
    if out.failure is not None:  # the batch's own step would raise it for this sequence
        raise out.failure
    return out


def _round(sf: SeqFill, sample: Sample, room: int) -> Round | None:
    """This step's round for a sequence whose in-flight sample is ``sample`` and that has
    ``room`` slots left: the round at the sample's slot when its session has not yet seen the
    last emitted id as a view's end; otherwise, or when that yields nothing, the round the
    sample leads (a chained round; none after an end id), unless the view the sample ends was
    just asked (:meth:`Asking.at_sample` asks it when the sample disagreed with its draft). That
    view is priced as one whose last id is emitted (not ``pending``): the serial lane's next
    view ends at the same sample and is priced so, and both lanes take the same decisions."""
    rnd = sf.asking.at_sample(sf.emitted, sample, room)
    if rnd is None and sf.asking.shown <= len(sf.emitted):
        rnd = sf.asking.after_sample(sf.emitted, sample, room, pending=False)
    return rnd


def _fill_rounds(gb: Any, reg: dict[int, SeqFill], responses: list) -> list:
    """After the stock step: one side step for every registered sequence with a proposal;
    returns the responses with the side steps' ids after their sequence's stock token."""
    extra: dict[int, list] = {}
    finished: set[int] = set()
    for i, uid in enumerate(gb.uids):
        sf = reg.get(uid)
        if sf is None or sf.session.refused is not None or not sf.session.sources:
            continue  # nothing can propose: no sync of the in-flight sample for it
        plan = sf.session.plan if sf.session.plan is not None else plan_for(gb.model)
        # a side step stalls the whole batch: it must beat the batched step's own rate
        sf.session.pace.min_gain = batch_min_gain(plan, len(gb.uids))
        if gb.logits_processors and gb.logits_processors[i]:
            sf.session.allow_assert = False  # an asserted row is not sampled: no processor sees it
        room = seam.slots_left(gb, i)
        if room <= 1:
            continue  # the in-flight sample is the sequence's last token: nothing to fill
        rnd = _round(sf, Sample(*seam.in_flight(gb, i)), room)  # reads the sample: a sync
        if rnd is None:
            continue
        try:
            out = _side_step(gb, i, rnd, plan, sf.session.stats)
        except Unsupported as e:
            sf.session.refuse(e.reason)
            continue
        sf.rounds += 1
        settle(sf.session, rnd, len(out.ids))
        finish = "stop" if out.stopped else ("length" if len(out.ids) >= room else None)
        seam.commit(gb, i, out.ids, None if out.next is None else (out.next.token,
                                                                   out.next.logprobs))
        sf.emitted.extend(out.ids)
        sf.session.stats.emitted = len(sf.emitted)
        rows = [gb.Response(uid, t, lp, None, None, None)
                for t, lp in zip(out.ids, out.logprobs)]
        if finish is not None:
            rows[-1] = gb.Response(uid, out.ids[-1], out.logprobs[-1], finish,
                                   gb.extract_cache(i), list(gb.tokens[i]))
        extra[uid] = rows
        if finish is not None:
            finished.add(i)
    if finished:
        gb.filter([i for i in range(len(gb.uids)) if i not in finished])
    if not extra:
        return responses
    merged = []
    for r in responses:
        merged.append(r)
        merged.extend(extra.get(r.uid, ()))
    return merged


def _end_finished(reg: dict[int, SeqFill], responses: list) -> None:
    for r in responses:
        sf = reg.get(r.uid)
        if sf is None:
            continue
        if r.finish_reason is not None:
            reg.pop(r.uid).end()


def install(generate_module: Any) -> bool:
    """Patch ``generate_module`` (``mlx_lm.generate``) so generation batches run side steps for
    registered sequences. Idempotent; returns True when this call patched. Sequences without a
    :class:`SeqFill` (and batches with none) take the stock code path unchanged."""
    BG, GB = generate_module.BatchGenerator, generate_module.GenerationBatch
    if getattr(GB.next, "__mlx_fill__", False):
        return False
    stock_next, stock_bg_next, stock_remove = (getattr(cls, name) for cls, name in
                                               ((GB, "next"), (BG, seam.BATCH_STEP), (BG, "remove")))

    def gb_next(self):
        reg = _active.get()
        if not reg or not any(u in reg for u in self.uids):
            return stock_next(self)
        uids = list(self.uids)
        responses = stock_next(self)
        for r in responses:
            sf = reg.get(r.uid)
            if sf is not None:
                sf.emitted.append(r.token)
                sf.session.stats.emitted = len(sf.emitted)
                sf.session.stats.forwards += 1
                sf.batch_peak = max(sf.batch_peak, len(uids))
        responses = _fill_rounds(self, reg, responses)
        _end_finished(reg, responses)
        return responses

    def bg_next(self):
        token = _active.set(registry(self))
        try:
            return stock_bg_next(self)
        finally:
            _active.reset(token)

    def remove(self, uids, *a, **kw):
        reg = registry(self)
        for uid in uids:
            if uid in reg:
                reg.pop(uid).end()
        return stock_remove(self, uids, *a, **kw)

    for cls, name, orig, new in ((GB, "next", stock_next, gb_next),
                                 (BG, seam.BATCH_STEP, stock_bg_next, bg_next),
                                 (BG, "remove", stock_remove, remove)):
        new.__wrapped__ = orig
        new.__mlx_fill__ = True
        new.__name__ = orig.__name__
        new.__doc__ = orig.__doc__
        setattr(cls, name, new)
    return True
