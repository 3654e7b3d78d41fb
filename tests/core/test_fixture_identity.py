"""Temperature 0 on the trained fixtures: every fill mode emits exactly the ids plain decoding
emits, over all the frozen held-out prompts (multi-turn, with tool results; pi, tau-bench and
mini-swe-agent), and fill really fires.

Identity must hold whatever the model's quality. The firing checks need a model that really
emits its template's tool calls: ``strict`` must inject on every prompt whose plain output holds
a parseable call and nothing where it is prose; the model-free sources must get drafts accepted.
The strict check is a strict xfail for fixtures whose recorded eval has fewer than half the
held-back call turns parseable (``mlx_fill.assets.fixtures.fixture_emits_calls``), so it turns red
once a retrained fixture passes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step as stock_generate_step

from mlx_fill.assets.fixtures import fixture_emits_calls, fixture_path, parse_tool_calls
import mlx_fill.session
from mlx_fill.core.loop import generate_step
from mlx_fill.session import build_session

PROMPTS = Path(__file__).resolve().parents[2] / "fixtures" / "prompts" / "heldout.jsonl"
MAX_TOKENS = 40
FAMILY_FIXTURES = ["qwen3-json", "qwen35-xml", "glm-xml"]
# The default suite runs the strict checks on the JSON-call fixture; the XML-call fixtures take
# 1.5-2.5 minutes each and run with the slow tests (their strict rows are audited by
# ``tests/strict`` in the default suite).
SLOW_FIXTURES = frozenset({"qwen35-xml", "glm-xml"})


def by_cost(name: str, *marks):
    """``name`` as a parameter, marked ``slow`` when it is in :data:`SLOW_FIXTURES`."""
    return pytest.param(name, marks=[*marks, *([pytest.mark.slow] if name in SLOW_FIXTURES else [])])


@functools.lru_cache(maxsize=None)
def fixture(name: str):
    """(model, tokenizer, [(row, prompt ids, plain output ids)]) for a fixture."""
    model, tok = load(str(fixture_path(name)))
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    cases = []
    for row in rows:
        ids = tok.apply_chat_template(row["messages"], tools=row["tools"],
                                      add_generation_prompt=True)
        cases.append((row, ids, decode(model, tok, ids, None)))
    return model, tok, cases


def decode(model, tok, ids, session) -> list[int]:
    """Greedy ids up to and including the first EOS (at most MAX_TOKENS)."""
    gen = (stock_generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS) if session is None
           else generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS, fill=session))
    out = []
    for t, _ in gen:
        out.append(t)
        if t in tok.eos_token_ids:
            break
    return out


def has_call(tok, ids, tools: list[dict]) -> bool:
    """The output's first tool call is one the model's own mlx-lm parser reads, naming a tool the
    request declares (strict can only fill the scaffold of a declared tool; a call to another
    name is the model's mistake, which verify rejects)."""
    text = tok.decode(ids)
    start = text.find(tok.tool_call_start)
    end = text.find(tok.tool_call_end, start) if start >= 0 else -1
    if end < 0:
        return False
    calls = parse_tool_calls(tok, text[: end + len(tok.tool_call_end)], tools)
    return bool(calls) and calls[0]["name"] in {t["function"]["name"] for t in tools}


def run_mode(name: str, mode: str, extra_sources=None, free_rows: bool = False):
    """Every held-out case decoded in ``mode``, the cost gates' estimates carried from case to
    case as a server carries them. ``free_rows``: the fixture's plan with a flat cost curve and
    every case from the prior, so the gates let every draft through (where a source fires,
    not whether it pays)."""
    model, tok, cases = fixture(name)
    results = []
    acceptance: dict | None = None if free_rows else {}
    real = mlx_fill.session.plan_for
    flat = (lambda m, group=None: replace(real(m, group), cost={64: 1.0})) if free_rows else real
    with mock.patch.object(mlx_fill.session, "plan_for", flat):
        for row, ids, plain in cases:
            session = build_session(mode, model=model, tokenizer=tok, prompt_ids=ids,
                                    messages=row["messages"], tools=row["tools"],
                                    extra_sources=extra_sources, acceptance=acceptance)
            out = decode(model, tok, ids, session)
            results.append((row, plain, out, session.stats))
    return tok, results


def needs_calls(name: str):
    """Strict xfail unless the fixture answers most held-back call turns with a parseable call."""
    return by_cost(name, pytest.mark.xfail(
        not fixture_emits_calls(name, share=0.5), strict=True,
        reason="fixture undertrained: emits few parseable tool calls (fixtures/models/README.md)"))


@functools.lru_cache(maxsize=None)
def run_mode_cached(name: str, mode: str, free_rows: bool = False):
    return run_mode(name, mode, free_rows=free_rows)


@pytest.mark.parametrize("name", [by_cost(n) for n in FAMILY_FIXTURES])
@pytest.mark.parametrize("mode", ["strict", pytest.param("echo", marks=pytest.mark.slow),
                                  pytest.param("all", marks=pytest.mark.slow)])
def test_fill_modes_are_token_identical(name, mode):
    """``strict`` runs with free rows (every verify row let through: the strongest identity
    check, and the run the firing check reads); the model-free modes with the estimates carried
    from case to case, as a server carries them."""
    _, results = run_mode_cached(name, mode, free_rows=mode == "strict")
    assert len(results) >= 30
    mismatched = [row["id"] for row, plain, out, _ in results if out != plain]
    assert not mismatched, f"{mode} changed the output on {mismatched}"


@pytest.mark.parametrize("name", [needs_calls(n) for n in FAMILY_FIXTURES])
def test_strict_fires_on_calls_and_never_on_prose(name):
    """Strict injects into every output holding a parseable call and never into prose (no
    tool-call start at all); a started call the model then garbles may have had its scaffold
    filled, which is lossless and not asserted either way. Rows are priced as free and every case
    starts from the prior: this checks where strict fires, not whether its gate finds it pays
    (carried estimates may rightly decline a verify row that kept being rejected)."""
    tok, results = run_mode_cached(name, "strict", free_rows=True)
    calls = [(row, s) for row, plain, _, s in results if has_call(tok, plain, row["tools"])]
    prose = [(row, s) for row, plain, _, s in results if tok.tool_call_start not in tok.decode(plain)]
    assert calls, "the fixture emitted no tool call on the held-out prompts"
    silent = [row["id"] for row, s in calls if s.injected == 0]
    assert not silent, f"strict injected nothing on tool-call outputs {silent}: " + str([s.as_dict() for row, s in calls if s.injected == 0])
    fired_on_prose = [row["id"] for row, s in prose if s.injected]
    assert not fired_on_prose, f"strict injected into prose outputs {fired_on_prose}"


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_FIXTURES)
@pytest.mark.parametrize("mode", ["echo", "all"])
def test_model_free_sources_get_drafts_accepted(name, mode):
    _, results = run_mode_cached(name, mode)
    assert sum(s.verify_accepted for *_, s in results) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_FIXTURES)
@pytest.mark.parametrize("source", ["ngram", "suffix"])
def test_each_draft_source_alone_is_token_identical(name, source):
    model, tok, cases = fixture(name)
    from mlx_fill.core.proposal import FillSession
    from mlx_fill.spec.roster import make_sources
    accepted = 0
    for row, ids, plain in cases:
        session = FillSession(make_sources([source], plan=None, tokenizer=tok, prompt_ids=ids),
                              prompt_ids=ids, eos_ids=tok.eos_token_ids)
        assert decode(model, tok, ids, session) == plain, row["id"]
        accepted += session.stats.verify_accepted
    assert accepted > 0
