"""Certainty classes of strict rows: every row has one, and only ``determined`` rows can ever be
asserted, whatever ``MLX_FILL_PROMOTE`` says and however much evidence a ``likely`` row has."""

from __future__ import annotations

import io
import json
import logging

import pytest

from mlx_fill.strict.guards import SYNTAXES, Markers, Role, TurnGuard
from mlx_fill.core.proposal import DecodeView, FillSession
from mlx_fill.strict.rows import CERTAINTIES, Row, compile_all_keys, compile_table, resumed_heads
from mlx_fill.strict.tokenbytes import token_bytes
from mlx_fill.assets.store import FAMILIES as ALL_FAMILIES
from mlx_fill.session import server_ledger
from mlx_fill.strict.source import strict_source
from strict_helpers import (FAMILIES, call, contained, reply_ids, teacher_force, tokenizer,
                            tools, wrong_asserts)

USER = [{"role": "user", "content": "hi"}]
DATE = {"date_string": "26 Jul 2024"}  # the Llama 3.x template's
TOOL_SETS = ("default", "single", "prefix", "open", "ref", "noargs")


def _reply(*calls) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_compiled_row_has_a_class(family):
    tok = tokenizer(family)
    for name in TOOL_SETS:
        table = compile_table(tok, USER, tools(name))
        assert table is not None
        compile_all_keys(table, tok, USER, tools(name))
        rows = [*table.head.values(), *table.later_head.values(), *table.close.values(),
                *table.keys.values()]
        assert rows and all(r.certainty in CERTAINTIES for r in rows), (family, name)
        assert set(table.later_head) == set(table.head)


@pytest.mark.parametrize("family", ["qwen3-coder", "qwen3.5", "glm4.x"])
def test_raw_text_syntaxes_determine_only_the_first_calls_head(family):
    table = compile_table(tokenizer(family), USER, tools())
    determined = [r for r in table.rows() if r.certainty == "determined"]
    assert all(r in table.head.values() and r.kind != "key" for r in determined)
    assert all(r.certainty == "likely" for r in table.later_head.values())
    assert table.close and all(r.certainty == "likely" for r in table.close.values())


def test_hermes_json_determines_the_scaffold_only():
    table = compile_table(tokenizer("qwen3"), USER, tools())
    assert table.head[""].certainty == "determined"
    assert table.later_head[""].certainty == "determined"   # a JSON value cannot end a call
    names = [r for r in table.head.values() if r.kind == "name"]
    assert names and all(r.certainty == "likely" for r in names)   # they reach into arguments
    assert all(r.certainty == "likely" for r in table.close.values())
    single = compile_table(tokenizer("qwen3"), USER, tools("single"))
    assert single.head[""].certainty == "likely"   # through the sole key: arguments spacing


def test_a_row_without_a_valid_class_cannot_be_built():
    with pytest.raises(TypeError):
        Row("scaffold", "", "", (1,), (2, 3))  # type: ignore[call-arg]
    for bad in (None, "", "assert", "maybe"):
        with pytest.raises(ValueError, match="certainty"):
            Row("scaffold", "", "", (1,), (2, 3), bad)  # type: ignore[arg-type]


def _policies(tok, tool_list, ids, ledger, trace=None):
    session = FillSession([strict_source(tok, USER, tool_list, ledger=ledger)], trace=trace)
    out, pos = [], 0
    while pos < len(ids):
        p = session.propose(DecodeView([], ids[:pos], frozenset(tok.eos_token_ids)))
        if p is None:
            pos += 1
            continue
        ok = tuple(ids[pos:pos + len(p.ids)]) == p.ids
        session.feedback(p, len(p.ids) if ok else 0, pos)
        out.append((p.origin, p.certainty, p.policy))
        pos += len(p.ids) if ok else 1
    return out, session


