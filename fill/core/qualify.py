"""``mlx-fill qualify``: measure, on this machine, which appends are exact and what they cost.

For every chunk size M and every KV length L around a candidate kernel boundary, an M-row append
is compared bit for bit (cache content incl. recurrent state, and every logit row) with M serial
one-token steps, both for a chunk that starts at L and for one that crosses L. The resulting
:class:`DispatchPlan` keeps the largest M that is exact everywhere except across KV lengths that
become ``kv_boundaries``; the plan is re-checked with those cuts before it is written. The cost
curve c(M) = time(M-row forward) / time(1-row forward) is the median of interleaved repeats;
the round overhead is what a synchronous one-row round costs over a pipelined plain step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from datetime import date
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from .errors import UserError, int_up_to, model_dir, replaced_file, unwritable
from .exactness import arrays_equal, cache_content
from .model_folder import vocab_size
from .plan import (COST_KV, DispatchPlan, PlanKey, cached_dir, config_key, format_cost, format_key,
                   save_plan)
from .shapes import SHAPES
from .primitive import (Unsupported, append, cache_offset, check_supported, checkpoint,
                        restore, rewind, ring_window)

FULL_SIZES = tuple(range(1, 17)) + (32,)
QUICK_SIZES = (1, 2, 3, 4, 8, 16)
# KV allocation grows in steps of 256; CUDA's cuDNN SDPA switches on kL % 256 and kL >= 256;
# Metal's 2-pass attention switches at kL 1024 / 4096; powers of two cover the rest. The quick
# set reaches 512: OpenBLAS (Haswell kernels) rounds 2- and 3-row attention products
# differently from one row at KV 384, 512, 768, 1024, 2048 but not at 0-257 (qwen3-json).
FULL_KV = (0, 1, 255, 256, 257, 511, 512, 1023, 1024, 2048, 4095, 4096, 8192)
QUICK_KV = (0, 1, 255, 256, 257, 511, 512)
# The second KV length the cost curve is measured at: agents' prompts run to thousands of ids,
# where attending over the cache is a large share of a forward (SmolLM2-135M bf16 on a 2-core
# x86 CPU: c(8) = 3.17 at KV 512, 4.06 at 4096).
LONG_KV = 4096
MAX_REPEATS = 1000
Agree = Callable[[bool], bool]


class Stopped(Exception):
    """The process is exiting (:func:`stop_measuring`): a measurement stops at its next step
    and nothing it measured is kept."""


_exiting = threading.Event()


def stop_measuring() -> None:
    """Make every measurement in this process raise :class:`Stopped` at its next step (a
    forward or a few). Called once, as the interpreter exits: MLX must be idle before it
    tears down."""
    _exiting.set()


def _step() -> None:
    """A point where a measurement may stop (:func:`_grow` starts with one, so every check that
    grows a cache passes one): raises :class:`Stopped` once the process exits."""
    if _exiting.is_set():
        raise Stopped("the process is exiting")


def _alone(verdict: bool) -> bool:
    """One process: its own verdict."""
    return verdict


@dataclass
class Check:
    """One chunk of ``size`` rows appended at KV length ``start`` (``kv``: the length the check
    is about; ``start < kv`` crosses it). ``ring``: a sliding-window check, the chunk crossing
    the end of a rotating layer's ring (which recurs every window, so no KV boundary avoids it).
    ``shape``: the append shape the chunk ran with (:mod:`.shapes`)."""

    size: int
    kv: int
    start: int
    exact: bool
    ring: bool = False
    shape: str = "native"


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()


def _grow(model: Any, cache: list[Any], length: int, vocab: int, decode: bool = False) -> None:
    """Extend ``cache`` to ``length`` tokens of seeded random ids: with one prompt forward, or
    with ``decode`` as decoding does, in appends of a few ids (a rotating layer's write index
    then runs around its ring as in serial decoding, instead of restarting after a prefill)."""
    _step()
    have = cache_offset(cache) if cache else 0
    if length <= have:
        return
    ids = _random_ids(length - have, vocab, length)
    if not decode:
        model(mx.array(ids)[None], cache=cache)
    else:
        steps = DispatchPlan(key=None, max_chunk=8, qualified=True)
        append(model, cache, ids, plan=steps, logits="none")
    mx.eval([c.state for c in cache])


def ring_lengths(window: int | None) -> tuple[int, ...]:
    """KV lengths where a chunk crosses a ring's end: the first wrap and a later one."""
    return () if window is None else (window, 2 * window)


