"""Which dispatch plan a model gets, qualifying it on first use; ``mlx-fill plan`` shows why.

:func:`resolve` looks the model's full :class:`~mlx_fill.core.plan.PlanKey` up (``$MLX_FILL_PLAN``,
the user cache, the plans shipped in the package). When none applies, or the one that applies
has sizes ``pending``, it starts a quick ``qualify`` of the loaded model in a background thread,
bounded by a budget (``$MLX_FILL_QUALIFY_BUDGET_S``, default 120 s: chunk sizes are measured
smallest first until it is spent, the rest by a later process), with one stderr line saying
what it does and for how long, and one when it is done; the plan is written to the user cache
under the full key (a process that exits first stops it at its next forward and saves
nothing; so does a measurement whose cost curve was only timing noise, a machine too loaded to
time, which the next first use measures again). Requests are served meanwhile: with the partial plan's sizes, else one token per
forward (:func:`~mlx_fill.core.plan.unqualified`, serial decoding itself). The outcome is kept
for the life of the process, so a configuration is looked up once per process and qualified
once per machine. A model ``qualify`` cannot measure gets a plan with ``max_chunk=1`` and the
reason.

The measurement runs on its own MLX stream and, one model at a time, beside the requests being
served (MLX 0.32 evaluates from several threads; each thread's default stream is its own).
Entry points resolve once: ``build_session`` per request (the session carries the plan to the
decode loop), ``mlx-fill serve`` and the ``MLX_FILL`` hook in ``mlx_lm.server`` when the model
is loaded, so a server starts qualifying before its first request.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from .errors import UserError, model_dir
from .plan import (
    DispatchPlan,
    Lookup,
    cached_dir,
    config_key,
    env_plan_problem,
    find_plan,
    format_cost,
    format_key,
    save_plan,
    shipped_dir,
    unqualified,
)

log = logging.getLogger("mlx_fill")


@dataclass(frozen=True)
class Resolution:
    """The plan a model gets and where it came from: ``source`` is ``MLX_FILL_PLAN``,
    ``cached`` or ``shipped`` (found at ``path``), ``qualified now`` (measured in this process,
    saved at ``path``, in ``seconds``), ``qualifying`` (measuring in the background; one token
    per forward meanwhile) or ``unqualified`` (``reason`` says why)."""

    plan: DispatchPlan
    source: str
    path: Path | None
    lookup: Lookup
    seconds: float = 0.0
    reason: str = ""


_resolved: dict[tuple[Any, ...], Resolution] = {}
_lock = threading.Lock()
_measuring: dict[tuple[Any, ...], threading.Thread] = {}  # memo -> its running measurement
_one_at_a_time = threading.Lock()  # a process measures one model at a time
DEFAULT_BUDGET_S = 120.0


def budget_s() -> float:
    """Seconds a first-use ``qualify`` may measure before it saves what it has
    (``$MLX_FILL_QUALIFY_BUDGET_S``, default 120); the sizes left are measured on a later
    first use (another process), each time with the same budget."""
    try:
        return max(0.0, float(os.environ.get("MLX_FILL_QUALIFY_BUDGET_S", DEFAULT_BUDGET_S)))
    except ValueError:
        return DEFAULT_BUDGET_S


def budget_problem() -> str | None:
    """Why ``$MLX_FILL_QUALIFY_BUDGET_S`` is no number of seconds (0 or more, finite), in one
    line naming the fix; None when it is one, or unset or empty."""
    budget = os.environ.get("MLX_FILL_QUALIFY_BUDGET_S")
    try:
        if not budget or 0 <= float(budget) < math.inf:
            return None
    except ValueError:
        pass
    return (f"MLX_FILL_QUALIFY_BUDGET_S={budget!r} is not a number of seconds (0 or more); set "
            f"it to e.g. 120 or unset it")


def _measure(model: Any, lookup: Lookup, prior: DispatchPlan | None, memo: tuple) -> None:
    """The background measurement: a budgeted quick qualify (continuing ``prior`` when it has
    sizes pending), saved under the full key, then the resolution every later call gets."""
    from . import qualify as measure
    t0 = time.perf_counter()
    outcome = Resolution(prior or unqualified(lookup.key), "unqualified", None, lookup,
                         reason="the measurement failed")
    try:
        with _one_at_a_time:
            stream = mx.new_stream(mx.default_device())
            with mx.stream(stream):
                plan, _ = measure.qualify(model, quick=True, bar=False, budget_s=budget_s(),
                                          prior=prior, note="qualified at first use",
                                          stream=stream)
        seconds = time.perf_counter() - t0
        path = save_plan(plan) if plan.key is not None else None
        left = f", sizes {list(plan.pending)} left for a later run" if plan.pending else ""
        print(f"mlx-fill: qualified in {seconds:.1f} s: max_chunk={plan.max_chunk}{left}"
              + (f", saved to {path}" if path else ""), file=sys.stderr, flush=True)
        outcome = Resolution(plan, "qualified now", path, lookup, seconds, reason=plan.reason)
    except measure.Stopped:
        outcome = replace(outcome, reason="stopped: the process exited first")
        print("mlx-fill: qualifying stopped, the process is exiting; nothing saved (the next "
              "first use measures again)", file=sys.stderr, flush=True)
    except measure.ImplausibleCost as e:
        outcome = replace(outcome, reason="the cost curve measured only timing noise")
        print(f"mlx-fill: qualifying measured only timing noise ({e}); nothing saved (the next "
              "first use measures again); "
              + (f"max_chunk={prior.max_chunk}" if prior else "one token per forward"),
              file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 -- a failed measurement must not fail decoding
        print(f"mlx-fill: qualifying failed ({type(e).__name__}: {e}); "
              + (f"max_chunk={prior.max_chunk}" if prior else "one token per forward"),
              file=sys.stderr, flush=True)
    finally:
        mx.clear_streams()  # this thread's streams: MLX aborts at exit on one left behind
        with _lock:
            _resolved[memo] = outcome
            _measuring.pop(memo, None)


def _start_measuring(model: Any, lookup: Lookup, prior: DispatchPlan | None,
                     memo: tuple) -> Resolution:
    """Start the background measurement (the caller holds ``_lock``); one stderr line says
    what it does and for how long. Returns what requests get meanwhile: ``prior`` (its
    measured sizes) or one token per forward."""
    key = lookup.key
    what = (f"measuring sizes {list(prior.pending)} left by an earlier run" if prior is not None
            else "qualifying this model once (quick)")
    print(f"mlx-fill: no complete dispatch plan for {key.backend} {key.dtype} "
          f"{key.shape.split()[0]} (BLAS {key.blas} {key.blas_version} {key.blas_core}".rstrip()
          + f"); {what} in the background: its cost curve, then chunk sizes for up to "
          f"{budget_s():.0f} s (MLX_FILL_QUALIFY_BUDGET_S); meanwhile "
          + (f"max_chunk={prior.max_chunk}" if prior is not None else "one token per forward"),
          file=sys.stderr, flush=True)
    from . import qualify  # noqa: F401 -- imported here: the exit hook may not import
    # weights a lazy cast (``model.set_dtype``) left as a graph on this thread's stream: the
    # measuring thread could not evaluate them ("There is no Stream(cpu, 0) in current thread")
    mx.eval(model.parameters())
    atexit.unregister(_stop_at_exit)  # registered once however many measurements start
    atexit.register(_stop_at_exit)
    thread = threading.Thread(target=_measure, args=(model, lookup, prior, memo), daemon=True,
                              name="mlx-fill-qualify")
    _measuring[memo] = thread
    thread.start()
    if prior is not None:
        return Resolution(prior, "cached", None, lookup, reason="sizes pending")
    return Resolution(unqualified(key), "qualifying", None, lookup,
                      reason="qualifying in the background")


EXIT_WAIT_S = 60.0  # how long exit waits for a stopped measurement's last step


def _stop_at_exit() -> None:
    """At interpreter exit, stop the background measurements at their next step and wait for
    them (registered with the first one). Nothing partly measured is saved; the next first use
    measures again."""
    from .qualify import stop_measuring
    stop_measuring()
    wait_qualified(timeout=EXIT_WAIT_S)


def wait_qualified(timeout: float | None = None) -> bool:
    """Wait for every background measurement; False when one still runs at ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _lock:
            threads = list(_measuring.values())
        if not threads:
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        threads[0].join(left)


