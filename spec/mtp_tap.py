"""Model surgery for the MTP head: a read-only capture of a target's pre-final-norm hidden states
(:class:`HiddenTap`), and the target's embeddings and lm-head as the head shares them.

The capture changes nothing the target computes: its decoder body notes the cache offset at
which each forward starts and its final norm records its input.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_fill.core.primitive import cache_offset


def text_model(target: Any) -> Any:
    """The language model holding ``args``, ``model`` (embeddings, layers, norm) and lm-head."""
    return getattr(target, "language_model", target)


def decoder_body(target: Any) -> Any:
    """The target's decoder body (embeddings, layers, final norm)."""
    return text_model(target).model


def lm_head_logits(target: Any, x: mx.array) -> mx.array:
    """Logits of hidden states ``x`` through the target's lm-head (tied or its own)."""
    lm = text_model(target)
    if getattr(lm.args, "tie_word_embeddings", False) or not hasattr(lm, "lm_head"):
        return lm.model.embed_tokens.as_linear(x)
    return lm.lm_head(x)


class HiddenTap:
    """Read-only capture of a target's pre-final-norm hidden states, indexed by position.

    :meth:`install` makes the target's decoder body note the cache offset at which each forward
    starts and its final norm record its input; nothing the target computes changes. A forward
    starting at offset ``s`` supersedes every captured row at positions ``>= s`` (that is what a
    rewind followed by a new append means for the cache), so the rows held always belong to
    what the target's cache holds now. ``release_below(p)`` drops rows a consumer no longer
    needs (memory stays bounded by the unconsumed tail).
    """

    _patched: dict[type, type] = {}

    def __init__(self) -> None:
        self._segments: list[tuple[int, mx.array]] = []
        self._start: int | None = None

    @classmethod
    def install(cls, target: Any) -> "HiddenTap":
        """The tap on ``target`` (installed on first use; later calls return the same tap)."""
        body = decoder_body(target)
        tap = getattr(body, "_fill_hidden_tap", None)
        if tap is not None:
            return tap
        tap = cls()
        body._fill_hidden_tap = tap
        body.norm._fill_hidden_tap = tap
        body.__class__ = cls._tapped(type(body), _body_call)
        body.norm.__class__ = cls._tapped(type(body.norm), _norm_call)
        return tap

    @classmethod
    def _tapped(cls, base: type, call: Any) -> type:
        if base not in cls._patched:
            cls._patched[base] = type(f"Tapped{base.__name__}", (base,), {"__call__": call})
        return cls._patched[base]

    def _begin(self, cache: Any) -> None:
        self._start = cache_offset(cache) if cache is not None and cache[0] is not None else None

    def _record(self, x: mx.array) -> None:
        start, self._start = self._start, None
        if start is None:
            return
        kept: list[tuple[int, mx.array]] = []
        for s, rows in self._segments:
            if s >= start:
                continue
            kept.append((s, rows if s + rows.shape[0] <= start else rows[:start - s]))
        kept.append((start, x[0]))
        self._segments = kept

    def first(self) -> int | None:
        """The lowest captured position (None when nothing is held)."""
        return self._segments[0][0] if self._segments else None

    def rows(self, start: int, stop: int) -> mx.array:
        """Hidden rows ``[stop - start, H]`` for positions ``start..stop-1``; KeyError when any
        of them was not captured."""
        parts: list[mx.array] = []
        pos = start
        for s, rows in self._segments:
            end = s + rows.shape[0]
            if end <= pos or s > pos:
                continue
            take = min(end, stop) - pos
            parts.append(rows[pos - s:pos - s + take])
            pos += take
            if pos == stop:
                break
        if pos != stop:
            raise KeyError(f"target hidden state at position {pos} was not captured "
                           f"(held: {[(s, s + r.shape[0]) for s, r in self._segments]})")
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def release_below(self, position: int) -> None:
        kept: list[tuple[int, mx.array]] = []
        for s, rows in self._segments:
            end = s + rows.shape[0]
            if end <= position:
                continue
            kept.append((s, rows) if s >= position else (position, rows[position - s:]))
        self._segments = kept


def _body_call(self, inputs, cache=None, input_embeddings=None):
    self._fill_hidden_tap._begin(cache)
    return super(type(self), self).__call__(inputs, cache, input_embeddings=input_embeddings)


def _norm_call(self, x):
    self._fill_hidden_tap._record(x)
    return super(type(self), self).__call__(x)
