"""Chunked appends and rewinds on mlx-lm's ``RotatingKVCache``, wrapped or not.

Serial decoding writes a rotating layer one token at a time (``_update_in_place``): the ring's
slots are overwritten in turn and every step attends the readable slots in slot order. A stock
multi-token update instead switches the layer to its concatenating prefill layout (temporal
order, up to ``max_size - 1 + M`` keys), after which later steps attend the same keys in a
different order, and a wrapped ring cannot be trimmed back.

Here an M-row chunk on a rotating layer

- writes the ring with M stock one-token updates, so buffer, ``offset`` and ``_idx`` are what
  serial decoding leaves, bit for bit;
- lets row j attend exactly the keys serial step j attends, in the same order: the keys are
  laid out once, each slot's successive occupants in slot order (the old key, then the new key
  that overwrote it), and row j's boolean mask selects the slots' occupants at step j.
  Where a backend reduces masked entries as exact zeros in sequence (MLX's CPU backend on
  Linux), every row equals its serial step; elsewhere ``qualify`` measures which sizes are.

The bookkeeping (growth, first trim after a prefill, rotation past ``keep``) comes from running
the stock update on a tiny buffer of ids (old slot i holds ``i + 1``, new row j holds
``-(j + 1)``), so it follows mlx-lm's own rules. A checkpoint keeps the ring by reference
(an alias of each buffer, so in-place writes copy instead of clobbering it) with ``offset`` and
``_idx``; a rewind restores it and rewrites the kept rows from the slots they now occupy.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache


class RingRefused(Exception):
    """A rotating layer this module cannot write in chunks; ``reason`` is a stable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


Signature = tuple[int | None, int, int, int, int]  # buffer length, offset, _idx, keep, max_size


def write_index(c: RotatingKVCache) -> int:
    """``RotatingKVCache._idx``: the slot the layer's next one-token update writes. The one
    private field of an mlx-lm cache the core touches, read and written only in this module."""
    return int(c._idx)


def signature(c: RotatingKVCache) -> Signature:
    """What decides where a rotating layer's next writes go."""
    length = None if c.keys is None else int(c.keys.shape[2])
    return length, int(c.offset), write_index(c), int(c.keep), int(c.max_size)


