"""The session's choice among its sources' proposals for one view."""

from __future__ import annotations

from mlx_fill.core.proposal import DecodeView, FillSession, Proposal


class _Fixed:
    """A source proposing ``ids`` (nothing when empty) at every view, recording its feedback."""

    def __init__(self, name: str, ids: tuple[int, ...], yields: bool = False) -> None:
        self.name = name
        self.ids = ids
        self.yields = yields
        self.asked = 0
        self.withdrawn = 0
        self.feedback_got: list[tuple[tuple[int, ...], int]] = []

    def propose(self, view: DecodeView) -> Proposal | None:
        self.asked += 1
        return Proposal(self.ids, "verify", self.name, yields=self.yields) if self.ids else None

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        self.feedback_got.append((proposal.ids, accepted))

    def withdraw(self) -> None:
        self.withdrawn += 1


def test_a_yielding_proposal_is_made_only_when_no_later_source_proposes():
    guess, copy = _Fixed("strict", (1, 2), yields=True), _Fixed("echo", (1, 2, 3, 4))
    session = FillSession([guess, copy])
    made = session.propose(DecodeView([], [7], ()))
    assert made is not None and made.origin == "echo" and copy.asked == 1
    session.feedback(made, 4, 1)
    assert copy.feedback_got == [((1, 2, 3, 4), 4)] and guess.feedback_got == []
    copy.ids = ()
    made = session.propose(DecodeView([], [7, 1, 2, 3, 4], ()))
    assert made is not None and made.origin == "strict" and made.ids == (1, 2)


def test_a_first_proposal_that_does_not_yield_is_made_and_later_sources_are_not_asked():
    first, later = _Fixed("strict", (5, 6)), _Fixed("echo", (1, 2, 3))
    made = FillSession([first, later]).propose(DecodeView([], [7], ()))
    assert made is not None and made.ids == (5, 6) and later.asked == 0


def test_of_two_yielding_proposals_the_first_is_made():
    first, second = _Fixed("strict", (5, 6), yields=True), _Fixed("echo", (1, 2), yields=True)
    made = FillSession([first, second]).propose(DecodeView([], [7], ()))
    assert made is not None and made.ids == (5, 6)


def test_the_longest_of_the_competing_drafts_is_made_and_the_others_are_withdrawn():
    """The roster's sources are all asked; the longest draft wins (the earlier of equal ones), the
    others are withdrawn, and the outcome reaches the source that made it."""
    key = _Fixed("strict", (1, 2), yields=True)
    echo, suffix, ngram = _Fixed("echo", (1, 2)), _Fixed("suffix", (1, 2, 3)), _Fixed("ngram", (1, 2, 3))
    model = _Fixed("draft", (9, 9, 9, 9))
    session = FillSession([key, echo, suffix, ngram, model], compete=("echo", "suffix", "ngram"))
    made = session.propose(DecodeView([], [7], ()))
    assert made is not None and made.origin == "suffix" and made.ids == (1, 2, 3)
    assert (echo.asked, suffix.asked, ngram.asked, model.asked) == (1, 1, 1, 0)
    assert (echo.withdrawn, suffix.withdrawn, ngram.withdrawn, key.withdrawn) == (1, 0, 1, 0)
    session.feedback(made, 2, 1)
    assert suffix.feedback_got == [((1, 2, 3), 2)] and echo.feedback_got == ngram.feedback_got == []


def test_of_equal_competing_drafts_the_earlier_source_s_is_made():
    echo, suffix = _Fixed("echo", (1, 2, 8)), _Fixed("suffix", (1, 2, 3))
    session = FillSession([echo, suffix], compete=("echo", "suffix"))
    made = session.propose(DecodeView([], [7], ()))
    assert made is not None and made.origin == "echo" and made.ids == (1, 2, 8)
    assert (echo.withdrawn, suffix.withdrawn) == (0, 1)


