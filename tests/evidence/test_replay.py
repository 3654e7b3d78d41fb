"""``mlx-fill replay`` / ``ab``: transcript loading, tool synthesis, recorded-history rendering,
interleaving, and an end-to-end run against a real ``mlx_lm.server`` on loopback."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from adapter_models import free_port, running_server

from mlx_fill.evidence import claude_code_log, codex_log, log_formats, replay
from mlx_fill.cli import main
from mlx_fill.core.errors import UserError
from mlx_fill.assets.checkout import TRANSCRIPTS



def _structured(tools=None, ids=True):
    session = {
        "source": "unit", "session_id": "s-structured", "tool_call_style": "structured",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "look up alice"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"name": "find", "arguments": {"who": "alice", "limit": 3}, "arguments_raw": '{"who":"alice","limit":3}'},
                {"name": "find", "arguments": {"who": "bob", "limit": 2.5}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "alice: 1"},
            {"role": "tool", "tool_call_id": "c2", "content": "bob: 2"},
            {"role": "assistant", "content": "Found both.", "tool_calls": [
                {"name": "note", "arguments": {"text": "done", "tags": ["a"]}}]},
            {"role": "tool", "content": "noted"},
            {"role": "assistant", "content": "All done."},
            {"role": "assistant", "content": "(a second assistant message in a row)"},
        ],
    }
    if ids:
        session["messages"][2]["tool_calls"][0]["id"] = "c1"
        session["messages"][2]["tool_calls"][1]["id"] = "c2"
    if tools is not None:
        session["tools"] = tools
    return session


def _inline():
    return {
        "source": "unit", "session_id": "s-inline", "tool_call_style": "inline_text",
        "messages": [
            {"role": "system", "content": "use bash blocks"},
            {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "```bash\nls\n```", "inline_tool_calls": True,
             "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
            {"role": "tool", "raw_role": "user", "tool_call_id": "x", "content": "a.py"},
            {"role": "assistant", "content": "done"},
        ],
    }


# ----------------------------------------------------------------------------- loading

def _write_lines(path: Path, lines: list[str], gz: bool = False) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_load_sessions_skips_and_reports_corrupt_lines(tmp_path, gz):
    raw_not_text = {"role": "assistant", "tool_calls": [{"name": "f", "arguments": {}, "arguments_raw": 1}]}
    lines = [json.dumps(_structured()), "{truncated", "[1, 2]", json.dumps({"messages": []}),
             json.dumps({"messages": [{"content": "no role"}]}), "",
             json.dumps({"messages": [{"role": "user", "content": ["parts"]}]}),
             json.dumps({"messages": [{"role": "assistant", "tool_calls": [{"arguments": {}}]}]}),
             json.dumps({"messages": [raw_not_text]}),
             '{"messages": [{"role": "user", "content": "bad \\ud800 half"}]}',
             '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
             json.dumps(_inline()), '"a string"']
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "t.jsonl", lines, gz=gz))
    assert [s["session_id"] for s in sessions] == ["s-structured", "s-inline"]
    assert [(c.line, c.reason.split(":")[0].split(" (")[0]) for c in corrupt] == [
        (2, "invalid JSON"), (3, "not a JSON object"), (4, "no messages list"), (5, "a message without a role"),
        (7, "a message whose content is not a string"), (8, "a tool call without a name"),
        (9, "a tool call whose arguments_raw is not a string"), (10, "text that is not Unicode"),
        (11, "JSON nested too deeply to read"), (13, "not a JSON object")]


def test_a_skipped_lines_reason_quoting_the_log_is_one_line_of_text(tmp_path):
    """A reason names what it found (an id, a status, a role, an index): a value of the log
    with line ends, a lone surrogate escape (which no UTF-8 file or terminal takes) or a
    megabyte of text is quoted on one line, its surrogates as their escapes, cut short; so a
    command prints and writes every reason."""
    odd = "a\nb\r\ud800" + "x" * 1_000_000
    previous = {"request": {"input": "hi", "previous_response_id": odd},
                "response": {"id": "r", "object": "response", "status": "completed", "output": []}}
    lines = [previous,
             {"request": {"input": "hi", "conversation": {"id": odd}}, "response": previous["response"]},
             {"request": {"input": "hi"}, "response": {**previous["response"], "status": odd}},
             {"request": {"messages": []}, "response": {"error": {"message": odd}}},
             {"request": {"messages": []}, "response": [
                 {"type": "message_start", "message": {"role": "assistant", "content": []}},
                 {"type": "content_block_delta", "index": odd, "delta": {"type": "text_delta", "text": "x"}}]},
             {"messages": [{"role": odd, "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
             {"timestamp": "t", "type": odd, "payload": 3},
             _event("user", "u1", odd, {"role": "user", "content": "hi"}),
             _event("assistant", "a1", "u1", _reply("m1", {"type": "text", "text": "hello"}))]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))  # the surrogate as its escape
    _, corrupt = replay.load_recordings(path)
    assert [c.line for c in corrupt] == [1, 2, 3, 4, 5, 6, 7, 9]
    for c in corrupt:
        assert c.reason.isprintable() and len(c.reason) < 600 and "\\ud800" in c.reason, c.reason
        c.reason.encode("utf-8")


def test_a_number_too_long_to_convert_is_a_skipped_line_saying_so(tmp_path):
    """Python converts no integer of more than ``sys.get_int_max_str_digits()`` digits (a
    guard against quadratic parsing): such a line is valid JSON that cannot be read, skipped
    saying why, and the lines around it are read."""
    digits = sys.get_int_max_str_digits() + 1
    lines = [json.dumps(_structured()), '{"messages": [], "n": ' + "1" * digits + "}", json.dumps(_inline())]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "t.jsonl", lines))
    assert [s["session_id"] for s in sessions] == ["s-structured", "s-inline"]
    assert [(c.line, c.reason) for c in corrupt] == [
        (2, f"a number of more than {digits - 1} digits, longer than Python reads")]


@pytest.mark.parametrize("newline, end", [("\n", ""), ("\n", "\n"), ("\r\n", "\r\n")])
def test_a_last_line_cut_off_is_skipped_saying_so_and_the_lines_before_read(tmp_path, newline, end):
    """A log still being written (a Claude Code session in use) ends in a line cut off."""
    whole = json.dumps(_structured())
    path = tmp_path / "t.jsonl"
    path.write_bytes((newline.join([whole, whole[:50], whole[:len(whole) // 2]]) + end).encode())
    sessions, corrupt = replay.load_recordings(path)
    assert len(sessions) == 1 and [c.line for c in corrupt] == [2, 3]
    assert all(c.reason.startswith("invalid JSON: ") and c.reason.endswith("(the line ends before its JSON does: "
                                                                            "cut off?)") for c in corrupt)
    path.write_bytes((whole + newline + "{} x" + end).encode())
    assert replay.load_recordings(path)[1][0].reason == "invalid JSON: Extra data at character 4 of 4"


def test_a_byte_order_mark_is_not_a_corrupt_first_line(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(_structured()) + "\n").encode())
    sessions, corrupt = replay.load_recordings(path)
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["s-structured"]


def test_a_byte_order_mark_of_a_joined_file_is_not_a_corrupt_line(tmp_path):
    """``cat a.jsonl b.jsonl`` where each was saved with a byte-order mark."""
    one = b"\xef\xbb\xbf" + (json.dumps(_structured()) + "\n").encode()
    path = tmp_path / "joined.jsonl"
    path.write_bytes(one + one + b"\xef\xbb\xbf\n")
    sessions, corrupt = replay.load_recordings(path)
    assert corrupt == [] and len(sessions) == 2


@pytest.mark.parametrize("gz", [False, True])
def test_a_line_that_is_not_utf8_is_one_corrupt_line_and_the_rest_is_read(tmp_path, gz):
    lines = [json.dumps({**_structured(), "session_id": f"s{i}"}).encode() for i in range(60)]
    lines[30] = json.dumps({"messages": [{"role": "user", "content": "caf\u00e9"}]},
                           ensure_ascii=False).encode("latin-1")
    path = tmp_path / "t.jsonl"
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if gz else data)
    sessions, corrupt = replay.load_recordings(path)
    assert len(sessions) == 59 and sessions[-1]["session_id"] == "s59"
    assert [(c.line, c.reason.split(" (")[0]) for c in corrupt] == [(31, "not UTF-8 text")]


def _anthropic_log() -> dict:
    """A session as Anthropic's Messages API logs it: ``system`` and ``tools`` at the top level,
    calls as ``tool_use`` parts, their results as ``tool_result`` parts of the next user
    message (one of them given as parts, beside an image), thinking and text around them."""
    return {"system": [{"type": "text", "text": "be brief"}],
            "tools": [{"name": "find", "description": "look up", "input_schema": {
                "type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}},
                      {"type": "bash_20250124", "name": "bash"}],
            "messages": [
                {"role": "user", "content": "look up alice"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "two lookups", "signature": "x"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "find", "input": {"who": "alice"}},
                    {"type": "tool_use", "id": "t2", "name": "bash", "input": {"command": "ls"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "alice: 1"},
                    {"type": "tool_result", "tool_use_id": "t2", "content": [
                        {"type": "text", "text": "a.py"}, {"type": "image", "source": {}}]},
                    {"type": "text", "text": "and bob?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Done."},
                                                  {"type": "tool_use", "id": "t3", "name": "bash", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3", "content": None}]}]}


def test_an_anthropic_messages_log_reads_as_its_recording(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [json.dumps(_anthropic_log())])
    sessions, corrupt = replay.load_recordings(path)
    assert corrupt == [] and len(sessions) == 1
    read = sessions[0]
    assert read["tool_call_style"] == "structured" and read["source"] == log_formats.UNNAMED_SOURCE
    assert read["tools"] == [
        {"type": "function", "function": {"name": "find", "description": "look up", "parameters": {
            "type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}}},
        {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    assert list(read["tools"][0]["function"]) == ["name", "description", "parameters"]  # as written
    assert replay._render_history(read) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "look up alice"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "find", "arguments": '{"who": "alice"}'}},
            {"id": "t2", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "alice: 1"},
        {"role": "tool", "tool_call_id": "t2", "content": "a.py"},
        {"role": "user", "content": "and bob?"},
        {"role": "assistant", "content": "Done.", "tool_calls": [
            {"id": "t3", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t3", "content": ""}]
    turns, origin = replay.recording_turns(read)
    assert origin == "recorded" and [t.message_index for t in turns] == [2, 6]


def test_an_anthropic_system_prompt_is_kept_beside_a_system_message_later_in_the_log():
    """A log with ``system`` at the top level and a system message in the middle (an
    instruction the harness added): the model saw both. One that repeats its top-level system
    prompt as its first message holds it once."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": "be terse now"}, {"role": "user", "content": "again"}]
    read = log_formats.as_recording({"system": "be brief", "messages": messages})
    assert [(m["role"], m["content"]) for m in read["messages"]][:1] == [("system", "be brief")]
    assert len(read["messages"]) == 5
    repeated = [{"role": "system", "content": "be brief"}, *messages]
    assert log_formats.as_recording({"system": "be brief", "messages": repeated})["messages"] == repeated


