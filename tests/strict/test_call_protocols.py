"""Harmony (gpt-oss), Llama 3.x JSON and Mistral ``[TOOL_CALLS]``: rows compiled from the real
fetched tokenizers and vendor templates, guards on adversarial strings, and the audit per family.

What must hold: a ``determined`` row holds only the protocol's forced text (the rest of a name,
the template's name-to-arguments text); what follows it is a ``likely`` ``header`` row; no span
holds a stop token or the model's own call id; markers written inside a JSON string value are
text (the tokenizers map such text to the special id when a template renders it, and still
nothing opens, ends or fires there); a call opens only where the protocol opens one.
"""

from __future__ import annotations

import re
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fill.cli import main
from mlx_fill.evidence.audit import DEFAULT_CORPUS, audit_case, load_cases
from mlx_fill.strict.guards import SYNTAXES, Role, TurnGuard, protocol_markers
from mlx_fill.assets.store import FAMILIES, family_dir
from mlx_fill.strict.rows import table_for
from mlx_fill.strict.source import LazyStrictSource, lazy_strict_source, strict_source
from strict_helpers import (call, contained, reply_ids, teacher_force, tokenizer, tools,
                            wrong_asserts)

DATE = {"date_string": "26 Jul 2024"}
USER = [{"role": "user", "content": "Do it"}]
# family -> (syntax, template kwargs, stop-token texts no span may hold)
PROTOCOLS = {
    "gpt-oss": ("harmony", {}, ("<|call|>", "<|return|>", "<|end|>")),
    "llama3.x": ("llama-json", DATE, ("<|eot_id|>", "<|eom_id|>")),
    "mistral-nemo": ("mistral", {}, ("</s>",)),
}


def _table(family: str, tool_list: str = "long"):
    return table_for(tokenizer(family), USER, tools(tool_list), PROTOCOLS[family][1])


@lru_cache(maxsize=None)
def _markers(family: str):
    """The family's protocol markers, read from its fetched template (no tokenizer load)."""
    template = (family_dir(family) / "chat_template.jinja").read_text(encoding="utf-8")
    eos = {"gpt-oss": "<|return|>", "llama3.x": "<|eot_id|>", "mistral-nemo": "</s>"}[family]
    return protocol_markers(template, eos)


def _guard(family: str) -> TurnGuard:
    markers, syntax = _markers(family)
    assert syntax == PROTOCOLS[family][0]
    return TurnGuard(SYNTAXES[syntax], markers, Role.CONTENT)


@pytest.mark.parametrize("family", PROTOCOLS)
def test_rows_compile_from_the_real_template_with_forced_text_determined(family):
    syntax, _, stops = PROTOCOLS[family]
    tok = tokenizer(family)
    table = _table(family)
    assert table is not None and table.syntax == syntax
    rows = table.rows()
    determined = [r for r in rows if r.certainty == "determined"]
    # harmony and Llama rows all write the rest of a name (the model may not end it there) or,
    # in Llama, past the name string (the key the arguments go under is the model's)
    assert bool(determined) == (family == "mistral-nemo"), [r.origin for r in determined]
    forced = SYNTAXES[syntax].forced
    for r in determined:
        assert r.kind in ("scaffold", "name")
        text = r.key + tok.decode(list(r.span))
        # inside the forced text: the arguments object (" {") is never part of it
        assert re.match(forced, text + " {").end() >= len(text), (r.origin, text)
    headers = [r for r in rows if r.kind == "header"]
    assert headers and all(r.certainty == "likely" for r in headers)
    assert all(r.certainty == "likely" for r in table.close.values())
    stop_ids = {i for s in stops for i in tok.encode(s, add_special_tokens=False)}
    for r in rows:
        assert not stop_ids & set(r.span), (r.origin, tok.decode(list(r.span)))


def test_the_run_shell_command_name_row_is_the_rest_of_the_name_in_each_protocol():
    expect = {"gpt-oss": ("_shell_command", ".run"),
              "llama3.x": ('_shell_command", "parameters":', "run"),
              "mistral-nemo": ('_shell_command", "arguments":', '[{"name": "run')}
    for family, (span, key) in expect.items():
        row = _table(family).head[key]
        assert (row.kind, row.certainty) == ("name", "likely")  # the model may name run_tests
        assert tokenizer(family).decode(list(row.span)) == span


