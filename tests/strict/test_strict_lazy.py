"""The serving path compiles strict rows lazily: same fires as the eager source, and prose turns
never compile; what a tokenizer's first compile pays once is paid at load (``warm_strict``)."""

from __future__ import annotations

import pytest

from mlx_fill.strict import rows, tokenbytes
from mlx_fill.strict.source import LazyStrictSource, lazy_strict_source, strict_source, warm_strict
from mlx_fill.strict.tokenbytes import ids_bytes, token_bytes
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


def test_no_conversation_and_a_conversation_ending_in_a_reply_get_no_source():
    """Nothing a template can render after (an empty message list raises in some templates),
    and nothing to answer: no source, whatever the model emits."""
    tok, tool_list = tokenizer("qwen3"), tools()
    assert lazy_strict_source(tok, [], tool_list) is None
    assert strict_source(tok, [], tool_list) is None  # the eager fallback alike
    assert lazy_strict_source(tok, [*USER, {"role": "assistant", "content": "x"}], tool_list) is None


def test_parse_fallbacks_reach_the_request_telemetry():
    from mlx_fill.core.proposal import DecodeView, FillSession
    tok, tool_list = tokenizer("qwen3-coder"), tools()
    session = FillSession([lazy_strict_source(tok, USER, tool_list)])
    broken = tok.encode("<tool_call>\n<function=bash><parameter=command>ls</parameter>"
                        "</function>\n</tool_call>", add_special_tokens=False)
    for pos in range(len(broken) + 1):
        p = session.propose(DecodeView([], broken[:pos]))
        if p is not None:
            session.feedback(p, 0, pos)
    assert session.stats.parse_fallbacks == 1


def test_rows_verify_until_the_ledger_promotes_them(tmp_path):
    from mlx_fill.sources.ledger import Ledger
    from mlx_fill.core.proposal import DecodeView, FillSession
    tok, tool_list = tokenizer("qwen3.5"), tools()
    ids = reply_ids(tok, USER, tool_list, REPLIES["two calls"])
    ledger = Ledger("m", "t", promote_after=2, eligible=frozenset({"strict:"}),
                    path=tmp_path / "l.json")

    def policies():
        session = FillSession([strict_source(tok, USER, tool_list, ledger=ledger)])
        out, pos = [], 0
        while pos < len(ids):
            p = session.propose(DecodeView([], ids[:pos]))
            if p is None:
                pos += 1
                continue
            ok = tuple(ids[pos:pos + len(p.ids)]) == p.ids
            session.feedback(p, len(p.ids) if ok else 0, pos)
            out.append((p.origin, p.policy))
            pos += len(p.ids) if ok else 1
        return out

    first = policies()
    policies()
    third = policies()
    assert first and all(policy == "verify" for _, policy in first)
    assert {o for o, _ in first} == {o for o, _ in third}
    promoted = [o for o, pol in third if pol == "assert"]
    claims = {c: ev for c, ev in ledger.claims.items() if c.split("@")[0] in promoted}
    assert promoted and claims and all(ev.agreements >= 2 for ev in claims.values())
    for claim in claims:  # one disagreement demotes a row for good
        ledger.record(claim, False)
    assert all(pol == "verify" for o, pol in policies() if o in promoted)


TEXTS = ["plain ascii", "Zürich café naïve", "東京の天気は？", "emoji 🙂👍🏽 and ZWJ 👩‍💻",
         "tabs\tand\r\nCRLF", "<tool_call>{\"name\": \"x\"}</tool_call>", "\u0301combining",
         "ÿ\u00a0\u00ad nbsp soft-hyphen"]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_bytes_give_back_the_text_they_encode(family):
    """Every id's bytes, joined, are the UTF-8 of the text the ids encode: what strict rows
    compare the model's text with."""
    tok = tokenizer(family)
    table = token_bytes(tok)
    assert len(table) == len(getattr(tok, "_tokenizer", tok))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids_bytes(table, ids) == text.encode("utf-8"), (family, text)


def test_warming_pays_the_tokenizer_table_at_load_and_caches_no_rows():
    tok = tokenizer("qwen3")
    hf = getattr(tok, "_tokenizer", tok)
    tokenbytes._TABLES.pop(hf, None)
    cached = dict(rows._TABLES)
    warm_strict(tok)
    assert hf in tokenbytes._TABLES
    assert rows._TABLES == cached


def test_warming_a_tokenizer_whose_template_cannot_be_probed_raises_nothing():
    """The template raises (no jinja error: a TypeError), after the vocabulary's table was
    built: the warm-up swallows it, as the request that needs the rows will report it."""
    rendered = []

    class Refusing:
        chat_template = "{{ messages }}"
        tool_call_start, tool_call_end = "<tool_call>", "</tool_call>"
        added_tokens_decoder: dict = {}

        def __len__(self) -> int:
            return 3

        def convert_ids_to_tokens(self, ids):
            return ["a", "b", "c"][:len(ids)]

        def decode(self, ids):
            return "abc"[ids[0]]

        def apply_chat_template(self, *args, **kwargs):
            rendered.append(kwargs.get("add_generation_prompt"))
            raise TypeError("refused")

    refusing = Refusing()
    warm_strict(refusing)
    assert rendered and tokenbytes._TABLES[refusing] == [b"a", b"b", b"c"]


def test_warming_a_tokenizer_without_call_markers_costs_nothing():
    read = []

    class Markerless:
        chat_template = "{{ messages }}"

        def __len__(self) -> int:
            read.append("vocabulary")
            return 0

        def apply_chat_template(self, *args, **kwargs):
            read.append("template")
            return ""

    warm_strict(Markerless())
    assert read == []


def test_a_row_verified_in_part_disagrees_when_the_model_goes_on_otherwise(tmp_path):
    """A verify cut short (here by the session's span cap) and accepted whole is no agreement;
    when the id the model emits after it is not the row's next one (compact JSON after the
    call-start token), the row's claim records a disagreement, so it is never promoted."""
    from mlx_fill.sources.ledger import Ledger
    from mlx_fill.core.proposal import DecodeView, FillSession
    tok, tool_list = tokenizer("qwen3"), tools()
    canonical = reply_ids(tok, USER, tool_list, REPLIES["two calls"])
    text = tok.decode(canonical)
    assert '{"name": "' in text
    compact = tok.encode(text.replace('{"name": "', '{"name":"'), add_special_tokens=False)

    def drive(ids: list[int]) -> dict[str, tuple[int, int]]:
        ledger = Ledger("m", "t", promote_after=2, eligible=frozenset({"strict:"}),
                        path=tmp_path / "l.json")
        session = FillSession([strict_source(tok, USER, tool_list, ledger=ledger)], max_span=3)
        pos = 0
        while pos < len(ids):
            p = session.propose(DecodeView([], ids[:pos]))
            if p is None:
                pos += 1
                continue
            ok = 0
            while ok < len(p.ids) and pos + ok < len(ids) and ids[pos + ok] == p.ids[ok]:
                ok += 1
            session.feedback(p, ok, pos)
            pos += ok + 1  # the ids kept and the target's own sample after them
        session.propose(DecodeView([], ids))
        return {c.split("@")[0]: (ev.agreements, ev.disagreements)
                for c, ev in ledger.claims.items()}

    assert drive(canonical).get("strict:scaffold", (0, 0))[1] == 0
    assert drive(compact)["strict:scaffold"][1] >= 1