def _exact(model: Any, cache: list[Any], ids: list[int], plan: DispatchPlan) -> bool:
    """Appending ``ids`` under ``plan`` equals serial steps (new cache content, recurrent state
    and every logit row). Both arms run on ``cache`` and are rewound; it is left unchanged."""
    start = cache_offset(cache)
    cp = checkpoint(model, cache, plan)
    rows_serial = [model(mx.array([[t]]), cache=cache)[0, -1:] for t in ids]
    serial_content = cache_content(cache, since=start)
    mx.eval(rows_serial, serial_content)
    cp.appended = list(ids)
    rewind(cp, 0)
    cp = checkpoint(model, cache, plan)
    rows = append(model, cache, ids, plan=plan, logits="all", record=cp)
    chunk_content = cache_content(cache, since=start)
    mx.eval(rows, chunk_content)
    same = len(serial_content) == len(chunk_content) and all(
        arrays_equal(a, b) for a, b in zip(serial_content, chunk_content)) and all(
        arrays_equal(rows[i:i + 1], r) for i, r in enumerate(rows_serial))
    rewind(cp, 0)
    return same


def check_exactness(model: Any, sizes: tuple[int, ...], kv_lengths: tuple[int, ...],
                    vocab: int, progress: Any = None, *, stop_after_failure: bool = False,
                    agree: Agree = _alone, rings: tuple[int, ...] = (),
                    deadline: float | None = None,
                    shapes: tuple[str, ...] = ("native",),
                    costs: dict[str, dict[int, float]] | None = None,
                    ) -> tuple[list[Check], tuple[int, ...]]:
    """Run the (M, L) checks size by size, smallest first: a plan's ``max_chunk`` is the
    largest size exact together with every smaller one, so each finished size is usable
    evidence on its own. For every L, a chunk starting at L and one crossing L (start
    L - M//2). ``rings``: more KV lengths, reached by decoding (:func:`ring_lengths`), whose
    checks are ``ring`` checks. Every check runs in the first of the append ``shapes``, and in
    each other one unless the first is exact at that size and the other no cheaper by
    ``costs`` (``{shape: c(M)}``; None: every shape is checked).
    ``stop_after_failure`` (where any failure makes a shape inexact, see :func:`derive_plan`):
    no larger size is checked after one no shape of which is exact. ``deadline``
    (``time.monotonic()``): sizes not started by then are left. ``agree`` turns this rank's
    verdict into the verdict of every rank (a sharded model: exact only where every rank is),
    so every rank runs the same checks in lockstep. Returns the checks and the sizes left."""
    checks: list[Check] = []
    todo = sorted(m for m in sizes if m > 1)
    lengths = [(kv, False) for kv in kv_lengths] + [(kv, True) for kv in rings]
    bases: dict[tuple[int, bool], list[Any]] = {}  # grown once, to the earliest start
    earliest = max(todo, default=2) // 2
    for i, m in enumerate(todo):
        if deadline is not None and time.monotonic() >= deadline:
            return checks, tuple(todo[i:])
        mine: list[Check] = []
        for shape in shapes:
            first = [c for c in mine if c.shape == shapes[0]]
            if shape != shapes[0] and costs is not None and all(c.exact for c in first) \
                    and costs[shape][m] >= costs[shapes[0]][m]:
                continue  # the first shape is exact and no dearer: nothing to gain
            for kv, ring in lengths:
                if (kv, ring) not in bases:
                    bases[kv, ring] = make_prompt_cache(model)
                    _grow(model, bases[kv, ring], max(0, kv - earliest), vocab, decode=ring)
                mine += _check_at(model, bases[kv, ring], m, shape, kv, ring, vocab, agree,
                                  progress)
        checks += mine
        if stop_after_failure and not any(all(c.exact for c in mine if c.shape == shape)
                                          for shape in {c.shape for c in mine}):
            return checks, ()
    return checks, ()


