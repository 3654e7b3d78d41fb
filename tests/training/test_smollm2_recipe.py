"""The smollm2-tools training recipe's data side (no model): the loss mask and the batch order."""

from __future__ import annotations

import itertools

import numpy as np

from scripts.training import fixture_data
from scripts.training import train_smollm2_tools as recipe


def test_loss_is_on_assistant_turns_only():
    seq = fixture_data.Sequence("pi_mono", list(range(20)), [(4, 10), (14, 16)])
    mask = recipe.span_mask(seq)
    assert np.flatnonzero(mask).tolist() == [4, 5, 6, 7, 8, 9, 14, 15]
    assert set(mask.tolist()) == {0.0, 1.0}


def test_sources_take_turns_and_each_cycles_through_its_windows():
    seqs = [fixture_data.Sequence(src, [1] * (2 + k + 10 * i), [(1, 2 + k + 10 * i)])
            for i, src in enumerate(fixture_data.SOURCES) for k in range(3)]
    batches = recipe.span_batches(seqs, seed=0)(seqs, 1, 64, loop=True)
    by_length = {len(q.ids): q.source for q in seqs}
    lengths = [int(np.count_nonzero(mask)) + 1 for _, mask in itertools.islice(batches, 12)]
    assert [by_length[n] for n in lengths] == list(fixture_data.SOURCES) * 4
    for i in range(3):  # every source: its 3 windows once each, then again in the same order
        mine = lengths[i::3]
        assert len(set(mine[:3])) == 3 and mine[3] == mine[0]
