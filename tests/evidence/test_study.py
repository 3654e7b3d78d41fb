"""mlx-fill study: accounting against a from-scratch reference, rendering, report, CLI."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from cli_lines import one_error_line

from mlx_fill import cli
from mlx_fill.assets.store import load_tokenizer
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.evidence.study import BASELINE, Row, markdown_report, run_study, study_session
from mlx_fill.evidence.transcripts import markers, recorded_responses, render_recording
from mlx_fill.strict import rows as strict_rows

READ = {"name": "read", "arguments": {"path": "src/app/main.py"}}


def _sessions():
    structured = {
        "source": "toy_structured", "session_id": "s1", "tool_call_style": "structured",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Open src/app/main.py and then src/app/util.py please."},
            {"role": "assistant", "content": "Reading it.", "tool_calls": [dict(READ, id="a")]},
            {"role": "tool", "tool_call_id": "a", "content": "def main():\n    return util.run()\n"},
            {"role": "assistant", "content": "Now the helper.", "tool_calls": [
                {"id": "b", "name": "read", "arguments": {"path": "src/app/util.py"}}]},
            {"role": "tool", "tool_call_id": "b", "content": "def run():\n    return 42\n"},
            {"role": "assistant", "content": "main() returns util.run(), which returns 42."},
        ]}
    inline = {
        "source": "toy_inline", "session_id": "s2", "tool_call_style": "inline_text",
        "messages": [
            {"role": "user", "content": "List the files then count them."},
            {"role": "assistant", "content": "THOUGHT: list.\n\n```bash\nls -la src/app\n```"},
            {"role": "tool", "content": "main.py\nutil.py\n"},
            {"role": "assistant", "content": "THOUGHT: count.\n\n```bash\nls -la src/app | wc -l\n```"},
        ]}
    return [structured, inline]


@pytest.fixture(scope="module")
def transcripts(tmp_path_factory):
    path = tmp_path_factory.mktemp("tr") / "toy.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for s in _sessions():
            f.write(json.dumps(s) + "\n")
        f.write("{broken json\n")
    return path


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def _reference_pld_forwards(tokens, turn, think, eos):
    """Teacher-forced forwards of plain PLD (n=3..1, K=10, first occurrence), from scratch."""
    prompt = tokens[:turn.start] + think
    out = tokens[turn.start:turn.end]
    forwards, ptr = 1, 1
    while ptr < len(out):
        ctx = prompt + out[:ptr]
        draft = []
        for n in (3, 2, 1):
            tail = ctx[-n:]
            ends = [i for i in range(n - 1, len(ctx) - 1) if ctx[i - n + 1:i + 1] == tail]
            if ends:
                draft = ctx[ends[0] + 1:ends[0] + 11]
                break
        for i, t in enumerate(draft):
            if t in eos:
                draft = draft[:i]
                break
        acc = 0
        while acc < min(len(draft), len(out) - ptr) and draft[acc] == out[ptr + acc]:
            acc += 1
        forwards += 1
        ptr += min(acc + 1, len(out) - ptr) if draft else 1
    return forwards


def test_render_cuts_assistant_outputs_and_labels_tool_calls(tok):
    r = render_recording(_sessions()[0], tok, markers(tok))
    assert len(r.turns) == 3
    first = tok.decode(r.tokens[r.turns[0].start:r.turns[0].end])
    assert first.startswith("Reading it.") and first.endswith("</tool_call><|im_end|>")
    assert '"path": "src/app/main.py"' in first
    assert "read" in r.turns[0].labels and "(text)" in r.turns[0].labels
    assert tok.decode(r.think_ids) == "<think>\n\n</think>\n\n"
    assert r.tools_origin == "synthesized"
    assert '"name": "read"' in tok.decode(r.tokens[:r.turns[0].start])  # the tools block


def test_recorded_arguments_reach_the_template_as_a_server_decodes_them(tok):
    session = _sessions()[0]
    session["messages"][2]["tool_calls"] = [dict(READ, id="a", arguments_raw='{"path":"src/a.py"}')]
    session["messages"][4]["tool_calls"] = [{"id": "b", "name": "read", "arguments": {},
                                             "arguments_raw": "[1, 2]"}]
    r = render_recording(session, tok, markers(tok))
    first = tok.decode(r.tokens[r.turns[0].start:r.turns[0].end])
    assert '"arguments": {"path": "src/a.py"}}' in first   # an object: the template's spacing
    assert r.messages[2]["tool_calls"][0]["function"]["arguments"] == {"path": "src/a.py"}
    second = tok.decode(r.tokens[r.turns[1].start:r.turns[1].end])
    assert '"arguments": [1, 2]}' in second                # not an object: the string as sent


@pytest.mark.parametrize("tools", [7, True, "bash"])
def test_recorded_tools_that_are_not_a_list_are_a_session_not_rendered(tok, tools):
    session = dict(_sessions()[0], tool_call_style="structured", tools=tools)
    with pytest.raises(ValueError, match="tools: expected a list of tool objects"):
        render_recording(session, tok, markers(tok))


def test_a_think_block_the_generation_prompt_opens_is_the_prompts_not_the_replys():
    """Qwen3.5's thinking-mode generation prompt opens ``<think>``, which earlier replies in the
    history do not carry: every reply is still found, and the block is the turn's prompt."""
    qwen35 = load_tokenizer("qwen3.5")
    mk = markers(qwen35)
    assert (mk.opener, mk.think) == ("<|im_start|>assistant\n", "<think>\n\n</think>\n\n")
    r = render_recording(_sessions()[0], qwen35, mk)
    assert [t.message_index for t in r.turns] == [2, 4, 6]
    assert qwen35.decode(r.tokens[r.turns[2].start:r.turns[2].end]) == (
        "main() returns util.run(), which returns 42.<|im_end|>")


