"""API-proxy logs (``{"request": BODY, "response": RESPONSE}`` per line) read as sessions:
the request's conversation and the response's assistant message, a conversation a later
line goes on from dropped, lines without a reply skipped saying why."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_fill.evidence import claude_code_log, codex_log, log_formats, proxy_log, replay

SYSTEM = "be brief"
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _openai_call(cid: str, command: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "bash",
                                                         "arguments": json.dumps({"command": command})}}


def _openai_exchange(messages: list[dict], reply: dict, rid: str = "chatcmpl-1") -> dict:
    """An OpenAI chat-completions request and its completion, as a proxy logs them."""
    return {"request": {"model": "gpt-4o", "tools": TOOLS, "messages": messages},
            "response": {"id": rid, "object": "chat.completion", "model": "gpt-4o-2024-08-06",
                         "choices": [{"index": 0, "finish_reason": "stop", "message": {
                             "role": "assistant", "refusal": None, **reply}}]}}


def _agent_openai() -> list[dict]:
    """An agent's three requests: each repeats the history and adds the last reply's result."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list files"}]
    first = {"content": None, "tool_calls": [_openai_call("c1", "ls")]}
    second = {"content": "Reading.", "tool_calls": [_openai_call("c2", "cat a.py")]}
    lines = [_openai_exchange(history, first, "r1")]
    history = [*history, {"role": "assistant", **first}, {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]
    lines.append(_openai_exchange(history, second, "r2"))
    history = [*history, {"role": "assistant", **second},
               {"role": "tool", "tool_call_id": "c2", "content": "x = 1"}]
    lines.append(_openai_exchange(history, {"content": "a.py sets x."}, "r3"))
    return lines


def test_an_openai_exchange_reads_as_its_conversation_and_reply(tmp_path):
    line = _agent_openai()[1]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [line]))
    assert corrupt == [] and len(sessions) == 1
    read = sessions[0]
    conversation = {"messages": [*line["request"]["messages"], line["response"]["choices"][0]["message"]],
                    "tools": TOOLS}
    assert read["source"] == log_formats.UNNAMED_SOURCE and read["tool_call_style"] == "structured"
    assert (read["session_id"], read["model"], read["tools"]) == ("r2", "gpt-4o", TOOLS)
    assert replay._render_history(read) == replay._render_history(log_formats.as_recording(conversation))
    assert [t.message_index for t in replay.recording_turns(read)[0]] == [2, 4]


def _anthropic_exchange(messages: list[dict], content: list[dict], rid: str) -> dict:
    """An Anthropic Messages request and its response as an HTTP gateway logs them: the
    request with its method and path, the body as JSON text, the response under its status."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 1024,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}],
            "messages": messages}
    return {"timestamp": "2026-01-01T00:00:00Z",
            "request": {"method": "POST", "path": "/v1/messages", "body": json.dumps(body)},
            "response": {"status_code": 200, "body": {
                "id": rid, "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929",
                "content": content, "stop_reason": "end_turn", "usage": {"input_tokens": 9}}}}


def test_an_anthropic_exchange_reads_and_a_conversation_a_later_line_goes_on_from_is_dropped(tmp_path):
    """Claude Code sends its reply back with the thinking and cache marks it was given: the
    conversation is the same, so the first line adds nothing to the second."""
    thinking = {"type": "thinking", "thinking": "look", "signature": "s"}
    call = {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}
    user = {"role": "user", "content": [{"type": "text", "text": "list files"}]}
    first = _anthropic_exchange([user], [thinking, call], "m1")
    echoed = {"role": "assistant", "content": [thinking, {**call, "cache_control": {"type": "ephemeral"}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]}
    second = _anthropic_exchange([user, echoed, result], [{"type": "text", "text": "One file."}], "m2")
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [first, second]))
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["m2"]
    assert replay._render_history(sessions[0]) == [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
        {"role": "assistant", "content": "One file."}]
    assert sessions[0]["model"] == "claude-sonnet-4-5"
    assert sessions[0]["tools"][0]["function"]["parameters"] == {"type": "object"}


def test_only_conversations_no_later_line_goes_on_from_are_kept(tmp_path):
    """An agent's requests, a retry logged twice, a branch from the first reply, another
    system prompt over the same messages, and another file's line: the last of each."""
    first, second, third = _agent_openai()
    branch = json.loads(json.dumps(second))
    branch["request"]["messages"][-1]["content"] = "b.py"
    other_system = json.loads(json.dumps(second))
    other_system["request"]["messages"][0]["content"] = "be thorough"
    lines = [first, second, branch, other_system, third, third]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", lines))
    assert corrupt == [] and [len(s["messages"]) for s in sessions] == [5, 5, 7]
    assert [s["messages"][3]["content"] for s in sessions] == ["b.py", "a.py", "a.py"]
    assert sessions[1]["messages"][0]["content"] == "be thorough"
    (tmp_path / "d").mkdir()
    _write(tmp_path / "d" / "one.jsonl", [first])
    _write(tmp_path / "d" / "two.jsonl", [third])
    assert len(replay.load_recordings(tmp_path / "d")[0]) == 2  # files are not compared


