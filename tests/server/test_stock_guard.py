"""The ``MLX_FILL`` hook keeps an unmodified ``mlx_lm.server`` serving: each request whose fields
would stop mlx-lm's generation thread (or end the process) gets a 400 in mlx-lm's own shape,
and the valid request after it is served; values at the edge of each check stay stock."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from adapter_models import TOOLS, BIN, free_port, running_server, serving_model_dir

from mlx_fill.adapters.stock_guard import refusal

MODEL, _ = serving_model_dir()
VOCAB = json.loads((MODEL / "config.json").read_text())["vocab_size"]  # the logits width
USER = [{"role": "user", "content": "hi"}]

# (name, raw JSON of the fields added to a valid request)
REFUSED = [
    ("stop int", '"stop": 123'),
    ("stop ints", '"stop": [1, 2]'),
    ("stop bool", '"stop": true'),
    ("stop null item", '"stop": ["a", null]'),
    ("stop surrogate", '"stop": "\\ud800"'),
    ("stop surrogate key", '"stop": {"\\udc00": 1}'),
    ("seed negative", '"seed": -1'),
    ("seed past uint64", f'"seed": {2 ** 64}'),
    ("temperature past int64", f'"temperature": {2 ** 63}'),
    ("top_k at the vocabulary", f'"temperature": 1, "top_k": {VOCAB}'),
    ("min_p NaN", '"temperature": 1, "min_p": NaN'),
    ("top_logprobs true", '"logprobs": true, "top_logprobs": true'),
    ("xtc_threshold over 0.5", '"temperature": 1, "xtc_probability": 0.5, "xtc_threshold": 0.7'),
    ("xtc_threshold NaN", '"temperature": 1, "xtc_probability": 0.5, "xtc_threshold": NaN'),
    ("repetition_penalty past int64", f'"repetition_penalty": {2 ** 63}'),
    ("presence_penalty past int64", f'"presence_penalty": {-(2 ** 63) - 1}'),
    ("context size past int64", f'"frequency_penalty": 1, "frequency_context_size": {2 ** 63}'),
    ("logit_bias id past int32", '"logit_bias": {"2147483647": 1}'),
    ("logit_bias id at the vocabulary", f'"logit_bias": {{"{VOCAB}": 1}}'),
    ("logit_bias negative id", '"logit_bias": {"-1": 1}'),
    ("tools and stop ints", f'"tools": {json.dumps(TOOLS)}, "stop": [1]'),
]
ACCEPTED = [
    ("stop dict", '"stop": {"a": 1}'),
    ("stop falsy", '"stop": 0'),
    ("top_logprobs false", '"logprobs": true, "top_logprobs": false'),
    ("seed at uint64 max", f'"seed": {2 ** 64 - 1}'),
    ("temperature int", '"temperature": 2, "top_k": 5'),
    ("top_k below the vocabulary", f'"temperature": 1, "top_k": {VOCAB - 1}'),
    ("xtc_threshold without xtc", '"temperature": 1, "xtc_threshold": 0.7'),
    ("repetition_penalty at int64 max", f'"repetition_penalty": {2 ** 63 - 1}'),
    ("logit_bias last id", f'"logit_bias": {{"{VOCAB - 1}": 1}}'),
    # greedy (the request's temperature, else the server's --temp 0): no sampler reads these
    ("top_k at the vocabulary, greedy", f'"temperature": 0, "top_k": {VOCAB}'),
    ("top_k at the vocabulary, the server's temperature", f'"top_k": {VOCAB}'),
    ("min_p NaN, greedy", '"temperature": 0.0, "min_p": NaN'),
    ("xtc_threshold over 0.5, greedy", '"xtc_probability": 0.5, "xtc_threshold": 0.7'),
]


def body(fields: str) -> bytes:
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            + fields + "}").encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("guard") / "server.log"
    argv = [str(BIN / "mlx_lm.server"), "--model", str(MODEL), "--port", str(port)]
    with running_server(argv, port, env={"MLX_FILL": "strict"}, log=log) as base:
        with httpx.Client(base_url=base, timeout=120) as client:
            # the first request waits for the model: the vocabulary checks need it loaded
            assert client.post("/v1/chat/completions", content=body('"seed": 1')).status_code == 200
            yield client


def test_each_refused_request_is_a_400_and_the_server_keeps_serving(server):
    for name, fields in REFUSED:
        r = server.post("/v1/chat/completions", content=body(fields))
        assert r.status_code == 400, (name, r.text)
        assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str), (name, r.text)
        ok = server.post("/v1/chat/completions", content=body('"temperature": 0'))
        assert ok.status_code == 200, (name, ok.text)
    assert server.get("/health").json() == {"status": "ok"}


def test_a_list_of_prompts_or_an_empty_one_is_a_400_and_the_server_keeps_serving(server):
    """``/v1/completions`` with ``prompt`` a list of strings (tokenized as a batch, it would
    kill the thread in mlx-lm's prompt-cache lookup) or empty (a sequence without ids, which the
    batch generator raises on); other prompts are left to mlx-lm."""
    r = server.post("/v1/completions", json={"prompt": ["hi", "there"], "max_tokens": 2})
    assert r.status_code == 400 and r.json() == {"error": "prompt must be a string, got a list of strings"}
    r = server.post("/v1/completions", json={"prompt": "", "max_tokens": 2})
    assert r.status_code == 400 and r.json() == {"error": "prompt must not be empty"}
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert server.get("/health").json() == {"status": "ok"}


def test_values_at_the_edge_are_served_as_stock(server):
    for name, fields in ACCEPTED:
        r = server.post("/v1/chat/completions", content=body(fields))
        assert r.status_code == 200, (name, r.text)
    assert server.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("name, fields", REFUSED + ACCEPTED, ids=[n for n, _ in REFUSED + ACCEPTED])
def test_refusal_is_the_pure_rule(name, fields):
    decoded = json.loads(body(fields))
    why = refusal(decoded, VOCAB, temperature=decoded.get("temperature", 0.0))
    assert (why is not None) == ((name, fields) in REFUSED), why
    assert why is None or "\n" not in why


def test_refusal_without_a_vocabulary_skips_only_the_vocabulary_checks():
    assert refusal({"top_k": VOCAB}) is None
    assert refusal({"logit_bias": {str(VOCAB): 1}}) is None
    assert refusal({"stop": 1}) is not None
    assert refusal({"min_p": math.nan}) is not None
    assert refusal([1]) is None


def test_the_sampler_checks_apply_unless_the_request_is_greedy():
    for fields in ({"top_k": VOCAB}, {"min_p": math.nan},
                   {"xtc_probability": 0.5, "xtc_threshold": 0.7}):
        assert refusal(fields, VOCAB, temperature=0) is None, fields
        assert refusal(fields, VOCAB, temperature=0.7) is not None, fields
        assert refusal(fields, VOCAB) is not None, fields  # temperature unknown


def test_only_a_text_prompt_that_is_a_list_of_strings_or_empty_is_refused():
    assert refusal({}, text_prompt=["a", "b"]) is not None
    assert refusal({}, text_prompt=["a"]) is not None
    assert refusal({}, text_prompt="") is not None
    for prompt in ("a", [], [1, 2], ["a", 1], None):  # mlx-lm answers these itself
        assert refusal({}, text_prompt=prompt) is None, prompt
