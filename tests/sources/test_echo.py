"""Echo index and echo source: index invariants, branch stops, corroboration, clamping, policy."""

from __future__ import annotations

import random

import pytest

from mlx_fill.core.index import EchoIndex
from mlx_fill.sources.echo import EchoDraft, EchoSource, echo_span
from mlx_fill.sources.ledger import Ledger
from mlx_fill.core.proposal import DecodeView, FillSession


def _brute_positions(seq, k, key):
    key = key if isinstance(key, tuple) else (key,)
    return [i for i in range(k - 1, len(seq)) if tuple(seq[i - k + 1:i + 1]) == key]


def test_index_matches_brute_force_under_append_truncate_sync():
    rng = random.Random(0)
    idx = EchoIndex(ks=(1, 2, 3))
    ref: list[int] = []
    for step in range(300):
        op = rng.random()
        if op < 0.6:
            t = rng.randrange(4)
            idx.append(t)
            ref.append(t)
        elif op < 0.8:
            n = rng.randrange(len(ref) + 1)
            idx.truncate(n)
            del ref[n:]
        else:
            new = ref[: rng.randrange(len(ref) + 1)] + [rng.randrange(4) for _ in range(5)]
            idx.sync(new)
            ref = list(new)
        assert idx.seq == ref
        for k in (1, 2, 3):
            if len(ref) >= k:
                key = ref[-1] if k == 1 else tuple(ref[-k:])
                assert list(idx.positions(k, key)) == _brute_positions(ref, k, key)


def test_common_prefix_and_advance_to_are_exact():
    idx = EchoIndex(tokens=[1, 2, 3, 4, 5])
    assert idx.common_prefix([1, 2, 9]) == 2
    assert idx.common_prefix([1, 2, 3, 4, 5, 6]) == 5
    idx.advance_to(7, [5, 6, 7])  # holds 5, needs the last 2 of the feed
    assert idx.seq == [1, 2, 3, 4, 5, 6, 7]
    idx.advance_to(7, [6, 7])  # idempotent for a second reader of the same stream
    assert len(idx) == 7
    with pytest.raises(ValueError):
        idx.advance_to(6, [7])
    with pytest.raises(ValueError):
        idx.advance_to(12, [1])


def test_nearest_is_nearest_first_and_excludes_the_tail_itself():
    idx = EchoIndex(ks=(2,), tokens=[7, 8, 0, 7, 8, 1, 7, 8, 2, 7, 8])
    assert idx.nearest(2, 2) == [7, 4]
    assert idx.nearest(2, 10) == [7, 4, 1]


def test_branch_point_stopping_and_corroboration():
    # "a b" was followed by "c d e" twice, then by "c d f": the span stops at the fork.
    seq = [10, 11, 12, 13, 14, 0, 10, 11, 12, 13, 14, 0, 10, 11, 12, 13, 15, 0, 10, 11]
    idx = EchoIndex(ks=(2,), tokens=seq)
    span = echo_span(idx, anchors=(2,), candidates=3, max_span=10)
    assert span.ids == (12, 13)
    assert span.branch_stop and span.corroboration == 3
    one = echo_span(idx, anchors=(2,), candidates=1, max_span=10)
    assert one.ids == (12, 13, 15, 0, 10, 11) and one.corroboration == 1 and not one.branch_stop


def test_delimiter_clamps_the_span_after_the_delimiter():
    seq = [5, 6, 7, 99, 8, 9, 0, 5, 6]
    idx = EchoIndex(ks=(2,), tokens=seq)
    span = echo_span(idx, anchors=(2,), candidates=2, max_span=10, delimiters={99})
    assert span.ids == (7, 99) and span.at_delimiter
    assert echo_span(idx, anchors=(2,), max_span=10).ids == (7, 99, 8, 9, 0, 5, 6)


def test_span_cap_and_no_match():
    idx = EchoIndex(ks=(2,), tokens=list(range(20)) + [0, 1])
    assert len(echo_span(idx, anchors=(2,), max_span=5).ids) == 5
    assert echo_span(EchoIndex(ks=(2,), tokens=[1, 2, 3]), anchors=(2,)) is None