def test_a_part_whose_type_is_no_string_is_a_part_of_no_kind_read(tmp_path):
    odd = [{"type": {"kind": "text"}, "text": "x"}, {"type": ["tool_use"]}, {"type": "text", "text": "hi"}]
    lines = [json.dumps({"messages": [{"role": role, "content": odd}, {"role": "assistant", "content": "ok"}]})
             for role in ("user", "assistant")]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "t.jsonl", lines))
    assert corrupt == [] and [s["messages"][0]["content"] for s in sessions] == ["hi", "hi"]


def test_call_parts_anthropic_logs_cannot_hold_are_a_corrupt_line_not_dropped(tmp_path):
    """A call part in a user message, a result part in an assistant message, and a result
    whose content is neither text nor parts: read as text, the session would lose them."""
    call = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.py"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "x"}
    lines = [json.dumps({"messages": [{"role": "user", "content": [call]}]}),
             json.dumps({"messages": [{"role": "assistant", "content": [result]}]}),
             json.dumps({"messages": [{"role": "user", "content": [{**result, "content": 3}]}]}),
             json.dumps(_anthropic_log())]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "t.jsonl", lines))
    assert len(sessions) == 1
    assert [(c.line, c.reason.split(" (")[0]) for c in corrupt] == [
        (1, "a tool_use content part in a message of role user"),
        (2, "a tool_result content part in a message of role assistant"),
        (3, "a tool_result content part in a message of role tool")]


def _event(kind: str, uuid: str, parent: str | None, message: dict | None = None, **extra) -> dict:
    """One line of a Claude Code session log."""
    event = {"type": kind, "uuid": uuid, "parentUuid": parent, "sessionId": "S", "isSidechain": False,
             "timestamp": "2026-01-01T00:00:00Z", **extra}
    return {**event, "message": message} if message is not None else event


def _reply(msg_id: str, *parts: dict, model: str = "claude-sonnet-4-5") -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": list(parts)}


def _claude_code_log() -> list[dict]:
    """A Claude Code session: a reply logged one part per line with a result between its
    calls, a system event in the chain, a branch the user rewound, an API error in the
    assistant's place, a subagent's conversation, a compaction, and bookkeeping lines."""
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    user = lambda t: {"role": "user", "content": t}  # noqa: E731
    result = lambda tid, c: user([{"type": "tool_result", "tool_use_id": tid, "content": c}])  # noqa: E731
    read = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.py"}}
    bash = {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"command": "ls"}}
    return [
        {"type": "summary", "summary": "Fixing", "leafUuid": "a7"},
        _event("user", "u1", None, user("fix the bug")),
        _event("assistant", "a1", "u1", _reply("m1", {"type": "thinking", "thinking": "hm", "signature": "s"})),
        _event("assistant", "a2", "a1", _reply("m1", text("Reading."))),
        _event("assistant", "a3", "a2", _reply("m1", read)),
        _event("user", "u2", "a3", result("t1", [text("x = 1")])),
        _event("assistant", "a4", "u2", _reply("m1", bash)),
        _event("user", "u3", "a4", result("t2", ["a.py"])),
        _event("system", "s1", "u3", subtype="turn_duration"),
        _event("assistant", "a5", "s1", _reply("m2", text("Fixed."))),
        _event("user", "u4", "a5", user("no, undo")),
        _event("assistant", "a6", "u4", _reply("m3", text("Undone."))),
        {"type": "file-history-snapshot", "messageId": "u4", "snapshot": {}},
        _event("user", "u5", "a5", user("thanks")),
        _event("assistant", "a7", "u5", _reply("m4", text("You're welcome."))),
        _event("user", "g1", None, user("find X"), isSidechain=True, agentId="ag1"),
        _event("assistant", "g2", "g1", _reply("m5", text("X is in b.py.")), isSidechain=True, agentId="ag1"),
        _event("assistant", "e1", "a7", _reply("m6", text("API Error: overloaded"), model="<synthetic>"),
               isApiErrorMessage=True),
        _event("system", "c1", None, subtype="compact_boundary", logicalParentUuid="a7"),
        _event("user", "u6", "c1", user("Summary: the bug is fixed."), isCompactSummary=True),
        _event("assistant", "a8", "u6", _reply("m7", text("Continuing."))),
    ]


