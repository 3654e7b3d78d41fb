"""``mlx_lm.server`` for one rank under ``mlx.launch`` (``test_distributed``), with a fault switch.

Run as ``python dist_server.py <mlx_lm.server args>``; the ``MLX_FILL`` hook patches the server
on import exactly as for the console script. With ``FAULT_RANK=r``, on rank ``r`` only, the
fill proposal step raises from the third proposal point of every request after the first: the
divergence that, without agreement, would leave that rank decoding differently from the others.
With ``PIN_COST=1`` every request's plan keeps its qualified chunking but prices rows as free:
the cost gates then decide alike in every configuration (a sharded model's measured curve is its
own), so the telemetry of a sharded and an unsharded run can be compared field by field. The
ranks' qualify then times nothing either (:func:`pin_cost_measure`): on a loaded machine their
timings can read an M-row forward cheaper than one row, and such a curve is refused (one token
per forward) though the exactness checks pass.
"""

import itertools
import os
import sys
from dataclasses import replace

import mlx.core as mx
from mlx_lm.server import main

import mlx_fill.session
from mlx_fill.core.proposal import FillSession


def pin_cost_measure() -> None:
    """Make qualify's cost curve flat (every size costs one row) instead of timing it; the
    exactness checks, which decide the chunking, still run."""
    import mlx_fill.core.qualify as qualify
    qualify.measure_plausible_cost = lambda model, cache, sizes, *args: {m: 1.0 for m in sizes}


if os.environ.get("PIN_COST") == "1":
    pin_cost_measure()
    _plan_for = mlx_fill.session.plan_for
    mlx_fill.session.plan_for = lambda model, group=None: replace(_plan_for(model, group), cost={64: 1.0})

if os.environ.get("FAULT_RANK", "") == str(mx.distributed.init().rank()):
    _propose = FillSession.propose
    _count = itertools.count()

    def _failing(self, view):
        if "_test_n" not in self.__dict__:
            self._test_n = next(_count)
        if self._test_n >= 1 and len(view.emitted) >= 3:
            raise RuntimeError("injected fault on this rank")
        return _propose(self, view)

    FillSession.propose = _failing

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    main()
