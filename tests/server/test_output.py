"""A finished completion's text split into content and OpenAI tool calls: whatever the model
wrote inside the call markers, the answer is a well-formed response (a call with a string name,
its arguments a JSON string), or the text stays in the content; never an exception."""

from __future__ import annotations

import pytest
from adapter_models import TOOLS, serving_model_dir

from mlx_fill.adapters.server.output import split_output
from mlx_fill.core.model_folder import load_model_folder


@pytest.fixture(scope="module")
def tokenizer():
    model, _ = serving_model_dir()
    _, tok = load_model_folder(str(model))
    assert tok.tool_call_start == "<tool_call>" and tok.tool_parser is not None
    return tok


def wrapped(body: str) -> str:
    return f"ok\n<tool_call>\n{body}\n</tool_call>"


def test_a_call_is_parsed_and_one_without_arguments_takes_none(tokenizer):
    content, _, calls = split_output(tokenizer, wrapped('{"name": "bash", "arguments": {"command": "ls"}}'), TOOLS)
    assert content == "ok\n" and [c["function"] for c in calls] == [
        {"name": "bash", "arguments": '{"command": "ls"}'}]
    content, _, calls = split_output(tokenizer, wrapped('{"name": "bash"}'), TOOLS)
    assert content == "ok\n" and [c["function"] for c in calls] == [{"name": "bash", "arguments": "{}"}]


@pytest.mark.parametrize("body", ['"bash"', "null", "[1]", "[]", '{"arguments": {}}',
                                  '{"name": {"a": 1}, "arguments": 5}', '{"name": ""}',
                                  '{"name": "bash", "arguments": {}', "not json"])
def test_what_is_not_a_call_stays_in_the_content(tokenizer, body):
    text = wrapped(body)
    content, _, calls = split_output(tokenizer, text, TOOLS)
    assert (content, calls) == (text, [])