def resolve(model: Any, *, qualify: bool = True, wait: bool = False) -> Resolution:
    """The plan for ``model`` on the current device (see the module docstring). With
    ``qualify=False`` a missing plan is reported as ``unqualified`` and nothing is measured.
    Otherwise a missing (or partly measured) plan is measured in a background thread and this
    call returns at once with what applies meanwhile; ``wait`` blocks until that measurement
    is done and returns its outcome. Thread-safe; the outcome is memoised per key and per plan
    locations."""
    key = config_key(model)
    memo = (key, os.environ.get("MLX_FILL_PLAN", ""), str(cached_dir()), str(shipped_dir()))
    with _lock:
        found = _resolved.get(memo)
        if found is None:
            lookup = find_plan(key)
            chosen = lookup.chosen
            prior = chosen.plan if chosen is not None else None
            if prior is not None and prior.complete:
                found = _resolved[memo] = Resolution(prior, chosen.origin, chosen.path, lookup)
            elif not qualify and prior is None:
                return Resolution(unqualified(key), "unqualified", None, lookup,
                                  reason="no plan applies and qualifying was not asked for")
            elif not qualify:
                return Resolution(prior, chosen.origin, chosen.path, lookup,
                                  reason="sizes pending")
            else:
                found = _resolved[memo] = _start_measuring(model, lookup, prior, memo)
        running = _measuring.get(memo)
    if wait and running is not None:
        running.join()
        with _lock:
            return _resolved[memo]
    return found


