"""Cost model: acceptance bookkeeping, length choice against a cost curve, gating, shadows."""

from __future__ import annotations

import random

import pytest

from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import DecodeView, FillSession, Pace, Proposal, Round
from mlx_fill.core.cost import (PRICE_MARGIN, AcceptanceByPosition, CostGate, DraftAcceptance,
                                batch_min_gain, best_length, choose_length, round_costs)

FLAT = DispatchPlan(key=None, max_chunk=64, cost={64: 1.0}, qualified=True)   # free rows
LINEAR = DispatchPlan(key=None, max_chunk=64, cost={}, qualified=False)      # c(m) = m
MILD = DispatchPlan(key=None, max_chunk=64, cost={2: 1.05, 4: 1.1, 8: 1.3, 16: 1.8, 32: 3.0},
                    qualified=True)
STEEP = DispatchPlan(key=None, max_chunk=16, cost={2: 1.6, 4: 2.0, 8: 3.2, 16: 6.0},
                     qualified=True)  # SmolLM2-135M bfloat16 on the 2-core CPU (real-model.md)
# c(2) 1.5 at KV 512; at 4096 a one-row forward takes 2x, a two-row one 3.5x the 512 one-row's
BY_KV = DispatchPlan(key=None, max_chunk=16, cost={2: 1.5, 16: 8.0}, qualified=True,
                     cost_kv=512, long_kv=4096, long_cost={1: 2.0, 2: 3.5, 16: 14.0})


def _stats(rate: float, rounds: int = 400, length: int = 16) -> AcceptanceByPosition:
    """Rounds where each position is accepted with probability ``rate`` (deterministic mix)."""
    rng = random.Random(int(rate * 1000))
    st = AcceptanceByPosition(max_len=32, decay=1.0)
    for _ in range(rounds):
        acc = 0
        while acc < length and rng.random() < rate:
            acc += 1
        st.observe(length, acc)
    return st


def test_conditional_acceptance_counts():
    st = AcceptanceByPosition(max_len=4, decay=1.0, prior_a=0, prior_b=0, z=0.0)
    st.observe(4, 2)  # positions 0,1 accepted, 2 rejected, 3 never reached
    st.observe(4, 4)
    assert st.q(0) == 1.0 and st.q(1) == 1.0 and st.q(2) == 0.5 and st.q(3) == 1.0
    assert st.survival(4) == pytest.approx([1, 1, 0.5, 0.5])  # 3.0 ids expected of 4
    with pytest.raises(ValueError):
        st.observe(2, 3)


def test_decay_forgets_old_rounds():
    st = AcceptanceByPosition(max_len=4, decay=0.5, prior_a=1, prior_b=1)
    for _ in range(20):
        st.observe(1, 1)
    for _ in range(20):
        st.observe(1, 0)
    assert st.q(0) < 0.3  # without decay it would be 21 / 42


def test_free_rows_propose_everything_linear_cost_proposes_nothing():
    good = _stats(0.9)
    assert choose_length(FLAT, good, 16) == 16
    assert choose_length(LINEAR, good, 16) == 0  # a 1-row-per-token cost never pays


def test_length_grows_with_acceptance_and_is_zero_when_gain_below_one():
    lengths = [choose_length(MILD, _stats(r), 16) for r in (0.01, 0.3, 0.6, 0.9)]
    assert lengths[0] == 0
    assert lengths == sorted(lengths) and lengths[-1] > lengths[1] > 0


def test_chosen_length_maximizes_expected_tokens_per_cost():
    st = _stats(0.7)
    m = choose_length(MILD, st, 16)
    s = st.survival(16)
    rates = [1.0] + [(1 + sum(s[:k])) / MILD.cost_of(k + 1) for k in range(1, 17)]
    assert rates[m] == pytest.approx(max(rates))


