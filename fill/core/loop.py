"""The fill-aware decode loop: ``generate_step`` with ``fill=``.

Same signature, yields and pipelining as ``mlx_lm.generate.generate_step`` (mlx-lm 0.32.x).
With ``fill=None`` it returns the stock generator untouched. With a :class:`FillSession`, after
each yielded token it asks the session for a proposal and applies it as one *round* through the
one append-and-rewind primitive. The steps, as in mlx-lm's ``speculative_generate_step``:

- ``_Target.prefill`` / ``_Target.step``: mlx-lm's chunked prefill and pipelined serial step.
- ``_assert_round``: the in-flight sample for the first slot is discarded (counted as wasted),
  the span is appended with one chunked forward (last-row logits only), its ids are yielded one
  at a time, and sampling resumes from the last row.
- ``_verify_round``: the first id was checked against the in-flight sample before any forward;
  the whole span is forwarded once, every row is sampled by the target (the acceptance rule,
  :mod:`mlx_fill.core.acceptance`), the rejected tail is rewound and decoding resumes at the
  correction token.
- ``_Output.burst``: yields a round's ids; its ``finally`` rewinds the cache to what the
  consumer received when it stops mid-burst.

A round that ends with a fresh sample is followed by a *chained* round: that sample (a
:class:`Sample`, not yet yielded nor fed) leads the next span. :class:`Round` is one round's
state.

Invariants: at every yield and when the consumer stops (``close()``, ``max_tokens`` inside a
span, an exception), the cache holds exactly prompt + yielded tokens; a proposed EOS is never
committed (the session cuts spans at EOS); every token not yielded by ``assert`` is a target
sample.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .acceptance import Sampler, process_row, verify_rows
from .plan import DispatchPlan
from .primitive import (Checkpoint, Unsupported, append, cache_kinds, cache_offset,
                        check_supported, checkpoint, rewind)
from .proposal import MEDIA_REFUSAL, DecodeView, FillSession, FillStats, Proposal
from .resolve import plan_for

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
    so delegation never recurses into a patched module attribute.
    """
    if fill is None:
        return stock_generate_step(prompt, model, stream, **kwargs)
    return _fill_loop(prompt, model, stream, fill=fill, **kwargs)


@dataclass(frozen=True)
class Sample:
    """A target sample not yet in the cache: ``token`` (shape ``[1]``, possibly still being
    computed) and the log-probabilities ``[V]`` it was drawn from."""

    token: mx.array
    logprobs: mx.array

    @property
    def id(self) -> int:
        return int(self.token.item())


@dataclass(frozen=True)
class Round:
    """One proposal applied at output index ``start`` (the slot of ``sample``).

    ``sample`` is the target's sample for that slot, not in the cache. In a ``chained`` round it
    was drawn by the previous round: it leads the span (fed first, always kept, yielded first).
    Otherwise it is the in-flight sample, which an ``assert`` span replaces (a wasted sample)
    and a ``verify`` span must start with. ``proposal`` holds the ids capped to ``cap`` (what
    fits before ``max_tokens``; None: no limit)."""

    proposal: Proposal
    sample: Sample
    chained: bool
    start: int
    cap: int | None

    @property
    def lead(self) -> list[int]:
        """The ids fed before the proposal's: the pending sample in a chained round."""
        return [self.sample.id] if self.chained else []

    @property
    def feed(self) -> list[int]:
        return self.lead + list(self.proposal.ids)

    @property
    def position(self) -> int:
        """Output index of the proposal's first id (what feedback and traces report)."""
        return self.start + len(self.lead)

    def wants_next(self, kept: int) -> bool:
        """Whether a sample after ``kept`` proposal ids is still needed (``max_tokens`` not reached)."""
        return self.cap is None or kept < self.cap


def _forced_logprobs(token: int, vocab: int) -> mx.array:
    """Log-probabilities of an asserted token: the policy put all mass on it (lazy)."""
    return mx.where(mx.arange(vocab) == token, 0.0, -mx.inf)


