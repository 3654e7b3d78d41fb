"""The strict-row compiler on the real tokenizers and vendor templates of every family."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_wrapper

from mlx_fill.assets.store import family_dir, search_roots
from mlx_fill.strict.rows import compile_all_keys, compile_table, identity_key, table_for
from mlx_fill.strict.schema import tool_schemas
from mlx_fill.strict.source import compile_strict, strict_source
from strict_helpers import FAMILIES, call, contained, reply_ids, teacher_force, tokenizer, tools

USER = [{"role": "user", "content": "hi"}]
# Values the compiler never probes with: spans must still be slices of these renderings.
UNSEEN = ["Zürich", "sk-123", "  spaced", "~/x", "#tag", "(paren", "3.14", "\ttab", "a\"b",
          "line\nbreak", "ends with space "]


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    return any(tuple(seq[i: i + n]) == sub for i in range(len(seq) - n + 1))


def _call_reply(name: str, args: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [call(name, args)]}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_is_a_slice_of_real_renderings_with_unseen_values(family):
    tok = tokenizer(family)
    table = compile_table(tok, USER, tools())
    assert table is not None and table.head and table.close
    specs = {s.name: s for s in tool_schemas(tools())}
    for name, spec in specs.items():
        for value in UNSEEN:
            args = {k: value for k in (spec.properties or [])}
            ids = reply_ids(tok, USER, tools(), _call_reply(name, args))
            for row in table.head.values():
                if row.kind == "scaffold" or row.detail == name:
                    assert _contains(ids, row.trigger + row.span), (family, name, value, row)
            fires = teacher_force(strict_source(tok, USER, tools()), ids,
                                  frozenset(tok.eos_token_ids))
            # a close while an optional key may follow is a guess; these calls write them all
            certain = [f for f in fires if f[2] != f"strict:close:{name}"]
            assert certain and contained(ids, certain), (family, name, value, fires)
            if family != "qwen3" and not spec.open and spec.properties:
                assert any(o == "strict:close" for _, _, o in fires), (family, name, value)


@pytest.mark.parametrize("family", FAMILIES)
def test_key_rows_propose_the_next_required_key_with_unseen_values(family):
    tok = tokenizer(family)
    tool_list = tools("keys")
    table = compile_all_keys(compile_table(tok, USER, tool_list), tok, USER, tool_list)
    assert {name for _, _, name in table.keys} == {"old_text", "new_text", "origin", "seats"}
    assert all(row.certainty == "likely" for row in table.keys.values())
    assert all(row.yields for row in [*table.keys.values(), *table.optional_close.values()])
    assert not any(row.yields for row in [*table.close.values(), *(
        r for r in table.head.values() if r.kind != "key")])
    for value in UNSEEN:
        calls = [("edit_file", {"path": value, "old_text": value, "new_text": value}),
                 ("book_flight", {"user_id": value, "origin": value, "seats": 3})]
        for name, args in calls:
            ids = reply_ids(tok, USER, tool_list, _call_reply(name, args))
            fires = teacher_force(strict_source(tok, USER, tool_list), ids,
                                  frozenset(tok.eos_token_ids))
            assert contained(ids, fires), (family, name, value, fires)
            keys = {o.rsplit(".", 1)[1] for _, _, o in fires if o.startswith("strict:key:")}
            assert set(args) - {"path"} <= keys, (family, name, value, fires)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_of_its_required_keys_alone_gets_its_own_close(family):
    tok = tokenizer(family)
    # values ending in "." end on a token boundary before Hermes JSON's closing quote
    for tool_set, name, args in (("default", "read_file", {"path": "notes."}),
                                 ("default", "search_web", {"query": "mlx."}),
                                 ("open", "get_weather", {"city": "Paris."})):
        tool_list = tools(tool_set)
        ids = reply_ids(tok, USER, tool_list, _call_reply(name, args))
        fires = teacher_force(strict_source(tok, USER, tool_list), ids,
                              frozenset(tok.eos_token_ids))
        assert contained(ids, fires), (family, name, fires)
        assert f"strict:close:{name}" in {o for _, _, o in fires}, (family, name, fires)


@pytest.mark.parametrize("family", ["glm4.x", "qwen3"])
def test_a_tools_key_rows_are_compiled_on_its_first_call_whatever_the_tool_count(family):
    """A table holds no key rows until a call names its tool; then that tool's (and only its)
    are compiled and fire in the same call, however many tools the request lists."""
    tok = tokenizer(family)
    many = [{"type": "function", "function": {"name": f"op{i}", "parameters": {
        "type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "required": ["a", "b", "c"]}}}
            for i in range(48)]   # two pairs per tool
    source = strict_source(tok, USER, many)
    assert not source.table.keys and not source.table.keyed
    ids = reply_ids(tok, USER, many, _call_reply("op47", {"a": "x.", "b": "y.", "c": "z."}))
    fires = teacher_force(source, ids, frozenset(tok.eos_token_ids))
    assert contained(ids, fires), fires
    assert {"strict:key:op47.b", "strict:key:op47.c"} <= {o for _, _, o in fires}, fires
    assert source.table.keyed == {"op47"}
    assert {name for _, name, _ in source.table.keys} == {"op47"}



def test_key_rows_another_request_compiled_fire_in_a_request_built_before(monkeypatch):
    """Requests share a table: key rows one request compiles mid-decode fire in another that
    was built before they existed (its after-value texts are read again)."""
    from mlx_fill.strict import rows
    monkeypatch.setattr(rows, "_TABLES", {})  # a table no earlier test compiled keys into
    tok, tool_list = tokenizer("qwen3"), tools("keys")
    conversation = [*USER, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go."}]
    first, second = strict_source(tok, USER, tool_list), strict_source(tok, conversation, tool_list)
    assert first.table is second.table and not first.table.keys
    args = {"path": "a.py", "old_text": "x = 1", "new_text": "x = 2"}
    teacher_force(first, reply_ids(tok, USER, tool_list, _call_reply("edit_file", args)),
                  frozenset(tok.eos_token_ids))
    assert first.table.keyed == {"edit_file"}
    second.compile_keys = None  # it can only fire what the first request compiled
    ids = reply_ids(tok, conversation, tool_list, _call_reply("edit_file", args))
    fires = teacher_force(second, ids, frozenset(tok.eos_token_ids))
    assert contained(ids, fires), fires
    assert {"strict:key:edit_file.old_text", "strict:key:edit_file.new_text"} <= {
        o for _, _, o in fires}, fires


def test_next_required_follows_the_schema_order():
    schema = {s.name: s for s in tool_schemas(tools("keys"))}["book_flight"]
    assert schema.next_required(()) == "user_id"
    assert schema.next_required(("user_id",)) == "origin"          # the optional note skipped
    assert schema.next_required(("user_id", "note")) == "origin"
    assert schema.next_required(("user_id", "origin")) == "seats"
    assert schema.next_required(("origin", "user_id")) == "seats"  # after the schema's latest
    assert schema.next_required(("seats",)) is None                # nothing follows it
    assert schema.next_required(("user_id", "origin", "seats")) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_spans_are_at_least_two_ids_and_never_hold_eos(family):
    tok = tokenizer(family)
    for name in ("default", "single", "prefix", "open", "ref", "noargs", "keys"):
        table = compile_table(tok, USER, tools(name))
        assert table is not None
        for row in table.rows():
            assert len(row.span) >= 2
            assert not set(row.span) & set(tok.eos_token_ids)
            assert any(c.isalpha() for c in tok.decode(list(row.trigger))) or row.kind in ("close", "key")


def test_probe_names_do_not_invent_the_eq_get_boundary():
    """Qwen3.5 writes <function=get_weather> as '=get' '_weather': no row may cut after '='."""
    tok = tokenizer("qwen3.5")
    table = compile_table(tok, USER, tools())
    eq = tok.encode("=", add_special_tokens=False)
    eq_get = tok.encode("\n<function=get_weather>", add_special_tokens=False)
    assert tok.decode([eq_get[3]]) == "=get"                  # the premise: one token
    for row in table.head.values():
        assert tuple(row.span[-1:]) != tuple(eq), row
        assert tok.decode(list(row.span)).rstrip().endswith("=") is False, row
    scaffold = table.head[""]
    assert tok.decode(list(scaffold.span)) == "\n<function"
    weather = table.head["\n<function=get_weather"]
    assert weather.trigger[-2:] == tuple(eq_get[3:5])       # '=get' '_weather' as the model writes


def test_thinking_newline_merge_still_compiles_rows():
    """Qwen3.5's primer ends '<think>\\n' and the reply opens '\\n</think>': the ids of the
    full rendering are not an extension of the primer ids, yet rows compile (text boundary)."""
    tok = tokenizer("qwen3.5")
    msgs = USER
    primer = tok.apply_chat_template(msgs, tools=tools(), tokenize=False,
                                     add_generation_prompt=True)
    full = tok.apply_chat_template([*msgs, _call_reply("bash", {"command": "ls"})], tools=tools(),
                                   tokenize=False, add_generation_prompt=False)
    p_ids = tok.encode(primer, add_special_tokens=False)
    f_ids = tok.encode(full, add_special_tokens=False)
    assert primer.endswith("<think>\n") and f_ids[: len(p_ids)] != p_ids   # the premise
    table = compile_table(tok, msgs, tools())
    assert table is not None and table.head[""].span


@pytest.mark.parametrize("family", FAMILIES)
def test_system_prompt_example_calls_do_not_change_rows(family):
    tok = tokenizer(family)
    system = {"role": "system", "content": "Example:\n<tool_call>\n<function=example_function_name>"
              "\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n"}
    plain = compile_table(tok, USER, tools())
    with_example = compile_table(tok, [system, *USER], tools())
    assert with_example.rows() == plain.rows()
    assert all("example" not in tok.decode(list(r.span)) for r in with_example.rows())


@pytest.mark.parametrize("family", FAMILIES)
def test_open_objects_get_no_sole_key_and_no_close(family):
    tok = tokenizer(family)
    open_tools = tools("open")
    table = compile_table(tok, USER, open_tools)
    assert table is not None
    for name, key in (("get_weather", "city"), ("lookup", "id")):
        assert not table.tools[name].closable((key,))
        rows = [r for r in table.head.values() if r.detail == name]
        assert rows and all(key not in tok.decode(list(r.span)) for r in rows)
    closed = compile_table(tok, USER, tools())
    weather = [r for r in closed.head.values() if r.detail == "get_weather"]
    assert any("city" in tok.decode(list(r.span)) for r in weather)


def test_ref_parameters_resolve_to_a_certain_sole_key():
    tok = tokenizer("qwen3-coder")
    table = compile_table(tok, USER, tools("ref"))
    assert table.tools["create_event"].sole_key == "title"
    rows = [r for r in table.head.values() if r.detail == "create_event"]
    assert rows and "title" in tok.decode(list(rows[0].span))


@pytest.mark.parametrize("bad,path", [
    ([{"type": "function", "function": {"name": "a"}}, "nope"], "tools[1]"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a"}},
      {"type": "function", "function": {"name": "b"}},
      {"type": "function", "function": {"name": "c", "parameters": {
          "type": "object", "properties": {"x": {"type": 5}}}}}],
     "tools[2].function.parameters.properties.x"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"$ref": "#/$defs/missing"}}}],
     "tools[0].function.parameters.$ref"),
    ([{"type": "function", "function": {"name": "a"}},
      {"type": "function", "function": {"name": "a"}}],
     "tools[1].function.name"),
])
def test_malformed_tools_raise_with_the_offending_path(bad, path):
    with pytest.raises(ValueError) as err:
        compile_table(tokenizer("qwen3"), USER, bad)
    assert str(err.value).startswith(path), str(err.value)


@pytest.mark.parametrize("ref,why", [("#/$defs/missing", "nothing is at that pointer"),
                                     ("#nope", "no such anchor"),
                                     ("https://example.com/s.json", "only references into the schema")])
def test_an_unresolvable_ref_is_one_short_line_whatever_the_schema_size(ref, why):
    """The error names the reference and why it does not resolve, not the schema it was looked
    up in (a large schema made it kilobytes long)."""
    props = {f"k{i}": {"type": "string", "description": "d" * 200} for i in range(50)}
    props["r"] = {"$ref": ref}
    with pytest.raises(ValueError) as err:
        tool_schemas([{"type": "function", "function": {"name": "t", "parameters": {
            "type": "object", "properties": props}}}])
    text = str(err.value)
    assert text.startswith("tools[0].function.parameters.properties.r.$ref: cannot resolve")
    assert why in text and "\n" not in text and len(text) < 200, text


def test_schema_check_is_memoized_yet_every_request_gets_its_error():
    """The meta-schema check is cached on the schema's JSON; a bad schema still fails on every
    request (with the path of the tool it sits in now), a good one is not re-checked."""
    from mlx_fill.strict.schema import _memo

    bad = {"type": "object", "properties": {"x": {"type": 5}}}
    good = {"type": "object", "properties": {"x": {"type": "string"}}}
    for index in (0, 1, 0):
        tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": good}} for i in range(index)]
        tools.append({"type": "function", "function": {"name": "bad", "parameters": bad}})
        with pytest.raises(ValueError) as err:
            tool_schemas(tools)
        assert str(err.value).startswith(f"tools[{index}].function.parameters.properties.x"), str(err.value)
    hits = _memo.hits
    tool_schemas([{"type": "function", "function": {"name": "g", "parameters": dict(good)}}])
    assert _memo.hits == hits + 1
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters"):
        tool_schemas([{"type": "function", "function": {"name": "n", "parameters": {"type": float("nan")}}}])


def _template_roots() -> list[Path]:
    """The asset roots plus the developers' asset folder where one is at hand: families and
    template revisions the pinned fetcher does not reproduce (the vendors' older revisions) live
    only there. ``.ci/run`` names it in ``MLX_FILL_DEV_ASSETS``; a checkout may have it beside it."""
    dev = os.environ.get("MLX_FILL_DEV_ASSETS")
    extra = Path(dev) if dev else Path(__file__).resolve().parents[2].parent / "shared" / "assets"
    return search_roots() + ([extra] if extra.is_dir() else [])


def test_templates_that_cannot_render_tool_calls_yield_no_rows():
    """A template without a call protocol (no mlx-lm tool parser, no harmony / Llama 3.x /
    Mistral call markup) compiles nothing; the Llama 3.2 template itself compiles
    (``test_call_protocols``)."""
    plain = load_wrapper(family_dir("llama3.x"))  # a fresh wrapper: its template is replaced
    plain._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert compile_table(plain, USER, tools()) is None
    assert compile_table(tokenizer("qwen3"), USER, None) is None
    ends_with_assistant = [*USER, {"role": "assistant", "content": "partial"}]
    assert compile_table(tokenizer("qwen3"), ends_with_assistant, tools()) is None


def test_plan_cache_is_keyed_on_exact_identity_and_reused_across_conversations():
    tok = tokenizer("qwen3-coder")
    first = table_for(tok, USER, tools())
    multi = [*USER, _call_reply("get_time", {"tz": "UTC"}), {"role": "tool", "content": "12:00"},
             {"role": "user", "content": "and now?"}]
    assert table_for(tok, multi, tools()) is first
    assert identity_key(tok, tools(), None) != identity_key(tok, tools("single"), None)
    no_think = {"enable_thinking": False}
    assert identity_key(tok, tools(), None) != identity_key(tok, tools(), no_think)
    assert table_for(tok, USER, tools("single")) is not first


def _count_renders(tok, monkeypatch) -> list[bool]:
    """The renders ``tok`` makes from now on, each as its ``add_generation_prompt``."""
    renders = []
    render = tok.apply_chat_template

    def counted(*args, **kwargs):
        renders.append(kwargs["add_generation_prompt"])
        return render(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    return renders


def test_a_cached_table_costs_a_request_three_renders(monkeypatch):
    """A request whose tool set's table is cached renders its conversation with the generation
    prompt once (the probe's reply extends it and it says the role the reply opens in), the
    probe's reply once and the conversation without the generation prompt once."""
    tok = tokenizer("qwen3")
    multi = [*USER, _call_reply("get_time", {"tz": "UTC"}), {"role": "tool", "content": "12:00"},
             {"role": "user", "content": "and now?"}]
    cached = compile_strict(tok, USER, tools())
    assert cached is not None
    renders = _count_renders(tok, monkeypatch)
    compiled = compile_strict(tok, multi, tools())
    assert compiled is not None and compiled.table is cached.table
    assert sorted(renders) == [False, False, True]


@pytest.mark.parametrize("family", ["gpt-oss", "llama3.x"])
def test_one_call_per_turn_templates_probe_in_batches_of_turns_to_the_same_rows(family,
                                                                                monkeypatch):
    """A template that renders one call per turn gets its probes from one render of many
    turns, and every row (head, close, keys) equals what rendering each probe alone gives."""
    from mlx_fill.strict.rows import TemplateError, _Prober

    tok = tokenizer(family)
    renders = _count_renders(tok, monkeypatch)
    batched = compile_all_keys(compile_table(tok, USER, tools("keys")), tok, USER, tools("keys"))
    batched_renders = len(renders)

    def refuse(self, calls, markers):
        raise TemplateError("probed one call at a time")

    monkeypatch.setattr(_Prober, "turns", refuse)
    renders.clear()
    alone = compile_all_keys(compile_table(tok, USER, tools("keys")), tok, USER, tools("keys"))
    assert batched is not None and repr(batched) == repr(alone)
    assert batched_renders * 3 < len(renders), (batched_renders, len(renders))


def _extra_templates() -> list[tuple[str, Path]]:
    out = []
    for root in _template_roots():
        for family, pattern in (("qwen3", "qwen3/extra_templates/*.jinja"),
                                ("qwen3.5", "qwen3.5/extra_templates/*.jinja"),
                                ("glm4.x", "glm4.x/*.jinja")):
            out += [(family, p) for p in sorted(root.glob(pattern))]
        if out:
            return out
    return out


@pytest.mark.parametrize("family,template", _extra_templates(), ids=lambda v: getattr(v, "name", v))
def test_other_template_revisions_compile_through_the_same_diff(family, template):
    """No template-specific code: every shipped revision compiles rows and fills contained."""
    tok = tokenizer(family)
    kwargs = {"chat_template": template.read_text()}
    source = strict_source(tok, USER, tools(), kwargs)
    assert source is not None
    reply = {"role": "assistant", "content": "ok", "reasoning_content": "Let me see.",
             "tool_calls": [call("get_weather", {"city": "Paris"}),
                            call("bash", {"command": "ls"})]}
    ids = reply_ids(tok, USER, tools(), reply, kwargs)
    fires = teacher_force(source, ids, frozenset(tok.eos_token_ids))
    assert len(fires) >= 2 and contained(ids, fires)


@pytest.mark.parametrize("params,where", [
    ({"type": "object", "properties": {1: {"type": "string"}}}, "properties"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {None: {}}}}},
     "properties.a.properties"),
])
def test_a_key_that_is_no_string_is_one_line_naming_its_path(params, where):
    """A schema built in Python can hold a key JSON cannot (an int): the error names where it
    is, before any template renders the tools with it, also after the same schema with string
    keys was checked (their JSON is the same)."""
    as_json = json.loads(json.dumps(params))
    tool_schemas([{"type": "function", "function": {"name": "t", "parameters": as_json}}])
    with pytest.raises(ValueError) as err:
        tool_schemas([{"type": "function", "function": {"name": "t", "parameters": params}}])
    assert str(err.value).startswith(f"tools[0].function.parameters.{where}: "), str(err.value)
    assert "string" in str(err.value) and "\n" not in str(err.value)
