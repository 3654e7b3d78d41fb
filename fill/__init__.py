"""mlx-fill: lossless token fast-forward for MLX decoding (strict fill, echo, speculative roster).

The public API is :data:`__all__`; each name is imported from its module on first use, so
``import mlx_fill`` (and the ``MLX_FILL`` hook that runs in every interpreter) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.4"

_EXPORTS = {
    # the mlx-lm drop-in
    "generate_step": "mlx_fill.adapters.mlx_lm",
    "stream_generate": "mlx_fill.adapters.mlx_lm",
    "pure_processor": "mlx_fill.core.acceptance",
    # the composition root: one request -> one session
    "build_session": "mlx_fill.session",
    "end_session": "mlx_fill.session",
    "usage_extra": "mlx_fill.session",
    # the proposal seam
    "FillSession": "mlx_fill.core.proposal",
    "Proposal": "mlx_fill.core.proposal",
    "ProposalSource": "mlx_fill.core.proposal",
    "DecodeView": "mlx_fill.core.proposal",
    # the primitive and its dispatch plan
    "append": "mlx_fill.core.primitive",
    "checkpoint": "mlx_fill.core.primitive",
    "rewind": "mlx_fill.core.primitive",
    "DispatchPlan": "mlx_fill.core.plan",
    "plan_for": "mlx_fill.core.resolve",
    # errors a caller can fix
    "UserError": "mlx_fill.core.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlx_fill' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
