"""Fixture models: assembled folders load with ``mlx_lm.load`` and, greedy, emit tool calls that
the family's mlx-lm parser parses on the frozen held-out mini-swe-agent requests; assembly is
exact and idempotent."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_fill.assets import fixtures

FROZEN = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "heldout.jsonl"


def _frozen_call_prompts(source: str) -> list[dict]:
    """The distinct frozen held-out requests of ``source`` whose recorded reply was a call."""
    rows, seen = [], set()
    for line in FROZEN.read_text().splitlines():
        row = json.loads(line)
        key = json.dumps(row["messages"], sort_keys=True)
        if row["source"] == source and row["expect"] == "call" and key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


# mini-swe-agent is the source every fixture trains and is evaluated on at its window size (the
# frozen pi and tau-bench requests are 400-480 tokens: the 512-token-window fixtures answer
# them poorly, see fixtures/models/README.md)
CALL_PROMPTS = _frozen_call_prompts("mini_swe_agent_gemini3pro")
MIN_PARSEABLE = 0.75
# The default suite decodes the JSON-call fixture; the others (a minute of decoding together)
# run with the slow tests: their outputs change only with their weights or MLX.
DEFAULT_FIXTURE = "qwen3-json"


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


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == DEFAULT_FIXTURE else [pytest.mark.slow])
                                  for n in fixtures.FIXTURES])
def test_fixture_emits_parseable_tool_calls(name):
    """Greedy, the fixture answers at least MIN_PARSEABLE of the frozen held-out mini-swe-agent
    call requests with a call its mlx-lm parser reads, to a declared tool, with object arguments."""
    model, tokenizer = load(str(_assembled(name)))
    stop = set(tokenizer.eos_token_ids)
    failures = []
    for row in CALL_PROMPTS:
        prompt = tokenizer.apply_chat_template(row["messages"], tools=row["tools"], add_generation_prompt=True)
        text = tokenizer.decode(_greedy(model, prompt, stop))
        calls = fixtures.parse_tool_calls(tokenizer, text, row["tools"])
        declared = {t["function"]["name"] for t in row["tools"]}
        if not calls or any(c["name"] not in declared or not c["arguments"] for c in calls):
            failures.append((row["id"], text[:200]))
    assert len(CALL_PROMPTS) >= 8
    assert len(failures) <= (1 - MIN_PARSEABLE) * len(CALL_PROMPTS), failures


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
    row = CALL_PROMPTS[0]
    prompt = tokenizer.apply_chat_template(row["messages"], tools=row["tools"], add_generation_prompt=True)
    tokens = _greedy(model, prompt, set(tokenizer.eos_token_ids), limit=8)
    assert 1 <= len(tokens) <= 8
    assert _greedy(model, prompt, set(tokenizer.eos_token_ids), limit=8) == tokens  # greedy is deterministic


def test_fixture_family_and_unknown_names():
    assert [fixtures.fixture_family(n) for n in fixtures.FIXTURES] == ["qwen3", "qwen3.5", "glm4.x", "qwen3"]
    with pytest.raises(ValueError, match="unknown fixture"):
        fixtures.fixture_family("llama-json")


def test_widened_fixture_is_the_narrow_model_with_twice_the_heads():
    narrow_dir, wide_dir = fixtures.fixture_path("qwen3-json"), fixtures.fixture_path("qwen3-json-x2")
    narrow_cfg = json.loads((narrow_dir / "config.json").read_text())
    wide_cfg = json.loads((wide_dir / "config.json").read_text())
    assert wide_cfg["num_attention_heads"] == 2 * narrow_cfg["num_attention_heads"]
    assert wide_cfg["num_key_value_heads"] == 2 * narrow_cfg["num_key_value_heads"]
    assert (wide_dir / "model.safetensors.index.json").is_file()  # pipeline loading reads it
    narrow, tokenizer = load(str(narrow_dir))
    wide, _ = load(str(wide_dir))
    ids = mx.array([tokenizer.encode("List the files in /tmp, then read README.md")])
    a, b = narrow(ids), wide(ids)
    assert mx.abs(a - b).max().item() < 1e-3
    assert (a.argmax(-1) == b.argmax(-1)).all().item()
