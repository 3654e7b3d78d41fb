"""``mlx-fill serve`` hardening, in-process on the tiny random qwen3: every reproducer of a 500,
a request-supplied template, or unbounded work gets a 4xx in the OpenAI shape (or a bounded,
fill-less answer), and the event loop stays free while a request is checked."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import jsonschema
import pytest
from adapter_models import TOOLS, random_qwen3_dir
from fastapi.testclient import TestClient

from mlx_fill.adapters import server_patch
from mlx_fill.adapters.server.openai_request import parse_chat_request
from mlx_fill.adapters.server.serve import Engine, create_app
from mlx_fill.adapters.server.template_vars import RENDERER_VARS, template_variables
from mlx_fill.limits import DEFAULT_LIMITS, JSON_DEPTH_CAP, Limits, deep_member, json_depth
from mlx_fill.core.resolve import prepare
from mlx_fill.strict.schema import _Memo, tool_schemas

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    return Engine(str(random_qwen3_dir()), mode="all", max_tokens=2)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


def post(client, body=None, raw: bytes | None = None):
    if raw is not None:
        return client.post("/v1/chat/completions", content=raw,
                           headers={"content-type": "application/json"})
    return client.post("/v1/chat/completions", json=body)


def error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err


def nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def tool(parameters, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def mixed_enum(n: int) -> dict:
    return {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
            "properties": {"a": {"enum": [i if i % 2 else str(i) for i in range(n)]}}}


# --- 1. bad input: 4xx, never 500 ---------------------------------------------------------

@pytest.mark.parametrize("where", ["messages", "metadata"])
def test_deeply_nested_json_anywhere_is_400(client, where):
    deep = b"[" * 1000 + b"]" * 1000
    raw = (b'{"messages": ' + deep + b"}" if where == "messages"
           else b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + deep + b"}")
    err = error(post(client, raw=raw), 400, where)
    assert "nested deeper" in err["message"]


def test_json_depth_ignores_brackets_in_strings_and_names_the_member():
    raw = json.dumps({"a": "[[[[{{{{", "b": [[1]], "c": {"d": [[[2]]]}}).encode()
    assert json_depth(raw) == 5
    assert deep_member(raw, 2) == "b" and deep_member(raw, 3) == "c"
    assert deep_member(raw, 5) is None
    assert deep_member(json.dumps({"k": {"x\"y:": [1]}}).encode(), 2) == "k"
    assert json_depth(b"[" * 5000) == 5000 and deep_member(b"[" * 5000, 64) is None
    assert json_depth(b"") == 0


def test_deep_tool_schema_is_400_naming_the_tool(client, engine, monkeypatch):
    monkeypatch.setattr(engine, "limits", Limits(max_json_depth=JSON_DEPTH_CAP))
    r = post(client, {"messages": USER, "tools": [tool(nested(100))]})
    error(r, 400, "tools[0].function.parameters")


def test_toolspec_refuses_schemas_past_the_recursion_safe_depth():
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters: nested deeper"):
        tool_schemas([tool(nested(120))])


@pytest.mark.parametrize("seed", [-1, 2 ** 70])
@pytest.mark.parametrize("stream", [False, True])
def test_seed_outside_uint64_is_400_before_any_chunk(client, seed, stream):
    error(post(client, {"messages": USER, "seed": seed, "stream": stream}), 400, "seed")


@pytest.mark.parametrize(("n", "status"), [(True, 422), (1.0, 422), ("1", 422), (2, 400)])
def test_n_other_than_the_integer_1_is_refused(client, n, status):
    error(post(client, {"messages": USER, "n": n}), status, "n")


def test_404_and_405_are_openai_shaped(client):
    assert error(client.get("/v1/nope"), 404)["code"] == "not_found"
    assert error(client.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"


def test_recursive_schema_is_accepted(client):
    r = post(client, {"messages": USER, "tools": [tool({"properties": {"child": {"$ref": "#"}}})]})
    assert r.status_code == 200, r.text


def test_tool_without_function_wrapper_in_tool_choice_is_not_a_500(client):
    r = post(client, {"messages": USER, "tools": [{"name": "f"}],
                      "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("role", "needle"), [
    ("bogus", "'bogus' is not one of system, developer, user, assistant, tool"),
    ("function", "send the function's result as a 'tool' message"),
])
def test_a_role_no_template_renders_is_400(client, role, needle):
    err = error(post(client, {"messages": [*USER, {"role": role, "content": "x"}]}), 400,
                "messages[1].role")
    assert needle in err["message"], err


@pytest.mark.parametrize("message", [
    {"role": "user", "content": None},
    {"role": "tool", "tool_call_id": "c", "content": None},
    {"role": "assistant", "content": None},
])
def test_null_content_is_400_unless_an_assistant_calls_tools(client, message):
    err = error(post(client, {"messages": [*USER, message]}), 400, "messages[1].content")
    assert "unless an assistant message has tool_calls" in err["message"], err


def test_null_content_of_an_assistant_that_calls_tools_is_served(client):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = post(client, {"messages": [*USER, {"role": "assistant", "content": None,
                                           "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": "c", "content": "ok"}],
                      "tools": [tool({"type": "object"})]})
    assert r.status_code == 200, r.text


def test_parameters_of_a_type_other_than_object_are_400(client):
    err = error(post(client, {"messages": USER, "tools": [tool({"type": "string"})]}), 400,
                "tools[0].function.parameters")
    assert "type 'object'" in err["message"], err


# Renders every message under its own role, as ChatML templates that read ``message.role`` do.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_developer_messages_a_template_skips_are_400_and_rendered_ones_served(client, engine,
                                                                              monkeypatch):
    """Qwen3's template has no 'developer' role and renders nothing of such a message: served,
    the request would silently lose it (alone in the request too). A template that renders it
    serves it."""
    messages = [{"role": "developer", "content": "Answer in French."}, *USER]
    for sent in (messages, messages[:1]):
        err = error(post(client, {"messages": sent}), 400, "messages[0].role")
        assert "does not render 'developer' messages; send them as 'system'" in err["message"]
    assert post(client, {"messages": [{**messages[0], "role": "system"}, *USER]}).status_code == 200
    monkeypatch.setattr(engine.tokenizer._tokenizer, "chat_template", CHATML)
    r = post(client, {"messages": messages})
    assert r.status_code == 200, r.text


# --- 2. templates only from the model directory -----------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"return_tensors": "np"}, {"return_tensors": "mlx"}, {"tokenize": False},
    {"chat_template": "<|im_start|>system\nINJECTED {{7*7}}<|im_end|>"},
    {"padding": "max_length", "max_length": 5000}])
def test_chat_template_kwargs_outside_the_template_are_400(client, kwargs):
    key = next(iter(kwargs))
    error(post(client, {"messages": USER, "chat_template_kwargs": kwargs}), 400,
          f"chat_template_kwargs.{key}")


def test_chat_template_kwargs_the_template_reads_are_accepted(client, engine):
    assert "enable_thinking" in engine.template_vars
    r = post(client, {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_template_variables_exclude_what_the_renderer_passes():
    found = template_variables("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt and not enable_thinking %}x{% endif %}"
                               "{{ tools | tojson }}{{ range(3) | list }}{{ return_tensors }}")
    assert found == {"enable_thinking"}
    assert not found & RENDERER_VARS
    assert template_variables(None) == frozenset()


# --- 3. bounded work ----------------------------------------------------------------------

def test_limits_reject_with_the_offending_param(client, engine, monkeypatch):
    monkeypatch.setattr(engine, "limits", Limits(max_tools=2, max_schema_bytes=200,
                                                 max_tokens_ceiling=8, max_prompt_tokens=64))
    error(post(client, {"messages": USER, "tools": [tool({}, f"t{i}") for i in range(3)]}),
          400, "tools")
    error(post(client, {"messages": USER, "tools": [tool(mixed_enum(100))]}),
          400, "tools[0].function.parameters")
    error(post(client, {"messages": USER, "max_tokens": 9}), 400, "max_tokens")
    error(post(client, {"messages": USER, "max_completion_tokens": 9}), 400,
          "max_completion_tokens")
    long = [{"role": "user", "content": "hello " * 200}]
    assert error(post(client, {"messages": long, "stream": True}), 400,
                 "messages")["code"] == "context_length_exceeded"


def test_request_over_the_compile_budget_is_served_without_fill(client, engine, monkeypatch):
    monkeypatch.setattr(engine, "limits", Limits(fill_compile_bytes=100))
    r = post(client, {"messages": USER, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["fill"]["refusals"] == {"compile_budget": 1}


def test_mixed_enum_schema_check_is_not_pairwise(monkeypatch):
    """jsonschema's ``uniq`` compares every pair when items do not sort (a draft-04 ``enum`` of
    strings and numbers); the meta check must never take that path."""
    def pairwise(_):
        raise AssertionError("quadratic uniqueItems")
    monkeypatch.setattr(jsonschema._keywords, "uniq", pairwise)
    assert tool_schemas([tool(mixed_enum(6000))])[0].properties == ("a",)
    dup = mixed_enum(10)
    dup["properties"]["a"]["enum"] += [3]
    with pytest.raises(ValueError, match="non-unique"):
        tool_schemas([tool(dup)])


def test_health_answers_while_a_request_is_being_checked(client, engine, monkeypatch):
    """Request checks run off the event loop: /health answers while one is in progress."""
    entered, release, seen = threading.Event(), threading.Event(), {}
    parse = engine.parse

    def slow_parse(body):
        entered.set()
        seen["released"] = release.wait(60)
        return parse(body)

    monkeypatch.setattr(engine, "parse", slow_parse)
    heavy = threading.Thread(target=lambda: seen.setdefault("r", post(client, {"messages": USER})))
    heavy.start()
    assert entered.wait(60)
    health = client.get("/health")
    release.set()
    heavy.join(60)
    assert health.status_code == 200
    assert seen["released"] is True and seen["r"].status_code == 200


def test_schema_memo_is_bounded_by_bytes_and_keeps_no_schema_text():
    memo = _Memo(max_entries=512, max_bytes=4096)
    for i in range(200):
        memo.get(i.to_bytes(32, "big"), lambda: ((), "x" * 100))
    assert memo.bytes <= 4096 and len(memo.entries) < 200
    assert memo.get((199).to_bytes(32, "big"), lambda: None) == ((), "x" * 100)


def test_limits_invariants():
    assert DEFAULT_LIMITS == Limits()
    with pytest.raises(ValueError):
        Limits(max_json_depth=JSON_DEPTH_CAP + 1)
    with pytest.raises(ValueError):
        Limits(max_tools=0)


# --- prefill cancellation and shutdown ----------------------------------------------------

class CountingModel:
    """Delegates to a model; counts forwards and sets ``event`` after ``after`` of them."""

    def __init__(self, model, event: threading.Event, after: int):
        self._model, self._event, self._after, self.calls = model, event, after, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls >= self._after:
            self._event.set()
        return self._model(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.mark.parametrize("fill", ["all", "off"])  # the fill loop and mlx-lm's own generate_step
@pytest.mark.parametrize("how", ["disconnect", "shutdown"])
def test_prefill_stops_within_a_chunk(engine, monkeypatch, how, fill):
    monkeypatch.setattr(engine, "mode", fill)
    cancelled = threading.Event()
    event = cancelled if how == "disconnect" else engine.stopping
    counting = CountingModel(engine.model, event, after=2)
    if fill != "off":  # the wrapper is a model of its own for the dispatch plan: resolve it first
        prepare(counting)
        counting.calls = 0
        event.clear()
    monkeypatch.setattr(engine, "model", counting)
    monkeypatch.setattr(engine, "prefill_step_size", 16)
    req = parse_chat_request({"messages": [{"role": "user", "content": "word " * 300}]})
    prepared = engine.prepare(req)
    assert len(prepared.prompt_ids) > 16 * 10
    try:
        assert engine.generate(prepared, cancelled) is None
    finally:
        engine.stopping.clear()
    assert counting.calls == 2  # the chunk in progress finished; no further forward ran
    _, rest = engine.prompt_cache.fetch_nearest_cache(engine.model_path, prepared.prompt_ids)
    assert len(rest) > len(prepared.prompt_ids) - 16  # a partial prefill is never kept for reuse


def test_app_shutdown_sets_the_stop_flag(engine):
    with TestClient(create_app(engine)):
        assert not engine.stopping.is_set()
    try:
        assert engine.stopping.is_set()
    finally:
        engine.stopping.clear()


# --- the MLX_FILL hook ---------------------------------------------------------------------

def hook_session(engine, monkeypatch, body):
    def no_build(*a, **kw):
        raise AssertionError("the hook compiled a request it should have refused")
    monkeypatch.setattr(server_patch, "build_session", no_build)
    args = SimpleNamespace(sampling=SimpleNamespace(temperature=0.0), seed=None, logprobs=False,
                           top_logprobs=-1)
    request = server_patch.FillRequest("strict", body, prompt_ids=[1, 2, 3])
    return server_patch.ServerFill("strict").open_session(
        request, args, {"tokenizer": engine.tokenizer, "model": engine.model})


def test_hook_skips_fill_over_the_compile_budget(engine, monkeypatch):
    session = hook_session(engine, monkeypatch,
                           {"messages": USER, "tools": [tool(mixed_enum(25000))]})
    assert session.stats.refusals == {"compile_budget": 1}


def test_hook_over_the_compile_budget_still_counts_a_prediction(engine):
    """The refused session decodes as stock; the prediction's ids are kept, so the reply still
    gets ``completion_tokens_details``."""
    body = {"messages": USER, "tools": [tool(mixed_enum(25000))],
            "prediction": {"type": "content", "content": "hello there"}}
    args = SimpleNamespace(sampling=SimpleNamespace(temperature=0.0), seed=None, logprobs=False,
                           top_logprobs=-1)
    request = server_patch.FillRequest("strict", body, prompt_ids=[1, 2, 3])
    session = server_patch.ServerFill("strict").open_session(
        request, args, {"tokenizer": engine.tokenizer, "model": engine.model})
    request.session = session
    assert session.stats.refusals == {"compile_budget": 1} and request.prediction
    session.emitted_ids.extend(request.prediction)  # what the decode loop writes
    assert request.usage()["completion_tokens_details"] == {
        "accepted_prediction_tokens": len(request.prediction), "rejected_prediction_tokens": 0}


@pytest.mark.parametrize(("prediction", "says"), [
    ({"type": "content"}, "prediction.content: expected a string or a list of text parts"),
    ("hello", "prediction: expected an object"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content[0]: expected"),
])
def test_hook_says_what_a_malformed_prediction_got_wrong(engine, monkeypatch, prediction, says):
    """The hook serves the request without fill; ``usage.fill`` names the field beside the
    ``invalid_request`` refusal."""
    request = server_patch.FillRequest("strict", {"messages": USER, "prediction": prediction},
                                       prompt_ids=[1, 2, 3])
    args = SimpleNamespace(sampling=SimpleNamespace(temperature=0.0), seed=None, logprobs=False,
                           top_logprobs=-1)
    request.session = server_patch.ServerFill("strict").open_session(
        request, args, {"tokenizer": engine.tokenizer, "model": engine.model})
    fill = request.usage()["fill"]
    assert fill["refusals"] == {"invalid_request": 1}
    assert fill["error"].startswith(says), fill["error"]


def test_hook_never_renders_a_request_template(engine, monkeypatch):
    session = hook_session(engine, monkeypatch, {
        "messages": USER, "tools": TOOLS, "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}})
    assert session.stats.refusals == {"template_kwargs": 1}


@pytest.mark.parametrize("stream", [False, True])
def test_no_tool_call_is_returned_under_tool_choice_none(engine, client, monkeypatch, stream):
    """A reply that writes a call to a tool the prompt did not show (``tool_choice: "none"``)
    comes back as content with ``finish_reason`` stop, as OpenAI's contract says; under
    ``auto`` the same text is the call."""
    from mlx_fill.adapters.server.engine import Outcome

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    monkeypatch.setattr(engine, "generate", lambda prepared, cancelled, on_text=None: Outcome(
        text=call, tokens=[1, 2, 3], finish_reason="stop", prompt_tokens=5, cached_tokens=0))

    def reply(choice: str) -> tuple[str, list, str]:
        body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "stream": stream}
        r = post(client, body)
        assert r.status_code == 200, r.text
        if not stream:
            choice0 = r.json()["choices"][0]
            msg = choice0["message"]
            return msg["content"] or "", msg.get("tool_calls") or [], choice0["finish_reason"]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c.get("choices")]
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        return content, calls, deltas[-1]["finish_reason"]

    content, calls, finish = reply("none")
    assert (content, calls, finish) == (call, [], "stop")
    content, calls, finish = reply("auto")
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and finish == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and not content.strip()


def test_both_servers_warm_the_tokenizers_strict_table_when_they_load():
    """``mlx-fill serve`` and the ``MLX_FILL`` hook's ``ModelProvider._load`` build the token-byte
    table of the tokenizer they load (``warm_strict``), so no request's first call pays it."""
    from mlx_lm import load

    from mlx_fill.strict import tokenbytes

    def built(tokenizer) -> bool:
        return getattr(tokenizer, "_tokenizer", tokenizer) in tokenbytes._TABLES

    folder = str(random_qwen3_dir())
    assert built(Engine(folder, mode="strict").tokenizer)
    assert not built(Engine(folder, mode="off").tokenizer)
    model, tokenizer = load(folder)
    assert not built(tokenizer)
    provider = SimpleNamespace(model=model, tokenizer=tokenizer)
    server_patch._load(server_patch.ServerFill("strict"), lambda self, *a, **kw: None)(provider)
    assert built(tokenizer)