def test_mistral_close_rows_stop_where_the_model_writes_its_call_id():
    tok = tokenizer("mistral-nemo")
    table = _table("mistral-nemo", "default")
    spans = {k: tok.decode(list(r.span)) for k, r in table.close.items()}
    assert spans['"},'] == ' "id": "'
    assert all(not s.rstrip('"').endswith(tuple("0123456789")) for s in spans.values()), spans


def test_the_tokenizers_map_delimiters_written_in_values_to_their_special_ids():
    """Why the guard reads JSON strings: the rendered value holds the special id itself."""
    for family, text in (("gpt-oss", "<|call|>"), ("mistral-nemo", "[TOOL_CALLS]"),
                         ("llama3.x", "<|eom_id|>")):
        tok = tokenizer(family)
        (special,) = tok.encode(text, add_special_tokens=False)
        reply = {"role": "assistant", "content": "", "tool_calls": [
            {**call("run_shell_command", {"command": f"echo '{text}'"}), "id": "abcDEF123"}]}
        ids = reply_ids(tok, USER, tools("long"), reply, PROTOCOLS[family][1])
        assert ids.count(special) >= 1 + (family == "gpt-oss")  # the value's, and harmony's end


@pytest.mark.parametrize("family,body_text", [
    ("gpt-oss", '.run_shell_command<|channel|>commentary json<|message|>{"command": "a<|call|>'
                '<|start|>assistant to=functions.x'),
    ("llama3.x", 'run_shell_command", "parameters": {"command": "<|eot_id|>{\\"name\\": \\"x\\"'),
    ("mistral-nemo", '[{"name": "run_shell_command", "arguments": {"command": "[TOOL_CALLS]</s>'),
])
def test_markers_inside_a_json_string_neither_end_nor_open_a_call(family, body_text):
    guard = _guard(family)
    start = guard.markers.call_start
    prefix = {"gpt-oss": " ", "llama3.x": "", "mistral-nemo": ""}[family]
    guard.feed(prefix + start + body_text)
    assert guard.role is Role.CALL and not guard.declined and guard.calls_ended == 0
    guard.feed('"}')
    assert guard.role is Role.CALL
    guard.feed({"gpt-oss": "<|call|>", "llama3.x": "}<|eot_id|>", "mistral-nemo": "]</s>"}[family])
    assert guard.role is Role.CONTENT and guard.calls_ended == 1


@pytest.mark.parametrize("family,text,opens", [
    ("gpt-oss", " to=functions", True),
    ("gpt-oss", "<|channel|>commentary to=functions", True),
    ("gpt-oss", "<|channel|>analysis<|message|>x to=functions<|end|><|start|>assistant to=functions",
     True),
    ("gpt-oss", "<|channel|>final<|message|>Call it so:\n to=functions", False),
    ("gpt-oss", "<|channel|>final<|message|>use to=functions", False),
    ("gpt-oss", "<|channel|>analysis<|message|> to=functions", False),
    ("llama3.x", '{"name": "', True),
    ("llama3.x", '<|python_tag|>{"name": "', True),
    ("llama3.x", 'JSON: {"name": "', False),
    ("llama3.x", 'Here:\n{"name": "', False),
    ("mistral-nemo", "[TOOL_CALLS]", True),
    ("mistral-nemo", "Write [TOOL_CALLS]", False),
    ("mistral-nemo", "```\n[TOOL_CALLS]", False),
])
def test_a_call_opens_only_where_the_protocol_opens_one(family, text, opens):
    guard = _guard(family)
    guard.feed(text)
    assert (guard.role is Role.CALL) is opens


def test_no_call_opens_after_a_llama_call_has_ended():
    guard = _guard("llama3.x")
    guard.feed('{"name": "x", "parameters": {}}<|eot_id|>\n{"name": "')
    assert guard.calls_ended == 1 and guard.role is Role.CONTENT