def test_gate_shadow_drafts_keep_learning_without_proposing():
    gate = CostGate(MILD, 8, acceptance=DraftAcceptance(8, decay=1.0))
    for _ in range(30):  # a source that was always wrong: gate closes
        gate.observe(8, 0)
    assert gate.length() == 0
    for _ in range(60):  # shadow drafts that turned out right reopen it
        gate.shadow([1, 2, 3, 4])
        gate.begin([1, 2])
        gate.begin([3, 4])
    assert gate.length() > 0
    before = gate.stats.rounds
    gate.shadow([5, 6])
    gate.begin([5, 9])
    assert gate.stats.rounds == before + 1 and gate.stats.q(1) < 1.0


def test_a_withdrawn_offer_is_scored_as_a_shadow_of_its_key():
    """An offer the gate let through that another source's draft displaced teaches the gate
    what it would have earned, under its own key, and is never reported as proposed."""
    acc = DraftAcceptance(8, decay=1.0)
    gate = CostGate(FLAT, 8, acceptance=acc)
    assert gate.offer([1, 2, 3, 4], key=("k",)) == 4
    gate.withdraw()
    before = acc.stats(("k",)).q(3)
    gate.begin([1, 2, 3, 4])
    assert acc.stats(("k",)).q(3) > before and acc.stats(("k",)).rounds == 1
    gate.observe_proposed(0, 0)  # nothing of the withdrawn offer is left to settle
    assert not gate._shadows


def test_shadow_positions_count_as_their_ids_arrive():
    """A long shadow teaches the gate before it settles: each position is recorded as soon as
    the id for its slot is emitted."""
    gate = CostGate(MILD, 32, acceptance=DraftAcceptance(32, decay=1.0))
    gate.shadow(list(range(32)))
    q0 = gate.stats.q(0)
    gate.begin([0, 1, 2])
    assert gate.stats.q(0) > q0 and gate.stats.q(2) > q0 and gate.stats.q(3) == q0
    gate.begin([7])  # position 3 rejected: the shadow settles
    assert gate.stats.q(3) < q0
    gate.begin([4, 5])  # nothing pending: later ids score nothing
    assert gate.stats.q(4) == q0


def test_acceptance_is_estimated_per_draft_key():
    """The same source's drafts differ: a key that is always right pays while the source's
    average would not, a key that is always wrong is declined, and a key seen for the first
    time is priced like the source's average draft (back-off)."""
    acc = DraftAcceptance(16, decay=1.0)
    gate = CostGate(STEEP, 15, acceptance=acc)
    for _ in range(40):
        gate.observe(15, 15, key=("anchor", 8))
        for _ in range(3):
            gate.observe(15, 0, key=("anchor", 2))
    assert choose_length(STEEP, acc.source, 15) == 0  # one estimate per source: nothing pays
    assert gate.length(("anchor", 8)) == 15
    assert gate.length(("anchor", 2)) == 0
    assert gate.length(("anchor", 4)) == 0  # unseen: priced like its parent, every anchor
    assert acc.stats(("anchor", 4)).q(0) == pytest.approx(acc.stats(("anchor",)).q(0))
    assert gate.length(("anchor", 8), available=3) == 3  # never more than the draft holds


def test_an_unseen_key_backs_off_to_its_shared_prefix():
    """A tuple key's prior is the key without its last element: a new case of a description
    that has been right is priced like that description, while a key sharing nothing with
    the evidence is priced like the source's average draft. Every round updates the key and
    each of its ancestors."""
    acc = DraftAcceptance(16, decay=1.0)
    gate = CostGate(STEEP, 15, acceptance=acc)
    for _ in range(40):
        gate.observe(15, 15, key=(8, 3, True))
        for _ in range(3):
            gate.observe(15, 0, key=(2, 1, False))
    assert gate.length((8, 3, False)) == 15  # priced from (8, 3): right every time
    assert gate.length((8, 1, True)) > 0  # from (8,), through an unseen (8, 1)
    assert gate.length((4, 3, True)) == 0  # from the source: mostly wrong
    assert acc.stats((4, 3, True)).q(0) == pytest.approx(acc.source.q(0))
    assert acc.stats((8,)).rounds == acc.stats((8, 3)).rounds == 40
    assert acc.source.rounds == 160


