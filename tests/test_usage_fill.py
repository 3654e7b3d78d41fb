"""``usage.fill`` tells a prediction that was tried from one its cost gate priced out and from
one the output never followed; ``completion_tokens_details.{accepted,rejected}_prediction_tokens``
count, as OpenAI defines them, the predicted ids the completion holds in order, whichever
source (if any) proposed them."""

from __future__ import annotations

from mlx_fill.core.proposal import DecodeView, FillSession
from mlx_fill.session import usage_extra
from mlx_fill.sources.prediction import PredictionSource, prediction_usage

PREDICTED = [5, 6, 7, 8]


class Gate:
    """A cost gate that lets ``allow`` ids of each offer through (0: declines it)."""

    def __init__(self, allow: int):
        self.allow = allow

    def begin(self, new):
        pass

    def offer(self, ids, key=()):
        return self.allow

    def observe_proposed(self, drafted, accepted):
        pass


def _round(session: FillSession, emitted: list[int], accepted: int):
    """One proposal round after ``emitted``: the proposal (None: nothing proposed), its
    outcome fed back with ``accepted`` ids kept."""
    proposal = session.propose(DecodeView(prompt=[1, 2], emitted=emitted))
    if proposal is not None:
        session.feedback(proposal, min(accepted, len(proposal.ids)), len(emitted))
    return proposal


def test_a_tried_prediction_is_proposed_by_origin():
    session = FillSession([PredictionSource(PREDICTED, gate=Gate(allow=4))])
    assert _round(session, [], accepted=2) is not None
    fill = usage_extra(session, prediction=PREDICTED, completion=[5, 6, 1, 2])
    assert fill["fill"]["proposed_by_origin"] == {"prediction": 4}
    assert fill["fill"]["by_origin"] == {"prediction": 2} and fill["fill"]["verify_rejected"] == 2
    assert fill["fill"]["declined_by_origin"] == {}
    assert fill["completion_tokens_details"] == {"accepted_prediction_tokens": 2,
                                                 "rejected_prediction_tokens": 2}


def test_a_priced_out_prediction_says_so():
    session = FillSession([PredictionSource(PREDICTED, gate=Gate(allow=0))])
    assert _round(session, [], accepted=0) is None
    assert _round(session, [5], accepted=0) is None
    fill = usage_extra(session, prediction=PREDICTED, completion=[9, 9])
    assert fill["fill"]["declined_by_origin"] == {"prediction": 2}
    assert fill["fill"]["verify_proposed"] == 0 and fill["fill"]["proposed_by_origin"] == {}
    assert fill["completion_tokens_details"]["rejected_prediction_tokens"] == 4


def test_a_prediction_the_output_never_followed_is_neither_proposed_nor_declined():
    session = FillSession([PredictionSource(PREDICTED, gate=Gate(allow=4))])
    assert _round(session, [9], accepted=0) is None  # the first id differs, no 2-gram to anchor on
    assert _round(session, [9, 10], accepted=0) is None
    fill = usage_extra(session, prediction=PREDICTED)["fill"]
    assert "prediction" not in fill["proposed_by_origin"] and "prediction" not in fill["declined_by_origin"]


def test_the_details_are_the_predicted_ids_the_completion_holds_in_order():
    predicted = list(range(100, 140))  # 40 distinct ids
    counts = lambda completion: tuple(prediction_usage(predicted, completion).values())  # noqa: E731
    assert counts(predicted) == (40, 0)  # exact, whatever filled it
    assert counts(predicted[:10] + [1, 2, 3] + predicted[10:]) == (40, 0)  # an insertion
    assert counts(predicted[:10] + predicted[15:]) == (35, 5)  # a deletion
    assert counts(predicted[:10] + [1] + predicted[11:]) == (39, 1)  # a substitution
    assert counts([1, 2, 3] * 20) == (0, 40)  # unrelated
    assert counts(predicted[:20]) == (20, 20) and counts([]) == (0, 40)
    assert counts(predicted[20:] + predicted[:20]) == (20, 20)  # moved: counted once, in order
    assert prediction_usage([], [1, 2]) == {"accepted_prediction_tokens": 0,
                                            "rejected_prediction_tokens": 0}


def test_without_a_completion_the_details_are_left_out():
    assert "completion_tokens_details" not in usage_extra(None, prediction=PREDICTED, error="x")
    session = FillSession([PredictionSource(PREDICTED, gate=Gate(allow=4))])
    session.emitted_ids.extend([5, 6, 7])  # what a decode loop writes
    assert usage_extra(session, prediction=PREDICTED)["completion_tokens_details"] == {
        "accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1}


def test_every_usage_fill_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "usage-fill.md").read_text()
    keys = set(FillSession([]).stats.as_dict()) | {"lane", "batch_peak", "error"}
    missing = sorted(k for k in keys if f"| `{k}` |" not in doc)
    assert not missing, f"docs/usage-fill.md has no row for {missing}"
