"""Parser-state guards: the lark call grammars and the incremental turn role tracker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fill.strict.guards import SYNTAXES, Markers, Role, TurnGuard, detect_syntax
from mlx_fill.strict.source import strict_source
from strict_helpers import FAMILIES, call, contained, reply_ids, teacher_force, tokenizer, tools

XML = SYNTAXES["xml"]
JSON = SYNTAXES["hermes-json"]
GLM = SYNTAXES["glm"]
MARKERS = Markers("<tool_call>", "</tool_call>", "<think>", "</think>")


# --- grammars -------------------------------------------------------------------------------

def test_xml_prefix_parses_only_after_a_complete_parameter_delimiter():
    head = "\n<function=bash>\n<parameter=command>\n"
    assert XML.parse(head + "ls\n</parameter>\n").keys == ("command",)
    assert XML.parse(head + "ls\n</parameter>").value_end == len(head) + 2
    assert XML.parse(head + "ls\n</parameter") is None
    assert XML.parse(head + "ls\n</") is None
    assert XML.parse(head + 'printf "</parameter') is None
    assert XML.parse(head + 'printf "</parameterization>"') is None
    # the value keeps </parameterization> and ends only at the real delimiter
    done = XML.parse(head + 'printf "%s" "</parameterization>"\n</parameter>\n')
    value = 'printf "%s" "</parameterization>"'
    assert done is not None and done.value_end == len(head) + len(value)
    assert XML.parse(head + "x\n</parameter>\n</function>\n").closed


def test_json_prefix_value_end_and_escapes():
    head = '\n{"name": "bash", "arguments": {"command": '
    value = r'"echo \"a\\b\" done"'
    got = JSON.parse(head + value)
    assert got is not None and got.keys == ("command",)
    assert got.value_end == len(head) + len(value) - 1      # before the closing quote
    assert JSON.parse(head + value[:-1]) is None              # string still open
    assert JSON.parse(head + r'"a\"') is None                 # escaped quote does not close it
    assert JSON.parse(head + value + "}}\n").closed
    nested = JSON.parse(head + '{"a": [1, 2]}')
    assert nested is not None and nested.value_end == len(head) + len('{"a": [1, 2]}')


@pytest.mark.parametrize("syntax, head", [
    ("hermes-json", '\n{"name": "edit", "arguments": {"path": '),
    ("llama-json", 'edit", "parameters": {"path": '),
    ("mistral", '[{"name": "edit", "arguments": {"path": '),
    ("harmony", '.edit <|constrain|>json<|message|>{"path": '),
])
def test_json_prefix_after_a_separator_expects_the_next_key(syntax, head):
    parse = SYNTAXES[syntax].parse
    got = parse(head + '"a.py",')
    assert got is not None and got.keys == ("path",) and not got.closed
    assert got.value_end == len(head) + len('"a.py')              # the separator is after it
    assert parse(head + '"a.py", "old') is None                     # a key being written
    assert parse(head + '"a.py",,') is None
    assert parse(head + '"a.py", }') is None                        # no trailing comma


def test_glm_prefix_needs_the_complete_arg_value_close():
    head = "bash\n<arg_key>command</arg_key>\n<arg_value>"
    assert GLM.parse(head + "ls</arg_value>\n").keys == ("command",)
    assert GLM.parse(head + "ls</arg_val") is None
    assert GLM.parse(head + "ls</arg_valueization>") is None


def test_generic_syntax_declines_everything():
    assert SYNTAXES["generic"].parse("\n<function=bash>\n") is None


@pytest.mark.parametrize("family,expected", [("qwen3", "hermes-json"), ("qwen3-coder", "xml"),
                                             ("qwen3.5", "xml"), ("glm4.x", "glm")])
def test_detect_syntax_reads_each_family_rendered_call(family, expected):
    tok = tokenizer(family)
    msgs = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "", "tool_calls": [call("bash", {"command": "ls"})]}
    text = tok.decode(reply_ids(tok, msgs, tools("single"), reply))
    body = text.split(tok.tool_call_start, 1)[1].split(tok.tool_call_end, 1)[0]
    assert detect_syntax(body, "bash", ("command",)).name == expected
    assert detect_syntax(body, "other", ("command",)).name == "generic"


# --- turn role tracking ---------------------------------------------------------------------

def _guard(initial=Role.CONTENT) -> TurnGuard:
    return TurnGuard(XML, MARKERS, initial)


def test_call_opens_only_at_line_start_in_content():
    g = _guard()
    g.feed("Sure.\n\n<tool_call>")
    assert g.role is Role.CALL and g.body == ""
    g.feed("\n<function=bash>\n</function>\n</tool_call>")
    assert g.role is Role.CONTENT and g.last_body == "\n<function=bash>\n</function>\n"
    g.feed(' see the "<tool_call>" tag')
    assert g.role is Role.CONTENT


def test_fenced_and_reasoning_markup_never_opens_a_call():
    g = _guard()
    g.feed("Example:\n```xml\n<tool_call>\n")
    assert g.role is Role.CONTENT
    g.feed("```\n<tool_call>")
    assert g.role is Role.CALL
    r = _guard(Role.REASONING)
    r.feed("maybe\n<tool_call>\n<function=bash>")
    assert r.role is Role.REASONING
    r.feed("</think>\n\n<tool_call>")
    assert r.role is Role.CALL


def test_nested_start_marker_and_duplicate_keys_decline_the_call():
    g = _guard()
    g.feed("<tool_call>\n<function=bash>\n<parameter=command>\n<tool_call>")
    assert g.declined
    g.feed("\n</parameter>\n</function>\n</tool_call>\n<tool_call>")
    assert g.role is Role.CALL and not g.declined
    g.feed("\n<function=f>\n<parameter=a>\n1\n</parameter>\n")
    assert g.call_prefix() is not None
    g.feed("<parameter=a>\n2\n</parameter>\n")
    assert g.call_prefix() is None and g.declined


def test_new_call_does_not_reuse_the_previous_parse():
    g = _guard()
    g.feed("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n")
    first = g.call_prefix()
    g.feed("</function>\n</tool_call>\n<tool_call>\n<function=g>\n<parameter=b>\n2\n</parameter>\n")
    second = g.call_prefix()
    assert first.tool == "f" and second.tool == "g"


# --- properties -----------------------------------------------------------------------------

PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "```", "\n", " ", "`", '"',
          "hello", "<function=bash>", "<parameter=command>", "</parameter>", "</function>",
          "ls -la", "{\"name\": \"bash\"", "é", "日本"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.data())
def test_guard_state_does_not_depend_on_how_text_is_chunked(pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    whole, chunked = _guard(), _guard()
    whole.feed(text)
    prev = 0
    for c in [*cuts, len(text)]:
        chunked.feed(text[prev:c])
        prev = c
    assert (whole.role, whole.body, whole.declined, whole.calls_ended, whole.last_body) == (
        chunked.role, chunked.body, chunked.declined, chunked.calls_ended, chunked.last_body)


MIDLINE = st.sampled_from(["hello", "ls", '"', "`", "é", ">", "x y"])
# Prose has no fences and no think tags, so concatenated parts never change each other's
# fence or reasoning state.
PROSE = st.lists(st.sampled_from(["hello ", "world", "\n", '"', "é", "</parameter>\n",
                                  "</tool_call>"]), max_size=8)


def _unstructured_markup(family: str):
    """Call markup that is NOT structural: mid-line, inside a fence, or inside reasoning."""
    tok = tokenizer(family)
    reply = {"role": "assistant", "content": "",
             "tool_calls": [call("get_weather", {"city": "Paris"})]}
    text = tok.decode(reply_ids(tok, [{"role": "user", "content": "hi"}], tools(), reply))
    start = text.index(tok.tool_call_start)
    markup = text[start: text.index(tok.tool_call_end) + len(tok.tool_call_end)]
    return st.one_of(
        st.builds(lambda p, w: "".join(p) + "\n" + w + markup, PROSE, MIDLINE),
        st.builds(lambda p: "".join(p) + "\n```\n" + markup + "\n```\n", PROSE),
        st.builds(lambda p: "<think>" + "".join(p) + "\n" + markup + "\n</think>", PROSE),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_no_fire_outside_structural_states(family):
    tok = tokenizer(family)
    msgs = [{"role": "user", "content": "hi"}]
    eos = frozenset(tok.eos_token_ids)

    @settings(max_examples=25, deadline=None)
    @given(st.lists(_unstructured_markup(family), min_size=1, max_size=3))
    def check(parts):
        content = "".join(parts)
        source = strict_source(tok, msgs, tools())
        lead = tok.decode(reply_ids(tok, msgs, tools(), {"role": "assistant", "content": "x"}))
        lead = lead[: lead.index("x")]                   # the template's primer (e.g. </think>)
        ids = tok.encode(lead + content, add_special_tokens=False)
        assert teacher_force(source, ids, eos) == []

    check()


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5", "glm4.x"])
def test_real_calls_after_random_prose_fill_contained(family):
    """The positive side of the property: prose (with quoted/fenced/reasoning markup) followed
    by a real rendered call fills, and every span is the stream's own next ids."""
    tok = tokenizer(family)
    msgs = [{"role": "user", "content": "hi"}]
    eos = frozenset(tok.eos_token_ids)

    @settings(max_examples=15, deadline=None)
    @given(st.lists(_unstructured_markup(family), max_size=2), PROSE,
           st.sampled_from(["get_weather", "get_time", "bash"]), st.text(min_size=1, max_size=12))
    def check(parts, prose, name, value):
        key = {"get_weather": "city", "get_time": "tz", "bash": "command"}[name]
        reply = {"role": "assistant", "content": "".join(parts) + "".join(prose) + "ok",
                 "tool_calls": [call(name, {key: value})]}
        ids = reply_ids(tok, msgs, tools(), reply)
        fires = teacher_force(strict_source(tok, msgs, tools()), ids, eos)
        assert contained(ids, fires)
        assert any(o == f"strict:name:{name}" for _, _, o in fires)

    check()