def _refusal(prompt_cache: list, input_embeddings: Any) -> str | None:
    if input_embeddings is not None:
        return MEDIA_REFUSAL
    try:
        check_supported(prompt_cache)
    except Unsupported as e:
        return e.reason
    return None


class _Target:
    """The target model and its cache for one generation: mlx-lm's single-token step, the
    chunked prefill, span forwards through the primitive, and the logits-processor history.

    Invariant: ``history`` ends with the last id fed to the cache (None without processors or
    before the first feed), exactly as in mlx-lm's ``generate_step``."""

    def __init__(self, model: nn.Module, cache: list, plan: DispatchPlan, stats: FillStats, *,
                 sampler: Sampler, logits_processors: list | None,
                 quantize: Callable[[list], None], prefill_step_size: int, replay: bool = False):
        self.model = model
        self.replay = replay  # rewind by restore-and-replay (every rank of a sharded model alike)
        self.cache = cache
        self.plan = plan
        self.stats = stats
        self.sampler = sampler
        self.logits_processors = logits_processors
        self.quantize = quantize
        self.prefill_step_size = prefill_step_size
        self.history: mx.array | None = None

    def _remember(self, ids: mx.array) -> None:
        if self.logits_processors:
            self.history = ids if self.history is None else mx.concat([self.history, ids])

    def remember(self, ids: Sequence[int]) -> None:
        """Grow the history by ids a span fed to the cache."""
        if self.logits_processors:
            dtype = self.history.dtype if self.history is not None else mx.uint32
            self._remember(mx.array(list(ids), dtype=dtype))

    def sample(self, row: mx.array) -> Sample:
        """Sample a ``[1, V]`` logits row after the current history (the one acceptance rule's
        row processing)."""
        return Sample(*process_row(row, self.history, self.sampler, self.logits_processors))

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

    def forward(self, feed: list[int], rows: str) -> tuple[Checkpoint, mx.array | None]:
        """Append ``feed`` in plan-sized chunks, keeping a checkpoint to rewind to; ``rows``
        selects the logits rows returned (``all``, ``last`` or ``none``)."""
        t0 = time.perf_counter()
        cp = checkpoint(self.model, self.cache, self.plan)
        cp.replay = self.replay
        self.stats.checkpoint_ms += (time.perf_counter() - t0) * 1e3
        self.stats.forwards += len(self.plan.chunks(cache_offset(self.cache), len(feed)))
        return cp, append(self.model, self.cache, feed, plan=self.plan, logits=rows, record=cp,
                          after_chunk=self.quantize)

    def rewind(self, cp: Checkpoint, keep: int) -> None:
        t0 = time.perf_counter()
        rewind(cp, keep)
        self.stats.checkpoint_ms += (time.perf_counter() - t0) * 1e3


class _Output:
    """What the consumer has received: ``emitted`` ids, mirrored in ``stats.emitted`` (the one
    place it is written), and the proposal rounds' bursts."""

    def __init__(self, fill: FillSession):
        self.fill = fill
        self.emitted: list[int] = []
        fill.stats.emitted = 0

    def emit(self, token: int) -> None:
        self.emitted.append(token)
        self.fill.stats.emitted = len(self.emitted)

    def burst(self, rnd: Round, cp: Checkpoint, ids: Sequence[int],
              logprobs: Sequence[mx.array]) -> Iterator[tuple[int, mx.array]]:
        """Yield a round's committed ids one at a time. If the consumer stops mid-burst
        (``close()`` or an exception at a yield), the ``finally`` rewinds the cache to exactly
        the ids it received and reports the proposal's share of them as the round's outcome."""
        received = 0
        finished = False
        try:
            for t, lp in zip(ids, logprobs):
                self.emit(t)
                received += 1
                yield t, lp
            finished = True
        finally:
            if not finished:
                rewind(cp, received)
                self.fill.feedback(rnd.proposal, max(0, received - len(rnd.lead)), rnd.position)