def test_a_claude_code_session_log_reads_as_its_conversations(tmp_path):
    path = _write_lines(tmp_path / "s.jsonl", [json.dumps(e) for e in _claude_code_log()])
    sessions, corrupt = replay.load_recordings(path)
    assert corrupt == []
    assert [(s["session_id"], s["source"], s["tool_call_style"]) for s in sessions] == [
        ("S", "claude_code", "structured"), ("S/ag1", "claude_code", "inline_text"),
        ("S#2", "claude_code", "inline_text")]
    assert sessions[0]["model"] == "claude-sonnet-4-5"
    assert replay._render_history(sessions[0]) == [
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": "Reading.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "Read", "arguments": '{"file_path": "a.py"}'}},
            {"id": "t2", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "x = 1"},
        {"role": "tool", "tool_call_id": "t2", "content": "a.py"},
        {"role": "assistant", "content": "Fixed."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You're welcome."}]
    assert [m["content"] for m in sessions[1]["messages"]] == ["find X", "X is in b.py."]
    assert [m["content"] for m in sessions[2]["messages"]] == ["Summary: the bug is fixed.", "Continuing."]


def test_a_claude_code_conversation_that_cannot_be_read_is_skipped_under_its_last_line(tmp_path):
    bad = [_event("user", "u1", None, {"role": "user", "content": [
               {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}),
           _event("assistant", "a1", "u1", _reply("m1", {"type": "text", "text": "ok"}))]
    lines = [json.dumps(_structured()), *map(json.dumps, bad), "{broken"]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "s.jsonl", lines))
    assert [s["session_id"] for s in sessions] == ["s-structured"]
    assert [(c.line, c.reason.split(" (")[0].split(":")[0]) for c in corrupt] == [
        (3, "a tool_use content part in a message of role user"), (4, "invalid JSON")]


def test_a_claude_code_reply_with_parallel_calls_keeps_every_call_and_result(tmp_path):
    """Claude Code 2.1 logs a reply's parallel calls one line each, chained, and each result
    as the child of its own call's line; results written out of call order leave the later
    calls and the other results off the chain the next reply continues."""
    call = lambda tid, name: {"type": "tool_use", "id": tid, "name": name, "input": {"n": tid}}  # noqa: E731
    result = lambda tid: {"role": "user", "content": [  # noqa: E731
        {"type": "tool_result", "tool_use_id": tid, "content": f"out {tid}"}]}
    lines = [_event("user", "u1", None, {"role": "user", "content": "run all three"}),
             _event("assistant", "a1", "u1", _reply("m1", {"type": "text", "text": "Three at once."})),
             _event("assistant", "a2", "a1", _reply("m1", call("t1", "Read"))),
             _event("progress", "p1", "a2", data={"type": "hook_progress"}),
             _event("assistant", "a3", "p1", _reply("m1", call("t2", "Bash"))),
             _event("assistant", "a4", "a3", _reply("m1", call("t3", "Grep"))),
             _event("user", "r3", "a4", result("t3"), sourceToolAssistantUUID="a4"),
             _event("attachment", "h3", "r3", attachment={"type": "hook_success"}),
             _event("user", "r2", "a3", result("t2"), sourceToolAssistantUUID="a3"),
             _event("user", "r1", "a2", result("t1"), sourceToolAssistantUUID="a2"),
             _event("assistant", "a5", "r1", _reply("m2", {"type": "text", "text": "Done."}))]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "s.jsonl", map(json.dumps, lines)))
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["S"]
    history = replay._render_history(sessions[0])
    assert [(m["role"], m.get("tool_call_id")) for m in history] == [
        ("user", None), ("assistant", None), ("tool", "t3"), ("tool", "t2"), ("tool", "t1"),
        ("assistant", None)]
    assert [c["id"] for c in history[1]["tool_calls"]] == ["t1", "t2", "t3"]
    assert [m["content"] for m in history[2:5]] == ["out t3", "out t2", "out t1"]


def test_a_claude_code_branch_without_a_reply_leaves_the_conversation_before_it(tmp_path):
    """Local commands typed after the last reply, logged as a branch off the log's first line
    (Claude Code 1.0): the conversation is the last reply's, not the last line's."""
    user = lambda t: {"role": "user", "content": t}  # noqa: E731
    lines = [_event("user", "c0", None, user("Caveat: local commands below."), isMeta=True),
             _event("user", "c1", "c0", user("<command-name>/clear</command-name>")),
             _event("user", "c2", "c1", user("<local-command-stdout></local-command-stdout>")),
             _event("user", "u1", "c2", user("fix the bug")),
             _event("assistant", "a1", "u1", _reply("m1", {"type": "text", "text": "Fixed."})),
             _event("user", "b1", "c0", user("<bash-input>pytest</bash-input>")),
             _event("user", "b2", "b1", user("<bash-stdout>1 passed</bash-stdout>"))]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "s.jsonl", map(json.dumps, lines)))
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["S"]
    assert [m["content"] for m in sessions[0]["messages"]][-2:] == ["fix the bug", "Fixed."]
    assert len(replay.recording_turns(sessions[0])[0]) == 1


def test_a_claude_code_conversation_that_goes_on_from_an_event_not_in_the_log_is_skipped(tmp_path):
    """A compaction's summarizer (``subagents/agent-acompact-*.jsonl``): its lines hold only
    what it added to the main session's conversation, their parents lines of that session's
    log; the model saw the whole conversation, so the line of the reply reports it."""
    user = lambda t: {"role": "user", "content": t}  # noqa: E731
    agent = {"isSidechain": True, "agentId": "acompact-1"}
    lines = [_event("user", "u1", None, user("hi")),
             _event("assistant", "a1", "u1", _reply("m1", {"type": "text", "text": "hello"})),
             _event("user", "h1", "main-7", user("<system-reminder>hook context</system-reminder>"),
                    isMeta=True, **agent),
             _event("user", "s1", "main-9", user("Your task is to create a detailed summary."), **agent),
             _event("assistant", "s2", "s1", _reply("m2", {"type": "text", "text": "Summary: ..."}), **agent)]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "s.jsonl", map(json.dumps, lines)))
    assert [s["session_id"] for s in sessions] == ["S"]
    assert [(c.line, c.reason.split(" (")[0]) for c in corrupt] == [
        (5, "a conversation that goes on from an event this log does not hold")]


def test_a_claude_code_conversation_holding_a_message_that_is_no_object_is_skipped(tmp_path):
    """A user or assistant event whose message is not an object holds a message no reader can
    read: its conversation is skipped naming the event, not read without that message; the
    log's other conversations are read."""
    log = _claude_code_log()
    thanks = next(i for i, e in enumerate(log) if e.get("uuid") == "u5")
    for broken in (7, "thanks", None):
        log[thanks] = {**log[thanks], "message": broken}
        sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "s.jsonl", map(json.dumps, log)))
        assert [s["session_id"] for s in sessions] == ["S/ag1", "S"]  # the compaction's, S's first read
        assert [(c.line, c.reason) for c in corrupt] == [
            (15, "a conversation holding a user event (uuid u5) whose message is not an object")]


def test_a_claude_code_log_without_links_reads_in_file_order(tmp_path):
    """Lines without ``parentUuid`` (an older or trimmed log, without ``sessionId`` too)
    follow the line before them."""
    lines = [{k: v for k, v in e.items() if k not in ("uuid", "parentUuid", "sessionId")}
             for e in _claude_code_log()[1:8]]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "s.jsonl", map(json.dumps, lines)))
    assert corrupt == [] and len(sessions) == 1
    assert [m["role"] for m in replay._render_history(sessions[0])] == ["user", "assistant", "tool", "tool"]


def test_a_folder_is_read_as_every_transcripts_file_in_it(tmp_path):
    """A Claude Code project folder: one log per session, a subagent's log in a subfolder;
    files of other names are not read, and a skipped line names its file."""
    (tmp_path / "s1").mkdir()
    log = [json.dumps({**e, "sessionId": "A"}) for e in _claude_code_log()]
    _write_lines(tmp_path / "A.jsonl", log)
    _write_lines(tmp_path / "s1" / "agent.jsonl.gz", [json.dumps(_structured()), "{oops"], gz=True)
    _write_lines(tmp_path / "notes.txt", ["{oops"])
    sessions, corrupt = replay.load_recordings(tmp_path)
    assert [s["session_id"] for s in sessions] == ["A", "A/ag1", "A#2", "s-structured"]
    assert [(c.where, c.reason.split(":")[0]) for c in corrupt] == [("s1/agent.jsonl.gz line 2", "invalid JSON")]
    assert replay.skipped_lines(corrupt).startswith("skipped 1 corrupt lines (s1/agent.jsonl.gz line 2: ")


def test_a_folder_walk_enters_symlinked_folders_and_reads_each_real_file_once(tmp_path):
    """``~/.claude/projects`` holding links: a linked project folder is read, a link to an
    ancestor ends no walk in a loop, and a file reached by two paths is read once, by the
    path without a link where there is one."""
    root, elsewhere = tmp_path / "projects", tmp_path / "elsewhere"
    (root / "real").mkdir(parents=True)
    elsewhere.mkdir()
    _write_lines(root / "real" / "a.jsonl", [json.dumps(_structured())])
    _write_lines(elsewhere / "b.jsonl", [json.dumps(_inline())])
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / "again").symlink_to(root / "real", target_is_directory=True)
    (root / "real" / "loop").symlink_to(root, target_is_directory=True)
    (root / "copy.jsonl").symlink_to(root / "real" / "a.jsonl")
    assert [str(p.relative_to(root)) for p in replay.transcript_files(root)] == ["linked/b.jsonl", "real/a.jsonl"]
    sessions, corrupt = replay.load_recordings(root)
    assert corrupt == [] and sorted(s["session_id"] for s in sessions) == ["s-inline", "s-structured"]


