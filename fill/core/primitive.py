"""The append-and-rewind primitive.

``append`` writes already-known token ids into a model's cache with chunked forwards;
``checkpoint`` / ``rewind`` take back a rejected tail. Invariant enforced here: after
``append`` followed by ``rewind(cp, keep)`` the cache equals, array for array, the cache that
forwarding only the first ``keep`` appended ids would have produced, and a failure inside
``append`` leaves the cache exactly at its pre-append state.

Supported per-layer caches (mlx-lm 0.32): ``KVCache``, ``QuantizedKVCache`` (trim),
``RotatingKVCache`` (chunks written and attended as serial steps, rewound from a
snapshot of the ring, wrapped or not: :mod:`.ring`), ``ArraysCache`` (recurrent state: snapshot
by reference, restore, replay the kept prefix) and ``CacheList`` (composition). Anything else is
refused with :class:`Unsupported`, as is a model whose rotating layers differ in window or
``keep`` (they share one attention mask per forward), and ``ChunkedKVCache`` (llama4's chunked
attention: a chunk appended after the cache has dropped its first attention chunk does not
reproduce serial steps' logits, measured on a random-weight replica).
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Sequence

import mlx.core as mx
from mlx_lm.models import cache as C

from .model_folder import vocab_size
from .plan import DispatchPlan
from .ring import RingRefused, RingSnapshot, chunk_writes
from .shapes import append_shape

LogitRows = Literal["none", "last", "all"]
LOGIT_ROWS = ("none", "last", "all")

# Model types whose ``__call__`` is exactly ``head(body(x))`` with head = lm_head or tied
# embeddings; for these the vocabulary projection runs only on the requested rows.
_SPLIT_HEAD_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next",
     "glm4", "glm", "glm4_moe", "phi3", "starcoder2", "olmo2", "granite"}
)


class Unsupported(Exception):
    """The primitive refuses this cache or operation; ``reason`` is a stable short code."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _leaves(cache: Sequence[Any]) -> list[Any]:
    """Flatten ``CacheList`` nesting into per-layer leaf caches, refusing unknown types."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, C.CacheList):
            out.extend(_leaves(c.caches))
        elif isinstance(c, C.ChunkedKVCache):
            raise Unsupported("chunked_kv", "chunked attention cache (llama4)")
        elif isinstance(c, (C.KVCache, C.QuantizedKVCache, C.RotatingKVCache, C.ArraysCache)):
            out.append(c)
        else:
            raise Unsupported("cache_type", type(c).__name__)
    return out


def check_supported(cache: Sequence[Any]) -> None:
    """Raise :class:`Unsupported` when any layer cache is of a type the primitive cannot rewind,
    or when rotating layers differ in ``(max_size, keep)``."""
    rings = {(c.max_size, c.keep) for c in _leaves(cache) if isinstance(c, C.RotatingKVCache)}
    if len(rings) > 1:
        raise Unsupported("rotating_mixed", f"rotating layers of (window, keep) {sorted(rings)}")


def ring_window(cache: Sequence[Any]) -> int | None:
    """The smallest window of the cache's rotating (sliding-window) layers; None without."""
    windows = [c.max_size for c in _leaves(cache) if isinstance(c, C.RotatingKVCache)]
    return min(windows) if windows else None


def cache_offset(cache: Sequence[Any]) -> int:
    """Tokens the cache holds (the first layer that counts tokens; recurrent layers do not)."""
    for c in _leaves(cache):
        if not isinstance(c, C.ArraysCache):
            return int(c.offset)
    raise Unsupported("no_offset", "cache has no attention layer to count tokens")


@dataclass
class Checkpoint:
    """Cache state before a speculative append; ``appended`` records every id fed since."""

    model: Any
    cache: list[Any]
    plan: DispatchPlan
    offsets: list[int | None]
    snapshots: list[tuple | None]
    rings: list[RingSnapshot | None]
    appended: list[int] = field(default_factory=list)
    replay: bool = False  # rewind by restore-and-replay even without recurrent layers
    # the step appends run after each chunk (mlx-lm's KV quantization), run again on replayed ids
    after_chunk: Callable[[list[Any]], None] | None = None
    # when that step swapped cache entries (KVCache -> QuantizedKVCache): the ids appended since
    # the checkpoint by then, and the entries as they were. Serial decoding holds those entries
    # until it has fed that many ids, so a rewind or a view to fewer puts them back.
    unswapped: tuple[int, list[Any]] | None = None

    @property
    def has_recurrent(self) -> bool:
        """Whether :func:`rewind` restores and replays (recurrent layers, or ``replay``: the
        ranks of a sharded model must all rewind the same way, see :mod:`.shared`)."""
        return self.replay or any(s is not None for s in self.snapshots)