def test_linear_cost_curve_closes_every_key():
    """A model whose m-row forward costs m one-row forwards (the float32 bundled-BLAS curve)
    gains nothing from verifying, however good the draft."""
    gate = CostGate(LINEAR, 16, acceptance=DraftAcceptance(16, decay=1.0))
    for _ in range(100):
        gate.observe(16, 16, key="perfect")
    assert gate.length("perfect") == 0


def test_a_round_is_priced_in_the_plans_chunks():
    """Rows that a plan must append one at a time cost one forward each, however flat the
    measured curve (OpenBLAS: flat c(M), but no multi-row chunk is exact)."""
    flat_serial = DispatchPlan(key=None, max_chunk=1, cost={64: 1.0}, qualified=True)
    gate = CostGate(flat_serial, 16, acceptance=DraftAcceptance(16, decay=1.0))
    for _ in range(100):
        gate.observe(16, 16)
    assert gate.length() == 0
    assert CostGate(FLAT, 16, acceptance=gate.acceptance).length() == 16


def test_a_round_saves_the_steps_of_what_it_emitted_less_its_rows_and_overhead():
    plan = DispatchPlan(key=None, max_chunk=16, cost={2: 1.5, 4: 2.5}, qualified=True,
                        round_overhead=0.25)
    chained = Round(True, "verify", 3, 2)  # the pending sample leads: 4 rows, 3 ids emitted
    assert (chained.rows, chained.emitted) == (4, 3)
    assert plan.round_saving(chained) == pytest.approx(3 - 2.5 - 0.25)
    ended = Round(False, "verify", 4, 1)  # first id agreed with the sample in flight: 4 rows
    assert (ended.rows, ended.emitted) == (4, 1)
    assert plan.round_saving(ended) == pytest.approx(1 - 2.5 - 0.25)
    refused = Round(False, "verify", 4, 0)  # rejected against the sample before any forward
    assert (refused.rows, refused.emitted) == (0, 0)
    assert plan.round_cost(refused) == pytest.approx(0.25)
    asserted = Round(False, "assert", 2, 0)  # asserted ids are emitted whatever was accepted
    assert (asserted.rows, asserted.emitted) == (2, 2)
    assert plan.round_saving(asserted, overhead=0.0) == pytest.approx(2 - 1.5)


def test_the_pace_raises_the_bar_for_every_gate_that_shares_it():
    """In a batch of 4 on the steep (bfloat16) curve a side step must beat 4 / c(4) = 2 tokens
    per one-row forward: a draft accepted at 70% per position pays alone but not in the batch;
    a perfect one pays in both. Every gate sharing the pace follows it."""
    pace = Pace()
    shared = DraftAcceptance(16, decay=1.0)
    gates = [CostGate(STEEP, 16, acceptance=shared, pace=pace) for _ in range(2)]
    rng = random.Random(7)
    for _ in range(400):
        acc = 0
        while acc < 16 and rng.random() < 0.7:
            acc += 1
        shared.observe("fair", 16, acc)
        shared.observe("perfect", 16, 16)
    alone = [g.length("fair") for g in gates], [g.length("perfect") for g in gates]
    assert batch_min_gain(STEEP, 4) == 2.0 and batch_min_gain(STEEP, 1) == 1.0
    pace.min_gain = batch_min_gain(STEEP, 4)
    batched = [g.length("fair") for g in gates], [g.length("perfect") for g in gates]
    assert alone[0][0] > 0 and batched[0] == [0, 0]
    assert batched[1][0] > 0 and batched[1] == [batched[1][0]] * 2


def test_session_prices_assert_spans_against_its_pace():
    """An asserted span runs whenever the pace is plain decoding's; above it, only a span whose
    rows cost less per emitted token than the pace demands (and never without a plan)."""
    span = Proposal((5, 6, 7), "assert", "strict")

    class One:
        name = "strict"

        def propose(self, view):
            return span

        def feedback(self, proposal, accepted):
            pass

    view = DecodeView([1], [], frozenset())
    session = FillSession([One()], plan=STEEP)
    assert session.propose(view) == span
    session.pace.min_gain = batch_min_gain(STEEP, 4)  # 2.0; 3 rows cost c(3) = 1.8 -> 1.67/fwd
    assert session.propose(view) is None
    session.pace.min_gain = 1.5
    assert session.propose(view) == span
    assert FillSession([One()], plan=None, pace=Pace(1.5)).propose(view) is None