@pytest.mark.parametrize("family, why", [
    ("glm4.x", "generation prompt rewrites the messages before it"),
    ("mistral-nemo", "generation prompt writes nothing before a reply"),
    ("gpt-oss", "ends an earlier reply with something other than the end-of-turn token")])
def test_a_template_whose_replies_cannot_be_cut_is_refused_saying_why(family, why, capsys):
    with pytest.raises(ValueError, match=why):
        markers(load_tokenizer(family))
    one_error_line(capsys, ["study", "--family", family, "--sessions", "1"], f"family {family}: ", why)


def test_a_session_the_template_refuses_is_skipped_saying_why():
    llama = load_tokenizer("llama3.x")
    session = _sessions()[0]
    session["messages"][2]["tool_calls"] *= 2  # Llama 3's template takes one call per reply
    with pytest.raises(ValueError, match="the chat template refuses the session"):
        render_recording(session, llama, markers(llama))


def test_arguments_a_template_cannot_write_are_a_session_refused_saying_why():
    """Qwen3-Coder's template writes a call's arguments as its parameters, one per key: an
    array or a string that is no JSON has none, and the template fails on it."""
    coder = load_tokenizer("qwen3-coder")
    session = _sessions()[0]
    session["messages"][2]["tool_calls"] = [dict(READ, arguments={}, arguments_raw="[1, 2]")]
    with pytest.raises(ValueError, match=r"refuses the session \(.*a call's arguments are no JSON object"):
        render_recording(session, coder, markers(coder))


def test_sessions_without_a_turn_to_study_are_one_error_line(tmp_path, capsys, monkeypatch):
    """No assistant reply (said before the family's tokenizer is fetched), or none the template
    renders: one line saying so, no empty report."""
    from mlx_fill.evidence import study
    path = tmp_path / "no_turn.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "study"
    argv = ["study", "--transcripts", str(path), "--sources", "ngram", "--workers", "1",
            "--out", str(out), "--no-progress"]
    with monkeypatch.context() as patched:
        patched.setattr(study, "load_tokenizer", lambda *a: pytest.fail("a tokenizer was loaded"))
        one_error_line(capsys, argv, f"no assistant turn to study in {path}; pass sessions with "
                       "assistant replies")
    session = _sessions()[0]
    session["messages"][2]["tool_calls"] *= 2  # Llama 3's template takes one call per reply
    path.write_text(json.dumps(session) + "\n")
    one_error_line(capsys, [*argv, "--family", "llama3.x"], "1 sessions not rendered (the first: s1: "
                   "the chat template refuses the session", "or another --family")
    assert not out.exists()


def test_a_transcripts_name_that_is_not_utf8_is_shown_with_escapes(tmp_path, capsys):
    """Bytes of a file name that are not UTF-8 (read by Python as surrogate escapes, which no
    UTF-8 file or terminal takes) are shown as ``\\xff``: the report naming the file, and a
    skipped line of it, is written and printed."""
    folder = tmp_path / "logs"
    folder.mkdir()
    name = os.fsdecode(b"run\xff.jsonl")
    (folder / name).write_text(json.dumps(_sessions()[0]) + "\n{broken\n")
    out = tmp_path / "study"
    for path, where in ((folder, "run\\xff.jsonl line 2"), (folder / name, "line 2")):
        code = cli.main(["study", "--transcripts", str(path), "--sources", "ngram", "--workers", "1",
                         "--out", str(out), "--no-progress"])
        report = (out / "study.md").read_text()
        assert code == 0 and f"Corrupt lines: 1 (the first: {where}: invalid JSON" in report
        assert report.splitlines()[0] == f"# mlx-fill study: {os.fsencode(path).decode('utf-8', 'backslashreplace')}"
        assert report in capsys.readouterr().out


