"""``scripts.bench.heldout_sessions``: the held-back and the trained sessions split the training
sources' recordings, the session split by turns included."""

from __future__ import annotations

from collections import Counter

from scripts.bench.heldout_sessions import TAIL, _training_sources_rows, heldout_rows, trained_rows
from scripts.training import fixture_data


def test_trained_and_held_back_sessions_split_the_recordings():
    held = heldout_rows(0)
    trained = trained_rows(0)
    whole = {(r["source"], r["session_id"]) for r in held if not r["session_id"].endswith(TAIL)}
    assert whole.isdisjoint((r["source"], r["session_id"]) for r in trained)
    # every recording of the training sources is in one part; a split one (pi's) in both
    recorded = Counter(s.source for s in fixture_data.load_recordings())
    for source, n in recorded.items():
        in_trained = sum(r["source"] == source for r in trained)
        in_held = sum(r["source"] == source and not r["session_id"].endswith(TAIL) for r in held)
        assert in_trained + in_held == n, source
    raw = _training_sources_rows()
    tails = [r for r in held if r["session_id"].endswith(TAIL)]
    assert tails
    for tail in tails:
        head = next(r for r in trained if r["session_id"] == tail["session_id"].removesuffix(TAIL))
        system = [m for m in head["messages"][:1] if m["role"] == "system"]
        assert tail["messages"][:len(system)] == system
        assert len(head["messages"]) + len(tail["messages"]) - len(system) \
            == len(raw[(tail["source"], head["session_id"])]["messages"])
        assert tail["messages"][len(system)]["role"] == "user"  # the cut is at a user turn


def test_per_source_caps_each_source():
    rows = trained_rows(0, per_source=2)
    assert max(Counter(r["source"] for r in rows).values()) == 2