def _assert_round(rnd: Round, target: _Target, out: _Output):
    """Append an asserted span (after the chained sample, else in place of the discarded
    in-flight sample) with one chunked forward; returns the sample after it, or None when the
    span reaches ``max_tokens``."""
    if not rnd.chained:
        target.stats.wasted_samples += 1
    need_next = rnd.wants_next(len(rnd.proposal.ids))
    feed = rnd.feed
    cp, row = target.forward(feed, "last" if need_next else "none")
    vocab = rnd.sample.logprobs.shape[-1]
    lead_lps = [rnd.sample.logprobs] if rnd.chained else []
    yield from out.burst(rnd, cp, feed,
                         lead_lps + [_forced_logprobs(t, vocab) for t in rnd.proposal.ids])
    target.remember(feed)
    nxt = None
    if need_next:
        nxt = target.sample(row)
        mx.async_eval(nxt.token, nxt.logprobs)
    out.fill.feedback(rnd.proposal, len(rnd.proposal.ids), rnd.position)
    return nxt


def _verify_round(rnd: Round, target: _Target, out: _Output):
    """Forward the span once, sample every row (the one acceptance rule), rewind the rejected
    tail and yield the agreeing prefix; returns the correction/bonus sample after it, or None
    when the kept ids reach ``max_tokens``."""
    feed = rnd.feed
    cp, rows = target.forward(feed, "all")
    verdict = verify_rows(rows, feed, target.history, target.sampler, target.logits_processors)
    target.rewind(cp, verdict.accepted)
    kept = feed[:verdict.accepted]
    yield from out.burst(rnd, cp, kept,
                         [rnd.sample.logprobs, *verdict.row_logprobs[:len(kept) - 1]])
    target.remember(kept)
    accepted = len(kept) - len(rnd.lead)
    out.fill.feedback(rnd.proposal, accepted, rnd.position)
    if not rnd.wants_next(accepted):
        return None
    return Sample(mx.array([verdict.next_token], dtype=rnd.sample.token.dtype),
                  verdict.next_logprobs)


def _round(proposal: Proposal, sample: Sample, chained: bool, start: int,
           remaining: int | None) -> Round:
    """The round for ``proposal``, its ids capped so the yields fit ``remaining``."""
    cap = None if remaining is None else remaining - int(chained)
    ids = proposal.ids if cap is None else proposal.ids[:cap]
    return Round(replace(proposal, ids=tuple(ids)), sample, chained, start, cap)


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
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    reason = _refusal(prompt_cache, input_embeddings)
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
    propose = fill.propose if shared is None else functools.partial(shared.propose, fill)
    progress = prompt_progress_callback or (lambda *_: None)
    prompt_ids = fill.prompt_ids if fill.prompt_ids is not None else prompt.tolist()
    out = _Output(fill)
    emitted = out.emitted
    total = len(prompt)

    def remaining() -> int | None:
        return max_tokens - len(emitted) if max_tokens >= 0 else None

    def apply(rnd: Round):
        with mx.stream(stream):
            if rnd.proposal.policy == "assert":
                return (yield from _assert_round(rnd, target, out))
            return (yield from _verify_round(rnd, target, out))

    with mx.stream(stream):
        sample = target.prefill(prompt, progress)
    chained = False  # sample was drawn by a round: not yielded, not fed, no step in flight
    asked = -1  # len(emitted) + 1 when the slot after sample was already offered to the sources
    while True:
        left = remaining()
        if chained and (left is None or left > 1):
            asked = len(emitted) + 1
            proposal = propose(DecodeView(prompt_ids, [*emitted, sample.id], fill.eos_ids,
                                          pending=True))
            if proposal is not None:
                sample = yield from apply(_round(proposal, sample, True, len(emitted), left))
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
        left = remaining()
        if left == 0 or asked == len(emitted):
            continue
        proposal = propose(DecodeView(prompt_ids, emitted, fill.eos_ids))
        if proposal is None:
            continue
        rnd = _round(proposal, sample, False, len(emitted), left)
        if rnd.proposal.policy == "verify" and sample.id != rnd.proposal.ids[0]:
            fill.feedback(rnd.proposal, 0, rnd.position)  # disagrees with the in-flight sample
            continue
        sample = yield from apply(rnd)
        if sample is None:  # max_tokens reached inside the span; the cache holds every yield
            break
        chained = True
