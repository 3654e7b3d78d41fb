"""The edit benchmark (``scripts.bench.predict``) on the embedded ``qwen3-json`` fixture: every
arm emits exactly plain decoding's ids, and the ``usage.completion_tokens_details`` counts equal
what the fill trace shows (accepted = the ids of ``prediction`` proposals the target kept)."""

from __future__ import annotations

import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import mlx.core as mx
from mlx_fill.assets.fixtures import fixture_path
from mlx_fill.core.resolve import plan_for
from mlx_fill.session import end_session, env_max_span, prediction_ids, usage_extra
from mlx_fill.sources.prediction import ORIGIN, prediction_usage
from scripts.bench import predict

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def loaded():
    return load(str(fixture_path("qwen3-json")))


def test_every_task_expects_a_real_edit_of_a_real_file():
    for task in predict.TASKS:
        assert task.expected() != task.original(), task.name
        assert 25 <= len(task.original().splitlines()) <= 300, task.name


def test_two_task_edit_run_is_identical_and_counts_match_the_trace(loaded):
    model, tok = loaded
    rate = predict.best_round_rate(plan_for(model), env_max_span())
    for name in ("rename-symbol", "useless-prediction"):
        task = {t.name: t for t in predict.TASKS}[name]
        result = predict.run_task(task, model=model, tok=tok, repeats=1, max_tokens=MAX_TOKENS, rate=rate)
        assert result["output_tokens"] > 0
        for arm, entry in result["arms"].items():
            assert entry["identical"], (name, arm)
            if arm != "off":
                assert (entry["accepted_prediction_tokens"] + entry["rejected_prediction_tokens"]
                        == result["predicted_tokens"])


def test_a_prediction_the_model_follows_is_accepted_and_counted_on_the_completion(loaded, tmp_path):
    """The prediction is the model's own plain reply, so the counts cannot all be zero."""
    model, tok = loaded
    task = predict.TASKS[0]
    messages = predict.messages_for(task)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=cache)
    base = cache[0].offset
    plain = predict.decode(model, tok, ids[-1:], cache, None, MAX_TOKENS)
    trim_prompt_cache(cache, cache[0].offset - base)
    prediction = {"type": "content", "content": tok.decode(plain)}
    trace = tmp_path / "trace.jsonl"
    session = predict.session_for("prediction", model=model, tok=tok, ids=ids, messages=messages,
                                  prediction=prediction, trace=trace)
    filled = predict.decode(model, tok, ids[-1:], cache, session, MAX_TOKENS)
    end_session(session)
    assert filled == plain
    predicted = prediction_ids(tok, prediction)
    details = usage_extra(session, prediction=predicted)["completion_tokens_details"]
    assert details == prediction_usage(predicted, filled)  # on the ids the decode emitted
    accepted = predict.trace_accepted(trace, ORIGIN)
    assert 0 < accepted <= details["accepted_prediction_tokens"]  # what the source drafted, and more
    assert details["rejected_prediction_tokens"] <= 1  # the reply itself: at most a re-encoded last id


def test_the_bound_is_priced_on_a_curve_measured_in_the_run(loaded, monkeypatch):
    """``bound`` uses the cost curve the run measures (at the plan's sizes), ``bound_plan`` the
    stored one: a curve twice as steep as the plan's gives a lower bound than the plan's."""
    model, tok = loaded
    plan = plan_for(model)
    steep = {m: 1.0 if m == 1 else 2 * c for m, c in plan.cost.items()}
    monkeypatch.setattr("mlx_fill.core.qualify.measure_cost", lambda *a, **k: steep)
    curve = predict.measured_curve(model, plan)
    assert curve.cost == steep and curve.max_chunk == plan.max_chunk
    report = predict.run("qwen3-json", ["useless-prediction"], 1, None, 8)
    assert report["measured_cost"]["cost"] == steep
    assert report["measured_cost"]["best_round_rate"] < report["plan"]["best_round_rate"]
    task = report["tasks"][0]
    assert task["coverage"] > 0 and task["bound"] < task["bound_plan"]