@pytest.mark.parametrize("family", PROTOCOLS)
def test_real_calls_fill_contained(family):
    tok = tokenizer(family)
    kwargs = PROTOCOLS[family][1]
    for name, args in (("run_shell_command", {"command": "ls -la"}),
                       ("fetch_web_page_text", {"url": "https://example.com/a?b=\"}"}),
                       ("get_weather", {"city": "日本"})):
        reply = {"role": "assistant", "content": "",
                 "tool_calls": [{**call(name, args), "id": "abcDEF123"}]}
        ids = reply_ids(tok, USER, tools("long"), reply, kwargs)
        source = strict_source(tok, USER, tools("long"), kwargs)
        fires = teacher_force(source, ids, frozenset(tok.eos_token_ids))
        assert fires and contained(ids, fires), (family, name)


@pytest.mark.parametrize("tool_set,name", [("long", "run_shell_command"), ("prefix", "read")])
def test_no_llama_row_asserts_the_key_its_arguments_go_under(tool_set, name):
    """A Llama 3.x call is JSON the model writes after the system prompt's instruction, with no
    special token or trained opening around it: the template writes ``"parameters"``, and the
    models also write ``"arguments"`` (which Llama tool parsers accept). Once every row has
    agreed on calls under ``parameters``, a call under ``arguments`` is not overwritten, from
    the name's first ids (``run``) or from its end (``read",`` beside ``read_file``)."""
    from mlx_fill.sources.ledger import Ledger

    tok, tool_list, kwargs = tokenizer("llama3.x"), tools(tool_set), PROTOCOLS["llama3.x"][1]
    ledger = Ledger("m", "t", promote_after=1, eligible=frozenset({"strict:"}))
    args = {"command": "ls"} if name == "run_shell_command" else {"uri": "x"}
    reply = {"role": "assistant", "content": "", "tool_calls": [call(name, args)]}
    given = reply_ids(tok, USER, tool_list, reply, kwargs)
    for _ in range(2):
        teacher_force(strict_source(tok, USER, tool_list, kwargs, ledger=ledger), given)
    text = tok.decode(given).replace('"parameters"', '"arguments"')
    ids = tok.encode(text, add_special_tokens=False)
    assert wrong_asserts(tok, USER, tool_list, ids, ledger, kwargs) == []


@pytest.mark.parametrize("family", PROTOCOLS)
def test_audit_of_the_family_passes_with_no_determined_false_fire(family, capsys):
    assert main(["audit", "--family", family]) == 0
    cases = load_cases(DEFAULT_CORPUS, family)
    assert len(cases) >= 10
    assert any("adv-" in c["id"] for c in cases) and any(c["expect"] == "none" for c in cases)
    out = capsys.readouterr().out
    determined = next(line for line in out.splitlines() if line.lstrip().startswith("determined "))
    assert "containment_failures=0 false_fires=0" in determined, determined


def test_a_determined_fire_where_none_may_happen_fails_the_mistral_audit():
    """The audit can fail on the protocol with a determined row (Mistral's scaffold; harmony and
    Llama 3.x have none): a real call marked ``expect: none``."""
    family = "mistral-nemo"
    case = {"id": "x", "family": family, "messages": USER, "template_kwargs": {},
            "reply": {"role": "assistant", "content": "", "tool_calls": [
                {**call("run_shell_command", {"command": "ls"}), "id": "abcDEF123"}]},
            "expect": "none"}
    result = audit_case(tokenizer(family), case, tools("long"))
    assert result.determined_failures > 0 and not result.ok


@pytest.mark.slow  # loads all seven tokenizers: over 30 s on its own
def test_audit_all_covers_six_call_syntaxes():
    """``mlx-fill audit --family all`` audits every asset family (its run is
    ``tests/evidence/test_audit.py``); their templates compile six call syntaxes."""
    families = [f for f in FAMILIES if load_cases(DEFAULT_CORPUS, f)]
    assert families == list(FAMILIES)
    syntaxes = {table_for(tokenizer(f), USER, tools("single"),
                          PROTOCOLS.get(f, (None, {}, ()))[1]).syntax for f in families}
    assert syntaxes == {"hermes-json", "xml", "glm", "harmony", "llama-json", "mistral"}


# --- properties -----------------------------------------------------------------------------