def test_a_conversations_next_request_syncs_the_index_its_last_one_left(engine):
    """``mlx-fill serve`` (mode ``all``) keeps its conversation indexes between requests: the
    next request of a conversation takes the index the last one gave back."""
    first = [{"role": "user", "content": "List the files in src/ and say which is largest."}]
    prepared = engine.prepare(parse_chat_request({"messages": first, "max_tokens": 2}))
    engine.generate(prepared, threading.Event())
    held = len(engine.indexes)
    kept = [index for index, _ in engine.indexes._kept]
    later = [*first, {"role": "assistant", "content": "src/a.py"},
             {"role": "user", "content": "And in tests/?"}]
    prompt = engine.render(parse_chat_request({"messages": first, "max_tokens": 2}))
    prepared = engine.prepare(parse_chat_request({"messages": later, "max_tokens": 2}))
    assert len(engine.indexes) == held - 1
    taken = prepared.session.release.args[0]
    assert any(taken is index for index in kept) and taken.seq[:len(prompt)] == prompt
    engine.generate(prepared, threading.Event())
    assert len(engine.indexes) == held


def test_the_hook_keeps_indexes_per_model_in_echo_and_all_only():
    fill = server_patch.ServerFill("all")
    assert fill.indexes_for("m") is fill.indexes_for("m") is not None
    assert fill.indexes_for("other") is not None and fill.indexes_for("other") is not fill.indexes_for("m")
    assert server_patch.ServerFill("strict").indexes_for("m") is None