def test_a_folder_whose_transcripts_are_only_behind_a_link_is_no_error(tmp_path):
    elsewhere, root = tmp_path / "elsewhere", tmp_path / "projects"
    elsewhere.mkdir()
    root.mkdir()
    _write_lines(elsewhere / "a.jsonl", [json.dumps(_structured())])
    (root / "p").symlink_to(elsewhere, target_is_directory=True)
    replay.check_transcripts(root)
    (root / "loop").symlink_to(root, target_is_directory=True)
    (elsewhere / "a.jsonl").unlink()
    with pytest.raises(UserError, match="folder without transcripts files"):
        replay.check_transcripts(root)


def test_claude_code_events_with_ids_of_other_types_are_read_without_error(tmp_path):
    """Ids that are lists or objects (no string to chain on or to bind a result by) and a chain
    that loops; the prompt that no reply follows is in no conversation."""
    call = {"type": "tool_use", "id": ["t"], "name": "f", "input": {}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": ["t"], "content": "ok"}]}
    lines = [_event("user", ["x"], ["y"], {"role": "user", "content": "hi"}),
             _event("assistant", "a", {"k": 1}, _reply(["m"], {"type": "text", "text": "yo"})),
             _event("assistant", "b", "b", _reply("m2", {"type": "text", "text": "again"})),
             _event("assistant", "c", "b", _reply("m3", call)),
             _event("user", "r", "c", result),
             _event("user", "r2", "c", result),
             _event("assistant", "d", "r", _reply("m4", {"type": "text", "text": "done"}))]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "s.jsonl", map(json.dumps, lines)))
    assert corrupt == [] and [(s["session_id"], [m["content"] for m in s["messages"]]) for s in sessions] == [
        ("S", ["yo"]), ("S#2", ["again", "", "ok", "done"])]


def _rollout_item(payload: dict) -> dict:
    return {"timestamp": "2025-12-28T12:21:44.491Z", "type": "response_item", "payload": payload}