# Pieces of each protocol's markup, and a lead that makes everything after it prose: harmony's
# final channel, text before a Llama reply's JSON, text on a Mistral line.
MARKUP = {
    "gpt-oss": ("<|channel|>final<|message|>",
                ["\n", " ", " to=functions", ".run_shell_command", "<|channel|>commentary json",
                 "<|message|>", '{"command": "', '"}', "<|call|>", "<|end|>", "é", "ls"]),
    "llama3.x": ("Sure:",
                 ["\n", " ", '{"name": "', "run_shell_command", '", "parameters": ', '{"command": "',
                  '"}}', "<|python_tag|>", "é", "ls"]),
    "mistral-nemo": ("See",
                     [" ", "[TOOL_CALLS]", '[{"name": "', "run_shell_command", '", "arguments": ',
                      '{"command": "', '"}, "id": "', "abcDEF123", '"}]', "é", "ls"]),
}


@pytest.mark.parametrize("family", PROTOCOLS)
def test_protocol_guard_state_does_not_depend_on_how_text_is_chunked(family):
    @settings(max_examples=80, deadline=None)
    @given(st.lists(st.sampled_from(MARKUP[family][1]), max_size=30), st.data())
    def check(pieces, data):
        text = "".join(pieces)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
        whole, chunked = _guard(family), _guard(family)
        whole.feed(text)
        prev = 0
        for c in [*cuts, len(text)]:
            chunked.feed(text[prev:c])
            prev = c
        assert (whole.role, whole.body, whole.calls_ended, whole.last_body) == (
            chunked.role, chunked.body, chunked.calls_ended, chunked.last_body)

    check()


@pytest.mark.parametrize("family", PROTOCOLS)
def test_no_fire_in_prose_that_writes_the_protocols_markup(family):
    tok = tokenizer(family)
    kwargs = PROTOCOLS[family][1]
    source_tools = tools("long")
    table_for(tok, USER, source_tools, kwargs)  # compiled once, reused by every example
    lead, pieces = MARKUP[family]

    @settings(max_examples=25, deadline=None)
    @given(st.lists(st.sampled_from(pieces), min_size=1, max_size=20))
    def check(parts):
        ids = tok.encode(lead + "".join(parts), add_special_tokens=False)
        source = strict_source(tok, USER, source_tools, kwargs)
        assert teacher_force(source, ids, frozenset(tok.eos_token_ids)) == []

    check()


def test_the_llama_3_1_template_compiles_and_its_builtin_tool_calls_get_no_rows():
    """The 3.1 revision (fetched beside the 3.2 template) renders JSON calls the same way; with
    ``builtin_tools`` it renders ``<|python_tag|>NAME.call(...)<|eom_id|>`` and compiles nothing."""
    tok = tokenizer("llama3.x")
    template = (family_dir("llama3.x") / "Llama-3.1-8B-Instruct.chat_template.jinja").read_text()
    kwargs = {**DATE, "chat_template": template}
    reply = {"role": "assistant", "content": "",
             "tool_calls": [call("run_shell_command", {"command": "ls"})]}
    ids = reply_ids(tok, USER, tools("long"), reply, kwargs)
    source = strict_source(tok, USER, tools("long"), kwargs)
    fires = teacher_force(source, ids, frozenset(tok.eos_token_ids))
    assert fires and contained(ids, fires)
    builtin = {**kwargs, "builtin_tools": ["brave_search"]}
    reply = {"role": "assistant", "content": "",
             "tool_calls": [call("brave_search", {"query": "weather"})]}
    ids = reply_ids(tok, USER, tools("long"), reply, builtin)
    assert tok.decode(ids).startswith("<|python_tag|>brave_search.call(")
    # with builtin tools every call ends with <|eom_id|>, not the protocol's <|eot_id|>: the
    # probes find no end marker and nothing compiles (strict is absent for such a request)
    assert strict_source(tok, USER, tools("long"), builtin) is None


def test_mistral_compiles_lazily_on_its_control_token_and_fills_as_the_eager_source():
    tok = tokenizer("mistral-nemo")
    reply = {"role": "assistant", "content": "",
             "tool_calls": [{**call("run_shell_command", {"command": "ls"}), "id": "abcDEF123"}]}
    ids = reply_ids(tok, USER, tools("long"), reply)
    lazy = lazy_strict_source(tok, USER, tools("long"))
    assert isinstance(lazy, LazyStrictSource)
    eos = frozenset(tok.eos_token_ids)
    fires = teacher_force(lazy, ids, eos)
    assert fires == teacher_force(strict_source(tok, USER, tools("long")), ids, eos)
    assert fires and contained(ids, fires)