def cache_kinds(cache: Sequence[Any]) -> tuple[bool, bool]:
    """(has recurrent layers, has rotating layers); (False, False) for a refused cache."""
    try:
        leaves = _leaves(cache)
    except Unsupported:
        return False, False
    return (any(isinstance(c, C.ArraysCache) for c in leaves),
            any(isinstance(c, C.RotatingKVCache) for c in leaves))


def _check_plan(plan: Any) -> None:
    """TypeError unless ``plan`` is a :class:`DispatchPlan`."""
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan: expected a DispatchPlan (plan_for(model)), got "
                        f"{type(plan).__name__}")


def checkpoint(model: Any, cache: list[Any], plan: DispatchPlan) -> Checkpoint:
    """Record the state a later :func:`rewind` returns to. O(layers), no array copies.

    KV layers record their offset (trim moves it back; stale slots are overwritten later).
    Rotating layers also keep their ring by alias (:class:`~.ring.RingSnapshot`): a wrapped
    ring's slots are overwritten in place. Recurrent layers record their arrays by reference:
    mlx-lm rebinds ``cache[i]`` on every update and never mutates those arrays in place, so the
    references stay exact. TypeError for a ``plan`` that is no :class:`DispatchPlan` (a
    rewind replays the kept ids with it).
    """
    _check_plan(plan)
    offsets: list[int | None] = []
    snaps: list[tuple | None] = []
    rings: list[RingSnapshot | None] = []
    for c in _leaves(cache):
        rings.append(RingSnapshot.of(c) if isinstance(c, C.RotatingKVCache) else None)
        if isinstance(c, C.ArraysCache):
            offsets.append(None)
            snaps.append((list(c.cache), c.left_padding, c.lengths))
        else:
            offsets.append(int(c.offset))
            snaps.append(None)
    return Checkpoint(model, cache, plan, offsets, snaps, rings)


def _entries_before_swap(cp: Checkpoint, keep: int) -> list[Any] | None:
    """The cache entries serial decoding holds after ``keep`` of the appended ids where an
    append's step has swapped them since (:attr:`Checkpoint.unswapped`); None where it holds
    the current ones."""
    if cp.unswapped is not None and keep < cp.unswapped[0]:
        return cp.unswapped[1]
    return None


def _unswap(cp: Checkpoint, keep: int) -> None:
    """Put back, for good, the entries :func:`_entries_before_swap` names."""
    entries = _entries_before_swap(cp, keep)
    if entries is not None:
        cp.cache[:] = entries
        cp.unswapped = None


def _kept_slots(cp: Checkpoint, leaves: list[Any], keep: int) -> dict[int, list[int] | None]:
    """For each rotating layer that cannot be trimmed (a wrapped ring), the slots now holding
    the first ``keep`` appended ids (:meth:`~.ring.RingSnapshot.kept_slots`; None: overwritten)."""
    return {i: ring.kept_slots(leaves[i], keep) for i, ring in enumerate(cp.rings)
            if ring is not None and not leaves[i].is_trimmable()}


def _cut(cp: Checkpoint, leaves: list[Any], keep: int, slots: dict[int, list[int]]) -> None:
    """Leave ``leaves`` (no recurrent layer among them) holding the checkpoint's ids and the
    first ``keep`` appended: KV layers trim, wrapped rings unwind to ``slots``."""
    for i, (c, off) in enumerate(zip(leaves, cp.offsets)):
        if i in slots:
            cp.rings[i].unwind(c, slots[i])
            continue
        extra = int(c.offset) - (off + keep)
        if extra > 0:
            c.trim(extra)


def restore(cp: Checkpoint) -> None:
    """Put every layer back at the checkpoint (KV trim, recurrent restore), whatever was
    forwarded since, recorded or not."""
    _unswap(cp, 0)
    for c, off, snap, ring in zip(_leaves(cp.cache), cp.offsets, cp.snapshots, cp.rings):
        if snap is not None:
            c.cache, c.left_padding, c.lengths = list(snap[0]), snap[1], snap[2]
            continue
        extra = int(c.offset) - off
        if extra < 0:
            raise Unsupported("rewind_forward", "cache is behind its checkpoint")
        if ring is not None:
            ring.restore(c)
        elif extra:
            c.trim(extra)


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (an int, a NumPy or 0-d MLX integer), not
    a bool; None otherwise."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError):
        return None


