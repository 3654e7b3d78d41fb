"""The fill-aware decode loop: ``generate_step`` with ``fill=``.

Same signature, yields and pipelining as ``mlx_lm.generate.generate_step`` (mlx-lm 0.32.x).
With ``fill=None`` it returns the stock generator untouched. With a :class:`FillSession`, after
each yielded token it asks the session for a proposal and applies it as one *round* through the
one append-and-rewind primitive. The steps, as in mlx-lm's ``speculative_generate_step``:

- ``_Target.prefill`` / ``_Target.step``: mlx-lm's chunked prefill and pipelined serial step.
- rounds: :class:`~mlx_fill.core.round.Asking` decides when the session is asked (after each
  yielded token, and after each round for the slots its fresh sample leads: a *chained*
  round); :func:`~mlx_fill.core.round.execute` appends, asserts or verifies, and rewinds (the
  one round executor, shared with the batched lane).
- ``_Output.burst``: yields a round's ids; its ``finally`` rewinds the cache to what the
  consumer received when it stops mid-burst.

Invariants: at every yield and when the consumer stops (``close()``, ``max_tokens`` inside a
span, an exception), the cache holds exactly prompt + yielded tokens (mid-burst, on models with
recurrent layers, it holds the burst's ids ahead until the burst ends or the consumer stops:
:func:`~mlx_fill.core.primitive.showing`; a cache another decode wrote while the consumer held
the generator is left as written); a logits processor's error ends the decode with the ids and
cache serial decoding has when its step raises it; a proposed EOS is never committed (the
session cuts spans at EOS); every token not yielded by ``assert`` is a target sample, and with
a logits processor nothing is asserted.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import replace
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .acceptance import STATEFUL_PROCESSOR, Sampler, is_pure
from .model_folder import vocab_size
from .plan import DispatchPlan
from .primitive import (Checkpoint, Unsupported, cache_kinds, check_supported, id_range, rewind,
                        showing)
from .proposal import MEDIA_REFUSAL, FillSession, FillStats
from .resolve import plan_for
from .round import Asking, CacheView, Round, Sample, execute, settle

DEFAULT_QUANTIZED_KV_START = 5000


def generate_step(
    prompt: mx.array,
    model: nn.Module,
    stream: Any = generation_stream,
    *,
    fill: FillSession | None = None,
    **kwargs: Any,
) -> Generator[tuple[int, mx.array], None, None]:
    """``mlx_lm.generate.generate_step`` plus ``fill=``; stock behaviour when ``fill`` is None.

    ``stock_generate_step`` is bound when this module is first imported, before any patching,
    so delegation never recurses into a patched module attribute. Raises TypeError at the call
    for a ``fill`` that is neither None nor a :class:`FillSession` (:func:`check_fill`), and
    ValueError for a session an earlier call took (:meth:`FillSession.begin`).
    """
    if fill is None:
        return stock_generate_step(prompt, model, stream, **kwargs)
    check_fill(fill)
    try:
        steps = _fill_loop(prompt, model, stream, fill=fill, **kwargs)
    except TypeError as e:  # binding the arguments: a generator's body runs at its first next()
        raise TypeError(str(e).replace("_fill_loop()", "generate_step()")) from None
    fill.begin()
    return steps


def check_fill(fill: Any) -> None:
    """TypeError unless ``fill`` is None or a :class:`FillSession` (what ``build_session``
    returns)."""
    if fill is not None and not isinstance(fill, FillSession):
        raise TypeError(f"fill: expected a FillSession from build_session, or None, got "
                        f"{type(fill).__name__} {fill!r:.40}")


def _token_budget(max_tokens: Any) -> int:
    """``max_tokens`` as an int: mlx-lm compares it with its count, so ``30.0`` is 30 and a
    negative number no limit. TypeError for what is no whole number (mlx-lm's loop never
    reaches ``2.5`` or ``None`` and decodes without end)."""
    if isinstance(max_tokens, numbers.Real) and float(max_tokens).is_integer():
        return int(max_tokens)
    raise TypeError(f"max_tokens: expected a whole number of tokens (-1: no limit), got "
                    f"{max_tokens!r}")


def _check_prompt(prompt: Any, model: nn.Module) -> None:
    """TypeError or ValueError naming what is wrong unless ``prompt`` is a 1-D ``mx.array`` of
    integer ids of ``model``'s vocabulary (empty allowed: mlx-lm's own error follows). Stock
    mlx-lm fails on such a prompt inside the model; an id past the embedding's rows can end
    the process."""
    if not isinstance(prompt, mx.array):
        raise TypeError(f"prompt: expected an mx.array of token ids, got {type(prompt).__name__}")
    if prompt.ndim != 1:
        raise ValueError(f"prompt: expected a 1-D array of token ids, got shape {prompt.shape}")
    if prompt.size == 0:
        return
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise TypeError(f"prompt: expected integer token ids, got {prompt.dtype}")
    vocab = vocab_size(model)
    outside = prompt < 0 if vocab is None else (prompt < 0) | (prompt >= vocab)
    if mx.any(outside).item():
        i = int(mx.argmax(outside).item())
        raise ValueError(f"prompt[{i}]: expected a token id from {id_range(vocab)}, got "
                         f"{prompt[i].item()}")


def _check_cache(prompt_cache: Any) -> None:
    """TypeError naming what is wrong unless ``prompt_cache`` is a non-empty list (or tuple) of
    layer caches, as ``make_prompt_cache`` returns it (each has a ``state``). Stock mlx-lm
    fails on another deep inside the model."""
    if not isinstance(prompt_cache, (list, tuple)) or not prompt_cache:
        got = type(prompt_cache).__name__
        if isinstance(prompt_cache, (list, tuple)):
            got = f"an empty {got}"
        raise TypeError(f"prompt_cache: expected make_prompt_cache(model)'s list of layer caches, "
                        f"got {got}")
    for i, c in enumerate(prompt_cache):
        if not hasattr(type(c), "state"):
            raise TypeError(f"prompt_cache[{i}]: expected a layer cache (mlx_lm.models.cache), "
                            f"got {type(c).__name__}")


def _refusal(prompt_cache: list, input_embeddings: Any,
             logits_processors: Sequence[Any] | None) -> str | None:
    """Why this decode must run without fill (a refusal name), or None."""
    if input_embeddings is not None:
        return MEDIA_REFUSAL
    if logits_processors and not all(is_pure(p) for p in logits_processors):
        return STATEFUL_PROCESSOR
    try:
        check_supported(prompt_cache)
    except Unsupported as e:
        return e.reason
    return None


class _Target(CacheView):
    """The target model and its cache for one generation: a :class:`CacheView` plus mlx-lm's
    single-token step, the chunked prefill and the logits-processor history they grow."""

    def __init__(self, model: nn.Module, cache: list, plan: DispatchPlan, stats: FillStats, *,
                 sampler: Sampler, logits_processors: list | None,
                 quantize: Callable[[list], None], prefill_step_size: int, replay: bool = False):
        super().__init__(model, cache, plan, stats, sampler=sampler,
                         logits_processors=logits_processors, quantize=quantize, replay=replay)
        self.prefill_step_size = prefill_step_size

    def _remember(self, ids: mx.array) -> None:
        if self.logits_processors:
            self.history = ids if self.history is None else mx.concat([self.history, ids])

    def prefill(self, prompt: mx.array, progress: Callable[[int, int], None]) -> Sample:
        """Feed the prompt in ``prefill_step_size`` chunks, all but its last id, then step on
        that id: returns the first sample (evaluation started)."""
        total = len(prompt)
        done = 0
        progress(done, total)
        while total - done > 1:
            n_chunk = min(self.prefill_step_size, total - done - 1)
            chunk = prompt[:n_chunk]
            self.model(chunk[None], cache=self.cache)
            self.quantize(self.cache)
            mx.eval([c.state for c in self.cache])
            self._remember(chunk)
            done += n_chunk
            progress(done, total)
            prompt = prompt[n_chunk:]
            mx.clear_cache()
        first = self.step(prompt)
        mx.async_eval(first.token, first.logprobs)
        return first

    def step(self, token: mx.array) -> Sample:
        """One serial forward on ``token`` (mlx-lm's ``_step``): its sample for the next slot."""
        logits = self.model(token[None], cache=self.cache)[:, -1, :]
        self._remember(token)
        self.quantize(self.cache)
        self.stats.forwards += 1
        return self.sample(logits)


CACHE_MOVED = ("fill: the prompt cache was written by another decode while this generator was "
               "held; it cannot go on (close it, or let it finish, before reusing the cache)")


class _Output:
    """What the consumer has received: ``emitted`` ids (the session's ``emitted_ids``), mirrored
    in ``stats.emitted`` (the one place either is written), and the proposal rounds' bursts."""

    def __init__(self, fill: FillSession):
        self.fill = fill
        self.emitted: list[int] = []
        fill.emitted_ids = self.emitted
        fill.stats.emitted = 0

    def emit(self, token: int) -> None:
        self.emitted.append(token)
        self.fill.stats.emitted = len(self.emitted)

    def burst(self, rnd: Round, cp: Checkpoint, ids: Sequence[int],
              logprobs: Sequence[mx.array]) -> Iterator[tuple[int, mx.array]]:
        """Yield a round's committed ids one at a time, the cache holding at each yield the ids
        received so far (:func:`~mlx_fill.core.primitive.showing`: the rest of the burst is
        hidden while the consumer holds the generator, as serial decoding has not fed them
        yet). If the consumer stops mid-burst (``close()`` or an exception at a yield), the
        ``finally`` rewinds the cache to exactly the ids it received and reports the
        proposal's share of them as the round's outcome; if another decode wrote the cache
        while the generator was held, the cache is that decode's: it is left alone, and
        resuming raises :data:`CACHE_MOVED`."""
        received = 0
        finished = False
        shown = None
        try:
            for t, lp in zip(ids, logprobs):
                self.emit(t)
                received += 1
                with showing(cp, received) as shown:
                    yield t, lp
                if shown.moved:
                    raise RuntimeError(CACHE_MOVED)
            finished = True
        finally:
            if not finished:
                if shown is None or not shown.moved:
                    rewind(cp, received)
                settle(self.fill, rnd, received)


def _apply(rnd: Round, target: _Target, out: _Output):
    """Run one round (:func:`~mlx_fill.core.round.execute`) and yield its committed ids;
    returns the sample after them, or None when they reach ``max_tokens``."""
    done = execute(target, rnd)
    yield from out.burst(rnd, done.checkpoint, done.ids, done.logprobs)
    settle(out.fill, rnd, len(done.ids))
    if done.failure is not None:
        raise done.failure
    return done.next


def _fill_loop(
    prompt: mx.array,
    model: nn.Module,
    stream: Any,
    *,
    fill: FillSession,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[list] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[list] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    input_embeddings: Optional[mx.array] = None,
) -> Iterator[tuple[int, mx.array]]:
    """The decode loop with fill: mlx-lm's pipelined serial step, and after each yielded token
    (or each round's last one: a *chained* round) one proposal applied as an assert or verify
    round."""
    max_tokens = _token_budget(max_tokens)
    if input_embeddings is None:
        _check_prompt(prompt, model)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    _check_cache(prompt_cache)
    reason = _refusal(prompt_cache, input_embeddings, logits_processors)
    shared = fill.shared
    if shared is not None:  # a sharded model: every rank takes the same decision
        reason = shared.start(fill, reason, cache_kinds(prompt_cache), stream)
    if reason is not None:
        fill.refuse(reason)
        yield from stock_generate_step(
            prompt, model, stream, max_tokens=max_tokens, sampler=sampler,
            logits_processors=logits_processors, max_kv_size=max_kv_size,
            prompt_cache=prompt_cache, prefill_step_size=prefill_step_size, kv_bits=kv_bits,
            kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
            prompt_progress_callback=prompt_progress_callback, input_embeddings=input_embeddings)
        return
    if len(prompt) == 0:
        raise ValueError("Either input_embeddings or prompt (or both) must be provided.")

    if logits_processors:  # an asserted row is not sampled: no processor would see it
        fill.allow_assert = False
    plan = fill.plan if fill.plan is not None else plan_for(model)
    if kv_bits is not None:
        # Serial decode quantizes the cache right after the step that reaches the threshold;
        # a chunk must end there too so later rows attend over the same (quantized) keys.
        plan = replace(plan, kv_boundaries=tuple(sorted({*plan.kv_boundaries,
                                                         quantized_kv_start})))
    quantize = functools.partial(maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                                 kv_group_size=kv_group_size, kv_bits=kv_bits)
    target = _Target(model, prompt_cache, plan, fill.stats, sampler=sampler or greedy_sampler,
                     logits_processors=logits_processors, quantize=quantize,
                     prefill_step_size=prefill_step_size,
                     replay=shared is not None and shared.replay)
    progress = prompt_progress_callback or (lambda *_: None)
    prompt_ids = fill.prompt_ids if fill.prompt_ids is not None else prompt.tolist()
    asking = Asking(fill, prompt_ids,
                    None if shared is None else functools.partial(shared.propose, fill))
    out = _Output(fill)
    emitted = out.emitted
    total = len(prompt)

    def remaining() -> int | None:
        return max_tokens - len(emitted) if max_tokens >= 0 else None

    def apply(rnd: Round):
        with mx.stream(stream):
            return (yield from _apply(rnd, target, out))

    with mx.stream(stream):
        sample = target.prefill(prompt, progress)
    chained = False  # sample was drawn by a round: not yielded, not fed, no step in flight
    while True:
        if chained:
            rnd = asking.after_sample(emitted, sample, remaining())
            if rnd is not None:
                sample = yield from apply(rnd)
                if sample is None:  # max_tokens reached inside the span
                    break
                continue
        with mx.stream(stream):
            if len(emitted) != max_tokens:
                following = target.step(sample.token)
                mx.async_eval(following.token, following.logprobs)
            if not emitted:
                mx.eval(sample.token)
                progress(total, total)
            if len(emitted) == max_tokens:
                break
        token = sample.id
        out.emit(token)
        yield token, sample.logprobs
        if len(emitted) % 256 == 0:
            mx.clear_cache()
        sample, chained = following, False
        rnd = asking.at_sample(emitted, sample, remaining())
        if rnd is None:
            continue
        sample = yield from apply(rnd)
        if sample is None:  # max_tokens reached inside the span; the cache holds every yield
            break
        chained = True