def test_the_same_conversation_with_other_tools_is_another_conversation(tmp_path):
    first, second, _ = _agent_openai()
    first["request"]["tools"] = [*TOOLS, {"type": "function", "function": {"name": "grep", "parameters": {}}}]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [first, second]))
    assert corrupt == [] and len(sessions) == 2


def test_an_exchange_without_a_reply_is_a_skipped_line_saying_why(tmp_path):
    request = _agent_openai()[0]["request"]
    sse = 'data: {"id":"x","object":"chat.completion.chunk","choices":[]}\n\ndata: [DONE]\n\n'
    lines = [{"request": request, "response": sse},
             {"request": request, "response": [{"object": "chat.completion.chunk", "choices": []}]},
             {"request": request, "response": {"error": {"message": "Rate limit reached", "type": "requests"}}},
             {"request": request, "response": {"type": "error", "error": {
                 "type": "overloaded_error", "message": "Overloaded"}}},
             {"request": request, "response": {"status_code": 529, "body": "upstream overloaded"}},
             {"request": request, "response": {"id": "r", "object": "chat.completion", "choices": []}},
             {"request": request, "response": {"input_tokens": 12}},
             {"request": {"model": "gpt-4o", "input": "hi"}, "response": _agent_openai()[2]["response"]},
             {"custom_id": "q1", "response": None, "error": {"code": "batch_expired", "message": "expired"}},
             _agent_openai()[2]]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", lines))
    assert [s["session_id"] for s in sessions] == ["r3"]
    assert [(c.line, c.reason.split(" (")[0]) for c in corrupt] == [
        (1, "a response without an assistant message"), (2, "a streamed response cut off before its end"),
        (3, "an error response"),
        (4, "an error response"), (5, "an error response"), (6, "a response without an assistant message"),
        (7, "a response without an assistant message"), (8, "a request of no API read here"),
        (9, "an exchange without a response")]
    assert "Overloaded" in corrupt[3].reason and "529" in corrupt[4].reason


def test_a_batch_output_line_reads_its_completion_with_the_request_beside_it(tmp_path):
    """OpenAI's batch output wraps the completion as ``{"status_code", "request_id", "body"}``."""
    line = _agent_openai()[2]
    wrapped = {"id": "batch_req_1", "custom_id": "q1", "request": {"method": "POST", "url": "/v1/chat/completions",
                                                                   "body": line["request"]},
               "response": {"status_code": 200, "request_id": "req_1", "body": line["response"]}, "error": None}
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [wrapped]))
    plain, _ = replay.load_recordings(_write(tmp_path / "q.jsonl", [line]))
    assert corrupt == [] and sessions == plain


def test_exchange_lines_are_taken_for_no_other_format_and_other_lines_read_beside_them():
    lines = _agent_openai() + [_anthropic_exchange([{"role": "user", "content": "hi"}], [], "m")]
    assert all(proxy_log.is_exchange(line) for line in lines)
    assert not any(claude_code_log.is_event(line) or codex_log.is_rollout_line(line) for line in lines)
    assert not proxy_log.is_exchange({"messages": [], "request": {}, "response": {}})


def test_a_file_mixing_exchanges_and_sessions_reads_both(tmp_path):
    session = {"source": "unit", "session_id": "s", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    first, second, third = _agent_openai()
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [first, session, second, third]))
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["s", "r3"]