def _said(role: str, text: str) -> dict:
    """A message item as Codex logs it (text as a Responses part)."""
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def _codex_rollout(meta: dict | None = None) -> list[dict]:
    """A Codex CLI rollout as 0.77 writes it (``{"timestamp", "type", "payload"}``; shapes from a
    real one, simonw/claude-code-transcripts' ``tests/sample_codex_session.jsonl``): the user's
    instructions in the meta and again as the first user message, context messages, reasoning,
    text and two parallel calls, a call output as parts, an ``apply_patch`` custom call, two
    texts in a row, a developer message, a ``local_shell_call``, a web search, events, turn
    contexts, a fork's parent meta, and a compaction the session went on from."""
    line = lambda kind, payload: {"timestamp": "2025-12-28T12:21:44.491Z", "type": kind,  # noqa: E731
                                  "payload": payload}
    context = line("turn_context", {"cwd": "/w", "approval_policy": "on-request", "model": "gpt-5.2-codex",
                                    "sandbox_policy": {"type": "workspace-write"}, "summary": "auto"})
    shell = lambda cid, command: _rollout_item({  # noqa: E731
        "type": "function_call", "name": "shell_command", "call_id": cid,
        "arguments": json.dumps({"command": command, "workdir": "/w"})})
    meta = meta or {"instructions": "## Skills\n- be brief", "model_provider": "openai"}
    return [
        line("session_meta", {"id": "019b", "timestamp": "2025-12-28T12:18:30.522Z", "cwd": "/w",
                              "originator": "codex_cli_rs", "cli_version": "0.77.0", "source": "cli", **meta}),
        line("session_meta", {"id": "parent", "timestamp": "2025-12-28T12:00:00.000Z", "cwd": "/w"}),
        _rollout_item(_said("user", "# AGENTS.md instructions for /w\n\n<INSTRUCTIONS>\n## Skills\n- be brief\n"
                                    "</INSTRUCTIONS>")),
        _rollout_item(_said("user", "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>")),
        _rollout_item(_said("user", "fix a.py")),
        line("event_msg", {"type": "user_message", "message": "fix a.py", "images": []}),
        context,
        _rollout_item({"type": "reasoning", "summary": [{"type": "summary_text", "text": "**Testing**"}],
                       "content": None, "encrypted_content": "gAAA"}),
        _rollout_item(_said("assistant", "Testing.")),
        shell("c1", "pytest -q"),
        shell("c2", "cat a.py"),
        line("event_msg", {"type": "token_count", "info": None}),
        _rollout_item({"type": "function_call_output", "call_id": "c1", "output": "Exit code: 1"}),
        _rollout_item({"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "return a - b"}, {"type": "input_image", "image_url": "data:"}]}),
        _rollout_item({"type": "custom_tool_call", "status": "completed", "call_id": "c3", "name": "apply_patch",
                       "input": "*** Begin Patch\n-a - b\n+a + b\n*** End Patch"}),
        _rollout_item({"type": "custom_tool_call_output", "call_id": "c3", "output": "Success."}),
        _rollout_item(_said("assistant", "Fixed.")),
        _rollout_item(_said("assistant", "Tests pass.")),
        line("event_msg", {"type": "agent_message", "message": "Tests pass."}),
        _rollout_item(_said("developer", "<permissions instructions>ask first</permissions instructions>")),
        _rollout_item(_said("user", "lint it")),
        context,
        _rollout_item({"type": "local_shell_call", "call_id": "c4", "status": "completed", "action": {
            "type": "exec", "command": ["ruff", "check"], "timeout_ms": None, "working_directory": None}}),
        _rollout_item({"type": "function_call_output", "call_id": "c4", "output": "All checks passed!"}),
        _rollout_item({"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "ruff"}}),
        _rollout_item(_said("assistant", "Clean.")),
        line("compacted", {"message": "Fixed a.py; lint clean.", "replacement_history": [
            _said("user", "fix a.py"), _said("user", "Summary: fixed a.py; lint clean.")]}),
        context,
        _rollout_item(_said("user", "commit")),
        _rollout_item(_said("assistant", "Committed.")),
    ]


def test_a_codex_rollout_reads_as_its_conversations(tmp_path):
    path = _write_lines(tmp_path / "rollout.jsonl", [json.dumps(line) for line in _codex_rollout()])
    sessions, corrupt = replay.load_recordings(path)
    assert corrupt == []
    assert [(s["session_id"], s["source"], s["model"], s["tool_call_style"]) for s in sessions] == [
        ("019b", "codex", "gpt-5.2-codex", "structured"), ("019b#2", "codex", "gpt-5.2-codex", "inline_text")]
    call = lambda cid, name, arguments: {  # noqa: E731
        "id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}
    assert replay._render_history(sessions[0]) == [
        {"role": "user", "content": "# AGENTS.md instructions for /w\n\n<INSTRUCTIONS>\n## Skills\n- be brief\n"
                                    "</INSTRUCTIONS>"},
        {"role": "user", "content": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"},
        {"role": "user", "content": "fix a.py"},
        {"role": "assistant", "content": "Testing.", "tool_calls": [
            call("c1", "shell_command", '{"command": "pytest -q", "workdir": "/w"}'),
            call("c2", "shell_command", '{"command": "cat a.py", "workdir": "/w"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "Exit code: 1"},
        {"role": "tool", "tool_call_id": "c2", "content": "return a - b"},
        {"role": "assistant", "content": "", "tool_calls": [
            call("c3", "apply_patch", '{"input": "*** Begin Patch\\n-a - b\\n+a + b\\n*** End Patch"}')]},
        {"role": "tool", "tool_call_id": "c3", "content": "Success."},
        {"role": "assistant", "content": "Fixed.\n\nTests pass."},
        {"role": "system", "content": "<permissions instructions>ask first</permissions instructions>"},
        {"role": "user", "content": "lint it"},
        {"role": "assistant", "content": "", "tool_calls": [call("c4", "local_shell", json.dumps(
            {"type": "exec", "command": ["ruff", "check"], "timeout_ms": None, "working_directory": None}))]},
        {"role": "tool", "tool_call_id": "c4", "content": "All checks passed!"},
        {"role": "assistant", "content": "Clean."}]
    turns, origin = replay.recording_turns(sessions[0])
    assert origin == "synthesized" and [t.message_index for t in turns] == [3, 6, 8, 11, 13]
    assert turns[0].expected["tool_calls"] == [
        {"name": "shell_command", "arguments": {"command": "pytest -q", "workdir": "/w"}},
        {"name": "shell_command", "arguments": {"command": "cat a.py", "workdir": "/w"}}]
    assert replay._render_history(sessions[1]) == [
        {"role": "user", "content": "fix a.py"}, {"role": "user", "content": "Summary: fixed a.py; lint clean."},
        {"role": "user", "content": "commit"}, {"role": "assistant", "content": "Committed."}]


def test_a_codex_rollout_logs_the_system_prompt_the_model_saw_where_its_meta_keeps_it(tmp_path):
    """A 2026 meta's ``base_instructions``; instructions no message holds (the first versions
    appended them to the system prompt) are a system message too."""
    meta = {"base_instructions": {"text": "You are Codex."}, "instructions": "answer in French"}
    path = _write_lines(tmp_path / "rollout.jsonl", [json.dumps(line) for line in _codex_rollout(meta)])
    sessions, corrupt = replay.load_recordings(path)
    system = [{"role": "system", "content": "You are Codex."}, {"role": "system", "content": "answer in French"}]
    assert corrupt == [] and [s["messages"][:2] for s in sessions] == [system, system]
    assert sessions[0]["messages"][2]["content"].startswith("# AGENTS.md instructions")


def test_a_codex_rollout_written_before_the_envelope_reads_the_same_way(tmp_path):
    """Codex CLI until September 2025: a bare session meta, items at the top level, state
    lines; no model logged; the user's instructions went to the system prompt."""
    lines = [{"id": "5973b6c0", "timestamp": "2025-08-18T01:16:13.522Z", "instructions": "be brief",
              "git": {"commit_hash": "abc123", "branch": "main"}},
             {"record_type": "state"},
             {**_said("user", "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"), "id": None},
             _said("user", "list the files"),
             {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
             {"type": "function_call", "name": "shell", "arguments": '{"command":["bash","-lc","ls"]}',
              "call_id": "call_1"},
             {"record_type": "state"},
             {"type": "function_call_output", "call_id": "call_1",
              "output": '{"output":"a.py\\n","metadata":{"exit_code":0,"duration_seconds":0.1}}'},
             _said("assistant", "One file: a.py.")]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "rollout.jsonl", map(json.dumps, lines)))
    assert corrupt == [] and [(s["session_id"], s["model"]) for s in sessions] == [("5973b6c0", None)]
    assert replay._render_history(sessions[0]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"},
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "shell", "arguments": '{"command":["bash","-lc","ls"]}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": lines[7]["output"]},
        {"role": "assistant", "content": "One file: a.py."}]
    assert [t.message_index for t in replay.recording_turns(sessions[0])[0]] == [3, 5]


def test_a_codex_compaction_without_its_history_goes_on_from_the_summary(tmp_path):
    """Each conversation takes the model in effect when it starts (or the first it names)."""
    line = lambda kind, payload: {"timestamp": "t", "type": kind, "payload": payload}  # noqa: E731
    lines = [line("session_meta", {"id": "s1"}), _rollout_item(_said("user", "hi")),
             line("turn_context", {"model": "o4-mini"}), _rollout_item(_said("assistant", "hello")),
             line("turn_context", {"model": "gpt-5"}), line("compacted", {"message": "We said hello."}),
             _rollout_item(_said("user", "bye")), _rollout_item(_said("assistant", "ciao"))]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "rollout.jsonl", map(json.dumps, lines)))
    assert corrupt == [] and [(s["session_id"], s["model"]) for s in sessions] == [("s1", "o4-mini"), ("s1#2", "gpt-5")]
    assert [(m["role"], m["content"]) for m in sessions[1]["messages"]] == [
        ("user", "We said hello."), ("user", "bye"), ("assistant", "ciao")]


def test_a_codex_line_that_cannot_be_read_is_skipped_saying_why_and_the_rollout_read(tmp_path):
    rollout = [json.dumps(line) for line in _codex_rollout()]
    bad = [_rollout_item({"type": "function_call", "arguments": "{}", "call_id": "c9"}),
           _rollout_item({"type": "message", "role": "user", "content": 3}),
           _rollout_item({"type": "function_call_output", "call_id": "c9", "output": {"content": "x"}}),
           _rollout_item({"type": "custom_tool_call", "name": "apply_patch", "input": None}),
           _rollout_item({"type": "local_shell_call", "action": "ls"}),
           {"timestamp": "t", "type": "response_item", "payload": "message"},
           {"timestamp": "t", "type": "session_meta", "payload": {"cwd": "/w"}},
           {"timestamp": "t", "type": "compacted", "payload": {"message": "s", "replacement_history": [
               {"type": "message", "content": []}]}}]
    lines = rollout[:5] + [json.dumps(b) for b in bad] + ["{broken"] + rollout[5:]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "rollout.jsonl", lines))
    assert [s["session_id"] for s in sessions] == ["019b", "019b#2"]
    assert replay._render_history(sessions[0]) == replay._render_history(
        replay.as_recording(codex_log.sessions_from_rollout(_codex_rollout())[0][1]))
    assert [(c.line, c.reason.split(":")[0]) for c in corrupt] == [
        (6, "a Codex function_call without a name"),
        (7, "a Codex message whose content is neither text nor parts"),
        (8, "a Codex function_call_output whose output is neither text nor parts"),
        (9, "a Codex custom_tool_call whose input is not text"),
        (10, "a Codex local_shell_call whose action is not an object"),
        (11, "a Codex response_item line whose payload is not an object"),
        (12, "a Codex session_meta without an id"),
        (13, "a Codex message without a role"),
        (14, "invalid JSON")]


def test_a_codex_conversation_that_cannot_be_read_is_skipped_under_its_last_line(tmp_path):
    lines = [_rollout_item(_said("user", "bad \ud800 half")), _rollout_item(_said("assistant", "ok")),
             {"timestamp": "t", "type": "event_msg", "payload": {"type": "token_count"}}]
    sessions, corrupt = replay.load_recordings(_write_lines(
        tmp_path / "rollout.jsonl", [json.dumps(_structured()), *map(json.dumps, lines)]))
    assert [s["session_id"] for s in sessions] == ["s-structured"]
    assert [(c.line, c.reason.split(" (")[0]) for c in corrupt] == [(3, "text that is not Unicode")]


def test_a_forked_rollout_is_one_session_named_by_its_own_meta(tmp_path):
    """A fork logs its own meta, then its parent's lines, metas too (an ancestor's wherever the
    parent logged it), as the history it went on from."""
    rollout = _codex_rollout()
    meta = {**rollout[0], "payload": {**rollout[0]["payload"], "id": "fork", "forked_from_id": "019b"}}
    lines = [meta, *rollout[:10], rollout[1], *rollout[10:]]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "fork.jsonl", map(json.dumps, lines)))
    parent, _ = replay.load_recordings(_write_lines(tmp_path / "parent.jsonl", map(json.dumps, rollout)))
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["fork", "fork#2"]
    assert [s["messages"] for s in sessions] == [s["messages"] for s in parent]


def test_one_file_mixing_every_format_reads_each_and_none_is_taken_for_another(tmp_path):
    """A session in the repository's format, OpenAI chat and Anthropic Messages sessions, a
    Claude Code log and a Codex rollout, interleaved: each line is read by its own reader."""
    claude = _claude_code_log()
    others = [_structured(), _openai_twin(_structured()), _anthropic_log(), _inline(), *claude]
    assert not any(codex_log.is_rollout_line(o) for o in others)
    assert all(codex_log.is_rollout_line(line) and not claude_code_log.is_event(line) for line in _codex_rollout())
    lines = [others[0], *_codex_rollout()[:12], *others[1:4], *claude, *_codex_rollout()[12:]]
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "mixed.jsonl", map(json.dumps, lines)))
    assert corrupt == []
    assert [(s["source"], s.get("session_id")) for s in sessions] == [
        ("unit", "s-structured"), (log_formats.UNNAMED_SOURCE, "s-structured#2"),
        (log_formats.UNNAMED_SOURCE, "session 3"),
        ("unit", "s-inline"), ("claude_code", "S"), ("claude_code", "S/ag1"), ("claude_code", "S#2"),
        ("codex", "019b"), ("codex", "019b#2")]
    alone, _ = replay.load_recordings(_write_lines(tmp_path / "r.jsonl", map(json.dumps, _codex_rollout())))
    assert sessions[-2:] == alone


