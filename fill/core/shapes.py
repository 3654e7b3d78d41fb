"""Append shapes: how an M-row chunk feeds the model's projections.

``native``: as a prompt does, ``[1, M, K]`` inputs (one multi-row matrix product per
projection). ``batched-m1``: every ``nn.Linear`` / ``nn.QuantizedLinear`` gets its input as
``[M, 1, K]`` against a broadcast view of its weights (no copy), so the backend runs M one-row
products in one batched kernel, the kernel a serial step runs. Where a backend's multi-row
product rounds differently from its one-row product (MLX 0.32 on Apple GPUs: the multi-row
matvec), ``batched-m1`` can keep chunks exact that ``native`` cannot; ``qualify`` measures both
and the plan records, per chunk size, the one that is exact and cheaper.

The projections answer per thread: their class is swapped once for a subclass that runs the
batched form only inside :func:`append_shape` on the calling thread, and the stock form
otherwise, so a request decoding on another thread (or a background ``qualify``) is never
affected. Mixture-of-experts projections (``SwitchLinear``) and tied-embedding heads keep
their native shape.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Literal

import mlx.core as mx
import mlx.nn as nn

AppendShape = Literal["native", "batched-m1"]
SHAPES: tuple[AppendShape, ...] = ("native", "batched-m1")

_active = threading.local()  # .on: this thread is inside a batched-m1 append
_install = threading.Lock()


def _batched() -> bool:
    return getattr(_active, "on", False)


def _rows(x: mx.array) -> mx.array:
    """``[..., L, K]`` -> ``[R, 1, K]`` with R the number of rows."""
    return x.reshape(-1, 1, x.shape[-1])


class BatchedLinear(nn.Linear):
    """``nn.Linear`` that runs ``[R, 1, K] @ broadcast(W^T)`` inside a batched-m1 append."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _batched() or x.ndim < 2 or x.shape[-2] == 1:
            return super().__call__(x)
        rows = _rows(x)
        w = mx.broadcast_to(self["weight"].T, (rows.shape[0], *self["weight"].T.shape))
        out = (mx.addmm(self["bias"], rows, w) if "bias" in self else rows @ w)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class BatchedQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` fed ``[R, 1, K]`` against broadcast packed weights, scales and
    biases inside a batched-m1 append."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _batched() or x.ndim < 2 or x.shape[-2] == 1:
            return super().__call__(x)
        rows = _rows(x)
        r = rows.shape[0]

        def wide(a: mx.array | None) -> mx.array | None:
            return None if a is None else mx.broadcast_to(a, (r, *a.shape))

        out = mx.quantized_matmul(rows, wide(self["weight"]), scales=wide(self["scales"]),
                                  biases=wide(self.get("biases")), transpose=True,
                                  group_size=self.group_size, bits=self.bits, mode=self.mode)
        if "bias" in self:
            out = out + self["bias"]
        return out.reshape(*x.shape[:-1], out.shape[-1])


_SUBCLASS = {nn.Linear: BatchedLinear, nn.QuantizedLinear: BatchedQuantizedLinear}


def install(model: nn.Module) -> None:
    """Swap every plain ``Linear`` / ``QuantizedLinear`` of ``model`` for its per-thread
    batched subclass (idempotent; outside :func:`append_shape` they compute as before)."""
    if getattr(model, "_mlx_fill_batched_m1", False):
        return
    with _install:
        for _, module in model.named_modules():
            sub = _SUBCLASS.get(type(module))
            if sub is not None:
                module.__class__ = sub
        model._mlx_fill_batched_m1 = True


@contextmanager
def append_shape(model: Any, shape: AppendShape) -> Iterator[None]:
    """Run the enclosed forward with ``shape`` on this thread."""
    if shape == "native":
        yield
        return
    if shape != "batched-m1":
        raise ValueError(f"unknown append shape {shape!r}; expected one of {SHAPES}")
    install(model)
    before = _batched()
    _active.on = True
    try:
        yield
    finally:
        _active.on = before