def test_a_reply_quoting_the_end_of_turn_marker_is_not_cut_into_a_turn(tok):
    session = _sessions()[0]
    quoting = session["messages"][4]
    quoting["content"] = "Qwen ends a turn with <|im_end|>; now the helper."
    r = render_recording(session, tok, markers(tok))
    # the marker inside the reply would end it early: that reply is not a turn, the others are
    assert [t.message_index for t in r.turns] == [2, 6]
    last = tok.decode(r.tokens[r.turns[1].start:r.turns[1].end])
    assert last == "main() returns util.run(), which returns 42.<|im_end|>"
    assert "now the helper." in tok.decode(r.tokens[r.turns[0].end:r.turns[1].start])


def test_a_message_quoting_the_assistant_opener_is_a_session_not_rendered_saying_so(tok):
    session = _sessions()[0]
    session["messages"][3]["content"] = "<|im_start|>assistant\nquoted from a chat log<|im_end|>"
    with pytest.raises(ValueError, match=r"found 4 assistant openers for 3 replies \(a message "
                                         r"quotes the template's opener '<\|im_start\|>assistant\\n'\)"):
        render_recording(session, tok, markers(tok))


def test_a_value_nested_too_deeply_to_render_is_a_session_not_rendered(tok):
    session = _sessions()[0]
    deep: object = "x"
    for _ in range(5000):
        deep = {"a": deep}
    session["messages"][2]["tool_calls"][0]["arguments"] = {"path": deep}
    with pytest.raises(ValueError, match="a value nested too deeply to render"):
        render_recording(session, tok, markers(tok))


def test_recorded_responses_are_every_rendered_reply_behind_its_prompt_tail(tok):
    sessions = _sessions()
    broken = {"source": "x", "messages": [  # a user quoting the assistant opener: turns are ambiguous
        {"role": "user", "content": "<|im_start|>assistant\nhi"}, {"role": "assistant", "content": "ok"}]}
    responses, skipped = recorded_responses([sessions[0], broken, sessions[1]], tok)
    assert skipped == 1
    want = []
    for s in sessions[:2]:
        r = render_recording(s, tok, markers(tok))
        want += [(r.tokens[max(0, t.start - 64):t.start], r.tokens[t.start:t.end]) for t in r.turns]
    assert responses == want and len(want) >= 3
    assert tok.decode(responses[-1][1]).endswith("<|im_end|>")


def test_baseline_row_equals_from_scratch_reference(transcripts, tok):
    result = run_study(transcripts, "qwen3", ["ngram", "echo", "suffix", "all", "strict", "best"],
                       workers=1, progress=False)
    eos = frozenset(tok.eos_token_ids)
    mk = markers(tok)
    for s in _sessions():
        r = render_recording(s, tok, mk)
        want = sum(_reference_pld_forwards(r.tokens, t, r.think_ids, eos) for t in r.turns)
        got = result["rows"][BASELINE]["by_source"][s["source"]]
        assert got["forwards"] == want
        assert got["tokens"] == sum(t.end - t.start for t in r.turns)
    for name in ("ngram", "echo", "suffix", "all", "best"):
        row = result["rows"][name]["total"]
        assert 1.0 <= row["tau"] and row["accepted"] > 0
        assert row["accepted"] + row["rejected"] == row["proposed"]
    strict = result["rows"]["strict"]["by_source"]["toy_structured"]
    # strict rows verify until a ledger promotes them: they fire and are accepted, never wrong
    assert strict["accepted"] > 0 and strict["assert_mismatches"] == 0
    assert result["rows"]["strict"]["by_source"]["toy_inline"]["proposed"] == 0  # no tools
    assert result["corrupt_lines"] and result["corrupt_lines"][0]["line"] == 3
    report = markdown_report(result)
    assert "| baseline |" in report and "toy_inline" in report