@pytest.mark.parametrize("family", ["qwen3.5", "glm4.x"])
def test_likely_rows_stay_verify_after_1000_agreements(family, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    monkeypatch.setenv("MLX_FILL_PROMOTE", "strict:")
    tok, tool_list = tokenizer(family), tools()
    ledger = server_ledger("m", tok)
    ids = reply_ids(tok, USER, tool_list, _reply(call("bash", {"command": "ls"}),
                                                 call("get_time", {"tz": "UTC"})))
    caplog.set_level(logging.INFO, logger="mlx_fill.sources.ledger")
    first, _ = _policies(tok, tool_list, ids, ledger)
    assert first and all(pol == "verify" for _, _, pol in first)
    assert {claim.split("@")[0] for claim in ledger.claims} == {o for o, _, _ in first}
    for claim in list(ledger.claims):  # every row's claim, as its verified rounds counted it
        for _ in range(1000):
            ledger.record(claim, True)
    later, _ = _policies(tok, tool_list, ids, ledger)
    _policies(tok, tool_list, ids, ledger)
    likely = [(o, pol) for o, c, pol in later if c == "likely"]
    determined = [(o, pol) for o, c, pol in later if c == "determined"]
    assert any(o == "strict:close" for o, _ in likely)
    assert likely and all(pol == "verify" for _, pol in likely)          # never promoted
    assert all(pol == "assert" for _, pol in determined)  # still promotes
    assert bool(determined) == (family != "glm4.x")  # GLM's head rows all write a key
    refusals = [r for r in caplog.records if "stays verify" in r.getMessage()]
    refused_rows = [r.args[0] for r in refusals]
    assert refused_rows and len(refused_rows) == len(set(refused_rows))  # once per row
    assert "strict:close" in refused_rows


def _tool_set(*names: str) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}},
        "required": ["command"]}}} for name in names]


@pytest.mark.parametrize("family", ["qwen3", "qwen3-coder", "qwen3.5"])  # GLM's scaffold holds no name
def test_a_rows_evidence_promotes_only_the_ids_it_was_verified_on(family, tmp_path):
    """Agreements for the scaffold row under one tool set do not promote the scaffold row of
    another, which also writes the prefix its tools' names share: the model may call a tool it
    was not given, and there that row is verified and refused, not asserted."""
    from mlx_fill.sources.ledger import Ledger

    tok = tokenizer(family)
    ledger = Ledger("m", "t", promote_after=2, eligible=frozenset({"strict:"}),
                    path=tmp_path / "ledger.json")
    bash = _reply(call("bash", {"command": "ls"}))
    many, few = _tool_set("bash", "read", "read_file", "edit"), _tool_set("read", "read_file")
    for _ in range(2):
        _policies(tok, many, reply_ids(tok, USER, many, bash), ledger)
    promoted, _ = _policies(tok, many, reply_ids(tok, USER, many, bash), ledger)
    assert ("strict:scaffold", "determined", "assert") in promoted  # its own evidence promotes it
    ids = reply_ids(tok, USER, few, bash)
    for _ in range(2):
        under_few, session = _policies(tok, few, ids, ledger)
        scaffold = [pol for o, _, pol in under_few if o == "strict:scaffold"]
        assert scaffold and set(scaffold) == {"verify"}
        assert session.stats.verify_rejected > 0  # it wrote `read`, the model `bash`


