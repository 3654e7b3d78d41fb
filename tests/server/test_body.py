"""``mlx-fill serve`` request bodies: no byte sequence gets a 5xx (ints past the digit limit,
invalid UTF-8, lone surrogates, deep nesting, in every field), errors never echo what UTF-8
cannot carry, the depth pre-scan does work linear in the body, and ``/health`` answers while a
body is being decoded."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
from adapter_models import random_qwen3_dir
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_fill import limits as limits_module
from mlx_fill.adapters.server import app, serve
from mlx_fill.adapters.server.body import decode_body, unencodable_path
from mlx_fill.adapters.server.openai_request import RequestError
from mlx_fill.limits import DEFAULT_LIMITS, Limits, deep_member, json_depth

USER = [{"role": "user", "content": "hi"}]
BIG_INT = "9" * 5000  # past Python's int-string limit (4300 digits)


@pytest.fixture(scope="module")
def client():
    engine = serve.Engine(str(random_qwen3_dir()), mode="all", max_tokens=2,
                          limits=Limits(max_tokens_ceiling=4, max_prompt_tokens=2048))
    with TestClient(serve.create_app(engine), raise_server_exceptions=False) as c:
        yield c
        assert c.get("/health").json()["status"] == "ok"


def post_raw(client, raw: bytes):
    return client.post("/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"})


def check(r) -> None:
    """Never a 5xx; every error in the OpenAI shape, with UTF-8 text."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert err["param"] is None or isinstance(err["param"], str)
        err["message"].encode("utf-8")
        (err["param"] or "").encode("utf-8")


# --- 1. decoding failures are 400s ----------------------------------------------------------

@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + BIG_INT.encode() + b"}", None),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\udfff"}', "model"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "\\ud800"]}', "stop[1]"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "prediction": '
     b'{"type": "content", "content": "x\\udc00"}}', "prediction.content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "\\ud800"}}]}', "tools[0].function.name"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', "\\ud800"),
])
def test_decoding_failures_are_400(client, raw, param):
    r = post_raw(client, raw)
    check(r)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_valid_surrogate_pair_is_text(client):
    r = post_raw(client, b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert r.status_code == 200, r.text


def test_an_error_escapes_what_it_cannot_encode():
    err = RequestError(400, "tool_choice.function.name: no tool named \ud800", "x.\udfff")
    body = err.body()["error"]
    assert body["message"].endswith("\\ud800") and body["param"] == "x.\\udfff"
    json.dumps(body, ensure_ascii=False).encode("utf-8")


def test_unencodable_path_names_keys_and_items():
    assert unencodable_path({"a": [1, {"b": "ok"}, {"c": "\ud800"}]}) == "a[2].c"
    assert unencodable_path({"a": {"\udc00": 1}}) == "a.\udc00"
    assert unencodable_path("\ud800") == ""
    assert unencodable_path({"a": ["\U0001f600"]}) is None


# --- the property: arbitrary JSON text in every field --------------------------------------

def _text(s: str) -> str:
    return json.dumps(s)  # ensure_ascii: lone surrogates become \\udXXX escapes


surrogates = st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                     min_size=1, max_size=3)
strings = (st.text(max_size=8) | surrogates
           | st.tuples(st.text(max_size=4), surrogates).map("".join)).map(_text)
numbers = (st.integers(-(2 ** 70), 2 ** 70).map(str)
           | st.integers(4290, 6000).map(lambda n: "9" * n)
           | st.floats(allow_nan=False, allow_infinity=False).map(repr)
           | st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "-0", "0.0", "1E400"]))
scalars = st.sampled_from(["null", "true", "false"]) | numbers | strings
deep = st.builds(lambda n, inner, kind: kind[0] * n + inner + kind[1] * n,
                 st.integers(1, 1200), scalars, st.sampled_from([("[", "]"), ('{"k":', "}")]))
json_texts = st.recursive(
    scalars | deep,
    lambda inner: st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
    | st.lists(st.tuples(strings, inner), max_size=4).map(
        lambda kvs: "{" + ",".join(f"{k}:{v}" for k, v in kvs) + "}"),
    max_leaves=10)