def test_arguments_nested_as_deeply_as_json_reads_are_checked_without_recursion(tmp_path):
    deep = '{"a": ' * 600 + '"x"' + "}" * 600
    line = json.dumps({"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": deep}}]}]})
    lone = line.replace('\\"x\\"', '\\"\\\\ud800\\"')
    sessions, corrupt = replay.load_recordings(_write_lines(tmp_path / "t.jsonl", [line, lone]))
    assert len(sessions) == 1 and sessions[0]["messages"][0]["tool_calls"][0]["arguments_raw"] == deep
    assert [(c.line, c.reason.split(" (")[0]) for c in corrupt] == [(2, "text that is not Unicode")]


def test_a_recorded_call_whose_arguments_are_a_json_string_reads_as_the_object():
    """The recording format holds ``arguments`` as an object; a file that holds the JSON string
    instead is read as the OpenAI form is (parsed, the string kept raw), never written twice
    escaped."""
    session = _structured()
    as_string = json.loads(json.dumps(session))
    for m in as_string["messages"]:
        for c in m.get("tool_calls") or []:
            c["arguments"] = c.pop("arguments_raw", None) or json.dumps(c["arguments"])
    read = replay.as_recording(as_string)
    assert replay._render_history(read) == replay._render_history(session)
    assert replay.synthesize_tools(read["messages"]) == replay.synthesize_tools(session["messages"])


def _openai_twin(session: dict) -> dict:
    """``session`` as an OpenAI chat log: tool calls nested under ``function`` with string
    arguments, text as content parts, no ``tool_call_style`` and no ``source``."""
    messages = []
    for m in session["messages"]:
        out = {k: v for k, v in m.items() if k != "tool_calls"}
        if m["role"] == "user":
            out["content"] = [{"type": "text", "text": m["content"]}, {"type": "image_url"}]
        if m.get("tool_calls"):
            out["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
                "name": c["name"],
                "arguments": c.get("arguments_raw") or json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in m["tool_calls"]]
        messages.append(out)
    return {"session_id": session["session_id"], "messages": messages}


def test_an_openai_chat_log_reads_as_its_recording(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [json.dumps(_openai_twin(_structured()))])
    sessions, corrupt = replay.load_recordings(path)
    assert corrupt == [] and len(sessions) == 1
    read = sessions[0]
    assert read["source"] == log_formats.UNNAMED_SOURCE and read["tool_call_style"] == "structured"
    assert replay._render_history(read) == replay._render_history(_structured())
    assert replay.synthesize_tools(read["messages"]) == replay.synthesize_tools(_structured()["messages"])
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": "hello"}]}
    assert replay.as_recording(chat)["tool_call_style"] == "inline_text"