@functools.lru_cache(maxsize=256)
def _simulate(sig: Signature, steps: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Run ``steps`` stock one-token updates on an id buffer in state ``sig``: the readable
    slots' ids after each step (what that serial step attends) and the final buffer's ids.
    Memoised (every rotating layer of a model is in the same state); the arrays are shared,
    read only."""
    length, offset, idx, keep, max_size = sig
    sim = RotatingKVCache(max_size, keep)
    with mx.stream(mx.cpu):
        if length is not None:
            ids = mx.arange(1, length + 1, dtype=mx.int32).reshape(1, 1, length, 1)
            sim.keys, sim.values = ids, mx.array(ids)
        sim.offset, sim._idx = offset, idx
        views = []
        for j in range(steps):
            new = mx.full((1, 1, 1, 1), -(j + 1), dtype=mx.int32)
            keys, _ = sim._update_in_place(new, new)
            views.append(keys.reshape(-1))
        final = sim.keys.reshape(-1)
        mx.eval(views, final)
    return [np.array(v) for v in views], np.array(final)


@dataclass(frozen=True)
class Layout:
    """How an M-row chunk attends a rotating layer: ``gather`` ``[E]`` indexes the pre-chunk
    buffer followed by the M new rows along the sequence axis; ``mask`` ``[M, E]`` says which
    of those E keys row j attends."""

    gather: mx.array
    mask: mx.array


@functools.lru_cache(maxsize=64)
def layout(sig: Signature, m: int) -> Layout:
    """The :class:`Layout` of an ``m``-row chunk on a layer in state ``sig``."""
    views, _ = _simulate(sig, m)
    grid = np.zeros((m, max(len(v) for v in views)), np.int64)  # 0: slot not readable
    for j, v in enumerate(views):
        grid[j, :len(v)] = v
    occupant = grid != 0
    occupant[1:] &= grid[1:] != grid[:-1]  # a slot's new occupant at step j
    slots, steps = np.nonzero(occupant.T)  # slot order, then step order within a slot
    ids = grid[steps, slots]
    if len(np.unique(ids)) != len(ids):
        raise RingRefused("rotating_layout", f"a key moves between slots within {m} rows")
    length = sig[0] or 0
    gather = np.where(ids > 0, ids - 1, length - ids - 1)
    mask = grid[:, slots] == ids[None, :]
    return Layout(mx.array(gather.astype(np.int32)), mx.array(mask))


def _write(c: RotatingKVCache, lay: Layout, keys: mx.array,
           values: mx.array) -> tuple[mx.array, mx.array]:
    """``update_and_fetch`` for one chunk: keys/values ``[B, H, M, D]`` written as M serial
    steps; returns the ``[B, H, E, D]`` keys and values the chunk's rows attend."""
    if keys.shape[2] != lay.mask.shape[0]:
        raise RingRefused("rotating_chunk", f"{keys.shape[2]} rows, layout for "
                                            f"{lay.mask.shape[0]}")
    if c.keys is None:
        src_k, src_v = keys, values
    else:  # built before the writes below: these nodes hold the pre-chunk buffers
        src_k = mx.concatenate([c.keys, keys], axis=2)
        src_v = mx.concatenate([c.values, values], axis=2)
    for j in range(keys.shape[2]):
        RotatingKVCache._update_in_place(c, keys[..., j:j + 1, :], values[..., j:j + 1, :])
    return mx.take(src_k, lay.gather, axis=2), mx.take(src_v, lay.gather, axis=2)


def _mask(c: RotatingKVCache, lay: Layout, n: int, window_size: int | None = None,
          return_array: bool = False) -> mx.array:
    """``make_mask`` for one chunk: the layout's ``[M, E]`` mask."""
    if window_size is not None and window_size < c.max_size:
        raise RingRefused("rotating_window", f"window {window_size} < ring {c.max_size}")
    if n != lay.mask.shape[0]:
        raise RingRefused("rotating_chunk", f"mask for {n} rows, layout for "
                                            f"{lay.mask.shape[0]}")
    return lay.mask


@contextmanager
def chunk_writes(leaves: Sequence[Any], m: int) -> Iterator[None]:
    """While one ``m``-row forward runs, every rotating layer in ``leaves`` writes and attends
    as serial steps do (module docstring). No-op for ``m == 1`` (the stock one-token update is
    the serial step)."""
    rings = [c for c in leaves if isinstance(c, RotatingKVCache)]
    if m == 1 or not rings:
        yield
        return
    try:
        for c in rings:
            lay = layout(signature(c), m)
            c.update_and_fetch = functools.partial(_write, c, lay)
            c.make_mask = functools.partial(_mask, c, lay)
        yield
    finally:
        for c in rings:
            c.__dict__.pop("update_and_fetch", None)
            c.__dict__.pop("make_mask", None)


def _alias(a: mx.array | None) -> mx.array | None:
    """A new array object on the same data: in-place writes to either leave the other as is."""
    return None if a is None else mx.array(a)


@dataclass(frozen=True)
class RingSnapshot:
    """A rotating layer's state at a checkpoint (buffers by alias, no copy)."""

    keys: mx.array | None
    values: mx.array | None
    offset: int
    idx: int

    @classmethod
    def of(cls, c: RotatingKVCache) -> "RingSnapshot":
        return cls(_alias(c.keys), _alias(c.values), int(c.offset), write_index(c))

    def restore(self, c: RotatingKVCache) -> None:
        """Put ``c`` back at this snapshot (fresh aliases: the snapshot stays reusable)."""
        c.keys, c.values = _alias(self.keys), _alias(self.values)
        c.offset, c._idx = self.offset, self.idx

    def kept_slots(self, c: RotatingKVCache, keep: int) -> list[int] | None:
        """The slots of ``c`` that now hold the first ``keep`` tokens written since this
        snapshot (serially or in chunks), or None when a later token has overwritten one."""
        written = int(c.offset) - self.offset
        if keep == 0:
            return []
        length = None if self.keys is None else int(self.keys.shape[2])
        _, final = _simulate((length, self.offset, self.idx, int(c.keep), int(c.max_size)),
                             written)
        where = {int(t): s for s, t in enumerate(final) if t < 0}
        slots = [where.get(-(j + 1)) for j in range(keep)]
        return None if any(s is None for s in slots) else slots

    def unwind(self, c: RotatingKVCache, slots: list[int]) -> None:
        """Restore this snapshot, then write the kept tokens' keys and values (now at
        ``slots``) back as the serial steps wrote them."""
        keys, values = c.keys, c.values
        self.restore(c)
        for s in slots:
            RotatingKVCache._update_in_place(c, keys[..., s:s + 1, :], values[..., s:s + 1, :])
