"""Generated bodies, tool schemas and ``chat_template_kwargs`` against the in-process app (tiny
random qwen3, ``--fill all``): never a 5xx, every 4xx in the OpenAI error shape, a stream never
carries an error after its first chunk, and ``/health`` still answers afterwards."""

from __future__ import annotations

import json

import pytest
from adapter_models import random_qwen3_dir
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_fill.adapters.server.serve import Engine, create_app
from mlx_fill.limits import Limits

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                           max_leaves=16)

SCHEMA_KEYS = ["type", "properties", "required", "enum", "items", "$ref", "additionalProperties",
               "anyOf", "$defs", "definitions", "$schema", "const", "minimum", "pattern"]
schemas = st.recursive(
    st.sampled_from([{}, {"type": "string"}, {"type": "object"}, {"$ref": "#"},
                     {"$ref": "#/$defs/x"}, {"enum": [1, "1", 1.0, True]}, {"type": "nonsense"},
                     {"$schema": "http://json-schema.org/draft-04/schema#"}]),
    lambda inner: st.dictionaries(st.sampled_from(SCHEMA_KEYS),
                                  inner | json_values | st.dictionaries(st.text(max_size=4), inner,
                                                                        max_size=3)
                                  | st.lists(inner | scalars, max_size=3), max_size=4),
    max_leaves=12)

tools = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "code"]),
     "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", ""]) | json_values},
                                       optional={"parameters": schemas | json_values,
                                                 "description": json_values})}),
    max_size=3) | json_values

KWARG_KEYS = ["enable_thinking", "chat_template", "tokenize", "padding", "max_length",
              "return_tensors", "return_dict", "tools", "messages", "add_generation_prompt",
              "content", "x"]
template_kwargs = (st.dictionaries(st.sampled_from(KWARG_KEYS), json_values, max_size=3)
                   | json_values)

messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "nobody"]) | json_values},
    optional={"content": st.text(max_size=30) | json_values,
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"type": st.just("function"),
                   "function": st.fixed_dictionaries({"name": st.text(max_size=5),
                                                      "arguments": st.text(max_size=20)
                                                      | json_values})}), max_size=2)
              | json_values,
              "tool_call_id": json_values}), max_size=3) | json_values

bodies = st.fixed_dictionaries(
    {"messages": messages},
    optional={"tools": tools, "tool_choice": st.sampled_from(["auto", "none", "required"])
              | json_values, "chat_template_kwargs": template_kwargs, "stream": st.booleans()
              | json_values, "stream_options": json_values, "max_tokens": st.integers(-2, 6)
              | json_values, "seed": st.integers(-(2 ** 70), 2 ** 70) | json_values,
              "temperature": json_values, "top_p": json_values, "stop": json_values,
              "prediction": json_values, "n": json_values, "logprobs": json_values,
              "response_format": json_values, "chat_template": json_values,
              "model": json_values})


@pytest.fixture(scope="module")
def client():
    engine = Engine(str(random_qwen3_dir()), mode="all", max_tokens=2,
                    limits=Limits(max_tokens_ceiling=4, max_prompt_tokens=2048))
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c
        assert c.get("/health").json()["status"] == "ok"


def check(r) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert err["param"] is None or isinstance(err["param"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text
        assert not any("error" in json.loads(e) for e in events[:-1]), r.text


@FUZZ
@given(body=bodies)
def test_generated_bodies(client, body):
    check(client.post("/v1/chat/completions", json=body))


@FUZZ
@given(parameters=schemas)
def test_generated_tool_schemas(client, parameters):
    body = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
    check(client.post("/v1/chat/completions", json=body))


@FUZZ
@given(kwargs=template_kwargs)
def test_generated_chat_template_kwargs(client, kwargs):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    r = client.post("/v1/chat/completions", json=body)
    check(r)
    if isinstance(kwargs, dict) and set(kwargs) - {"enable_thinking", "content"}:
        assert r.status_code == 400  # only variables the model's template reads pass


@FUZZ
@given(raw=st.binary(max_size=64) | st.builds(lambda n, s: s * n, st.integers(1, 3000),
                                               st.sampled_from([b"[", b"{", b'{"a":', b"[1,"])))
def test_generated_raw_bytes(client, raw):
    check(client.post("/v1/chat/completions", content=raw,
                      headers={"content-type": "application/json"}))
