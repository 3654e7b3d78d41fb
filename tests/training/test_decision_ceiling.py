"""The call-or-prose predictability measurement (no model): it sees only what precedes a turn,
its AUC and operating points are the textbook ones, and it learns a decision the context does
determine."""

from __future__ import annotations

import numpy as np

from scripts.training import decision_ceiling as ceiling
from scripts.training import fixture_data


def _call(name: str) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}


def test_features_see_only_the_messages_before_the_turn():
    messages = [{"role": "user", "content": "cancel my booking ABC123"}, _call("get_reservation"),
                {"role": "tool", "content": "{\"status\": \"ok\"}"}, {"role": "assistant", "content": "Done."}]
    before = ceiling.features(messages, 3)
    changed = messages[:3] + [_call("cancel_reservation"), {"role": "user", "content": "thanks anyway"}]
    assert ceiling.features(changed, 3) == before
    assert "called:get_reservation" in before and "called:cancel_reservation" not in before
    assert "previous=tool" in before and "last=call" in before


def test_auc_and_operating_points():
    labels = np.array([1, 1, 1, 0, 0])
    assert ceiling.auc(np.array([0.9, 0.8, 0.7, 0.2, 0.1]), labels) == 1.0
    assert ceiling.auc(np.array([0.1, 0.2, 0.3, 0.8, 0.9]), labels) == 0.0
    assert ceiling.auc(np.full(5, 0.5), labels) == 0.5  # ties count half
    # 2 of 3 calls above every prose turn, 1 below: calls >= 85% only by calling everything
    points = ceiling.operating_points(np.array([0.9, 0.8, 0.1, 0.5, 0.4]), labels)
    assert points == {"prose_kept_at_calls_85": 0.0, "calls_at_prose_kept_90": 0.667}


def test_a_decision_the_context_determines_is_learned():
    """Sessions where the agent calls after a user message and answers in prose after a tool
    result: held-back turns are ranked perfectly."""

    def session(k: int) -> fixture_data.Session:
        messages = [{"role": "system", "content": "airline agent"}]
        for turn in range(3):
            messages += [{"role": "user", "content": f"request {k} {turn}"}, _call("lookup"),
                         {"role": "tool", "content": "result"}, {"role": "assistant", "content": "Here it is."}]
        return fixture_data.Session("tau_bench_gpt4o_airline", str(k), [], messages)

    train_rows, train_labels = ceiling.decisions([session(k) for k in range(8)], "tau_bench_gpt4o_airline")
    held_rows, held_labels = ceiling.decisions([session(99)], "tau_bench_gpt4o_airline")
    assert train_labels.tolist() == [1, 0] * 24
    scores = ceiling.fit(train_rows, train_labels)(held_rows)
    assert ceiling.auc(scores, held_labels) == 1.0