def test_a_round_overhead_declines_rounds_that_only_pay_for_their_rows():
    """A round costs its rows plus a fixed overhead (its forward is synchronous, a plain step
    is pipelined): one draft accepted at 73% (priced at its lower bound, 71%) pays for its
    rows on the steep curve (1.71 tokens / c(2) = 1.6) but not once 0.25 of a step is added
    (1.71 / 1.85); a draft that
    is always accepted still fires whole (16 tokens for 6.25). The gate reads the overhead
    from the pace it shares."""
    pace = Pace()
    gate = CostGate(STEEP, 16, pace=pace)
    always = _stats(1.0)
    fair = _stats(0.72)
    before = (choose_length(STEEP, fair, 1), choose_length(STEEP, always, 16))
    after = (choose_length(STEEP, fair, 1, overhead=0.25),
             choose_length(STEEP, always, 16, overhead=0.25))
    assert before[0] == 1 and after[0] == 0
    assert before[1] == after[1] == 15  # 16 rows: 16 tokens for c(16) + 0.25
    gate.acceptance.source = fair
    assert gate.length(available=1) == 1
    pace.round_overhead = 0.25
    assert gate.length(available=1) == 0


def test_session_prices_assert_spans_with_the_round_overhead():
    """At plain decoding's pace an asserted span runs unless its rows plus the round overhead
    cost more than feeding its ids one by one: on a near-linear curve (float32 here, c(2) =
    1.99) two ids do not pay once a round costs 0.2 more, sixteen still do."""
    near_linear = DispatchPlan(key=None, max_chunk=16, cost={2: 1.986, 4: 3.888, 8: 7.288,
                                                           16: 14.957}, qualified=True)

    class Rows:
        name = "strict"

        def __init__(self, n):
            self.span = Proposal(tuple(range(5, 5 + n)), "assert", "strict")

        def propose(self, view):
            return self.span

        def feedback(self, proposal, accepted):
            pass

    view = DecodeView([1], [], frozenset())
    for n, pays in ((2, False), (16, True)):
        session = FillSession([Rows(n)], plan=near_linear, pace=Pace(round_overhead=0.2))
        assert (session.propose(view) is not None) is pays, n
        assert FillSession([Rows(n)], plan=near_linear).propose(view) is not None


BF16 = DispatchPlan(key=None, max_chunk=16, cost={2: 1.258, 3: 1.766, 4: 2.148, 8: 3.616,
                                                  16: 6.538}, qualified=True)  # shipped SmolLM2


def test_a_draft_at_the_view_end_is_priced_without_its_first_id():
    """At a view's end the first id only has to match the sample in flight: ``m`` ids run ``m``
    rows and gain ``1 + s_1 + ... + s_{m-1}`` over the plain step they replace. So a one-id draft
    never pays there however sure it is (it is the plain step, made synchronous), while after a
    known sample (a chained round) it does; a longer sure draft pays in both places."""
    sure = _stats(1.0)
    assert choose_length(BF16, sure, 1) == 1
    assert choose_length(BF16, sure, 1, first_in_flight=True) == 0
    assert choose_length(BF16, sure, 1, overhead=0.086, first_in_flight=True) == 0
    assert choose_length(BF16, sure, 16, first_in_flight=True) == 16

    fair = _stats(0.7)
    overhead = 0.086
    s = fair.survival(16)

    def view_end_rate(m):  # the contract, position by position
        tokens = 1 + sum(s[1:m])
        return tokens / (1 + overhead + s[0] * (BF16.rows_cost(m) - 1))

    best = max(range(1, 17), key=view_end_rate)
    chosen = choose_length(BF16, fair, 16, overhead=overhead, first_in_flight=True)
    assert chosen == (best if view_end_rate(best) > PRICE_MARGIN else 0)
    # the pace tells the gate where the draft starts; the session sets it for every view
    pace = Pace(round_overhead=overhead)
    gate = CostGate(BF16, 16, pace=pace)
    gate.acceptance.source = sure
    pace.first_in_flight = True
    assert gate.length(available=1) == 0
    pace.first_in_flight = False
    assert gate.length(available=1) == 1