def id_range(vocab: int | None) -> str:
    """The token ids of a vocabulary of ``vocab`` ids, as a message says them (None: unknown)."""
    return f"0 to {vocab - 1}" if vocab is not None else "0 or more"


def token_ids(ids: Sequence[Any], vocab: int | None, name: str = "ids") -> list[int]:
    """``ids`` as ints, each a whole number (:func:`_whole`) from 0 to ``vocab`` - 1 (None:
    unknown, only negative ids are refused). ValueError naming the first that is not, as
    ``NAME[i]``: an id past the embedding's rows reads outside it."""
    out: list[int] = []
    for i, t in enumerate(ids):
        value = _whole(t)
        if value is None or value < 0 or (vocab is not None and value >= vocab):
            raise ValueError(f"{name}[{i}]: expected a token id from {id_range(vocab)}, got {t!r}")
        out.append(value)
    return out


def rewind(cp: Checkpoint, keep: int) -> None:
    """Keep the first ``keep`` ids appended since ``cp`` and drop the rest.

    Postcondition: the cache is bit-identical to having appended only ``cp.appended[:keep]``
    from the checkpoint. Trimmable layers trim; when recurrent layers are present and a tail
    must go, every layer is restored and the kept prefix is replayed with one chunked append.
    ValueError, the cache untouched, unless ``keep`` is a whole number from 0 to the ids
    appended since ``cp``.
    """
    n = len(cp.appended)
    whole = _whole(keep)
    if whole is None or not 0 <= whole <= n:
        raise ValueError(f"keep={keep!r}: expected a whole number from 0 to {n}")
    keep = whole
    if keep == n:
        return
    _unswap(cp, keep)
    kept = cp.appended[:keep]
    leaves = _leaves(cp.cache)
    slots = _kept_slots(cp, leaves, keep)
    if cp.has_recurrent or any(s is None for s in slots.values()):
        restore(cp)
        cp.appended = []
        if kept:
            append(cp.model, cp.cache, kept, plan=cp.plan, logits="none", record=cp,
                   after_chunk=cp.after_chunk)
        return
    _cut(cp, leaves, keep, slots)
    cp.appended = kept


@dataclass
class Shown:
    """What :func:`showing` found when its block ended: ``moved``, whether the cache was
    written inside the block (another decode used it while the burst was held), in which case
    it was left as that decode left it."""

    moved: bool = False


def _fingerprint(cache: Sequence[Any]) -> tuple:
    """What any write to the cache changes: its entries, each counting layer's offset (and a
    ring's write index), each recurrent layer's arrays."""
    leaves = _leaves(cache)
    return (tuple(map(id, cache)),
            tuple(tuple(map(id, c.cache)) if isinstance(c, C.ArraysCache)
                  else (int(c.offset), getattr(c, "_idx", None)) for c in leaves))


@contextmanager
def showing(cp: Checkpoint, keep: int) -> Iterator[Shown]:
    """Inside the block the cache holds exactly ``cp.appended[:keep]`` after the checkpoint (what
    serial decoding holds once those ids are fed); on exit the ids after them are back, their
    rows as written, with no forward: KV layers only move their offset, rotating ones restore
    their ring by alias (:class:`~.ring.RingSnapshot`), entries a KV-quantization step swapped
    are swapped back and forth. With recurrent layers the state after ``keep`` rows was never
    computed (a chunk's forward yields only its last), and a rotating layer whose later rows
    overwrote a shown one (a round longer than its window) has no copy of it: there the cache is
    left holding every appended id. The block's :class:`Shown` says whether something wrote the
    cache inside it; then nothing is put back."""
    undo = None
    if keep < len(cp.appended) and all(s is None for s in cp.snapshots):
        entries = list(cp.cache)
        before = _entries_before_swap(cp, keep)
        if before is not None:
            cp.cache[:] = before
        leaves = _leaves(cp.cache)
        slots = _kept_slots(cp, leaves, keep)
        if any(s is None for s in slots.values()):
            cp.cache[:] = entries
        else:
            shown = [RingSnapshot.of(c) if isinstance(c, C.RotatingKVCache) else int(c.offset)
                     for c in leaves]
            _cut(cp, leaves, keep, slots)

            def undo() -> None:
                for c, state in zip(leaves, shown):
                    if isinstance(state, RingSnapshot):
                        state.restore(c)
                    else:
                        c.offset = state
                cp.cache[:] = entries
    found = Shown()
    mark = _fingerprint(cp.cache)
    try:
        yield found
    finally:
        found.moved = _fingerprint(cp.cache) != mark
        if undo is not None and not found.moved:
            undo()


