"""StrictSource: the ProposalSource contract, incrementality, and the seed's pitfalls."""

from __future__ import annotations

import pytest

from mlx_fill.core.proposal import DecodeView, ProposalSource
from mlx_fill.strict.source import StrictSource, strict_source
from strict_helpers import FAMILIES, call, contained, reply_ids, teacher_force, tokenizer, tools

USER = [{"role": "user", "content": "hi"}]


def _reply(*calls, content="", reasoning=None) -> dict:
    m = {"role": "assistant", "content": content, "tool_calls": list(calls)}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def _run(family, reply, tool_list=None, messages=USER, kwargs=None):
    tok = tokenizer(family)
    tool_list = tool_list or tools()
    ids = reply_ids(tok, messages, tool_list, reply, kwargs)
    source = strict_source(tok, messages, tool_list, kwargs)
    return tok, ids, source, teacher_force(source, ids, frozenset(tok.eos_token_ids))


def test_strict_source_implements_the_proposal_protocol():
    source = strict_source(tokenizer("qwen3.5"), USER, tools())
    assert isinstance(source, StrictSource) and isinstance(source, ProposalSource)
    assert source.name == "strict"


def test_no_tools_means_no_source_and_bad_tools_raise():
    tok = tokenizer("qwen3")
    assert strict_source(tok, USER, None) is None
    assert strict_source(tok, USER, []) is None
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters"):
        strict_source(tok, USER, [{"type": "function", "function": {"name": "a", "parameters": 3}}])


@pytest.mark.parametrize("family", FAMILIES)
def test_assert_spans_are_contained_and_fire_in_order(family):
    tok, ids, source, fires = _run(family, _reply(call("get_weather", {"city": "Paris"}),
                                                  call("bash", {"command": "ls -la"})))
    assert contained(ids, fires)
    origins = [o for _, _, o in fires]
    assert origins.count("strict:name:get_weather") == 1 and origins.count("strict:name:bash") == 1
    assert all(o.startswith("strict:") for o in origins)
    assert source.stats.fires == len(fires)
    assert source.stats.accepted == sum(len(s) for _, s, _ in fires)
    assert source.stats.parse_fallbacks == 0


@pytest.mark.parametrize("family", ["qwen3-coder", "qwen3.5", "glm4.x"])
def test_parameterization_in_a_value_never_closes_it(family):
    command = 'printf "%s" "</parameterization>"\necho "\n</parameterization>"'
    tok, ids, _, fires = _run(family, _reply(call("bash", {"command": command})))
    assert contained(ids, fires)
    text = tok.decode(ids)
    value_end = text.rindex(command.split("\n")[-1]) + len(command.split("\n")[-1])
    closes = [p for p, _, o in fires if o == "strict:close"]
    assert len(closes) == 1
    assert len(tok.decode(ids[: closes[0]])) > value_end      # only after the real delimiter


def test_thinking_template_fills_after_closed_reasoning_only():
    reply = _reply(call("get_weather", {"city": "Nice"}),
                   reasoning="I could write <tool_call> here\n<tool_call>\n<function=get_weather>")
    tok, ids, _, fires = _run("qwen3.5", reply)
    assert fires and contained(ids, fires)
    think_end = tok.decode(ids).index("</think>")
    assert all(len(tok.decode(ids[:p])) > think_end for p, _, _ in fires)


def test_non_thinking_kwargs_compile_and_fill():
    kwargs = {"enable_thinking": False}
    tok, ids, _, fires = _run("qwen3.5", _reply(call("get_time", {"tz": "UTC"})), kwargs=kwargs)
    assert fires and contained(ids, fires)


def test_multiturn_with_tool_results_fills_each_call():
    history = [*USER, _reply(call("get_weather", {"city": "Paris"})),
               {"role": "tool", "content": '{"temp": 18}'}, {"role": "user", "content": "time?"}]
    for family in FAMILIES:
        tok, ids, _, fires = _run(family, _reply(call("get_time", {"tz": "Asia/Tokyo"})),
                                  messages=history)
        assert fires and contained(ids, fires), family