def test_competing_drafts_are_compared_after_the_cut_at_an_end_id():
    echo, suffix = _Fixed("echo", (1, 2, 3)), _Fixed("suffix", (1, 0, 3, 4))
    made = FillSession([echo, suffix], compete=("echo", "suffix")).propose(DecodeView([], [7], (0,)))
    assert made is not None and made.origin == "echo" and suffix.withdrawn == 1


def test_a_source_outside_the_competition_keeps_its_priority():
    first, echo, suffix = _Fixed("prediction", (5, 6)), _Fixed("echo", (1,)), _Fixed("suffix", (1, 2, 3))
    made = FillSession([first, echo, suffix], compete=("echo", "suffix")).propose(DecodeView([], [7], ()))
    assert made is not None and made.origin == "prediction" and echo.asked == suffix.asked == 0


def test_a_source_whose_withdraw_raises_is_disarmed_and_the_view_still_gets_its_draft():
    class Broken(_Fixed):
        def withdraw(self) -> None:
            raise RuntimeError("broken")

    echo, suffix = Broken("echo", (1,)), _Fixed("suffix", (1, 2))
    session = FillSession([echo, suffix], compete=("echo", "suffix"))
    made = session.propose(DecodeView([], [7], ()))
    assert made is not None and made.origin == "suffix"
    assert session.stats.source_errors == {"echo:RuntimeError": 1} and session.sources == [suffix]


def test_a_request_risks_no_more_than_it_has_saved_plus_the_deficit_it_may_run_to():
    """With ``cap_in_deficit`` (every request ``build_session`` makes), a verify proposal holds
    the longest span whose worst outcome (here, chained: the pending sample alone emitted)
    leaves the request's balance at ``-DEFICIT`` or above, ``DEFICIT_SPAN`` at least: a request
    that has saved nothing proposes a short span, accepted rounds let the spans grow, a rejected
    one shrinks them. Asserted spans, a session without a plan and one without the cap are
    never cut."""
    from mlx_fill.core.plan import DispatchPlan
    from mlx_fill.core.proposal import DEFICIT, DEFICIT_SPAN
    # c(M) between measured sizes is interpolated: c(6) 2.885, c(7) 3.253, c(14) 5.815, c(15) 6.18
    plan = DispatchPlan(key=None, max_chunk=16, qualified=True,
                        cost={2: 1.26, 4: 2.15, 8: 3.62, 16: 6.54})
    long = _Fixed("echo", tuple(range(1, 11)))
    session = FillSession([long], plan=plan, cap_in_deficit=True)
    chained = DecodeView([], [7], (), pending=True)  # the pending sample leads a round's rows
    made = session.propose(chained)
    assert made is not None and made.ids == long.ids[:5]  # c(6) - 1 <= DEFICIT < c(7) - 1
    session.feedback(made, 5, 1)  # saved 6 - c(6)
    assert abs(session.balance - (6 - 2.885)) < 1e-3, session.balance
    made = session.propose(chained)  # room 5.1 would allow 13 ids: the draft's 10
    assert made is not None and len(made.ids) == 10
    session.feedback(made, 0, 1)  # 11 rows for the pending sample alone
    assert -DEFICIT < session.balance < 0, session.balance
    made = session.propose(chained)  # room under c(5) - 1: the floor
    assert made is not None and made.ids == long.ids[:DEFICIT_SPAN]

    strict = _Fixed("strict", ())
    strict.propose = lambda view: Proposal(long.ids, "assert", "strict")
    in_deficit = FillSession([strict], plan=plan, cap_in_deficit=True)
    in_deficit.balance = -10 * DEFICIT
    assert in_deficit.propose(chained).ids == long.ids
    unpriced = FillSession([long], cap_in_deficit=True)
    unpriced.feedback(unpriced.propose(chained), 0, 1)
    assert unpriced.balance == 0.0 and len(unpriced.propose(chained).ids) == 10
    uncapped = FillSession([long], plan=plan)  # a peer as it ships
    uncapped.feedback(uncapped.propose(chained), 0, 1)
    assert uncapped.balance < -DEFICIT and len(uncapped.propose(chained).ids) == 10
