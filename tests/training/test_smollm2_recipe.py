"""The smollm2-tools training recipe's data side (no model): the loss weights and the batch order."""

from __future__ import annotations

import itertools

import numpy as np

from scripts.training import fixture_data
from scripts.training import train_smollm2_tools as recipe


def test_decision_tokens_weigh_more_and_context_weighs_nothing():
    seq = fixture_data.Sequence("pi_mono", list(range(20)), [(4, 10), (14, 16)])
    mask = recipe.span_mask(seq)
    w = recipe.DECISION_WEIGHT
    assert mask[:4].tolist() == [0.0] * 4
    assert mask[4:10].tolist() == [w, w, w, 1.0, 1.0, 1.0]
    assert mask[10:14].tolist() == [0.0] * 4
    assert mask[14:16].tolist() == [w, w]  # a turn shorter than the decision prefix
    assert mask[16:].sum() == 0


def test_batch_order_follows_the_schedule_and_cycles_each_source():
    seqs = [fixture_data.Sequence(src, [1] * (2 + k + 10 * i), [(1, 2 + k + 10 * i)])
            for i, src in enumerate(fixture_data.SOURCES) for k in range(3)]
    batches = recipe.span_batches(seqs, seed=0)(seqs, 1, 64, loop=True)
    first = list(itertools.islice(batches, 2 * len(recipe.SCHEDULE)))
    by_length = {len(q.ids): q.source for q in seqs}
    lengths = [int(np.count_nonzero(mask)) + 1 for _, mask in first]  # ids up to the span end
    sources = [by_length[n] for n in lengths]
    assert sources == list(recipe.SCHEDULE) * 2
    tau = [n for n, s in zip(lengths, sources) if s == "tau_bench_gpt4o_airline"]
    assert len(tau) == 4 and len(set(tau[:3])) == 3 and tau[3] == tau[0]  # each window once, then again