def test_multibyte_values_split_across_tokens_are_decoded_exactly():
    value = "naïve 日本語 🙂 ok"
    tok, ids, source, fires = _run("qwen3-coder", _reply(call("bash", {"command": value})))
    assert contained(ids, fires)
    assert "strict:close" in [o for _, _, o in fires]
    assert value in source.guard.last_body


def test_emitted_stream_may_not_shrink():
    tok = tokenizer("qwen3")
    source = strict_source(tok, USER, tools())
    ids = tok.encode("Hello there", add_special_tokens=False)
    source.propose(DecodeView([], ids))
    with pytest.raises(ValueError):
        source.propose(DecodeView([], ids[:1]))


def test_a_call_that_does_not_parse_disarms_after_rows_fired():
    tok = tokenizer("qwen3-coder")
    source = strict_source(tok, USER, tools())
    good = reply_ids(tok, USER, tools(), _reply(call("bash", {"command": "ls"})))
    # the model breaks the syntax after the scaffold: no newline after the function tag
    broken = tok.encode("<tool_call>\n<function=bash><parameter=command>ls</parameter>"
                        "</function>\n</tool_call>", add_special_tokens=False)
    fires = teacher_force(source, broken + good)
    assert source.stats.parse_fallbacks == 1 and not source.armed
    assert all(p < len(broken) for p, _, _ in fires)


def test_a_gate_prices_verify_rows_and_learns_from_declined_ones():
    """Under a cost curve where verifying never pays (c(m) = m) every row is declined and kept
    as a shadow that still learns; where rows are nearly free every row fires whole."""
    from mlx_fill.core.plan import DispatchPlan
    from mlx_fill.core.cost import CostGate

    linear = DispatchPlan(key=None, max_chunk=16, cost={}, qualified=True)
    free = DispatchPlan(key=None, max_chunk=16, cost={64: 1.0}, qualified=True)
    tok = tokenizer("qwen3")
    reply = _reply(call("get_weather", {"city": "Paris"}))
    ids = reply_ids(tok, USER, tools(), reply, None)
    closed = CostGate(linear, 64)
    assert teacher_force(strict_source(tok, USER, tools(), gate=closed), ids) == []
    assert closed.stats.rounds > 0  # the declined rows were scored as shadows
    ungated = teacher_force(strict_source(tok, USER, tools()), ids)
    assert teacher_force(strict_source(tok, USER, tools(), gate=CostGate(free, 64)), ids) == ungated != []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_head_row_passed_over_is_entered_mid_span(family):
    """A scaffold or name row whose first ids were emitted without it firing (its gate let a
    prefix through, or a batched step emitted one id) proposes the rest of its span at the
    next position it is shown, under the same origin and class; a stream that reached the
    same text through other ids does not enter it."""
    reply = _reply(call("get_weather", {"city": "Paris"}), call("bash", {"command": "ls -la"}))
    tok, ids, _, fires = _run(family, reply)
    eos = frozenset(tok.eos_token_ids)
    heads = [(p, s, o) for p, s, o in fires if o.startswith(("strict:scaffold", "strict:name"))]
    assert heads and any(len(s) > 2 for _, s, _ in heads)
    for pos, span, origin in heads:
        for k in range(1, len(span)):
            source = strict_source(tok, USER, tools())
            p = source.propose(DecodeView([], ids[:pos + k], eos))
            assert p is not None and (p.ids, p.origin) == (span[k:], origin), (family, origin, k)
    pos, span, origin = next((p, s, o) for p, s, o in heads if len(s) > 2)
    text = tok.decode(list(span[:2]))
    other = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
    if other != list(span[:2]):  # the same text in other ids: not the row's stream
        source = strict_source(tok, USER, tools())
        p = source.propose(DecodeView([], [*ids[:pos], *other], eos))
        assert p is None or p.origin != origin