def test_echo_source_is_verify_unless_ledger_promotes_and_never_at_temperature():
    seq = [1, 2, 3, 99, 0, 1, 2, 3, 99, 0, 1, 2]
    led = Ledger("m", "t", promote_after=2, eligible=frozenset({"echo:corroborated"}))

    def make():
        d = EchoDraft(EchoIndex(), anchors=(2,), candidates=2, delimiters={99})
        return EchoSource(d, assert_allowed=lambda: led.promoted("echo:corroborated"),
                          record=led.record)

    src = make()
    p = src.propose(DecodeView(seq, []))
    assert p.ids == (3, 99) and p.policy == "verify" and p.origin == "echo:corroborated"
    src.feedback(p, 2)
    src2 = make()
    src2.feedback(src2.propose(DecodeView(seq, [])), 2)
    assert led.claims["echo:corroborated"].agreements == 2
    assert make().propose(DecodeView(seq, [])).policy == "assert"
    # above temperature 0 the session (allow_assert=False, as build_session arms it) drops it
    assert FillSession([make()], allow_assert=False).propose(DecodeView(seq, [])) is None
    led.record("echo:corroborated", False)  # the first disagreement demotes for good
    assert make().propose(DecodeView(seq, [])).policy == "verify"


def test_a_corroborated_span_made_only_in_part_is_no_evidence_for_its_row():
    """The session may make a corroborated span cut short (here at an end id); its prefix
    verified whole does not count as the row's agreement."""
    seq = [1, 2, 3, 99, 0, 1, 2, 3, 99, 0, 1, 2]
    led = Ledger("m", "t", promote_after=1, eligible=frozenset({"echo:corroborated"}))
    src = EchoSource(EchoDraft(EchoIndex(), anchors=(2,), candidates=2, delimiters={99}),
                     assert_allowed=lambda: led.promoted("echo:corroborated"), record=led.record)
    made = FillSession([src]).propose(DecodeView(seq, [], (99,)))
    assert made.ids == (3,) and made.origin == "echo:corroborated"
    src.feedback(made, 1)
    assert "echo:corroborated" not in led.claims and not led.promoted("echo:corroborated")


def test_echo_source_incremental_feed_equals_fresh_lookup():
    rng = random.Random(3)
    prompt = [rng.randrange(6) for _ in range(200)]
    emitted = [rng.randrange(6) for _ in range(40)]
    src = EchoSource(EchoDraft(EchoIndex()))
    for i in range(1, len(emitted) + 1):
        got = src.propose(DecodeView(prompt, emitted[:i]))
        fresh = echo_span(EchoIndex(tokens=prompt + emitted[:i]))
        assert (got.ids if got else None) == (fresh.ids if fresh else None)


def test_gated_echo_prices_each_span_under_its_own_key():
    """The gate keys each echo span by (anchor, corroboration, delimiter end): after spans of
    one key were always accepted, the next span of that key is proposed (cut to what pays),
    while the source's first span, at the prior, is only kept as a shadow."""
    from mlx_fill.core.plan import DispatchPlan
    from mlx_fill.core.cost import CostGate

    steep = DispatchPlan(key=None, max_chunk=16, cost={2: 1.6, 4: 2.0, 8: 3.2, 16: 6.0}, qualified=True)
    copy = list(range(10, 40))
    prompt = [1, 2, 3] + copy + [4, 5]
    gate = CostGate(steep, 16)
    src = EchoSource(EchoDraft(max_span=16), gate=gate)
    assert src.propose(DecodeView(prompt=prompt, emitted=copy[:8])) is None  # prior: shadow only
    key = src.draft.confidence()
    for _ in range(20):
        gate.observe(16, 16, key=key)
    p = src.propose(DecodeView(prompt=prompt, emitted=copy[:9]))
    assert p is not None and p.policy == "verify" and p.ids == tuple(copy[9:9 + len(p.ids)])
    assert 1 < len(p.ids) <= 16