def test_a_round_priced_within_the_margin_of_plain_decoding_does_not_fire():
    """Positions accepted half the time on firm evidence (the lower bound 0.49), on the shipped
    bf16 curve: a two-id draft at a view's end is priced 1.02 tokens per forward, above plain
    decoding but inside the estimates' error, so it is declined; a one-id chained round (1.11)
    still fires."""
    firm = AcceptanceByPosition(max_len=16, prior_a=1000, prior_b=1000)
    costs = round_costs(BF16, 16)
    m, rate = best_length(firm, 16, costs, overhead=0.086, first_in_flight=True)
    assert m == 2 and 1.0 < rate < PRICE_MARGIN
    assert choose_length(BF16, firm, 16, overhead=0.086, first_in_flight=True) == 0
    m, rate = best_length(firm, 16, costs, overhead=0.086)
    assert m == 1 and rate > PRICE_MARGIN
    assert choose_length(BF16, firm, 16, overhead=0.086) == 1


def test_a_key_is_priced_on_its_evidence_not_only_its_estimate():
    """Two keys estimated alike (9 in 10 at every position), one on ten observations and one on
    a thousand: the thin one is priced lower and proposes less far; at the prior alone nothing
    pays on the steep curve."""
    thin = AcceptanceByPosition(max_len=16, prior_a=9, prior_b=1)
    firm = AcceptanceByPosition(max_len=16, prior_a=900, prior_b=100)
    assert thin.q(0) == firm.q(0) == 0.9 and thin.q_low(0) < firm.q_low(0) < 0.9
    costs = round_costs(BF16, 16)
    (m_thin, rate_thin), (m_firm, rate_firm) = (best_length(st, 16, costs, overhead=0.086)
                                                for st in (thin, firm))
    assert rate_thin < rate_firm and m_thin < m_firm
    assert choose_length(BF16, AcceptanceByPosition(max_len=16), 16, overhead=0.086) == 0


def test_the_session_tells_its_gates_whether_a_view_ends_at_the_sample_in_flight():
    seen = []

    class Spy:
        name = "spy"

        def propose(self, view):
            seen.append(session.pace.first_in_flight)

        def feedback(self, proposal, accepted):
            pass

    session = FillSession([Spy()], plan=BF16)
    session.propose(DecodeView([1], [2], frozenset()))
    session.propose(DecodeView([1], [2, 3], frozenset(), pending=True))
    session.propose(DecodeView([1], [2, 3, 4], frozenset()))
    assert seen == [True, False, True]


def test_the_tail_of_an_accepted_prefix_is_scored_in_the_same_round():
    """A draft cut to its first id and accepted whole: the next fed ids (that id, then the
    slots after it) score positions 1.. of the same round under the draft's key, up to the
    first miss; a rejected prefix leaves its tail unscored. (The source's estimate is firm and
    high, so the draft is proposed; the key's positions start at it.)"""
    def gate_with_a_sure_source() -> CostGate:
        gate = CostGate(BF16, 8)
        gate.acceptance.source = _stats(1.0)
        return gate

    gate = gate_with_a_sure_source()
    parent = gate.acceptance.source
    draft = [10, 11, 12, 13]
    assert gate.offer(draft, "k") >= 1
    gate.observe_proposed(1, 1)
    gate.begin([10, 11, 12, 99])  # the accepted id, then positions 1, 2 hit and 3 misses
    st = gate.acceptance.stats("k")
    assert st.q(1) > parent.q(1) and st.q(2) > parent.q(2)
    assert st.q(3) < parent.q(3) and st.q(4) == pytest.approx(parent.q(4))
    assert st.rounds == 1

    other = gate_with_a_sure_source()
    other.offer(draft, "k")
    other.observe_proposed(2, 1)
    other.begin([10, 50, 12, 13])
    st, parent = other.acceptance.stats("k"), other.acceptance.source
    assert st.q(2) == pytest.approx(parent.q(2)) and st.q(3) == pytest.approx(parent.q(3))


