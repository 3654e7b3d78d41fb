"""The serving path compiles strict rows lazily: same fires as the eager source, and prose turns
never compile."""

from __future__ import annotations

import pytest

from mlx_fill.strict import LazyStrictSource, lazy_strict_source, strict_source
from strict_helpers import FAMILIES, call, reply_ids, teacher_force, tokenizer, tools

USER = [{"role": "user", "content": "hi"}]
REPLIES = {
    "two calls": {"role": "assistant", "content": "Let me look.", "tool_calls": [
        call("read_file", {"path": "src/a.py"}), call("read_file", {"path": "src/b.py"})]},
    "prose mentioning tools": {"role": "assistant",
                               "content": "I would call read_file on `src/a.py` next."},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(REPLIES))
def test_lazy_source_fires_exactly_like_the_eager_one(family, case):
    tok, tool_list = tokenizer(family), tools()
    ids = reply_ids(tok, USER, tool_list, REPLIES[case])
    eos = frozenset(tok.eos_token_ids)
    lazy = lazy_strict_source(tok, USER, tool_list)
    assert isinstance(lazy, LazyStrictSource)
    eager_fires = teacher_force(strict_source(tok, USER, tool_list), ids, eos)
    assert teacher_force(lazy, ids, eos) == eager_fires
    assert lazy._built == (case == "two calls")
    assert bool(eager_fires) == (case == "two calls")


def test_lazy_source_still_rejects_malformed_tools_up_front():
    bad = [{"type": "function", "function": {"name": "x", "parameters": {"type": 7}}}]
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        lazy_strict_source(tokenizer("qwen3"), USER, bad)


def test_parse_fallbacks_reach_the_request_telemetry():
    from mlx_fill.proposal import DecodeView, FillSession
    tok, tool_list = tokenizer("qwen3-coder"), tools()
    session = FillSession([lazy_strict_source(tok, USER, tool_list)])
    broken = tok.encode("<tool_call>\n<function=bash><parameter=command>ls</parameter>"
                        "</function>\n</tool_call>", add_special_tokens=False)
    for pos in range(len(broken) + 1):
        p = session.propose(DecodeView([], broken[:pos]))
        if p is not None:
            session.feedback(p, 0, pos)
    assert session.stats.parse_fallbacks == 1
