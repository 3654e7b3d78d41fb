"""Bit-exact comparison of caches and logits: the yardstick of every exactness claim.

A cache's *content* is what serial decoding would read back: attention layers up to their
offset (slots past it are stale and always overwritten before they are read), the readable
slots of a rotating layer in their stored order with its ``offset`` and write index (a wrapped
ring is compared whole, whatever ``since`` says), and every recurrent array. Two caches are equal when their
contents are equal bit for bit (same dtype, shape and bytes)."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from .ring import write_index


def _as_list(x: Any) -> list[mx.array]:
    if x is None:
        return []
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (tuple, list)):
        return [a for item in x for a in _as_list(item)]
    raise TypeError(f"unexpected cache element {type(x).__name__}")


def cache_content(cache: Sequence[Any], since: int = 0) -> list[mx.array]:
    """Flat list of the arrays that define ``cache``'s state, in layer order.

    ``since`` restricts attention layers to positions ``since..offset`` (a tail both sides
    wrote on top of one shared prefix); recurrent arrays are always included whole.
    """
    out: list[mx.array] = []
    for c in cache:
        if isinstance(c, C.CacheList):
            out.extend(cache_content(c.caches, since))
        elif isinstance(c, C.ArraysCache):
            out.extend(_as_list(c.cache))
        elif isinstance(c, C.RotatingKVCache):
            out.extend(_ring_content(c))
        elif isinstance(c, (C.KVCache, C.QuantizedKVCache, C.ChunkedKVCache)):
            n = int(c.offset)
            out.extend(a[..., since:n, :] for a in _as_list((c.keys, c.values)))
        else:
            raise TypeError(f"unsupported cache type {type(c).__name__}")
    return out


def _ring_content(c: C.RotatingKVCache) -> list[mx.array]:
    """The slots a rotating layer's next step reads (mlx-lm's ``keys_and_values``), in stored
    order, and its bookkeeping: where the next write goes depends on ``offset`` and ``_idx``."""
    state = [mx.array([int(c.offset), write_index(c)])]
    if c.keys is None:
        return state
    n = min(int(c.offset), int(c.keys.shape[2]))
    return state + [a[..., :n, :] for a in _as_list((c.keys, c.values))]


_BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


def arrays_equal(a: mx.array, b: mx.array) -> bool:
    """Bitwise equality of two arrays (dtype and shape included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS.get(a.dtype)
    if bits is not None:
        a, b = a.view(bits), b.view(bits)
    return np.array_equal(np.array(a), np.array(b))


def caches_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """True when both caches hold bit-identical content (see module docstring)."""
    ca, cb = cache_content(a), cache_content(b)
    return len(ca) == len(cb) and all(arrays_equal(x, y) for x, y in zip(ca, cb))
