"""``mlx-fill audit``: the shipped corpus passes, and the audit fails loudly when it should."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from mlx_fill.evidence.audit import DEFAULT_CORPUS, load_cases
from mlx_fill.cli import main
from strict_helpers import FAMILIES


def test_shipped_corpus_covers_the_three_syntaxes_and_the_adversarial_kinds():
    cases = [c for f in FAMILIES for c in load_cases(DEFAULT_CORPUS, f)]
    assert len(cases) >= 40
    per_family = Counter(c["family"] for c in cases)
    assert all(per_family[f] >= 10 for f in FAMILIES), per_family
    ids = " ".join(c["id"] for c in cases)
    for kind in ("quoted", "fenced", "parameterization", "reasoning-names-tool", "prefix",
                 "open-extra", "escapes", "eos", "system-example", "after-reasoning",
                 "duplicate-key", "optional-keys"):
        assert kind in ids, kind
    assert Counter(c["expect"] for c in cases)["none"] >= 20


def test_audit_passes_on_every_family_and_fills(tmp_path):
    out = tmp_path / "audit.json"
    assert main(["audit", "--family", "all", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert all(c["ok"] for c in cases)
    for family in FAMILIES:
        fam = [c for c in cases if c["family"] == family]
        assert sum(c["injected"] for c in fam) > 0, family
        assert all(not c["fires"] for c in fam if c["expect"] == "none"), family


def _corpus(tmp_path: Path, family: str, case: dict) -> Path:
    root = tmp_path / "corpus"
    (root / family).mkdir(parents=True)
    shutil.copytree(DEFAULT_CORPUS / "tools", root / "tools")
    (root / family / "case.json").write_text(json.dumps({"family": family, **case}))
    return root


def _run(root: Path, family: str) -> int:
    return main(["audit", "--family", family, "--corpus", str(root)])


CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
USER = [{"role": "user", "content": "weather?"}]


@pytest.mark.parametrize("family,after_name", [("qwen3", '\n{"name'),
                                               ("qwen3.5", "\n<function")])
def test_a_fire_where_no_fill_may_happen_fails_the_audit(tmp_path, family, after_name):
    """``after_name`` is where a ``determined`` row fires."""
    root = _corpus(tmp_path, family, {"id": "x", "messages": USER, "reply": CALL, "expect": "none"})
    assert _run(root, family) == 1
    root2 = _corpus(tmp_path / "b", family, {"id": "y", "messages": USER, "reply": CALL,
                                              "expect": "fill", "no_fill_in": [after_name]})
    assert _run(root2, family) == 1


def test_a_span_that_is_not_the_real_stream_fails_the_audit(tmp_path):
    raw = "<tool_call>\n<function=other>\n</function>\n</tool_call><|im_end|>"
    root = _corpus(tmp_path, "qwen3-coder", {"id": "z", "tools": "single.json", "messages": USER,
                                             "raw_reply": raw, "expect": "fill"})
    assert _run(root, "qwen3-coder") == 1


def test_a_positive_case_with_no_fill_fails_the_audit(tmp_path):
    root = _corpus(tmp_path, "qwen3.5", {"id": "m", "messages": USER, "expect": "fill",
                                         "reply": {"role": "assistant", "content": "No."}})
    assert _run(root, "qwen3.5") == 1


def test_likely_rows_false_fires_are_reported_but_do_not_fail(tmp_path):
    """The close row fires after a </parameter> inside the value: likely, so verified."""
    reply = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "bash", "arguments": {"command": "cat f\n</parameter>\n</function>\ndone"}}}]}
    root = _corpus(tmp_path, "qwen3.5", {"id": "l", "messages": USER, "reply": reply,
                                         "expect": "fill",
                                         "no_fill_in": ["</parameter>\n</function>\ndone"]})
    out = tmp_path / "audit.json"
    assert main(["audit", "--family", "qwen3.5", "--corpus", str(root), "--json", str(out)]) == 0
    case, = json.loads(out.read_text())["cases"]
    wrong = [f for f in case["fires"] if f["false_fire"] or not f["contained"]]
    assert wrong and all(f["certainty"] == "likely" for f in wrong)
    assert case["ok"] and case["determined_failures"] == 0


def test_a_row_without_a_class_fails_the_audit(tmp_path, monkeypatch):
    from mlx_fill.strict import rows
    from mlx_fill.strict.source import strict_source
    from strict_helpers import tokenizer, tools

    monkeypatch.setattr(rows, "_TABLES", {})   # a private table cache for this test
    table = strict_source(tokenizer("qwen3.5"), [{"role": "user", "content": "audit"}],
                         tools()).table
    object.__setattr__(table.close[next(iter(table.close))], "certainty", None)
    root = _corpus(tmp_path, "qwen3.5", {"id": "c", "messages": USER, "reply": CALL,
                                         "expect": "fill"})
    out = tmp_path / "audit.json"
    assert main(["audit", "--family", "qwen3.5", "--corpus", str(root), "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["unclassed_rows"] == 1
    assert any(f["certainty"] is None for f in report["cases"][0]["fires"])
