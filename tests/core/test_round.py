"""The round executor both lanes run: one round leaves the cache equal to serial decoding of
exactly the ids it commits, keeps only target samples in ``verify``, honours a stop cut and the
cap, and asks each view once."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from mlx_fill.core.exactness import caches_equal
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import FillSession, Proposal
from mlx_fill.core.round import Asking, CacheView, Sample, execute, make_round

from conftest import tiny_model

PLAN = DispatchPlan(key=None, max_chunk=4, qualified=True)
PROMPT = [random.Random(5).randrange(512) for _ in range(12)]


def _serial(model, ids):
    """A cache fed ``PROMPT + ids`` one step at a time, and each step's greedy sample."""
    cache = make_prompt_cache(model)
    model(mx.array(PROMPT)[None], cache=cache)
    samples = []
    for t in ids:
        samples.append(int(mx.argmax(model(mx.array([[t]]), cache=cache)[0, -1]).item()))
    return cache, samples


def _greedy(model, n):
    """The first ``n`` greedy ids after the prompt."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(PROMPT)[None], cache=cache)[0, -1]
    out = [int(mx.argmax(logits).item())]
    while len(out) < n:
        out.append(int(mx.argmax(model(mx.array([[out[-1]]]), cache=cache)[0, -1]).item()))
    return out


def _view(model):
    """A view whose cache holds the prompt, and the in-flight sample for the next slot."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(PROMPT)[None], cache=cache)[:, -1, :]
    session = FillSession([], prompt_ids=PROMPT, plan=PLAN)
    view = CacheView(model, cache, PLAN, session.stats, sampler=greedy_sampler,
                     logits_processors=None)
    return view, view.sample(logits)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("policy,wrong_at", [("assert", None), ("verify", None), ("verify", 3)])
@pytest.mark.parametrize("chained", [False, True])
def test_a_round_commits_exactly_what_serial_decoding_would(arch, policy, wrong_at, chained):
    model = tiny_model(arch)
    ref = _greedy(model, 10)
    view, sample = _view(model)
    ids = ref[1:7] if chained else ref[0:6]
    if wrong_at is not None:
        ids = [*ids[:wrong_at], (ids[wrong_at] + 1) % 512, *ids[wrong_at + 1:]]
    rnd = make_round(Proposal(tuple(ids), policy, "t"), sample, chained, 0, None)
    out = execute(view, rnd)
    want = rnd.feed if wrong_at is None else rnd.feed[:wrong_at + int(chained)]
    assert out.ids == want and not out.stopped
    assert len(out.logprobs) == len(out.ids)
    serial_cache, samples = _serial(model, out.ids)
    assert caches_equal(view.cache, serial_cache)
    assert out.next.id == samples[-1]  # the correction (or bonus) is the target's sample
    assert view.stats.wasted_samples == int(policy == "assert" and not chained)


def test_a_stop_cut_and_the_cap_keep_only_what_the_sequence_takes():
    model = tiny_model("qwen3")
    ref = _greedy(model, 10)
    view, sample = _view(model)
    rnd = make_round(Proposal(tuple(ref[1:8]), "verify", "t"), sample, True, 0, None)
    out = execute(view, rnd, stop=lambda ids: 3 if len(ids) >= 3 else None)
    assert out.ids == ref[:3] and out.stopped and out.next is None
    assert caches_equal(view.cache, _serial(model, ref[:3])[0])

    view, sample = _view(model)
    rnd = make_round(Proposal(tuple(ref[0:8]), "assert", "t"), sample, False, 0, 4)
    assert rnd.proposal.ids == tuple(ref[:4])
    out = execute(view, rnd)
    assert out.ids == ref[:4] and out.next is None  # the cap is reached: no sample after it


class _Counting:
    name = "count"

    def __init__(self, ids):
        self.ids, self.views = ids, []

    def propose(self, view):
        self.views.append((list(view.emitted), view.pending))
        return Proposal(tuple(self.ids), "verify", self.name)

    def feedback(self, proposal, accepted):
        pass


def test_each_view_is_asked_once_and_a_disagreeing_verify_costs_no_forward():
    """A view-end proposal whose first id disagrees with the in-flight sample is rejected
    before any forward; that sample, read by the check, then leads a chained round asked of
    the view it ends (pending: not in the cache)."""
    src = _Counting([7, 8])
    session = FillSession([src], prompt_ids=PROMPT, plan=PLAN)
    asking = Asking(session, PROMPT)
    sample = Sample(mx.array([9]), mx.zeros((512,)))
    rnd = asking.at_sample([1], sample, None)  # 7 != 9: rejected before a forward
    assert session.stats.verify_rejected == 2 and session.stats.forwards == 0
    assert rnd.chained and rnd.feed == [9, 7, 8] and src.views == [([1], False), ([1, 9], True)]
    assert asking.at_sample([1], sample, None) is None and len(src.views) == 2
    assert asking.at_sample([1, 9], sample, None) is None  # that slot was offered chained
    assert asking.after_sample([1, 9], sample, 1) is None  # no slot after the sample
    assert len(src.views) == 2


def test_a_disagreeing_sample_that_ends_the_sequence_leads_no_round():
    src = _Counting([7, 8])
    session = FillSession([src], prompt_ids=PROMPT, plan=PLAN, eos_ids=[9])
    asking = Asking(session, PROMPT)
    assert asking.at_sample([1], Sample(mx.array([9]), mx.zeros((512,))), None) is None
    assert src.views == [([1], False)]
    assert asking.after_sample([1, 5], Sample(mx.array([9]), mx.zeros((512,))), None) is None
    assert src.views == [([1], False)]  # a view ending with an end id asks no source
