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
import time
from datetime import date
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from .errors import UserError, model_dir, positive_int
from .exactness import arrays_equal, cache_content
from .plan import DispatchPlan, PlanKey, config_key, format_key, save_plan
from .primitive import (Unsupported, append, cache_offset, check_supported, checkpoint,
                        restore, rewind)

FULL_SIZES = tuple(range(1, 17)) + (32,)
QUICK_SIZES = (1, 2, 3, 4, 8, 16)
# KV allocation grows in steps of 256; CUDA's cuDNN SDPA switches on kL % 256 and kL >= 256;
# Metal's 2-pass attention switches at kL 1024 / 4096; powers of two cover the rest. The quick
# set reaches 512: OpenBLAS (Haswell kernels) rounds 2- and 3-row attention products
# differently from one row at KV 384, 512, 768, 1024, 2048 but not at 0-257 (qwen3-json).
FULL_KV = (0, 1, 255, 256, 257, 511, 512, 1023, 1024, 2048, 4095, 4096, 8192)
QUICK_KV = (0, 1, 255, 256, 257, 511, 512)
COST_KV = 512
Agree = Callable[[bool], bool]


def _alone(verdict: bool) -> bool:
    """One process: its own verdict."""
    return verdict


@dataclass
class Check:
    size: int
    kv: int
    start: int
    exact: bool


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()


