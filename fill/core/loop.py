"""The fill-aware decode loop: ``generate_step`` with ``fill=``.

Same signature, yields and pipelining as ``mlx_lm.generate.generate_step`` (mlx-lm 0.32.x).
With ``fill=None`` it returns the stock generator untouched. With a :class:`FillSession`, after
each yielded token it asks the session for a proposal and applies it through the one
append-and-rewind primitive:

- ``assert``: the in-flight sample for the first slot is discarded (counted as wasted), the span
  is appended with one chunked forward (last-row logits only), its ids are yielded one at a
  time, and sampling resumes from the last row.
- ``verify``: the first id is checked against the in-flight sample before any forward; on a
  match the whole span is forwarded once, every row is sampled by the target
  (``mlx_fill.core.acceptance``), the rejected tail is rewound and decoding resumes at the
  correction token.

Invariants: at every yield and when the consumer stops (``close()``, ``max_tokens`` inside a
span, an exception), the cache holds exactly prompt + yielded tokens; a proposed EOS is never
committed (the session cuts spans at EOS); every token not yielded by ``assert`` is a target
sample.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .resolve import plan_for
from .primitive import Checkpoint, Unsupported, append, cache_offset, check_supported, checkpoint, rewind
from .proposal import DecodeView, FillSession, Proposal
from .acceptance import process_row, verify_rows

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


def _forced_logprobs(token: int, vocab: int) -> mx.array:
    """Log-probabilities of an asserted token: the policy put all mass on it (lazy)."""
    return mx.where(mx.arange(vocab) == token, 0.0, -mx.inf)


def _refusal(prompt_cache: list, input_embeddings: Any) -> str | None:
    if input_embeddings is not None:
        return "media_input"
    try:
        check_supported(prompt_cache)
    except Unsupported as e:
        return e.reason
    return None


def _fill_loop(
    prompt: mx.array,
    model: nn.Module,
    stream: Any,
    *,
    fill: FillSession,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
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
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    reason = _refusal(prompt_cache, input_embeddings)
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
    sampler = sampler or greedy_sampler
    progress = prompt_progress_callback or (lambda *_: None)
    prompt_ids = fill.prompt_ids if fill.prompt_ids is not None else prompt.tolist()
    stats = fill.stats
    emitted: list[int] = []
    history: mx.array | None = None  # logits-processor history, as in mlx-lm's _step

    def _step(y: mx.array) -> tuple[mx.array, mx.array]:
        nonlocal history
        with mx.stream(stream):
            logits = model(y[None], cache=prompt_cache)[:, -1, :]
            if logits_processors:
                history = y if history is None else mx.concat([history, y])
            quantize(prompt_cache)
            stats.forwards += 1
            return process_row(logits, history, sampler, logits_processors)

    def _grow_history(ids: Sequence[int]) -> None:
        nonlocal history
        if logits_processors:
            new = mx.array(list(ids), dtype=history.dtype if history is not None else mx.uint32)
            history = new if history is None else mx.concat([history, new])

    def _burst(cp: Checkpoint, ids: Sequence[int], logprobs: Sequence[mx.array],
               proposal: Proposal, lead: int) -> Iterator[tuple[int, mx.array]]:
        """Yield committed ids one at a time (``lead`` leading ids are not the proposal's). If
        the consumer stops mid-burst, rewind the cache to exactly the ids it received and report
        the proposal's share of them as its outcome."""
        position = len(emitted) + lead
        for j, (t, lp) in enumerate(zip(ids, logprobs)):
            emitted.append(t)
            stats.emitted += 1
            try:
                yield t, lp
            except GeneratorExit:
                rewind(cp, j + 1)
                fill.feedback(proposal, max(0, j + 1 - lead), position)
                raise

    with mx.stream(stream):
        total = len(prompt)
        done = 0
        progress(done, total)
        while total - done > 1:
            n_chunk = min(prefill_step_size, total - done - 1)
            chunk = prompt[:n_chunk]
            model(chunk[None], cache=prompt_cache)
            quantize(prompt_cache)
            mx.eval([c.state for c in prompt_cache])
            if logits_processors:
                history = chunk if history is None else mx.concat([history, chunk])
            done += n_chunk
            progress(done, total)
            prompt = prompt[n_chunk:]
            mx.clear_cache()
        y, logprobs = _step(prompt)
        mx.async_eval(y, logprobs)

    def _forward(feed: list[int], rows: str) -> tuple[Checkpoint, mx.array | None]:
        t0 = time.perf_counter()
        cp = checkpoint(model, prompt_cache, plan)
        stats.checkpoint_ms += (time.perf_counter() - t0) * 1e3
        stats.forwards += len(plan.chunks(cache_offset(prompt_cache), len(feed)))
        return cp, append(model, prompt_cache, feed, plan=plan, logits=rows, record=cp,
                          after_chunk=quantize)

    def _apply_assert(ids: list[int], need_next: bool, proposal: Proposal, lead):
        """Append an asserted span (after the pending ``lead`` token when given, else in place of
        the discarded in-flight sample); returns the sample after it (None at max_tokens)."""
        lead_ids, lead_lps = ([int(lead[0].item())], [lead[1]]) if lead else ([], [])
        if not lead:
            stats.wasted_samples += 1
        feed = lead_ids + ids
        cp, row = _forward(feed, "last" if need_next else "none")
        vocab = logprobs.shape[-1]
        yield from _burst(cp, feed, lead_lps + [_forced_logprobs(t, vocab) for t in ids],
                          proposal, len(lead_ids))
        _grow_history(feed)
        if not need_next:
            return None
        nxt, nxt_lp = process_row(row, history, sampler, logits_processors)
        mx.async_eval(nxt, nxt_lp)
        return nxt, nxt_lp

    def _apply_verify(ids: list[int], first: tuple[mx.array, mx.array], proposal: Proposal,
                      lead: bool):
        """Forward a span and keep its agreeing prefix. ``first`` is either the in-flight sample
        ``ids[0]`` already equals (``lead`` False) or the pending token the span follows
        (``lead`` True), which leads the forward and is always kept. Returns (proposal ids kept,
        next token, its logprobs)."""
        lead_ids = [int(first[0].item())] if lead else []
        feed = lead_ids + ids
        cp, rows = _forward(feed, "all")
        verdict = verify_rows(rows, feed, history, sampler, logits_processors)
        t0 = time.perf_counter()
        rewind(cp, verdict.accepted)
        stats.checkpoint_ms += (time.perf_counter() - t0) * 1e3
        kept = feed[:verdict.accepted]
        yield from _burst(cp, kept, [first[1], *verdict.row_logprobs[:len(kept) - 1]],
                          proposal, len(lead_ids))
        _grow_history(kept)
        nxt = mx.array([verdict.next_token], dtype=first[0].dtype)
        return len(kept) - len(lead_ids), nxt, verdict.next_logprobs

    def _apply(proposal: Proposal, remaining: int | None, pending: tuple | None):
        """Apply ``proposal`` (capped so the yields fit ``remaining``); ``pending`` is the
        sampled-but-unfed token it follows in a chained round, else None (the proposal's first
        slot has an in-flight sample). Returns (yielded, next (token, logprobs) or None), or
        None when a verify proposal's first id disagrees with the in-flight sample."""
        lead = 1 if pending is not None else 0
        cap = None if remaining is None else remaining - lead
        ids = list(proposal.ids if cap is None else proposal.ids[:cap])
        applied = replace(proposal, ids=tuple(ids))
        position = len(emitted) + lead
        if proposal.policy == "assert":
            need_next = cap is None or len(ids) < cap
            with mx.stream(stream):
                after = yield from _apply_assert(ids, need_next, applied, pending)
            kept = len(ids)
        else:
            if pending is None and y.item() != ids[0]:
                fill.feedback(applied, 0, position)
                return None
            first = pending if pending is not None else (y, logprobs)
            with mx.stream(stream):
                kept, nxt, nxt_lp = yield from _apply_verify(ids, first, applied, lead == 1)
            after = (nxt, nxt_lp) if cap is None or kept < cap else None
        fill.feedback(applied, kept, position)
        return kept + lead, after

    n = 0
    chained = False  # y was sampled by a fill round: not fed yet, no step in flight
    asked = -1  # len(emitted) + 1 when the slot after y was already offered to the sources
    while True:
        if chained and n != max_tokens:
            remaining = max_tokens - n if max_tokens >= 0 else None
            if remaining is None or remaining > 1:
                asked = len(emitted) + 1
                view = DecodeView(prompt_ids, [*emitted, int(y.item())], fill.eos_ids,
                                  pending=True)
                proposal = fill.propose(view)
                if proposal is not None:
                    yielded, after = yield from _apply(proposal, remaining, (y, logprobs))
                    n += yielded
                    stats.emitted = n
                    if after is None:  # max_tokens reached inside the span
                        break
                    y, logprobs = after
                    continue
        with mx.stream(stream):
            if n != max_tokens:
                next_y, next_logprobs = _step(y)
                mx.async_eval(next_y, next_logprobs)
            if n == 0:
                mx.eval(y)
                progress(total, total)
            if n == max_tokens:
                break
        token = y.item()
        emitted.append(token)
        n += 1
        stats.emitted = n
        yield token, logprobs
        if n % 256 == 0:
            mx.clear_cache()
        y, logprobs = next_y, next_logprobs
        chained = False
        remaining = max_tokens - n if max_tokens >= 0 else None
        if remaining == 0 or asked == len(emitted):
            continue
        proposal = fill.propose(DecodeView(prompt_ids, emitted, fill.eos_ids))
        if proposal is None:
            continue
        result = yield from _apply(proposal, remaining, None)
        if result is None:
            continue
        yielded, after = result
        n += yielded
        stats.emitted = n
        if after is None:  # max_tokens reached inside the span; the cache holds every yield
            break
        y, logprobs = after
        chained = True
    stats.emitted = n
