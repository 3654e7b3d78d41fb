"""Which dispatch plan a model gets, qualifying it on first use; ``mlx-fill plan`` shows why.

:func:`resolve` looks the model's full :class:`~mlx_fill.core.plan.PlanKey` up (``$MLX_FILL_PLAN``,
the user cache, the plans shipped in the package). When none applies, it runs a quick
``qualify`` on the loaded model (one progress line on stderr), writes the plan to the user cache
under the full key and uses it. The outcome is kept for the life of the process, so a
configuration is looked up once per process and qualified once per machine. Until a plan
exists (qualifying disabled, an unsupported cache type, or a failed measurement), appends go
one token per forward (:func:`~mlx_fill.core.plan.unqualified`): serial decoding itself.

Entry points resolve once: ``build_session`` per request (the session carries the plan to the
decode loop), ``mlx-fill serve`` and the ``MLX_FILL`` hook in ``mlx_lm.server`` when the model
is loaded, so a server qualifies before its first fill request.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import model_dir
from .plan import (
    DispatchPlan,
    Lookup,
    cached_dir,
    config_key,
    find_plan,
    format_key,
    save_plan,
    shipped_dir,
    unqualified,
)

log = logging.getLogger("mlx_fill")


@dataclass(frozen=True)
class Resolution:
    """The plan a model gets and where it came from: ``source`` is ``MLX_FILL_PLAN``,
    ``cached`` or ``shipped`` (found at ``path``), ``qualified now`` (measured by this call,
    saved at ``path``, in ``seconds``), or ``unqualified`` (``reason`` says why)."""

    plan: DispatchPlan
    source: str
    path: Path | None
    lookup: Lookup
    seconds: float = 0.0
    reason: str = ""


_resolved: dict[tuple[Any, ...], Resolution] = {}
_lock = threading.Lock()


def _qualify_now(model: Any, lookup: Lookup) -> Resolution:
    """Quick-qualify ``model``, save the plan under its key, say so on one stderr line."""
    from mlx_lm.models.cache import make_prompt_cache

    from .primitive import Unsupported, check_supported
    from .qualify import qualify
    try:
        check_supported(make_prompt_cache(model))
    except Unsupported as e:
        return Resolution(unqualified(lookup.key), "unqualified", None, lookup,
                          reason=f"fill does not support this cache ({e.reason})")
    key = lookup.key
    print(f"mlx-fill: no dispatch plan for {key.backend} {key.dtype} {key.shape.split()[0]} "
          f"(BLAS {key.blas} {key.blas_version} {key.blas_core}".rstrip() + "); qualifying "
          "this model once (quick), one token per forward until done ...",
          end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        plan, _ = qualify(model, quick=True, bar=False, note="qualified at first use")
        path = save_plan(plan)
    except Exception as e:  # noqa: BLE001 -- a failed measurement must not fail decoding
        print(f" failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return Resolution(unqualified(key), "unqualified", None, lookup,
                          reason=f"qualify failed ({type(e).__name__}: {e})")
    seconds = time.perf_counter() - t0
    print(f" done in {seconds:.1f} s: max_chunk={plan.max_chunk}, saved to {path}",
          file=sys.stderr, flush=True)
    return Resolution(plan, "qualified now", path, lookup, seconds)


def resolve(model: Any, *, qualify: bool = True) -> Resolution:
    """The plan for ``model`` on the current device (see the module docstring). With
    ``qualify=False`` a missing plan is reported as ``unqualified`` and nothing is measured.
    Thread-safe; the outcome is memoised per key and per plan locations."""
    key = config_key(model)
    memo = (key, os.environ.get("MLX_FILL_PLAN", ""), str(cached_dir()), str(shipped_dir()))
    with _lock:
        if memo in _resolved:
            return _resolved[memo]
        lookup = find_plan(key)
        chosen = lookup.chosen
        if chosen is not None and chosen.plan is not None:
            found = Resolution(chosen.plan, chosen.origin, chosen.path, lookup)
        elif not qualify:
            return Resolution(unqualified(key), "unqualified", None, lookup,
                              reason="no plan applies and qualifying was not asked for")
        else:
            found = _qualify_now(model, lookup)
        _resolved[memo] = found
        return found


SHARED_PLAN = "_mlx_fill_plan"  # the model attribute holding the plan its ranks share


def _shared_plan(model: Any, ranks: Any) -> DispatchPlan:
    """The plan every rank of a sharded model uses (:func:`~mlx_fill.core.shared.share_plan`):
    rank 0's lookup, else a quick qualify in lockstep, saved by rank 0 only. Kept on the model
    so later requests exchange nothing."""
    from .qualify import qualify
    from .shared import share_plan

    def lookup() -> DispatchPlan | None:
        res = resolve(model, qualify=False)
        return res.plan if res.source != "unqualified" else None

    def measure() -> DispatchPlan:
        plan, _ = qualify(model, quick=True, bar=False, agree=ranks.all,
                          note=f"qualified at first use, rank 0 of {ranks.size}")
        if ranks.root:
            print(f"mlx-fill: qualified the sharded model: max_chunk={plan.max_chunk}, "
                  f"saved to {save_plan(plan)}", file=sys.stderr, flush=True)
        return plan

    plan = share_plan(ranks, lookup, measure)
    setattr(model, SHARED_PLAN, plan)
    return plan


def plan_for(model: Any, group: Any = None) -> DispatchPlan:
    """:func:`resolve`'s plan (exact mode): what a request on ``model`` appends with. With a
    distributed ``group`` of more than one rank (a sharded model), the plan rank 0 chose, the
    same on every rank; every rank must then call this at the same point the first time."""
    shared = getattr(model, SHARED_PLAN, None)
    if shared is not None:
        return shared
    from .shared import ranks_of
    ranks = ranks_of(group)
    if ranks is not None:
        return _shared_plan(model, ranks)
    return resolve(model).plan


def prepare(model: Any, group: Any = None) -> None:
    """Resolve (and if needed qualify) ``model``'s plan now, as a server does at start-up; a
    failure is logged, never raised (requests then decode one token per forward). ``group``:
    as in :func:`plan_for` (every rank prepares together)."""
    try:
        plan_for(model, group)
    except Exception as e:  # noqa: BLE001 -- start-up must not fail on the plan
        log.warning("mlx-fill: no dispatch plan (%s: %s); one token per forward",
                    type(e).__name__, e)


def plan_source(model: Any) -> str:
    """One line: the plan ``model`` has here and where it came from (resolved already, e.g. by
    :func:`prepare`; nothing is measured). For a start-up log: a failure is described, never
    raised."""
    try:
        res = resolve(model, qualify=False)
    except Exception as e:  # noqa: BLE001 -- a log line must not fail start-up
        return f"no dispatch plan ({type(e).__name__}: {e})"
    where = f"{res.source} {res.path}" if res.path is not None else f"unqualified: {res.reason}"
    return f"dispatch plan max_chunk={res.plan.max_chunk} from {where}"


def format_resolution(res: Resolution) -> str:
    """What ``mlx-fill plan`` prints: the plan, its source, its key, every other candidate."""
    plan = res.plan
    cost = "  ".join(f"c({m})={c:.2f}" for m, c in sorted(plan.cost.items())) or "none measured"
    lines = [f"plan: mode={plan.mode} max_chunk={plan.max_chunk} "
             f"kv_boundaries={list(plan.kv_boundaries)}",
             f"cost: {cost}  round overhead={plan.round_overhead:.2f}"]
    if res.source == "qualified now":
        lines.append(f"source: qualified now ({res.seconds:.1f} s), saved to {res.path}")
    elif res.path is not None:
        lines.append(f"source: {res.source} {res.path}")
    else:
        lines.append(f"source: unqualified, one token per forward: {res.reason}")
    if plan.note:
        lines.append(f"note: {plan.note}")
    lines += format_key(res.lookup.key)
    others = [c for c in res.lookup.candidates if c.path != res.path]
    lines.append("other plans:" if others else "other plans: none")
    for c in others:
        lines.append(f"  {c.origin} {c.path}: {c.problem or 'applies too (an earlier one wins)'}")
        if c.plan is not None and c.plan.key is not None and (c.problem or "").startswith("key"):
            for name in c.plan.key.differences(res.lookup.key):
                lines.append(f"      {name}: {getattr(c.plan.key, name)!r} in the plan, "
                             f"{getattr(res.lookup.key, name)!r} here")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=model_dir, help="mlx-lm model directory")
    parser.add_argument("--no-qualify", action="store_true",
                        help="only look plans up; do not qualify when none applies")


def run(args: argparse.Namespace) -> int:
    from mlx_lm.utils import load_model

    model, _ = load_model(args.model)
    print(format_resolution(resolve(model, qualify=not args.no_qualify)))
    return 0