def test_an_openai_call_with_arguments_that_are_no_json_object_keeps_them_raw():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{broken"}}
    read = replay.as_recording({"messages": [{"role": "assistant", "tool_calls": [call]}]})
    assert read["messages"][0]["tool_calls"] == [
        {"id": "c", "name": "f", "arguments": {}, "arguments_raw": "{broken"}]
    nameless = {"type": "function", "function": {"arguments": "{}"}}
    assert replay._session_problem(replay.as_recording(
        {"messages": [{"role": "assistant", "tool_calls": [nameless]}]})) == "a tool call without a name"
    assert replay._session_problem(replay.as_recording(
        {"messages": [{"role": "assistant", "tool_calls": 5}]})) == "a message whose tool_calls is not a list"


def test_truncated_gzip_keeps_what_was_read(tmp_path):
    data = gzip.compress(("\n".join(json.dumps(_structured()) for _ in range(200)) + "\n").encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    sessions, corrupt = replay.load_recordings(path)
    assert 0 < len(sessions) < 200
    assert len(corrupt) == 1 and corrupt[0].reason.startswith("unreadable")


def test_a_gzip_stream_whose_data_is_corrupt_keeps_what_was_read(tmp_path):
    """Compressed data zlib cannot inflate (a flipped byte, here a block of a reserved type)
    ends the file's read with a skipped line, as a truncated stream does."""
    good = gzip.compress((json.dumps(_structured()) + "\n").encode())
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(good[:10] + b"\xff" * 40)
    sessions, corrupt = replay.load_recordings(path)
    assert sessions == [] and [(c.line, c.reason.split(":")[0]) for c in corrupt] == [(1, "unreadable")]
    assert "invalid block type" in corrupt[0].reason


# ----------------------------------------------------------------------------- tools

def test_synthesized_tools_union_keys_and_require_common_ones():
    tools = replay.synthesize_tools(_structured()["messages"])
    assert [t["function"]["name"] for t in tools] == ["find", "note"]
    find = tools[0]["function"]["parameters"]
    assert find["properties"] == {"who": {"type": "string"}, "limit": {"type": "number"}}
    assert find["required"] == ["who", "limit"]
    note = tools[1]["function"]["parameters"]
    assert note["properties"] == {"text": {"type": "string"}, "tags": {"type": "array"}}


def test_optional_keys_and_mixed_types():
    messages = [{"role": "assistant", "tool_calls": [
        {"name": "read", "arguments": {"path": "a", "offset": 1}},
        {"name": "read", "arguments": {"path": "b", "offset": "2"}},
        {"name": "read", "arguments": {"path": "c", "limit": True}}]}]
    params = replay.synthesize_tools(messages)[0]["function"]["parameters"]
    assert params["required"] == ["path"]
    assert params["properties"] == {"path": {"type": "string"}, "offset": {}, "limit": {"type": "boolean"}}


def test_session_without_tools_is_marked_synthesized_and_recorded_tools_are_kept():
    turns, origin = replay.recording_turns(_structured())
    assert origin == "synthesized" and all(t.tools_origin == "synthesized" for t in turns)
    assert [t["function"]["name"] for t in turns[0].tools] == ["find", "note"]
    recorded = [{"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}]
    turns, origin = replay.recording_turns(_structured(tools=recorded))
    assert origin == "recorded" and turns[0].tools == recorded
    assert replay.session_tools(_inline()) == (None, "none")
    assert replay.session_tools(_structured(tools=recorded)) == (recorded, "recorded")


# ----------------------------------------------------------------------------- history

def test_structured_turns_send_the_recorded_history():
    turns, _ = replay.recording_turns(_structured())
    # The second assistant message in a row is not a turn: nothing non-assistant precedes it.
    assert [(t.turn, t.message_index) for t in turns] == [(0, 2), (1, 5), (2, 7)]
    first, second = turns[0], turns[1]
    assert first.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "look up alice"}]
    assert first.expected["tool_calls"] == [{"name": "find", "arguments": {"who": "alice", "limit": 3}},
                                            {"name": "find", "arguments": {"who": "bob", "limit": 2.5}}]
    call_turn = second.messages[2]
    assert call_turn["role"] == "assistant"
    assert [c["id"] for c in call_turn["tool_calls"]] == ["c1", "c2"]
    # The raw argument string is sent where it was recorded, else the arguments as JSON.
    assert call_turn["tool_calls"][0]["function"]["arguments"] == '{"who":"alice","limit":3}'
    assert json.loads(call_turn["tool_calls"][1]["function"]["arguments"]) == {"who": "bob", "limit": 2.5}
    assert second.messages[3:] == [{"role": "tool", "tool_call_id": "c1", "content": "alice: 1"},
                                   {"role": "tool", "tool_call_id": "c2", "content": "bob: 2"}]
    # A tool result without an id binds to the pending call of the turn before it.
    third = turns[2].messages
    assert third[-1] == {"role": "tool", "tool_call_id": "call_5_0", "content": "noted"}
    assert third[-2]["tool_calls"][0]["id"] == "call_5_0"


def test_missing_call_ids_are_synthesized_and_bound_in_order():
    turns, _ = replay.recording_turns(_structured(ids=False))
    messages = turns[1].messages
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_2_0", "call_2_1"]
    # Recorded tool_call_ids are kept verbatim even when the calls had none.
    assert [m["tool_call_id"] for m in messages[3:]] == ["c1", "c2"]


def test_inline_sessions_send_results_as_user_messages_without_tools():
    turns, origin = replay.recording_turns(_inline())
    assert origin == "none" and turns[0].tools is None
    assert turns[1].messages[2:] == [{"role": "assistant", "content": "```bash\nls\n```"},
                                     {"role": "user", "content": "a.py"}]
    assert turns[0].expected == {"content": "```bash\nls\n```", "tool_calls": [], "tool_names": ["bash"]}


def test_select_turns_filters_sources_sessions_and_turns():
    sessions = [_structured(), _inline(), dict(_inline(), source="other", session_id="s3")]
    turns, notes = replay.select_turns(sessions, sources=None, max_sessions=2, turns_per_session=1)
    assert [(t.session_id, t.turn) for t in turns] == [("s-structured", 0), ("s-inline", 0)]
    assert [n["tools_origin"] for n in notes] == ["synthesized", "none"]
    turns, notes = replay.select_turns(sessions, sources=["other"], max_sessions=None, turns_per_session=None)
    assert [(t.session_id, t.turn) for t in turns] == [("s3", 0), ("s3", 1)]


def test_schedule_interleaves_and_alternates_the_first_arm():
    turns, _ = replay.recording_turns(_inline())
    plan = [(t.turn, rep, arm) for t, rep, arm in replay.schedule(turns, ["A", "B"], 2)]
    assert plan == [(0, 0, "A"), (0, 0, "B"), (0, 1, "B"), (0, 1, "A"),
                    (1, 0, "A"), (1, 0, "B"), (1, 1, "B"), (1, 1, "A")]


@pytest.mark.parametrize("n", [3, 4])
def test_schedule_balances_positions_over_several_arms(n):
    arms = ["A", "strict", "echo", "all"][:n]
    turns, _ = replay.recording_turns(_inline())
    plan = list(replay.schedule(turns, arms, n))  # 2 turns x n reps = 2n groups
    groups = [[arm for _, _, arm in plan[i:i + n]] for i in range(0, len(plan), n)]
    assert len(groups) == 2 * n
    assert all(sorted(g) == sorted(arms) for g in groups)
    assert all(len({(t.turn, rep) for t, rep, _ in plan[i:i + n]}) == 1 for i in range(0, len(plan), n))
    for end in range(2, len(groups) + 1, 2):  # every even number of groups: equal mean position
        assert {arm: sum(g.index(arm) for g in groups[:end]) for arm in arms} == \
            dict.fromkeys(arms, end * (n - 1) // 2)
    # a full cycle puts every arm at every position (first included) equally often
    assert all(sorted(g.index(arm) for g in groups) == sorted(list(range(n)) * 2) for arm in arms)


def test_candidate_arms_names_and_urls():
    assert replay.candidate_arms(["http://h:1"]) == {"B": "http://h:1"}
    assert replay.candidate_arms(["strict=http://h:1"]) == {"strict": "http://h:1"}
    assert replay.candidate_arms(["strict=http://h:1", "https://h:2/v1?key=x=y", "fill.all_2-x=http://h:3"]) == {
        "strict": "http://h:1", "B2": "https://h:2/v1?key=x=y", "fill.all_2-x": "http://h:3"}
    assert replay.candidate_arms(["http://h:1", "http://h:2"]) == {"B1": "http://h:1", "B2": "http://h:2"}
    assert list(replay.candidate_arms(["z=http://h:1", "a=http://h:2"])) == ["z", "a"]


@pytest.mark.parametrize(("values", "needle"), [
    (["A=http://h:1"], "'A' is the reference arm"),
    (["s=http://h:1", "s=http://h:2"], "'s' is given twice"),
    (["B2=http://h:1", "http://h:2"], "'B2' is given twice"),
    (["strict=127.0.0.1:8402"], "neither URL nor NAME=URL"),
    (["bad name=http://h:1"], "neither URL nor NAME=URL"),
])
def test_candidate_arms_rejects_bad_values(values, needle):
    with pytest.raises(UserError, match=needle):
        replay.candidate_arms(values)


# ----------------------------------------------------------------------------- command errors

def test_bad_input_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert main(["replay", "--sessions", str(missing), "--url", "http://127.0.0.1:9"]) == 2
    assert "no such transcripts file" in capsys.readouterr().err
    only_corrupt = _write_lines(tmp_path / "bad.jsonl", ["{oops"])
    assert main(["ab", "--sessions", str(only_corrupt), "--url-a", "http://127.0.0.1:9",
                 "--url-b", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "holds no session (1 corrupt lines, line 1: invalid JSON" in err and err.count("\n") == 1
    good = _write_lines(tmp_path / "good.jsonl", [json.dumps(_inline())])
    assert main(["replay", "--sessions", str(good), "--url", "http://127.0.0.1:9", "--turns", "0"]) == 2
    assert main(["ab", "--sessions", str(good), "--url-a", "http://127.0.0.1:9",
                 "--url-b", "x=http://127.0.0.1:9", "--url-b", "x=http://127.0.0.1:8"]) == 2
    assert "'x' is given twice" in capsys.readouterr().err


def test_no_turn_to_replay_says_why_and_what_to_do(tmp_path, capsys):
    good = _write_lines(tmp_path / "good.jsonl", [json.dumps(_inline())])
    argv = ["replay", "--sessions", str(good), "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "o")]
    assert main([*argv, "--source", "other"]) == 2
    assert capsys.readouterr().err == (f"mlx-fill replay: no session of --source other in {good}; "
                                       f"pass one of its sources: unit\n")
    no_reply = _write_lines(tmp_path / "no_reply.jsonl", [json.dumps(
        {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": "hello"}]})])
    assert main(["replay", *argv[1:], "--sessions", str(no_reply)]) == 2
    assert capsys.readouterr().err == (f"mlx-fill replay: no assistant turn to replay in {no_reply}; "
                                       f"pass sessions with assistant replies\n")
    assert not (tmp_path / "o").exists()


def test_unreachable_endpoint_is_recorded_not_raised(tmp_path, capsys):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="x", timeout=5, max_retries=0)
    turn = replay.recording_turns(_inline())[0][0]
    for stream in (True, False):
        reply = replay.request_turn(client, "m", turn, max_tokens=4, temperature=0.0, stream=stream)
        assert reply.error and reply.error.startswith("APIConnectionError")
    good = _write_lines(tmp_path / "good.jsonl", [json.dumps(_inline())])
    out = tmp_path / "out"
    assert main(["replay", "--sessions", str(good), "--url", f"http://127.0.0.1:{free_port()}",
                 "--timeout", "5", "--out", str(out)]) == 1
    assert "every request failed" in capsys.readouterr().err
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["run", "turn", "turn"]
    assert all(r["error"] for r in records[1:])


def test_a_sessions_name_that_is_not_utf8_is_written_with_escapes(tmp_path, capsys):
    """A sessions file whose name holds bytes that are not UTF-8, in a folder: the run's header
    names it, and the file of its skipped line, with ``\\xff`` escapes (the runs file is
    UTF-8 text)."""
    folder = tmp_path / "logs"
    folder.mkdir()
    _write_lines(folder / os.fsdecode(b"bad\xff.jsonl"), [json.dumps(_inline()), "{broken"])
    out = tmp_path / "out"
    for sessions in (folder, folder / os.fsdecode(b"bad\xff.jsonl")):
        shutil.rmtree(out, ignore_errors=True)
        assert main(["replay", "--sessions", str(sessions), "--url", f"http://127.0.0.1:{free_port()}",
                     "--timeout", "5", "--out", str(out)]) == 1
        header = json.loads((out / "runs.jsonl").read_text(encoding="utf-8").splitlines()[0])
        assert header["sessions_file"] == os.fsencode(sessions).decode("utf-8", "backslashreplace")
        assert [c["file"] for c in header["corrupt_lines"]] == ["bad\\xff.jsonl" if sessions == folder else ""]
    capsys.readouterr()


# ----------------------------------------------------------------------------- end to end

def _tiny_model_dir(root: Path) -> Path:
    """The trained qwen3 fixture when it emits tool calls, else a seeded random-weight qwen3."""
    from mlx_fill.assets import store as assets
    from mlx_fill.assets import fixtures

    if fixtures.fixture_emits_calls("qwen3-json"):
        return fixtures.fixture_path("qwen3-json")
    import mlx.core as mx

    from mlx_fill.assets import random_models

    # The real Qwen3 vocabulary (every id the tokenizer produces has a row), otherwise minimal:
    # prefill of multi-thousand-token recorded prompts must stay cheap on 2 CPU cores.
    config = dict(random_models.config_for("qwen3"), vocab_size=151936, tie_word_embeddings=True,
                  hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64)
    model, config = random_models.build(config, dtype=mx.float32, seed=0)
    out = random_models.save(model, config, root / "tiny-qwen3")
    family = assets.family_dir("qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(family / name, out / name)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-server")
    model_dir = _tiny_model_dir(root)
    port = free_port()
    command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port)]
    with running_server(command, port, log=root / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def sessions_file(tmp_path_factory):
    """Two real structured sessions (one with a tools array, one without; the shortest of each,
    so the server's prefills stay cheap) and a corrupt line."""
    picked: dict[str, str] = {}
    with gzip.open(TRANSCRIPTS, "rt", encoding="utf-8") as fh:
        for line in fh:
            session = json.loads(line)
            structured = session["tool_call_style"] == "structured"
            wanted = "tools" if session.get("tools") else "no-tools" if structured else None
            line = line.strip()
            if wanted and (wanted not in picked or len(line) < len(picked[wanted])):
                picked[wanted] = line
    path = tmp_path_factory.mktemp("replay-sessions") / "two.jsonl"
    return _write_lines(path, [picked["tools"], '{"source": "broken', picked["no-tools"]])


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replay_end_to_end(server, sessions_file, tmp_path, capsys):
    out = tmp_path / "replay"
    code = main(["replay", "--sessions", str(sessions_file), "--url", server, "--turns", "2",
                 "--max-tokens", "6", "--no-stream", "--out", str(out)])
    assert code == 0
    assert "line 2 skipped" in capsys.readouterr().err
    header, *turns = _records(out / "runs.jsonl")
    assert header["kind"] == "run" and header["corrupt_lines"][0]["line"] == 2
    assert [s["tools_origin"] for s in header["sessions"]] == ["recorded", "synthesized"]
    assert len(turns) == 4 and not any(t["error"] for t in turns)
    for t in turns:
        assert t["arm"] == "replay"
        assert 0 < t["usage"]["completion_tokens"] <= 6
        assert t["usage"]["prompt_tokens"] > 100
        assert t["usage"]["fill"] is None
        assert t["timing"]["wall_s"] > 0
    result = json.loads((out / "report.json").read_text())
    assert result["verdict"] is None and result["arms"]["replay"]["requests"] == 4
    assert (out / "report.md").read_text().startswith("# mlx-fill replay report")


def test_sessions_logged_without_a_name_replay_as_sessions_of_their_own(server, sessions_file,
                                                                        tmp_path, capsys):
    """OpenAI and Anthropic logs name no session: each is replayed and reported on its own."""
    lines = [json.loads(line) for line in sessions_file.read_text().splitlines()
             if not line.startswith('{"source": "broken')]
    for session in lines:
        session.pop("session_id", None)
    unnamed = _write_lines(tmp_path / "unnamed.jsonl", [json.dumps(s) for s in lines])
    out = tmp_path / "replay"
    code = main(["replay", "--sessions", str(unnamed), "--url", server, "--turns", "1",
                 "--max-tokens", "4", "--no-stream", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    _, *turns = _records(out / "runs.jsonl")
    assert [t["session_id"] for t in turns] == ["session 1", "session 2"]
    assert json.loads((out / "report.json").read_text())["arms"]["replay"]["requests"] == 2


def test_every_session_read_holds_a_name_of_its_own(tmp_path):
    one = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    named = dict(one, session_id="a")
    path = _write_lines(tmp_path / "s.jsonl", [json.dumps(x) for x in (one, named, named, one)])
    sessions, _ = replay.load_recordings(path)
    assert [s["session_id"] for s in sessions] == ["session 1", "a", "a#2", "session 4"]


def test_ab_end_to_end(server, sessions_file, tmp_path, capsys):
    out = tmp_path / "ab"
    code = main(["ab", "--sessions", str(sessions_file), "--url-a", server, "--url-b", server + "/v1",
                 "--turns", "2", "--reps", "2", "--max-tokens", "6", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "verdict:" in printed and "over 8 pairs" in printed
    turns = _records(out / "runs.jsonl")[1:]
    assert [t["arm"] for t in turns[:4]] == ["A", "B", "B", "A"]
    assert not any(t["error"] for t in turns)
    # a first-token time exactly when something streamed (a call still open at max_tokens streams
    # nothing: mlx_lm.server holds tool-call text back until the call closes)
    assert all((t["timing"]["ttft_s"] is None) == (not t["output"]["content"] and not t["output"]["tool_calls"])
               for t in turns)
    result = json.loads((out / "report.json").read_text())
    # One server behind both arms, greedy decoding: the arms must produce the same outputs.
    assert result["paired"]["identical_outputs"] == 8
    assert result["paired"]["agreement"]["a_only"] == result["paired"]["agreement"]["b_only"] == 0
    assert code == (0 if result["verdict"]["pass"] else 1)
    assert (out / "wall_ratio.png").is_file()


def test_ab_end_to_end_with_several_candidates(server, sessions_file, tmp_path, capsys):
    out = tmp_path / "abc"
    code = main(["ab", "--sessions", str(sessions_file), "--url-a", server, "--url-b", f"strict={server}",
                 "--url-b", server + "/v1", "--turns", "1", "--max-tokens", "4", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed[:2]] == ["verdict strict", "verdict B2"]
    assert all("over 2 pairs" in line for line in printed[:2])
    header, *turns = _records(out / "runs.jsonl")
    assert header["urls"] == {"A": server, "strict": server, "B2": server + "/v1"}
    assert [t["arm"] for t in turns] == ["A", "strict", "B2", "B2", "strict", "A"]
    assert not any(t["error"] for t in turns)
    result = json.loads((out / "report.json").read_text())
    assert "paired" not in result and list(result["candidates"]) == ["strict", "B2"]
    # One server behind every arm, greedy decoding: every candidate matches A.
    assert all(c["paired"]["identical_outputs"] == 2 for c in result["candidates"].values())
    assert code == (0 if result["verdict"]["pass"] else 1)
    assert "### B2 vs A:" in (out / "report.md").read_text()


@pytest.mark.slow
def test_ab_fill_off_vs_all_on_the_fixture_model(tmp_path, capsys):
    """Acceptance: ``mlx-fill ab`` between ``mlx-fill serve --fill off`` and ``--fill all`` on the
    trained qwen3 fixture completes >= 20 paired turns, prints the verdict, and (greedy decoding,
    lossless fill) both arms produce the same output on every pair."""
    from mlx_fill.assets import fixtures

    model_dir = fixtures.fixture_path("qwen3-json")
    urls = {}
    with contextlib.ExitStack() as stack:
        for mode in ("off", "all"):
            port = free_port()
            command = [sys.executable, "-m", "mlx_fill.cli", "serve", "--model", str(model_dir),
                       "--fill", mode, "--host", "127.0.0.1", "--port", str(port)]
            urls[mode] = stack.enter_context(running_server(
                command, port, log=tmp_path / f"serve-{mode}.log", ready_path="/health"))
        out = tmp_path / "ab"
        code = main(["ab", "--sessions", str(TRANSCRIPTS), "--url-a", urls["off"], "--url-b", urls["all"],
                     "--source", "tau_bench_gpt4o_airline", "--max-sessions", "10", "--turns", "2",
                     "--max-tokens", "96", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "verdict:" in printed
    result = json.loads((out / "report.json").read_text())
    paired = result["paired"]
    assert paired["pairs"] >= 20 and paired["left_out_records"] == 0
    assert paired["identical_outputs"] == paired["pairs"]
    assert result["arms"]["B"]["fill_reported"] == result["arms"]["B"]["requests"]
    assert code == (0 if result["verdict"]["pass"] else 1)


def test_the_older_function_call_form_reads_as_a_tool_call_and_its_result():
    chat = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}]}
    read = replay.as_recording(chat)
    assert read["tool_call_style"] == "structured"
    assert read["messages"][1]["tool_calls"] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}, "arguments_raw": '{"city": "Paris"}'}]
    assert "function_call" not in read["messages"][1]
    history = replay._render_history(read)
    assert history[2] == {"role": "tool", "tool_call_id": history[1]["tool_calls"][0]["id"],
                          "content": "sunny"}