SHARED_PLAN = "_mlx_fill_plan"  # the model attribute holding the plan its ranks share


def _shared_plan(model: Any, ranks: Any) -> DispatchPlan:
    """The plan every rank of a sharded model uses (:func:`~mlx_fill.core.shared.share_plan`):
    rank 0's lookup, else a quick qualify in lockstep, saved by rank 0 only. Kept on the model
    so later requests exchange nothing."""
    from .qualify import ImplausibleCost, qualify
    from .shared import share_plan

    def lookup() -> DispatchPlan | None:
        res = resolve(model, qualify=False)
        return res.plan if res.source != "unqualified" else None

    def measure() -> DispatchPlan:
        try:
            plan, _ = qualify(model, quick=True, bar=False, agree=ranks.all,
                              note=f"qualified at first use, rank 0 of {ranks.size}")
        except ImplausibleCost as e:  # raised on every rank alike (``agree``)
            if ranks.root:
                print(f"mlx-fill: qualifying the sharded model measured only timing noise ({e}); "
                      "nothing saved (the next start measures again); one token per forward",
                      file=sys.stderr, flush=True)
            return replace(unqualified(config_key(model)), reason=str(e))
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
    same on every rank; every rank must then call this at the same point the first time.
    TypeError for a ``model`` that is no loaded model (one without an ``nn.Module``'s
    ``parameters()``; a wrapper that delegates to a model is one)."""
    if not callable(getattr(model, "parameters", None)):
        raise TypeError(f"model: expected a loaded mlx-lm model (an mlx.nn.Module), got "
                        f"{type(model).__name__}")
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
    lines = [f"plan: mode={plan.mode} max_chunk={plan.max_chunk} "
             f"kv_boundaries={list(plan.kv_boundaries)}", format_cost(plan)]
    if res.source == "qualified now":
        lines.append(f"source: qualified now ({res.seconds:.1f} s), saved to {res.path}")
    elif res.path is not None:
        lines.append(f"source: {res.source} {res.path}")
    else:
        lines.append(f"source: {res.source}, one token per forward: {res.reason}")
    if plan.pending:
        lines.append(f"pending: sizes {list(plan.pending)} not measured yet")
    if plan.reason:
        lines.append(f"not measured: {plan.reason}")
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
    from mlx_fill.core.model_folder import load_model_folder

    if problem := env_plan_problem() or budget_problem():
        raise UserError(problem)
    model, _ = load_model_folder(args.model, tokenizer=False)
    print(format_resolution(resolve(model, qualify=not args.no_qualify, wait=True)))
    return 0
