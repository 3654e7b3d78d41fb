"""The one verifier: mlx-lm's sample-and-compare acceptance rule over a multi-row forward.

Given the logit rows of a forward over proposed ids ``f_1..f_k`` (row ``i`` predicts the slot
after ``f_{i+1}``), each row is processed exactly as mlx-lm's single-token step processes its
logits (logits processors with the history grown one token per row, log-softmax, the request's
sampler), so every sample is the target's own. Acceptance: ``f_1`` was already checked against
the in-flight sample; ``f_{i+1}`` is accepted while it equals the sample of row ``i``; the
sample after the last accepted id is the correction (or bonus) token. This is lossless for any
proposer at any temperature: every emitted token is a target sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
# the attribute :func:`pure_processor` sets
_PURE = "__mlx_fill_pure__"
# the refusal name for a logits processor that may keep state between calls
STATEFUL_PROCESSOR = "logits_processor"


def pure_processor(processor: LogitsProcessor) -> LogitsProcessor:
    """Declare ``processor`` a function of its ``(tokens, logits)`` alone, keeping no state
    between calls, and return it: fill may then run it on a round's every row, rejected ones
    included, as a verify round must. TypeError for an object that takes no attribute (a bound
    method: declare the function it wraps)."""
    try:
        setattr(processor, _PURE, True)
    except (AttributeError, TypeError):
        raise TypeError(f"pure_processor: {processor!r:.60} takes no attribute; pass a function "
                        f"(def or lambda) or a functools.partial") from None
    return processor


def is_pure(processor: LogitsProcessor) -> bool:
    """Whether fill may run ``processor`` on rows it then rejects: mlx-lm's own
    (``mlx_lm.sample_utils``: logit bias, repetition, presence and frequency penalties, each a
    function of the tokens it is given; mlx-lm's speculative decoding runs them on rejected
    rows too) and those declared with :func:`pure_processor`. Any other may keep state (a
    grammar matcher advanced per call, a counter), which rejected rows would advance: plain
    decoding calls it once per emitted token."""
    return (getattr(processor, "__module__", None) == "mlx_lm.sample_utils"
            or getattr(processor, _PURE, False) is True)


def process_row(
    logits: mx.array,
    history: mx.array | None,
    sampler: Sampler,
    logits_processors: Sequence[LogitsProcessor] | None,
) -> tuple[mx.array, mx.array]:
    """Sample one ``[1, V]`` logits row the way ``generate_step``'s ``_step`` does.

    ``history`` already ends with the token this row follows. Returns ``(sample[1], logprobs[V])``.
    """
    if logits_processors:
        for processor in logits_processors:
            logits = processor(history, logits)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return sampler(logprobs), logprobs.squeeze(0)


@dataclass
class Verdict:
    """Outcome of one verify round. ``accepted`` counts proposed ids kept (``>= 1``: the first was
    pre-checked); ``logprobs[i]`` belongs to the slot after ``ids[i]``; ``next_token`` is the
    target's sample after the last accepted id, not yet in the cache. ``failure``: what a
    logits processor raised on the row after the last kept id, every id before it accepted (the
    step serial decoding takes there raises it alike: it feeds that id, then processes its row);
    ``next_token`` is then -1."""

    accepted: int
    next_token: int
    next_logprobs: mx.array | None
    row_logprobs: list[mx.array]
    failure: Exception | None = None


def verify_rows(
    rows: mx.array,
    ids: Sequence[int],
    history: mx.array | None,
    sampler: Sampler,
    logits_processors: Sequence[LogitsProcessor] | None,
) -> Verdict:
    """Sample every row of ``rows`` (``[k, V]`` for ``ids = f_1..f_k``) and apply the rule.

    ``history`` is the logits-processor history before ``f_1`` (None without processors). A
    processor that raises on row ``j`` (its history through ``f_{j+1}``) ends the rows there:
    when an id before ``f_{j+1}`` was rejected, serial decoding never reaches that history and
    the verdict is the rows' before it; otherwise the verdict keeps ``f_1..f_{j+1}`` and carries
    the ``failure``.
    """
    samples: list[mx.array] = []
    logprobs: list[mx.array] = []
    hist = history
    failure = None
    for i, t in enumerate(ids):
        if logits_processors:
            tok = mx.array([t], dtype=hist.dtype if hist is not None else mx.uint32)
            hist = tok if hist is None else mx.concatenate([hist, tok])
        try:
            s, lp = process_row(rows[i:i + 1], hist, sampler, logits_processors)
        except Exception as e:  # a processor's error: whether serial decoding meets it is below
            failure = e
            break
        samples.append(s)
        logprobs.append(lp)
    mx.eval(samples)
    sampled = [int(s.item()) for s in samples]
    reached = len(ids) if failure is None else len(samples) + 1  # ids whose rows were processed
    accepted = 1
    while accepted < reached and sampled[accepted - 1] == ids[accepted]:
        accepted += 1
    if failure is not None and accepted == reached:
        return Verdict(accepted, -1, None, logprobs, failure)
    return Verdict(accepted, sampled[accepted - 1], logprobs[accepted - 1], logprobs)