V = "@V@"
VALID = {"messages": [{"role": "user", "content": "hi"}],
         "tools": [{"type": "function", "function": {
             "name": "f", "description": "d",
             "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}],
         "tool_choice": "auto", "prediction": {"type": "content", "content": "hello"},
         "stop": ["x"], "max_tokens": 2, "temperature": 0, "top_p": 1, "seed": 1,
         "stream": False, "stream_options": {"include_usage": True}, "model": "m", "n": 1,
         "chat_template_kwargs": {"enable_thinking": False}, "response_format": {"type": "text"},
         "logprobs": False, "user": "u"}


def _slots(value, path=()):
    """Every path into VALID where a value can be replaced (and each container itself)."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _slots(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _slots(v, (*path, i))


SLOTS = [p for p in _slots(VALID) if p]


def _with_placeholder(path: tuple) -> str:
    body = json.loads(json.dumps(VALID))
    node = body
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = V
    return json.dumps(body)


PROPERTY = settings(max_examples=80, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@PROPERTY
@given(path=st.sampled_from(SLOTS), value=json_texts, stream=st.booleans())
def test_any_json_text_in_any_field_is_never_a_5xx(client, path, value, stream):
    template = _with_placeholder(path).replace('"stream": false', f'"stream": {json.dumps(stream)}')
    r = post_raw(client, template.replace(json.dumps(V), value, 1).encode("utf-8"))
    check(r)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text
        assert not any("error" in json.loads(e) for e in events[:-1]), r.text


# --- 2. the depth pre-scan is linear ---------------------------------------------------------

def reference_depth(raw: bytes) -> int:
    """The string/escape state machine, byte by byte."""
    depth = deepest = 0
    in_string = escaped = False
    for c in raw:
        if in_string:
            if escaped:
                escaped = False
            elif c == ord("\\"):
                escaped = True
            elif c == ord('"'):
                in_string = False
        elif c == ord('"'):
            in_string = True
        elif c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


def _random_json(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 5 or roll < 0.3:
        return "".join(rng.choice('[]{}"\\a:, ') for _ in range(rng.randint(0, 6)))
    if roll < 0.65:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_random_json(rng, 9): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_json_depth_agrees_with_the_state_machine():
    """On JSON text and on every prefix of it (unterminated strings and escapes included)."""
    rng = random.Random(5)
    for _ in range(150):
        raw = json.dumps(_random_json(rng)).encode()
        for end in range(len(raw) + 1):
            assert json_depth(raw[:end]) == reference_depth(raw[:end]), raw[:end]
    raw = json.dumps({"a": ["\\\"[", {"b": "\\\\"}, [[["]"]]]]}).encode()
    assert json_depth(raw) == reference_depth(raw) == 5


class Counted(np.ndarray):
    """An array that adds the elements of every array it is an operand of to ``work[0]``."""

    work = [0]

    @classmethod
    def _count(cls, args) -> None:
        cls.work[0] += sum(a.size for a in args if isinstance(a, np.ndarray))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        Counted._count(inputs)
        plain = lambda a: a.view(np.ndarray) if isinstance(a, Counted) else a  # noqa: E731
        if "out" in kwargs:
            kwargs["out"] = tuple(map(plain, kwargs["out"]))
        out = getattr(ufunc, method)(*map(plain, inputs), **kwargs)
        return out.view(Counted) if isinstance(out, np.ndarray) else out

    def __array_function__(self, func, types, args, kwargs):
        flat = [*args, *kwargs.values()]
        Counted._count(flat)
        plain = lambda a: a.view(np.ndarray) if isinstance(a, Counted) else a  # noqa: E731
        out = func(*map(plain, args), **{k: plain(v) for k, v in kwargs.items()})
        return out.view(Counted) if isinstance(out, np.ndarray) else out


ADVERSARIAL = {
    "unterminated escaped quotes": lambda n: b'{"a": "' + b'\\"' * (n // 2),
    "escaped backslashes": lambda n: b'{"a": "' + b"\\\\" * (n // 2),
    "alternating quotes": lambda n: b'"a",' * (n // 4),
    "brackets": lambda n: b"[" * n,
    "keys": lambda n: b'{' + b'"k":1,' * (n // 6),
}


def scan_work(raw: bytes, monkeypatch) -> int:
    real = np.frombuffer
    monkeypatch.setattr(limits_module.np, "frombuffer",
                        lambda buf, dtype: real(buf, dtype=dtype).view(Counted))
    Counted.work[0] = 0
    json_depth(raw)
    deep_member(raw, 64)
    monkeypatch.setattr(limits_module.np, "frombuffer", real)
    return Counted.work[0]


@pytest.mark.parametrize("kind", sorted(ADVERSARIAL))
def test_the_depth_scan_does_linear_work_up_to_the_body_limit(kind, monkeypatch):
    """Work = elements passing through NumPy operations (every pass is one such operation): at
    the 4 MiB limit it is a small constant times the body, and 4x the body is 4x the work."""
    limit = DEFAULT_LIMITS.max_request_bytes
    small = ADVERSARIAL[kind](limit // 4)
    large = ADVERSARIAL[kind](limit)
    assert len(large) <= limit + 16
    work_small, work_large = scan_work(small, monkeypatch), scan_work(large, monkeypatch)
    assert work_large <= 60 * len(large), (work_large, len(large))
    assert work_large <= 4.2 * work_small, (work_small, work_large)
    assert work_small > 0


# --- /health while a body is decoded -------------------------------------------------------

def test_health_answers_while_a_large_body_is_decoded(client, monkeypatch):
    """The decoder runs on a worker thread: /health answers while a 4 MiB adversarial body is
    in it (held there until /health has answered), and the body then gets its 400."""
    entered, answered, seen = threading.Event(), threading.Event(), {}

    def held_decode(raw, limits):
        entered.set()
        seen["released"] = answered.wait(60)
        return decode_body(raw, limits)

    monkeypatch.setattr(app, "decode_body", held_decode)
    raw = b'{"messages": "' + b'\\"' * ((DEFAULT_LIMITS.max_request_bytes - 32) // 2)
    heavy = threading.Thread(target=lambda: seen.setdefault("r", post_raw(client, raw)))
    heavy.start()
    assert entered.wait(60)
    health = client.get("/health")
    answered.set()
    heavy.join(120)
    assert health.status_code == 200 and seen["released"] is True
    check(seen["r"])
    assert seen["r"].status_code == 400