def _split_head(model: Any) -> tuple[Any, Any] | None:
    """(body, head) with ``model(x) == head(body(x))`` for known architectures, else None."""
    m = getattr(model, "language_model", model)
    if getattr(model, "model_type", None) not in _SPLIT_HEAD_TYPES:
        return None
    if getattr(m, "sharding_group", None) is not None:
        return None  # a vocabulary-sharded head gathers its slices inside the model's __call__
    body = getattr(m, "model", None)
    if body is None:
        return None
    args = getattr(m, "args", None)
    if getattr(args, "tie_word_embeddings", False) or not hasattr(m, "lm_head"):
        return body, body.embed_tokens.as_linear
    return body, m.lm_head


def append(
    model: Any,
    cache: list[Any],
    ids: Sequence[int],
    *,
    plan: DispatchPlan,
    logits: LogitRows = "last",
    record: Checkpoint | None = None,
    after_chunk: Callable[[list[Any]], None] | None = None,
) -> mx.array | None:
    """Forward known ``ids`` into ``cache`` in plan-sized chunks.

    ``ids`` must not include the token whose KV the previous step already wrote. Each chunk
    runs in the append shape the plan gives its size (:mod:`.shapes`). Returns
    logits of shape ``[1, V]`` for ``"last"``, ``[len(ids), V]`` for ``"all"``, or None; the
    vocabulary projection runs only on those rows. The returned arrays are lazy.
    On any exception (including cancellation) the cache is restored to its entry state.
    When ``record`` is given the ids are recorded on it for a later :func:`rewind`.
    ``after_chunk(cache)`` runs after every chunk's forward (the decode loop passes mlx-lm's
    KV-quantization step, which may swap list entries in place exactly as serial decode would).
    Before any forward: ValueError for no ids, an id that is no token of the model's vocabulary
    or a ``logits`` outside :data:`LOGIT_ROWS`; TypeError for a ``plan`` that is no
    :class:`DispatchPlan` (:func:`checkpoint`).
    """
    ids = token_ids(ids, vocab_size(model))
    if not ids:
        raise ValueError("append needs at least one id")
    if logits not in LOGIT_ROWS:
        raise ValueError(f"logits: expected 'none', 'last' or 'all', got {logits!r}")
    leaves = _leaves(cache)
    entry = checkpoint(model, cache, plan)
    if record is not None:
        record.after_chunk = after_chunk
    split = _split_head(model)
    try:
        start = cache_offset(cache)
        rows: list[mx.array] = []
        pos = 0
        for size in plan.chunks(start, len(ids)):
            x = mx.array(ids[pos:pos + size])[None]
            pos += size
            last_chunk = pos == len(ids)
            want = logits == "all" or (logits == "last" and last_chunk)
            with chunk_writes(leaves, size), append_shape(model, plan.shape_for(size)):
                # logits, or hidden states with a split head
                out = model(x, cache=cache) if split is None else split[0](x, cache=cache)
            if want:
                out = out if logits == "all" else out[:, -1:]
                rows.append((out if split is None else split[1](out))[0])
            if after_chunk is not None:
                before = list(cache)
                after_chunk(cache)
                if any(a is not b for a, b in zip(before, cache)):
                    for cp in (entry, record):  # ids since each checkpoint: this append's pos
                        if cp is not None and cp.unswapped is None:
                            cp.unswapped = (len(cp.appended) + pos, before)
                leaves = _leaves(cache)
            mx.eval([c.state for c in leaves] if not last_chunk else [])
        if record is not None:
            record.appended.extend(ids)
        if not rows:
            return None
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)
    except RingRefused as e:
        restore(entry)
        raise Unsupported(e.reason, str(e)) from e
    except BaseException:
        restore(entry)
        raise