def _check_at(model: Any, cache: list[Any], m: int, shape: str, kv: int, ring: bool,
              vocab: int, agree: Agree, progress: Any) -> list[Check]:
    """The checks of ``m``-row chunks in ``shape`` starting at and crossing ``kv``, each from
    ``cache`` grown to its start (``cache`` is left as it was)."""
    found = []
    plan = DispatchPlan(key=None, max_chunk=m, qualified=True, shapes={m: shape})
    for start in sorted({kv, max(0, kv - m // 2)}):
        if progress:
            progress.update(1)
        cp = checkpoint(model, cache, plan)
        _grow(model, cache, start, vocab, decode=ring)
        exact = agree(_exact(model, cache, _random_ids(m, vocab, 7 * m + start), plan))
        found.append(Check(m, kv, start, exact, ring, shape))
        restore(cp)
    return found


def derive_plan(key: PlanKey, checks: list[Check], sizes: tuple[int, ...], *, floor: int = 1,
                boundaries: tuple[int, ...] = (), shapes: dict[int, str] | None = None,
                cost: dict[str, dict[int, float]] | None = None) -> DispatchPlan:
    """Largest M exact at every start that does not cross a KV length and at every ring check;
    KV lengths crossed by a failing chunk become boundaries. On the CPU backend, where no
    kernel switches at a KV length, any failing check makes M inexact: a BLAS that rounds M
    rows differently at one tested length does so wherever the data brings it out, also at
    untested lengths (OpenBLAS does; see the CHANGELOG), which a list of boundaries cannot
    describe. Each size keeps the append shape that is exact by that rule and cheaper by
    ``cost`` (``native`` on a tie or without costs). ``floor`` / ``boundaries`` / ``shapes``:
    what an earlier, budgeted run established (sizes up to ``floor`` exact with those cuts and
    shapes); a size without checks ends the plan (not measured)."""
    found: set[int] = set(boundaries)
    chosen: dict[int, str] = dict(shapes or {})
    max_chunk = max(1, floor)
    on_cpu = key is not None and key.backend == "cpu"
    for m in sorted(s for s in sizes if s > max_chunk):
        exact = {}
        for shape in dict.fromkeys(c.shape for c in checks if c.size == m):
            mine = [c for c in checks if c.size == m and c.shape == shape]
            if all(c.exact for c in mine if c.start == c.kv or c.ring or on_cpu):
                exact[shape] = mine
        if not exact:
            break
        best = min(exact, key=lambda s: ((cost or {}).get(s, {}).get(m, 0.0), s != "native"))
        found |= {c.kv for c in exact[best] if not c.exact and c.start < c.kv}
        chosen[m] = best
        max_chunk = m
    return DispatchPlan(key=key, mode="exact", max_chunk=max_chunk,
                        kv_boundaries=tuple(sorted(found)), qualified=True, shapes=chosen)


def confirm_plan(model: Any, plan: DispatchPlan, kv_lengths: tuple[int, ...], vocab: int,
                 agree: Agree = _alone, rings: tuple[int, ...] = ()) -> bool:
    """Re-check the derived plan (with its cuts) on chunks crossing every tested KV length and
    every ring length (reached by decoding)."""
    m = plan.max_chunk
    for lengths, decode in ((kv_lengths, False), (rings, True)):
        cache = make_prompt_cache(model)
        for kv in lengths:
            _grow(model, cache, max(0, kv - m // 2), vocab, decode)
            if not agree(_exact(model, cache, _random_ids(m, vocab, 31 * m + kv), plan)):
                return False
    return True


def cost_cache(model: Any, vocab: int) -> list[Any]:
    """A fresh cache grown to ``COST_KV`` seeded random ids: where the cost curve and the round
    overhead are measured."""
    cache = make_prompt_cache(model)
    _grow(model, cache, COST_KV, vocab)
    return cache


def _timed_append(model: Any, cache: list[Any], ids: list[int], plan: DispatchPlan) -> float:
    """Seconds of one verify forward of ``ids`` appended to ``cache`` (left as it was)."""
    _step()
    cp = checkpoint(model, cache, plan)
    t0 = time.perf_counter()
    mx.eval(append(model, cache, ids, plan=plan, logits="all", record=cp))
    dt = time.perf_counter() - t0
    rewind(cp, 0)
    return dt


def measure_cost(model: Any, cache: list[Any], sizes: tuple[int, ...], vocab: int,
                 repeats: int, shape: str = "native") -> dict[int, float]:
    """c(M): median over interleaved repeats of time(M-row verify forward) / time(1-row), on
    ``cache`` (left as it was), every chunk in append ``shape``."""
    plan = DispatchPlan(key=None, max_chunk=max(sizes), qualified=True,
                        shapes={max(sizes): shape})
    times: dict[int, list[float]] = {m: [] for m in sizes}
    ids = _random_ids(max(sizes), vocab, 3)
    for r in range(repeats + 1):
        for m in sizes:
            dt = _timed_append(model, cache, ids[:m], plan)
            if r:  # the first round warms up kernels and allocations
                times[m].append(dt)
    one = statistics.median(times[1])
    return {m: round(statistics.median(t) / one, 3) for m, t in times.items()}


def long_cache(model: Any, cache: list[Any]) -> list[Any] | None:
    """A cache of ``LONG_KV`` ids: every layer's keys and values in ``cache`` (a plain
    ``KVCache`` each) repeated end to end, state caches (whose size does not grow with the
    sequence) as they are. Timing depends on the shapes, not the values, so this stands for a
    long prompt without prefilling one. None when a layer keeps another cache (a rotating or
    quantized one), whose cost at length is not this."""
    from mlx_lm.models.cache import ArraysCache, KVCache
    have = cache_offset(cache)
    if have <= 0 or LONG_KV % have:
        return None
    out = []
    for c in cache:
        if type(c) is KVCache:
            keys, values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
            grown = KVCache()
            grown.update_and_fetch(mx.concatenate([keys] * (LONG_KV // have), axis=2),
                                   mx.concatenate([values] * (LONG_KV // have), axis=2))
            out.append(grown)
        elif isinstance(c, ArraysCache):
            out.append(c)
        else:
            return None
    mx.eval([(c.keys, c.values) for c in out if type(c) is KVCache])
    return out


def measure_long_cost(model: Any, cache: list[Any], grown: list[Any], plan: DispatchPlan,
                      sizes: tuple[int, ...], vocab: int, repeats: int) -> dict[int, float]:
    """``long_cost``: median over interleaved repeats of time(M-row verify forward on
    ``grown``) / time(1-row forward on ``cache``), every size in the shape ``plan`` gives it."""
    ids = _random_ids(max(sizes), vocab, 5)
    one_chunk = {m: replace(plan, max_chunk=m, kv_boundaries=()) for m in sizes}
    near: list[float] = []
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for r in range(repeats + 1):
        one = _timed_append(model, cache, ids[:1], plan)
        for m in sizes:
            dt = _timed_append(model, grown, ids[:m], one_chunk[m])
            if r:  # the first round warms up kernels and allocations
                times[m].append(dt)
        if r:
            near.append(one)
    base = statistics.median(near)
    return {m: round(statistics.median(t) / base, 3) for m, t in times.items()}


COST_TRIES = 3  # cost-curve measurements before a curve with some c(M) < 1 is judged
COST_NOISE = 0.05  # c(M) this far below 1 is timing noise around equal cost: stored as 1


class ImplausibleCost(UserError):
    """Every cost-curve measurement had some c(M) < 1 - COST_NOISE for M >= 2: an M-row forward
    timed clearly cheaper than a one-row forward, which only timing noise (a loaded machine)
    produces."""


def measure_plausible_cost(model: Any, cache: list[Any], sizes: tuple[int, ...], vocab: int,
                           repeats: int, shape: str = "native",
                           agree: Agree = _alone) -> dict[int, float]:
    """:func:`measure_cost` in append ``shape``, measured again while some c(M) < 1 for M >= 2 (an M-row forward
    costs at least a one-row forward), at most ``COST_TRIES`` times. The last measurement is
    kept with values within ``COST_NOISE`` below 1 raised to 1; one further below raises
    :class:`ImplausibleCost` naming what was measured. ``agree`` makes every rank re-measure
    (and refuse) together."""
    tries = []
    for _ in range(COST_TRIES):
        cost = measure_cost(model, cache, sizes, vocab, repeats, shape)
        tries.append(cost)
        if agree(all(c >= 1.0 for m, c in cost.items() if m >= 2)):
            return cost
    if agree(all(c >= 1.0 - COST_NOISE for m, c in cost.items() if m >= 2)):
        return {m: c if m < 2 else max(c, 1.0) for m, c in cost.items()}
    low = "; ".join(", ".join(f"c({m})={c:.2f}" for m, c in sorted(t.items()) if m >= 2 and c < 1)
                    for t in tries)
    raise ImplausibleCost(f"the cost curve measured an M-row forward cheaper than a one-row one "
                          f"in all {COST_TRIES} tries ({low}), which only timing noise gives: "
                          f"qualify again on a quieter machine")


def measure_round_overhead(model: Any, cache: list[Any], repeats: int, steps: int = 8,
                           stream: Any = None) -> float:
    """What a fill round costs beyond its rows, in plain steps: the median over repeats of
    time(synchronous 1-row append, its sample read, as a round does) / time(pipelined greedy
    step, as mlx-lm's ``generate_step`` decodes: the next forward is built while the current
    one computes) - 1, at least 0. Both on ``stream`` (default: mlx-lm's generation stream),
    on ``cache``, restored after every run."""
    stream = generation_stream if stream is None else stream
    plan = DispatchPlan(key=None, max_chunk=1, qualified=True)

    def step(y: mx.array) -> mx.array:
        logits = model(y[None], cache=cache)[:, -1, :]
        return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)

    def pipelined() -> float:
        cp = checkpoint(model, cache, plan)
        with mx.stream(stream):
            nxt = step(mx.array([1]))
            mx.async_eval(nxt)
            t0 = time.perf_counter()
            for _ in range(steps):
                cur, nxt = nxt, step(nxt)
                mx.async_eval(nxt)
                cur.item()
            dt = time.perf_counter() - t0
            mx.eval(nxt)
        restore(cp)
        return dt

    def synchronous() -> float:
        cp = checkpoint(model, cache, plan)
        token = 1
        with mx.stream(stream):
            t0 = time.perf_counter()
            for _ in range(steps):
                rows = append(model, cache, [token], plan=plan, logits="all", record=cp)
                token = mx.argmax(rows[-1], axis=-1).item()
            dt = time.perf_counter() - t0
        rewind(cp, 0)
        return dt

    ratios = []
    for r in range(repeats + 1):
        _step()
        p, s = pipelined(), synchronous()
        if r:  # the first round warms up kernels and allocations
            ratios.append(s / p)
    return round(max(0.0, statistics.median(ratios) - 1.0), 3)


def vocab_of(model: Any) -> int:
    """The model's vocabulary size: from its mlx-lm configuration
    (:func:`~mlx_fill.core.model_folder.vocab_size`), else one forward's logits."""
    return vocab_size(model) or int(model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1])


def qualify(model: Any, *, quick: bool, vocab: int | None = None, repeats: int | None = None,
            bar: bool = True, note: str = "", agree: Agree = _alone,
            budget_s: float | None = None, prior: DispatchPlan | None = None,
            stream: Any = None) -> tuple[DispatchPlan, list[Check]]:
    """Measure exactness and cost for ``model`` on the default device; return the plan, keyed
    by :func:`~mlx_fill.core.plan.config_key` as measured here. ``bar``: a tqdm bar on stderr (when
    it is a terminal); ``note`` is stored in the plan with the date. ``agree``: see
    :func:`check_exactness`; with it every rank of a sharded model runs the same forwards (the
    cost curve is each rank's own timing; :func:`~mlx_fill.core.shared.share_plan` keeps rank
    0's). ``budget_s``: stop starting new chunk sizes after that many seconds; the plan then
    lists the rest as ``pending``, and a later call with it as ``prior`` measures only those
    (keeping its cost curve, ``max_chunk`` and cuts). ``stream``: where the round overhead is
    timed (default: mlx-lm's generation stream; a background measurement passes its own).

    Raises :class:`Stopped` when the process exits meanwhile (:func:`stop_measuring`) and
    :class:`ImplausibleCost` when every cost measurement was timing noise (a plan measured on a
    machine too loaded to time it is not one to keep); never raises on a model or cache it
    cannot measure: it prints one line on stderr and returns a plan with ``max_chunk=1`` and
    the ``reason`` (serial decoding, always exact), qualified (kept) where the primitive
    refuses the cache (:class:`~mlx_fill.core.primitive.Unsupported`, a property of the model)
    and not qualified (measured again at the next first use) for any other failure."""
    stamp = f"{'quick' if quick else 'full'} qualify, {date.today().isoformat()}"
    note = f"{note}; {stamp}" if note else stamp
    key = None
    try:
        key = config_key(model)
        return _measure(model, key, quick=quick, vocab=vocab, repeats=repeats, bar=bar,
                        note=note, agree=agree, budget_s=budget_s, prior=prior, stream=stream)
    except (Stopped, ImplausibleCost):
        raise
    except Exception as e:  # noqa: BLE001 -- a model qualify cannot measure gets serial decoding
        reason = str(e) if isinstance(e, Unsupported) else f"{type(e).__name__}: {e}"
        print(f"mlx-fill qualify: cannot measure chunked appends ({reason}); the plan is "
              "max_chunk=1, one token per forward", file=sys.stderr, flush=True)
        return DispatchPlan(key=key, max_chunk=1, reason=reason, note=note,
                            qualified=key is not None and isinstance(e, Unsupported)), []


def _measure(model: Any, key: PlanKey, *, quick: bool, vocab: int | None, repeats: int | None,
             bar: bool, note: str, agree: Agree, budget_s: float | None,
             prior: DispatchPlan | None, stream: Any) -> tuple[DispatchPlan, list[Check]]:
    """:func:`qualify`'s measurement: the cost curve (unless ``prior`` has one), then the
    exactness checks of the sizes left, size by size until ``budget_s`` is spent."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    check_supported(make_prompt_cache(model))
    sizes = QUICK_SIZES if quick else FULL_SIZES
    kv_lengths = QUICK_KV if quick else FULL_KV
    vocab = vocab or vocab_of(model)
    rings = ring_lengths(ring_window(make_prompt_cache(model)))
    repeats = repeats or (3 if quick else 7)
    cache = cost_cache(model, vocab)  # grown once: both measures run on it
    costs = {shape: measure_plausible_cost(model, cache, sizes, vocab, repeats, shape, agree)
             for shape in SHAPES}
    overhead = measure_round_overhead(model, cache, repeats, stream=stream)
    todo = prior.pending if prior is not None else sizes
    floor = prior.max_chunk if prior is not None else 1
    bounds = prior.kv_boundaries if prior is not None else ()
    from tqdm import tqdm
    with tqdm(total=(len(kv_lengths) + len(rings)) * (len(todo) - 1) * 2, desc="exactness",
              file=sys.stderr, disable=None if bar else True) as progress:
        checks, pending = check_exactness(model, todo, kv_lengths, vocab, progress,
                                          stop_after_failure=key.backend == "cpu", agree=agree,
                                          rings=rings, deadline=deadline, shapes=SHAPES,
                                          costs=costs if agree is _alone else None)
    earlier = prior.shapes if prior is not None else {}
    plan = derive_plan(key, checks, todo, floor=floor, boundaries=bounds, shapes=earlier,
                       cost=costs)
    if plan.max_chunk > floor and not confirm_plan(model, plan, kv_lengths, vocab, agree, rings):
        plan = replace(plan, max_chunk=floor, kv_boundaries=bounds, shapes=earlier)
    measured = max((c.size for c in checks), default=floor)
    cost = {m: costs[plan.shape_for(m)][m] for m in costs["native"]}
    grown = long_cache(model, cache)
    long_cost = ({} if grown is None else
                 measure_long_cost(model, cache, grown, plan, sizes, vocab, repeats))
    return replace(plan, cost=cost, round_overhead=overhead, note=note, cost_kv=COST_KV,
                   long_kv=LONG_KV if long_cost else 0, long_cost=long_cost,
                   pending=pending if plan.max_chunk == max(measured, floor) else ()), checks


def format_table(plan: DispatchPlan, checks: list[Check]) -> str:
    sizes = sorted({c.size for c in checks} | {m for m in plan.cost if m > 1})
    kvs = sorted({(c.ring, c.kv) for c in checks})
    head = "KV \\ M " + " ".join(f"{m:>4}" for m in sizes)
    lines = [*format_key(plan.key), "exact (chunk crossing / starting at the KV length; "
             "per start native then batched-m1):", head]
    for ring, kv in kvs:
        cells = []
        for m in sizes:
            mine = [c for c in checks if c.size == m and c.kv == kv and c.ring == ring]
            cells.append(f"{''.join('y' if c.exact else 'N' for c in mine):>4}")
        lines.append(f"{kv:>5}{'r' if ring else ' '} " + " ".join(cells))
    lines.append("(blank: not checked, a smaller size had failed; r: reached by decoding, the "
                 "chunk crossing a sliding-window ring's end)")
    lines.append("c(M) = time(M-row forward) / time(1-row forward), at a KV length:")
    lines.append("  " + format_cost(plan))
    lines.append(f"plan: mode=exact max_chunk={plan.max_chunk} "
                 f"kv_boundaries={list(plan.kv_boundaries)}")
    if plan.shapes:
        lines.append("append shapes: " + "  ".join(f"{m}={s}" for m, s in
                                                    sorted(plan.shapes.items())))
    if plan.pending:
        lines.append(f"pending (budget spent; measured by a later qualify): sizes "
                     f"{list(plan.pending)}")
    if plan.reason:
        lines.append(f"not measured: {plan.reason}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=model_dir, help="mlx-lm model directory")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and KV lengths")
    parser.add_argument("--out", type=replaced_file, default=None,
                        help="plan file (default: the user cache's plans/ dir)")
    parser.add_argument("--repeats", type=int_up_to(MAX_REPEATS), default=None,
                        help=f"timing repeats per size, at most {MAX_REPEATS} (default: 3 with "
                             f"--quick, else 7)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the floating-point weights after loading, as a server or "
                             "script that runs the model in that dtype does (default: as stored)")


def run(args: argparse.Namespace) -> int:
    from mlx_fill.core.model_folder import load_model_folder

    problem = None if args.out is not None else unwritable(cached_dir())
    if problem:  # before minutes of measuring, not after
        raise UserError(f"cannot write the plan into the user cache: {problem}; set "
                        f"MLX_FILL_CACHE to a writable folder or pass --out")
    model, config = load_model_folder(args.model, tokenizer=False)
    if args.dtype is not None:
        model.set_dtype(getattr(mx, args.dtype))
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    plan, checks = qualify(model, quick=args.quick, vocab=int(vocab) if vocab else None,
                           repeats=args.repeats,
                           note=f"mlx-fill qualify on {Path(args.model).name}"
                                + (f" cast to {args.dtype}" if args.dtype else ""))
    print(format_table(plan, checks))
    print(f"wrote {save_plan(plan, args.out)}")
    return 0