def _grow(model: Any, cache: list[Any], length: int, vocab: int) -> None:
    """Extend ``cache`` to ``length`` tokens with one prompt forward of seeded random ids."""
    have = cache_offset(cache) if cache else 0
    if length > have:
        model(mx.array(_random_ids(length - have, vocab, length))[None], cache=cache)
        mx.eval([c.state for c in cache])


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
                    agree: Agree = _alone) -> list[Check]:
    """Run every (M, L) check: a chunk starting at L and one crossing L (start L - M//2).
    ``stop_after_failure`` (where any failure makes a size inexact, see :func:`derive_plan`):
    once a size fails, that size and larger ones are not checked again. ``agree`` turns this
    rank's verdict into the verdict of every rank (a sharded model: exact only where every rank
    is), so every rank runs the same checks in lockstep."""
    checks: list[Check] = []
    failed = max(sizes) + 1  # smallest size found inexact so far
    for kv in kv_lengths:
        cache = make_prompt_cache(model)
        for start in sorted({s for m in sizes if m > 1 for s in (kv, max(0, kv - m // 2))}):
            _grow(model, cache, start, vocab)
            for m in sizes:
                if m == 1 or start not in (kv, max(0, kv - m // 2)):
                    continue
                if progress:
                    progress.update(1)
                if stop_after_failure and m >= failed:
                    continue
                plan = DispatchPlan(key=None, max_chunk=m, qualified=True)
                ids = _random_ids(m, vocab, 7 * m + start)
                checks.append(Check(m, kv, start, agree(_exact(model, cache, ids, plan))))
                if not checks[-1].exact:
                    failed = min(failed, m)
    return checks


def derive_plan(key: PlanKey, checks: list[Check], sizes: tuple[int, ...]) -> DispatchPlan:
    """Largest M exact at every start that does not cross a KV length; KV lengths crossed by a
    failing chunk become boundaries. On the CPU backend, where no kernel switches at a KV
    length, any failing check makes M inexact: a BLAS that rounds M rows differently at one
    tested length does so wherever the data brings it out, also at untested lengths (OpenBLAS
    does; see the CHANGELOG), which a list of boundaries cannot describe."""
    boundaries: set[int] = set()
    max_chunk = 1
    on_cpu = key is not None and key.backend == "cpu"
    for m in sorted(s for s in sizes if s > 1):
        mine = [c for c in checks if c.size == m]
        if not all(c.exact for c in mine if c.start == c.kv or on_cpu):
            break
        crossing_failures = {c.kv for c in mine if not c.exact and c.start < c.kv}
        boundaries |= crossing_failures
        max_chunk = m
    return DispatchPlan(key=key, mode="exact", max_chunk=max_chunk,
                        kv_boundaries=tuple(sorted(boundaries)), qualified=True)


def confirm_plan(model: Any, plan: DispatchPlan, kv_lengths: tuple[int, ...], vocab: int,
                 agree: Agree = _alone) -> bool:
    """Re-check the derived plan (with its cuts) on chunks crossing every tested KV length."""
    m = plan.max_chunk
    cache = make_prompt_cache(model)
    for kv in kv_lengths:
        _grow(model, cache, max(0, kv - m // 2), vocab)
        if not agree(_exact(model, cache, _random_ids(m, vocab, 31 * m + kv), plan)):
            return False
    return True


def measure_cost(model: Any, cache: list[Any], sizes: tuple[int, ...], vocab: int,
                 repeats: int) -> dict[int, float]:
    """c(M): median over interleaved repeats of time(M-row verify forward) / time(1-row), on
    ``cache`` (left as it was)."""
    plan = DispatchPlan(key=None, max_chunk=max(sizes), qualified=True)
    times: dict[int, list[float]] = {m: [] for m in sizes}
    ids = _random_ids(max(sizes), vocab, 3)
    for r in range(repeats + 1):
        for m in sizes:
            cp = checkpoint(model, cache, plan)
            t0 = time.perf_counter()
            mx.eval(append(model, cache, ids[:m], plan=plan, logits="all", record=cp))
            dt = time.perf_counter() - t0
            rewind(cp, 0)
            if r:  # the first round warms up kernels and allocations
                times[m].append(dt)
    one = statistics.median(times[1])
    return {m: round(statistics.median(t) / one, 3) for m, t in times.items()}


COST_TRIES = 3  # cost-curve measurements before a curve with some c(M) < 1 is judged
COST_NOISE = 0.05  # c(M) this far below 1 is timing noise around equal cost: stored as 1


class ImplausibleCost(UserError):
    """Every cost-curve measurement had some c(M) < 1 - COST_NOISE for M >= 2: an M-row forward
    timed clearly cheaper than a one-row forward, which only timing noise (a loaded machine)
    produces."""


def measure_plausible_cost(model: Any, cache: list[Any], sizes: tuple[int, ...], vocab: int,
                           repeats: int, agree: Agree = _alone) -> dict[int, float]:
    """:func:`measure_cost`, measured again while some c(M) < 1 for M >= 2 (an M-row forward
    costs at least a one-row forward), at most ``COST_TRIES`` times. The last measurement is
    kept with values within ``COST_NOISE`` below 1 raised to 1; one further below raises
    :class:`ImplausibleCost` naming what was measured. ``agree`` makes every rank re-measure
    (and refuse) together."""
    tries = []
    for _ in range(COST_TRIES):
        cost = measure_cost(model, cache, sizes, vocab, repeats)
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


def measure_round_overhead(model: Any, cache: list[Any], repeats: int, steps: int = 8) -> float:
    """What a fill round costs beyond its rows, in plain steps: the median over repeats of
    time(synchronous 1-row append, its sample read, as a round does) / time(pipelined greedy
    step, as mlx-lm's ``generate_step`` decodes: the next forward is built while the current
    one computes) - 1, at least 0. Both on mlx-lm's generation stream, on ``cache``, restored
    after every run."""
    plan = DispatchPlan(key=None, max_chunk=1, qualified=True)

    def step(y: mx.array) -> mx.array:
        logits = model(y[None], cache=cache)[:, -1, :]
        return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)

    def pipelined() -> float:
        cp = checkpoint(model, cache, plan)
        with mx.stream(generation_stream):
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
        with mx.stream(generation_stream):
            t0 = time.perf_counter()
            for _ in range(steps):
                rows = append(model, cache, [token], plan=plan, logits="all", record=cp)
                token = mx.argmax(rows[-1], axis=-1).item()
            dt = time.perf_counter() - t0
        rewind(cp, 0)
        return dt

    ratios = []
    for r in range(repeats + 1):
        p, s = pipelined(), synchronous()
        if r:  # the first round warms up kernels and allocations
            ratios.append(s / p)
    return round(max(0.0, statistics.median(ratios) - 1.0), 3)


def vocab_of(model: Any) -> int:
    """The model's vocabulary size: from its mlx-lm configuration, else one forward's logits."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for value in (getattr(args, "vocab_size", None), (text or {}).get("vocab_size")):
        if value:
            return int(value)
    return int(model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1])


def qualify(model: Any, *, quick: bool, vocab: int | None = None, repeats: int | None = None,
            bar: bool = True, note: str = "", agree: Agree = _alone,
            ) -> tuple[DispatchPlan, list[Check]]:
    """Measure exactness and cost for ``model`` on the default device; return the plan, keyed
    by :func:`~mlx_fill.core.plan.config_key` as measured here. ``bar``: a tqdm bar on stderr (when
    it is a terminal); ``note`` is stored in the plan with the date. ``agree``: see
    :func:`check_exactness`; with it every rank of a sharded model runs the same forwards (the
    cost curve is each rank's own timing; :func:`~mlx_fill.core.shared.share_plan` keeps rank
    0's)."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    kv_lengths = QUICK_KV if quick else FULL_KV
    vocab = vocab or vocab_of(model)
    key = config_key(model)
    from tqdm import tqdm
    with tqdm(total=len(kv_lengths) * (len(sizes) - 1) * 2, desc="exactness", file=sys.stderr,
              disable=None if bar else True) as progress:
        checks = check_exactness(model, sizes, kv_lengths, vocab, progress,
                                 stop_after_failure=key.backend == "cpu", agree=agree)
    plan = derive_plan(key, checks, sizes)
    if plan.max_chunk > 1 and not confirm_plan(model, plan, kv_lengths, vocab, agree):
        plan = replace(plan, max_chunk=1, kv_boundaries=())
    repeats = repeats or (3 if quick else 7)
    cache = make_prompt_cache(model)  # grown once: both measures run at KV length COST_KV
    _grow(model, cache, COST_KV, vocab)
    cost = measure_plausible_cost(model, cache, sizes, vocab, repeats, agree)
    overhead = measure_round_overhead(model, cache, repeats)
    stamp = f"{'quick' if quick else 'full'} qualify, {date.today().isoformat()}"
    plan = replace(plan, cost=cost, round_overhead=overhead,
                   note=f"{note}; {stamp}" if note else stamp)
    return plan, checks


def format_table(plan: DispatchPlan, checks: list[Check]) -> str:
    sizes = sorted({c.size for c in checks} | {m for m in plan.cost if m > 1})
    kvs = sorted({c.kv for c in checks})
    head = "KV \\ M " + " ".join(f"{m:>4}" for m in sizes)
    lines = [*format_key(plan.key), "exact (chunk crossing / starting at the KV length):",
             head]
    for kv in kvs:
        cells = []
        for m in sizes:
            mine = [c for c in checks if c.size == m and c.kv == kv]
            cells.append(f"{''.join('y' if c.exact else 'N' for c in mine):>4}")
        lines.append(f"{kv:>6} " + " ".join(cells))
    lines.append("(blank: not checked, a smaller size had failed)")
    lines.append("cost c(M) = time(M-row forward) / time(1-row forward):")
    lines.append("  " + "  ".join(f"c({m})={c:.2f}" for m, c in sorted(plan.cost.items()))
                 + f"  round overhead={plan.round_overhead:.2f}")
    lines.append(f"plan: mode=exact max_chunk={plan.max_chunk} "
                 f"kv_boundaries={list(plan.kv_boundaries)}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=model_dir, help="mlx-lm model directory")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and KV lengths")
    parser.add_argument("--out", type=Path, default=None,
                        help="plan file (default: the user cache's plans/ dir)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timing repeats per size (default: 3 with --quick, else 7)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the floating-point weights after loading, as a server or "
                             "script that runs the model in that dtype does (default: as stored)")


def run(args: argparse.Namespace) -> int:
    from mlx_lm.utils import load_model

    model, config = load_model(args.model)
    if args.dtype is not None:
        model.set_dtype(getattr(mx, args.dtype))
    try:
        check_supported(make_prompt_cache(model))
    except Unsupported as e:
        print(f"mlx-fill qualify: unsupported cache for fill: {e}", file=sys.stderr)
        return 2
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    plan, checks = qualify(model, quick=args.quick, vocab=vocab, repeats=args.repeats,
                           note=f"mlx-fill qualify on {Path(args.model).name}"
                                + (f" cast to {args.dtype}" if args.dtype else ""))
    print(format_table(plan, checks))
    print(f"wrote {save_plan(plan, args.out)}")
    return 0
