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
from mlx_fill.session import end_session, env_max_span, predicted_count, usage_extra
from mlx_fill.sources.prediction import ORIGIN
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
                assert entry["usage_matches_trace"], (name, arm, entry)
                assert (entry["accepted_prediction_tokens"] + entry["rejected_prediction_tokens"]
                        == result["predicted_tokens"])


def test_a_prediction_the_model_follows_is_accepted_and_counted_as_the_trace_shows(loaded, tmp_path):
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
    predicted = predicted_count(tok, prediction)
    details = usage_extra(session, predicted=predicted)["completion_tokens_details"]
    accepted = predict.trace_accepted(trace, ORIGIN)
    assert accepted > 0
    assert details == {"accepted_prediction_tokens": min(accepted, predicted),
                       "rejected_prediction_tokens": predicted - min(accepted, predicted)}