def test_a_key_always_accepted_learns_to_propose_longer_spans():
    """The learning trap this guards against: an unproven key proposes nothing (or one id) on
    the steep bfloat16 curve, and a key never proposed long was never priced long. Declined
    drafts are scored as shadows and an accepted prefix's tail is scored too, so a key whose
    drafts are always right opens and grows its span round by round."""
    pace = Pace(round_overhead=0.086)
    gate = CostGate(BF16, 16, pace=pace)
    stream = list(range(100, 100 + 40 * 17 + 16))  # 40 rounds of up to 16 ids and a bonus
    pos, lengths = 0, []
    for _ in range(40):
        draft = stream[pos:pos + 16]
        n = gate.offer(draft, "always")
        lengths.append(n)
        if n:
            gate.observe_proposed(n, n)
        pos += n + 1  # the accepted ids and the bonus sample (a plain step when declined)
        gate.begin(stream[pos - n - 1:pos])
    assert lengths[0] <= 1
    assert lengths[-1] >= 8, lengths


def test_drafts_are_scored_side_by_side():
    """A shadow still being scored does not keep a later draft from being scored: each key
    learns at the rate its drafts arrive (one shadow at a time, a 64-id shadow held the gate
    for ~20 rounds), and every shadow ends at its own first mismatch."""
    gate = CostGate(BF16, 8, acceptance=DraftAcceptance(8, decay=1.0))
    gate.shadow([1, 2, 3, 4, 5, 6, 7, 8], "a")
    gate.begin([1])
    gate.shadow([2, 3, 9, 9], "b")
    gate.begin([2, 3, 4])
    acc = gate.acceptance
    unseen = acc.stats("never drafted")
    assert acc.stats("b").q(0) > unseen.q(0) and acc.stats("b").q(1) > unseen.q(1)
    assert acc.stats("b").q(2) < unseen.q(2)  # "b" missed at its position 2 and ended there
    assert acc.stats("a").q(3) > unseen.q(3)  # "a" is still scored past "b"'s end
    gate.begin([5])
    assert acc.stats("a").q(4) > unseen.q(4)


def test_cost_depends_on_the_kv_length_through_two_measured_lengths():
    assert BY_KV.cost_of(2) == BY_KV.cost_of(2, 512) == pytest.approx(1.5)
    assert BY_KV.cost_of(2, 4096) == pytest.approx(3.5 / 2.0)
    # halfway: both times affine in the KV length, c(2) their ratio
    assert BY_KV.cost_of(2, 2304) == pytest.approx((1.5 + 1.0) / (1.0 + 0.5))
    # beyond the longer length the same lines extend: c(2) -> 1.5 / 1.0 (the slopes' ratio)
    assert BY_KV.cost_of(2, 7680) == pytest.approx((1.5 + 4.0) / (1.0 + 2.0))
    assert BY_KV.rows_cost(2, 4096) == pytest.approx(1.75) and BY_KV.cost_of(1, 4096) == 1.0
    assert STEEP.cost_of(2, 8192) == STEEP.cost_of(2) == 1.6  # one length measured: no change
    assert DispatchPlan.from_json(BY_KV.to_json()) == BY_KV


def test_a_draft_that_pays_at_a_short_context_is_declined_where_rows_cost_more():
    st = DraftAcceptance(16, decay=1.0, z=0.0)
    for accepted in [1, 1, 1, 0, 0] * 100:
        st.observe("k", 1, accepted)  # 60% of one-id drafts accepted
    pace = Pace()
    gate = CostGate(BY_KV, 16, acceptance=st, pace=pace)
    pace.kv_length = 100
    assert gate.length("k", 1) == 1  # c(2) 1.42 here: 1.6 expected tokens for it
    pace.kv_length = 6000
    assert gate.length("k", 1) == 0  # c(2) 1.80: the same draft loses
