"""Fixture models: assembled folders load with ``mlx_lm.load`` and, greedy, emit tool calls that
the family's mlx-lm parser parses on a few frozen prompts; assembly is exact and idempotent."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_fill import fixtures

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run one bash command in the repository shell and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The command to run."}},
                   "required": ["command"]}}}
PI_TOOLS = [
    {"type": "function", "function": {"name": "read", "description": "Read the contents of a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "bash", "description": "Execute a bash command in the current working directory.",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
]
# Frozen prompts in the shape of the training corpus (mini-swe-agent, pi), not taken from it.
PROMPTS = [
    ([BASH], [
        {"role": "system", "content": "You are a helpful assistant that can interact multiple times with a computer "
                                      "shell to solve programming tasks."},
        {"role": "user", "content": "<pr_description>\nConsider the following PR description:\n"
                                    "`Table.read` fails on empty files\n</pr_description>"},
    ]),
    ([BASH], [
        {"role": "system", "content": "You are a helpful assistant that can interact multiple times with a computer "
                                      "shell to solve programming tasks."},
        {"role": "user", "content": "<pr_description>\nConsider the following PR description:\n"
                                    "Pretty printing of sets is not sorted\n</pr_description>"},
        {"role": "assistant", "content": "I will look at the repository layout first.",
         "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "content": "<returncode>0</returncode>\n<output>\nREADME.rst\nsetup.py\nsympy\n</output>"},
    ]),
    (PI_TOOLS, [
        {"role": "user", "content": "read packages/tui/README.md and tell me what the package does"},
    ]),
]


def _assembled(name: str):
    try:
        return fixtures.fixture_path(name)
    except fixtures.FixtureMissing as err:
        pytest.fail(str(err))


def _greedy(model, ids: list[int], stop: set[int], limit: int = 120) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=limit):
        out.append(int(token))
        if out[-1] in stop:
            break
    return out


# Fixtures whose committed weights (trained ~10 CPU-minutes each) do not reach this yet; see the
# measured shares in fixtures/models/README.md. strict: once a retrained model passes, XPASS fails
# the suite so that its entry is removed here.
# glm-xml answers 96.7% of held-back call turns with a parseable call but one prompt here in prose.
UNDERTRAINED = {"qwen3-json", "glm-xml", "qwen3-draft"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="undertrained, see fixtures/models/README.md"))
    if n in UNDERTRAINED else n
    for n in fixtures.FIXTURES
])
def test_fixture_emits_parseable_tool_calls(name):
    model, tokenizer = load(str(_assembled(name)))
    stop = set(tokenizer.eos_token_ids)
    parsed_calls = 0
    for tools, messages in PROMPTS:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        text = tokenizer.decode(_greedy(model, prompt, stop))
        assert tokenizer.tool_call_start in text and tokenizer.tool_call_end in text, text
        body = text.split(tokenizer.tool_call_start, 1)[1].split(tokenizer.tool_call_end, 1)[0]
        call = tokenizer.tool_parser(body, tools)
        assert call["name"] in {t["function"]["name"] for t in tools}, text
        assert isinstance(call["arguments"], dict) and call["arguments"], text
        parsed_calls += 1
    assert parsed_calls == len(PROMPTS)


def test_assembly_is_the_trained_model_plus_seeded_rows():
    name = "qwen3-draft"
    folder = _assembled(name)
    committed = fixtures.committed_dir(name)
    meta = json.loads((committed / "fixture.json").read_text())
    trained = mx.load(str(committed / "trained.safetensors"))
    full = mx.load(str(folder / "model.safetensors"))[meta["embedding_key"]]
    ids = np.array(trained["rows.ids"])
    assert np.array_equal(np.array(full[mx.array(ids)]), np.array(trained["rows.weight"].astype(mx.float32)))
    config = json.loads((folder / "config.json").read_text())
    seeded = fixtures.seeded_embedding(config["vocab_size"], config["hidden_size"], meta["init_seed"], meta["init_std"])
    untouched = np.setdiff1d(np.arange(config["vocab_size"]), ids)[:: 997]
    assert np.array_equal(np.array(full[mx.array(untouched)]), seeded[untouched])


def test_fixture_path_is_idempotent_and_rebuilds_a_stale_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    name = "qwen3-draft"
    folder = _assembled(name)
    weights = folder / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert fixtures.fixture_path(name) == folder
    assert weights.stat().st_mtime_ns == before
    (folder / fixtures.STAMP).write_text("stale\n")
    assert fixtures.fixture_path(name) == folder
    assert (folder / fixtures.STAMP).read_text().strip() != "stale"


@pytest.mark.parametrize("name", fixtures.FIXTURES)
def test_fixture_loads_and_generates_through_mlx_lm(name):
    model, tokenizer = load(str(_assembled(name)))
    tools, messages = PROMPTS[0]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    tokens = _greedy(model, prompt, set(tokenizer.eos_token_ids), limit=8)
    assert 1 <= len(tokens) <= 8
    assert _greedy(model, prompt, set(tokenizer.eos_token_ids), limit=8) == tokens  # greedy is deterministic


def test_fixture_family_and_unknown_names():
    assert [fixtures.fixture_family(n) for n in fixtures.FIXTURES] == ["qwen3", "qwen3.5", "glm4.x", "qwen3"]
    with pytest.raises(ValueError, match="unknown fixture"):
        fixtures.fixture_family("llama-json")