@pytest.mark.parametrize("family", FAMILIES)
def test_key_rows_stay_verify_after_1000_agreements(family, monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    monkeypatch.setenv("MLX_FILL_PROMOTE", "strict:")
    tok, tool_list = tokenizer(family), tools("keys")
    ledger = server_ledger("m", tok)
    edit = call("edit_file", {"path": "a.py", "old_text": "x = 1", "new_text": "x = 2"})
    ids = reply_ids(tok, USER, tool_list, _reply(edit))
    first, _ = _policies(tok, tool_list, ids, ledger)
    keys = {o for o, _, _ in first if o.startswith("strict:key:")}
    assert {"strict:key:edit_file.old_text", "strict:key:edit_file.new_text"} <= keys
    for origin in keys:
        for _ in range(1000):
            ledger.record(origin, True)
    later, _ = _policies(tok, tool_list, ids, ledger)
    assert [(o, c, p) for o, c, p in later if o in keys] == [
        (o, "likely", "verify") for o, _, _ in first if o in keys]


def test_only_a_whole_row_verified_is_an_agreement_and_any_refusal_a_disagreement(tmp_path):
    """Proposals cut to one id (``max_span``) agree on a prefix of the scaffold row: that says
    nothing of the ids an assert of the row would write after it, so no prefix is an agreement.
    The rows entered mid-span make the row's own claim: the last id, verified whole as the rest
    of the row, completes the row the model wrote, one agreement. A refused id of it is a
    disagreement of that one claim: no part of the row is promoted after it, whatever agrees
    later."""
    from mlx_fill.sources.ledger import Ledger

    tok, tool_list = tokenizer("qwen3.5"), tools()
    ledger = Ledger("m", "t", promote_after=2, eligible=frozenset({"strict:"}),
                    path=tmp_path / "ledger.json")
    ids = reply_ids(tok, USER, tool_list, _reply(call("bash", {"command": "ls"})))

    def force(accept) -> tuple[str, list[Row]]:
        src = strict_source(tok, USER, tool_list, ledger=ledger)
        session = FillSession([src], max_span=1)
        for pos in range(len(ids)):
            p = session.propose(DecodeView([], ids[:pos]))
            if p is not None:
                session.feedback(p, accept(p, pos), pos)
        (row,) = [r for r in src.table.head.values() if r.kind == "scaffold"]
        rests = resumed_heads(src.table.head_rows(0), token_bytes(tok)).values()
        return row.claim, [r for r in rests if r.resumes == row.claim]

    def follow(p, pos) -> int:
        return int(tuple(ids[pos:pos + 1]) == p.ids)

    scaffold, rests = force(follow)
    assert rests and {r.claim for r in rests} == {scaffold}
    assert (ledger.claims[scaffold].agreements, ledger.claims[scaffold].disagreements) == (1, 0)
    force(lambda p, pos: 0)
    assert ledger.claims[scaffold].disagreements >= 1
    force(follow)
    assert ledger.claims[scaffold].agreements == 2
    assert not any(ledger.promoted(r.origin, certainty=r.certainty, claim=r.claim) for r in rests)


def test_trace_and_usage_name_the_class():
    tok, tool_list = tokenizer("qwen3.5"), tools()
    ids = reply_ids(tok, USER, tool_list, _reply(call("bash", {"command": "ls"})))
    trace = io.StringIO()
    fires, session = _policies(tok, tool_list, ids, None, trace)
    events = [json.loads(line) for line in trace.getvalue().splitlines()]
    assert [e["certainty"] for e in events] == [c for _, c, _ in fires]
    usage = session.stats.as_dict()["by_certainty"]
    assert set(usage) == {"determined", "likely"} and all(n > 0 for n in usage.values())


def test_json_guard_reads_call_markers_only_outside_strings():
    g = TurnGuard(SYNTAXES["hermes-json"], Markers("<tool_call>", "</tool_call>"), Role.CONTENT)
    g.feed('<tool_call>\n{"name": "bash", "arguments": {"command": "echo \'</tool_call>')
    assert g.role is Role.CALL and g.calls_ended == 0
    g.feed('<tool_call> \\"}}</tool_call>\'"}}\n')
    assert g.role is Role.CALL and not g.declined and g.call_prefix() is not None
    g.feed("</tool_call>")
    assert g.role is Role.CONTENT and g.calls_ended == 1
    assert SYNTAXES["hermes-json"].parse(g.last_body).closed
    g.feed('\n<tool_call>\n{"name": "bash", "arguments": {"command": "never closed\n</tool_call>')
    assert g.role is Role.CONTENT and g.calls_ended == 2   # a raw newline ends a bad string


def test_json_close_fires_once_after_a_string_holding_the_end_marker():
    tok, tool_list = tokenizer("qwen3"), tools()
    command = "echo '\"}}\n</tool_call>\n<tool_call>' > ok."  # ok." splits before the quote
    ids = reply_ids(tok, USER, tool_list, _reply(call("bash", {"command": command})))
    source = strict_source(tok, USER, tool_list)
    fires = teacher_force(source, ids, frozenset(tok.eos_token_ids))
    assert contained(ids, fires) and source.stats.parse_fallbacks == 0
    assert [o for _, _, o in fires].count("strict:close") == 1


@pytest.mark.parametrize("family", ["qwen3-coder", "qwen3.5", "glm4.x"])
def test_a_name_whose_text_starts_another_tools_name_is_likely(family):
    """``read_file``'s name row fires once ``read_file`` is written, and ``read_files`` begins
    with that text: a model writing ``read_files`` through the ids of ``read_file`` and ``s``
    calls a tool of the request whose call that row would overwrite. Its row is ``likely``
    (never asserted, however much evidence it has)."""
    from mlx_fill.sources.ledger import Ledger

    tok, tool_list = tokenizer(family), _tool_set("read_file", "read_files")
    table = compile_table(tok, USER, tool_list)
    names = {r.detail: r for r in table.head.values() if r.kind == "name"}
    assert names["read_file"].certainty == "likely"
    ledger = Ledger("m", "t", promote_after=1, eligible=frozenset({"strict:"}))
    canonical = reply_ids(tok, USER, tool_list, _reply(call("read_file", {"command": "ls"})))
    for _ in range(2):
        _policies(tok, tool_list, canonical, ledger)
    name = names["read_file"]
    cut = next(i for i in range(len(canonical)) if tuple(canonical[i - len(name.trigger):i])
               == name.trigger)
    text = tok.decode(canonical[cut:])
    other = [*canonical[:cut], *tok.encode("s" + text, add_special_tokens=False)]
    assert tok.decode(other) == tok.decode(canonical[:cut]) + "s" + text
    fires, _ = _policies(tok, tool_list, other, ledger)
    assert ("strict:name:read_file", "likely", "verify") in fires
    assert all(pol == "verify" for o, _, pol in fires if o == "strict:name:read_file")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tool_set", [("bash",), ("read", "read_file")])
def test_no_determined_row_writes_the_start_of_a_name(family, tool_set):
    """Which tool a call names is the model's to begin, also where the request offers one tool,
    or tools whose names all start alike: a model may call a tool it was not given (a small one
    copies the template's ``example_function_name``). Once every row has agreed under the tool
    set, a call of another tool is not overwritten: a scaffold that writes into the name is
    ``likely``, checked by the model's own samples."""
    from mlx_fill.sources.ledger import Ledger

    tok, tool_list = tokenizer(family), _tool_set(*tool_set)
    ledger = Ledger("m", "t", promote_after=1, eligible=frozenset({"strict:"}))
    given = reply_ids(tok, USER, tool_list, _reply(call(tool_set[-1], {"command": "ls"})))
    for _ in range(2):
        _policies(tok, tool_list, given, ledger)
    other = reply_ids(tok, USER, tool_list, _reply(call("example_function_name",
                                                        {"command": "ls"})))
    session = FillSession([strict_source(tok, USER, tool_list, ledger=ledger)])
    for pos in range(len(other)):
        p = session.propose(DecodeView([], other[:pos], frozenset(tok.eos_token_ids)))
        if p is not None:
            assert p.policy == "verify" or tuple(other[pos:pos + len(p.ids)]) == p.ids, \
                (p.origin, tok.decode(list(p.ids)))
            session.feedback(p, 0, pos)


def test_after_a_raw_newline_ends_a_json_string_no_row_is_asserted():
    """A raw newline cannot be in a JSON string, so the guard takes it as the string's end; a
    model that wrote one may still be inside its string, where ``</tool_call>`` and
    ``<tool_call>`` are its text. Rows the guard finds after it (a later call's scaffold,
    ``determined`` and promoted) are verified by the model's own samples, not written."""
    from mlx_fill.sources.ledger import Ledger

    tok, tool_list = tokenizer("qwen3"), tools()
    ledger = Ledger("m", "t", promote_after=1, eligible=frozenset({"strict:"}))
    two = reply_ids(tok, USER, tool_list, _reply(call("bash", {"command": "ls"}),
                                                 call("get_time", {"tz": "UTC"})))
    for _ in range(2):
        _policies(tok, tool_list, two, ledger)
    promoted, _ = _policies(tok, tool_list, two, ledger)
    assert any(pol == "assert" for _, _, pol in promoted)  # the later call's scaffold too
    text = ('<tool_call>\n{"name": "bash", "arguments": {"command": "cat > f <<EOF\n'
            '</tool_call>\n<tool_call>\nEOF"}}\n</tool_call><|im_end|>')
    ids = tok.encode(text, add_special_tokens=False)
    newline = len(tok.encode(text[:text.index("EOF\n") + 4], add_special_tokens=False))
    session = FillSession([strict_source(tok, USER, tool_list, ledger=ledger)])
    for pos in range(newline, len(ids)):
        p = session.propose(DecodeView([], ids[:pos], frozenset(tok.eos_token_ids)))
        if p is not None:
            assert p.policy == "verify", (p.origin, tok.decode(list(p.ids)))
            session.feedback(p, 0, pos)


@pytest.mark.parametrize("family", ["qwen3-coder", "qwen3.5", "glm4.x"])
def test_no_determined_row_writes_a_key_the_model_may_leave_out(family):
    """Which keys a call writes is the model's: it may call a tool without the key its schema
    requires (the request left it no value) or with a key the schema lacks (``file_path`` for
    ``path``). A head row that writes past where a call of its tool with no arguments parts
    from it (the schema's sole key, or the opening of a first key) is ``likely``: once every
    row has agreed on calls that write the sole key, a call of ``read`` with no arguments or
    with another key is not overwritten."""
    from mlx_fill.sources.ledger import Ledger

    tok, tool_list = tokenizer(family), tools("prefix")
    ledger = Ledger("m", "t", promote_after=1, eligible=frozenset({"strict:"}))
    given = reply_ids(tok, USER, tool_list, _reply(call("read", {"uri": "x"})))
    for _ in range(2):
        _policies(tok, tool_list, given, ledger)
    for args in ({}, {"path": "a.py"}, {"url": "x", "uri": "y"}):
        ids = reply_ids(tok, USER, tool_list, _reply(call("read", args)))
        assert wrong_asserts(tok, USER, tool_list, ids, ledger) == [], args


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("other", ["fetch_url", "fetch", "get_forecast"])
def test_no_determined_row_writes_the_rest_of_a_name(family, other):
    """Which tool a call names is the model's until it ends the name: after the first ids of
    ``fetch_web_page_text`` a model may go on to a tool it was not given (``fetch_url``, a
    fetch tool it knows), or end the name there (``fetch``). A row that writes name text, or
    ends a name the model has not ended, is ``likely``: once every row has agreed on calls of
    the tools offered, a call of ``other`` is not overwritten."""
    from mlx_fill.sources.ledger import Ledger

    tok, kwargs = tokenizer(family), DATE if family == "llama3.x" else {}
    tool_list = [{"type": "function", "function": {
        "name": name, "description": name,
        "parameters": {"type": "object", "properties": {key: {"type": "string"}}}}}
        for name, key in (("fetch_web_page_text", "url"), ("get_weather", "city"))]
    ledger = Ledger("m", "t", promote_after=1, eligible=frozenset({"strict:"}))

    def ids_of(name: str, args: dict) -> list[int]:
        reply = _reply({**call(name, args), "id": "abcDEF123"})
        return reply_ids(tok, USER, tool_list, reply, kwargs)

    for given in (ids_of("fetch_web_page_text", {"url": "x"}), ids_of("get_weather", {})):
        for _ in range(2):
            teacher_force(strict_source(tok, USER, tool_list, kwargs, ledger=ledger), given)
    ids = ids_of(other, {"url": "https://example.com"})
    assert wrong_asserts(tok, USER, tool_list, ids, ledger, kwargs) == []


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_a_scaffold_ends_where_a_call_of_any_tool_parts_from_it(family):
    """In Qwen3-Coder's and Qwen3.5's templates ``ping`` and ``pong`` render as ``<function=``
    then the name, so the scaffold ends on ``=``; a call of a tool the request does not offer
    merges ``=`` into its name (``=get``, ``=search``): the scaffold's last id is not what the
    model writes. A scaffold whose ids a call of a tool it was not given does not begin with
    is ``likely``: once every row has agreed on calls of ``ping`` and ``pong``, such a call is
    not overwritten."""
    from mlx_fill.sources.ledger import Ledger

    tok, kwargs = tokenizer(family), DATE if family == "llama3.x" else {}
    tool_list = [{"type": "function", "function": {"name": name, "description": name,
                                                   "parameters": {"type": "object"}}}
                 for name in ("ping", "pong")]
    ledger = Ledger("m", "t", promote_after=1, eligible=frozenset({"strict:"}))

    def ids_of(name: str) -> list[int]:
        reply = _reply({**call(name, {}), "id": "abcDEF123"})
        return reply_ids(tok, USER, tool_list, reply, kwargs)

    for name in ("ping", "pong"):
        for _ in range(2):
            source = strict_source(tok, USER, tool_list, kwargs, ledger=ledger)
            if source is not None:  # GLM compiles no row for two tools without arguments
                teacher_force(source, ids_of(name))
    for other in ("get", "Pong", "search"):
        assert wrong_asserts(tok, USER, tool_list, ids_of(other), ledger, kwargs) == [], other