def _calling_session(turns: int) -> dict:
    """A structured session of ``turns`` assistant turns, each calling ``read`` once."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Read every part of src/app."}]
    for k in range(turns):
        call = {"id": f"c{k}", "name": "read", "arguments": {"path": f"src/app/p{k}.py"}}
        messages += [{"role": "assistant", "content": f"Part {k}.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{k}", "content": f"def p{k}(): ...\n"}]
    return {"source": "toy_calls", "session_id": f"calls{turns}", "tool_call_style": "structured",
            "messages": messages}


def test_strict_rows_render_the_history_no_more_often_as_a_session_grows(tok, monkeypatch):
    """Studying a session's strict rows renders at most twice as many messages through the
    chat template for twice as many turns: no turn renders its history again (a session of N
    turns would render on the order of N * N messages)."""
    template = type(tok).apply_chat_template
    rendered: list[int] = []

    def counting(self, messages, *args, **kwargs):
        rendered.append(len(messages))
        return template(self, messages, *args, **kwargs)

    messages_rendered = {}
    for turns in (10, 20):
        session = render_recording(_calling_session(turns), tok, markers(tok))
        monkeypatch.setattr(strict_rows, "_TABLES", {})  # each session compiles its own table
        monkeypatch.setattr(type(tok), "apply_chat_template", counting)
        row = Row("strict", ["strict"], None)
        study_session(session, [row], None, frozenset(tok.eos_token_ids), 32, tok)
        monkeypatch.setattr(type(tok), "apply_chat_template", template)
        assert row.by_source["toy_calls"].accepted > 0  # the strict rows fired
        messages_rendered[turns] = sum(rendered)
        rendered.clear()
    assert messages_rendered[20] <= 2 * messages_rendered[10], messages_rendered


# rows nearly free at any KV length, and the same curve at KV 256 whose rows cost twice a plain
# step's per row at KV 512 and beyond
CHEAP = DispatchPlan(key=None, max_chunk=16, cost={2: 1.01, 16: 1.1}, qualified=True)
DEAR_PAST_512 = DispatchPlan(key=None, max_chunk=16, cost={2: 1.01, 16: 1.1}, qualified=True,
                             cost_kv=256, long_kv=512, long_cost={1: 1.0, 2: 4.0, 16: 32.0})


def test_rounds_are_gated_and_priced_at_the_kv_length_they_append_at(tmp_path):
    """A session whose turns all append past KV 512, on both curves: priced at each view's KV
    length the gates decline every draft on the dear one and the study charges plain decoding;
    on the cheap one they propose, each round near one step. Rounds made either way (the
    baseline's) are charged at the KV length."""
    session = _sessions()[0]
    manual = "".join(f"Step {i}: open src/app/module_{i}.py and read its docstring.\n" for i in range(60))
    session["messages"][0]["content"] += "\n" + manual
    path = tmp_path / "long.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(session) + "\n")
    rows = ["echo", "all", "best"]
    cheap = run_study(path, "qwen3", rows, workers=1, progress=False, plan=CHEAP)
    dear = run_study(path, "qwen3", rows, workers=1, progress=False, plan=DEAR_PAST_512)
    for name in rows:
        got, free = dear["rows"][name]["total"], cheap["rows"][name]["total"]
        # priced, not timed: the rounds' cost in one-row forwards is below the tokens they emit
        assert free["accepted"] > 0 and free["cost"] < free["tokens"], (name, free)
        assert free["cost"] < free["forwards"] * 1.1, (name, free)
        assert got["proposed"] == 0 and got["cost"] == got["tokens"], (name, got)
    # the baseline proposes without a gate: the same rounds, each charged at its KV length
    got, free = dear["rows"][BASELINE]["total"], cheap["rows"][BASELINE]["total"]
    assert got["proposed"] == free["proposed"] > 0 and got["forwards"] == free["forwards"]
    rounds = got["forwards"] - got["turns"]
    assert got["cost"] > free["cost"] + 2.0 * rounds, (got, free)


def test_a_worker_that_fails_raises_its_error_not_a_wait_for_its_sessions(transcripts):
    """The workers load the family's tokenizer themselves: one that cannot raises in each."""
    from mlx_fill.assets.store import UnknownFamily
    with pytest.raises(UnknownFamily):
        run_study(transcripts, "no-such-family", ["ngram"], workers=2, progress=False)


def test_cli_writes_json_report_and_plot(transcripts, tmp_path, capsys):
    out = tmp_path / "study"
    code = cli.main(["study", "--transcripts", str(transcripts), "--sources", "ngram",
                     "--workers", "1", "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads((out / "study.json").read_text())
    assert set(data["rows"]) == {BASELINE, "ngram"}
    assert (out / "study.md").read_text().startswith("# mlx-fill study")
    assert "Corrupt lines: 1 (the first: line 3: invalid JSON: " in capsys.readouterr().out
    assert (out / "tau_by_source.png").read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["study", "--transcripts", str(transcripts), "--sources", "bogus"]) == 2
