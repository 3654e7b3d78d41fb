"""OpenAI Responses API lines of API-proxy logs (``POST /v1/responses``) read as sessions: the
request's items and the response's output items are the chat messages the Codex reader makes
of the same items, ``instructions`` a system message, function tools in the chat form; a
line that goes on from an earlier line's response (``previous_response_id``) holds that line's
conversation; a streamed response reads as the response logged whole; a response that did
not complete, a stream cut off before its end, and a conversation the server holds are
skipped lines saying why.

Shapes as the API gives them. The request (``model``, ``instructions``, ``input`` text or
items, ``tools``, ``previous_response_id``, ``prompt``; a previous response's instructions are
not carried over) and its items (an input message with or without ``type``, ``function_call``
and its ``function_call_output``, ``local_shell_call`` with its ``action`` and the
``local_shell_call_output`` naming the call by ``id``, ``item_reference`` with ``type``
optional): openai/openai-python ``src/openai/types/responses/response_create_params.py`` and
``response_input_item_param.py``. The response (``object: "response"``, ``status``: completed,
failed, in_progress, cancelled, queued or incomplete, ``incomplete_details.reason``,
``error``): its ``response.py``. The stream: ``response.completed`` carries the whole response
(https://docs.rs/crate/openai-client-base/latest/source/docs/ResponseCompletedEvent.md),
``response.output_item.done`` an output item whole
(https://v03.api.js.langchain.com/interfaces/_langchain_openai.OpenAIClient.Responses.ResponseOutputItemDoneEvent.html),
the ``error`` event its ``code`` and ``message`` at the top level
(https://rubydoc.info/github/openai/openai-ruby/OpenAI/Models/Responses/ResponseErrorEvent);
a server may end a stream with a ``response.completed`` whose ``output`` is empty, the items
given by ``response.output_item.done`` alone, as Codex CLI's own test stream does (openai/codex
``codex-rs/core/tests/cli_responses_fixture.sse``: Codex takes its items from those events).
Codex's items (reasoning with ``encrypted_content``, ``custom_tool_call`` ``apply_patch``) are
those of the rollout in ``test_replay.py``. The built-in ``shell`` and ``apply_patch`` tools
(``{"type": "shell", "environment"?}``, ``{"type": "apply_patch"}``), their ``shell_call`` and
``shell_call_output`` (entries of ``stdout``, ``stderr`` and an ``exit`` or ``timeout``
``outcome``), ``apply_patch_call`` and ``apply_patch_call_output`` (``output`` optional), and
the ``mcp`` tool with its ``mcp_list_tools`` (``tools`` of ``name``, ``input_schema``,
``description``?, ``annotations``?; ``error``?), ``mcp_call`` (``id``, ``server_label``,
``name``, ``arguments`` text, ``output``?, ``error``?: an object, text in SDKs before
f38355e, ``status``?, ``approval_request_id``?), ``mcp_approval_request`` and
``mcp_approval_response`` items: openai-python's ``function_shell_tool_param.py``,
``apply_patch_tool_param.py``, ``tool_param.py``, ``response_function_shell_tool_call.py``,
``response_function_shell_tool_call_output.py``, ``response_apply_patch_tool_call.py``,
``response_apply_patch_tool_call_output.py``, ``response_output_item.py``,
``response_input_item_param.py`` and ``mcp_tool_call_error.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_fill.evidence import codex_log, log_formats, proxy_log, replay

SYSTEM = "You are a coding agent."
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
TOOLS = [{"type": "function", "name": "shell", "description": "run a command", "parameters": SCHEMA,
          "strict": False},
         {"type": "custom", "name": "apply_patch", "description": "edit files",
          "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
         {"type": "local_shell"},
         {"type": "web_search"}]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "shell", "description": "run a command", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "apply_patch", "description": "edit files", "parameters": {
        "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}},
    {"type": "function", "function": {"name": "local_shell", "parameters": {"type": "object"}}}]
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "**Listing**"}],
             "encrypted_content": "gAAA"}
CUT_OFF = "a streamed response cut off before its end"


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _said(role: str, text: str) -> dict:
    """A message item: the model's as the API returns it, any other as an input item."""
    if role == "assistant":
        return {"type": "message", "id": f"msg_{len(text)}", "status": "completed", "role": role,
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def _call(cid: str, command: str) -> dict:
    return {"type": "function_call", "id": f"fc_{cid}", "call_id": cid, "name": "shell",
            "arguments": json.dumps({"command": command}), "status": "completed"}


def _output(cid: str, text: str) -> dict:
    return {"type": "function_call_output", "call_id": cid, "output": text}


def _response(rid: str, output: list[dict], status: str = "completed", **fields) -> dict:
    return {"id": rid, "object": "response", "created_at": 1, "status": status, "error": None,
            "incomplete_details": None, "model": "gpt-5-2025-08-07", "output": output,
            "usage": {"input_tokens": 9, "output_tokens": 5, "total_tokens": 14}, **fields}


def _line(given, output: list[dict], rid: str, **request) -> dict:
    """A Responses API request and its response as a proxy logs them."""
    return {"request": {"model": "gpt-5", "instructions": SYSTEM, "input": given, "tools": TOOLS,
                        "store": False, **request},
            "response": _response(rid, output)}


TURNS = [  # (what the agent adds to the input, what the model gives)
    ([_said("user", "list files")], [REASONING, _call("c1", "ls")]),
    ([_output("c1", "a.py")], [_said("assistant", "Reading."), _call("c2", "cat a.py")]),
    ([_output("c2", "x = 1")], [_said("assistant", "a.py sets x.")]),
]
HISTORY = [  # the conversation the agent's last line holds, as chat messages
    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "list files"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    {"role": "assistant", "content": "Reading.", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "shell", "arguments": '{"command": "cat a.py"}'}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "x = 1"},
    {"role": "assistant", "content": "a.py sets x."}]


def _resending_agent() -> list[dict]:
    """A stateless agent's lines (``store: false``): each input holds the whole history, the
    model's items (reasoning too) sent back as it gave them."""
    lines, history = [], []
    for number, (added, output) in enumerate(TURNS, 1):
        history = [*history, *added]
        lines.append(_line(history, output, f"resp_{number}"))
        history = [*history, *output]
    return lines


def _chaining_agent() -> list[dict]:
    """The same agent letting the server keep the history: each line after the first sends only
    what it adds, naming the response it goes on from."""
    return [_line(added, output, f"resp_{number}",
                  **({"previous_response_id": f"resp_{number - 1}"} if number > 1 else {}))
            for number, (added, output) in enumerate(TURNS, 1)]


def test_a_responses_line_reads_as_its_conversation_and_the_items_the_model_gave(tmp_path):
    line = _resending_agent()[2]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [line]))
    assert corrupt == [] and len(sessions) == 1
    read = sessions[0]
    assert (read["session_id"], read["model"], read["tools"]) == ("resp_3", "gpt-5", CHAT_TOOLS)
    assert read["source"] == log_formats.UNNAMED_SOURCE and read["tool_call_style"] == "structured"
    assert replay._render_history(read) == HISTORY
    turns, origin = replay.recording_turns(read)
    assert origin == "recorded" and [t.message_index for t in turns] == [2, 4, 6]
    assert proxy_log.is_exchange(line) and not codex_log.is_rollout_line(line)


def test_the_items_read_as_the_codex_reader_reads_them(tmp_path):
    """Every item kind either reader meets, in a request and its output and in a rollout: the
    same chat messages (reasoning and web searches dropped, calls in the assistant message
    the model's items between two inputs make, an output as parts read as its text, a
    ``local_shell_call_output`` bound to the call its ``id`` names)."""
    patch = {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch",
             "input": "*** Begin Patch\n-a - b\n+a + b\n*** End Patch"}
    shell = {"type": "local_shell_call", "id": "lsh_1", "call_id": "c4", "status": "completed",
             "action": {"type": "exec", "command": ["ruff", "check"], "env": {}}}
    given = [_said("developer", "ask first"), _said("user", "fix a.py"), REASONING, _said("assistant", "Fixing."),
             patch, {"type": "custom_tool_call_output", "call_id": "c3", "output": [
                 {"type": "input_text", "text": "Succ"}, {"type": "input_text", "text": "ess."}]},
             {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
             _said("assistant", "Fixed."), _said("assistant", "Linting."), shell,
             {"type": "local_shell_call_output", "id": "c4", "output": "All checks passed!"}]
    output = [REASONING, _said("assistant", "Clean."), _call("c5", "git status")]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [_line(given, output, "resp_1")]))
    rollout = [{"timestamp": "t", "type": "session_meta", "payload": {"id": "s"}},
               *({"timestamp": "t", "type": "response_item", "payload": item} for item in [*given, *output])]
    codex, _ = replay.load_recordings(_write(tmp_path / "rollout.jsonl", rollout))
    assert corrupt == [] and sessions[0]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert sessions[0]["messages"][1:] == codex[0]["messages"]
    assert [(m["role"], m["content"]) for m in replay._render_history(sessions[0])] == [
        ("system", SYSTEM), ("system", "ask first"), ("user", "fix a.py"), ("assistant", "Fixing."),
        ("tool", "Success."), ("assistant", "Fixed.\n\nLinting."), ("tool", "All checks passed!"),
        ("assistant", "Clean.")]
    assert [c["function"]["name"] for m in replay._render_history(sessions[0]) for c in m.get("tool_calls", [])] == [
        "apply_patch", "local_shell", "shell"]


def test_text_input_and_input_messages_without_a_type_read_as_messages(tmp_path):
    """``input`` as text is one user message; an input message may leave out ``type`` and give
    its content as text; a ``system`` message stays one, after the instructions."""
    lines = [_line("hi", [_said("assistant", "hello")], "resp_1", instructions=None),
             _line([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                   [_said("assistant", "hello")], "resp_2", tools=[])]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", lines))
    assert corrupt == [] and [replay._render_history(s) for s in sessions] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "system", "content": SYSTEM}, {"role": "system", "content": "be brief"},
         {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
    assert [s["tool_call_style"] for s in sessions] == ["structured", "inline_text"]


def test_an_agent_resending_its_history_is_one_conversation(tmp_path):
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", _resending_agent()))
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["resp_3"]
    assert replay._render_history(sessions[0]) == HISTORY


def test_a_line_going_on_from_an_earlier_response_holds_its_conversation(tmp_path):
    """``previous_response_id`` names an earlier line's response: the line's conversation is
    that one's and its own input and output, so the earlier lines, which it holds whole, are
    dropped; it reads as the agent that resends its history."""
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", _chaining_agent()))
    resent, _ = replay.load_recordings(_write(tmp_path / "q.jsonl", _resending_agent()))
    assert corrupt == [] and sessions == resent


def test_the_last_requests_instructions_are_the_system_prompt_of_a_chained_line(tmp_path):
    """A previous response's instructions are not carried over: a line that changes them holds
    another conversation than the line it goes on from, and both are kept; two lines going on
    from one response are two branches."""
    first, second, third = _chaining_agent()
    second["request"]["instructions"] = "be thorough"
    branch = json.loads(json.dumps(third))
    branch["request"]["previous_response_id"] = "resp_1"
    branch["response"]["id"] = "resp_4"
    branch["request"]["input"] = [_output("c1", "b.py")]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [first, second, third, branch]))
    assert corrupt == [] and [s["session_id"] for s in sessions] == ["resp_2", "resp_3", "resp_4"]
    assert [m["content"] for m in sessions[0]["messages"][:2]] == ["be thorough", "list files"]
    assert replay._render_history(sessions[1]) == HISTORY
    assert [m["content"] for m in replay._render_history(sessions[2])] == [
        SYSTEM, "list files", "", "b.py", "a.py sets x."]


def test_a_conversation_the_server_holds_is_a_skipped_line_saying_so(tmp_path):
    """A response no earlier line of the file holds (a log that starts mid-conversation, a
    response on another file), a stored conversation or prompt, or an item named by reference."""
    first, second, _ = _chaining_agent()
    lines = [second, first,
             _line("hi", [_said("assistant", "hello")], "resp_5", conversation="conv_1"),
             _line("hi", [_said("assistant", "hello")], "resp_6", prompt={"id": "pmpt_1", "version": "2"}),
             _line([{"type": "item_reference", "id": "msg_1"}, _said("user", "hi")], [_said("assistant", "yo")], "r7"),
             _line([{"id": "msg_1"}, _said("user", "hi")], [_said("assistant", "yo")], "resp_8")]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", lines))
    assert [s["session_id"] for s in sessions] == ["resp_1"]
    assert [c.line for c in corrupt] == [1, 3, 4, 5, 6]
    assert all(c.reason.startswith("a Responses API request that goes on from what the server holds")
               for c in corrupt)
    assert [c.reason.split(" (")[1].split(":")[0].split(" ")[0] for c in corrupt] == [
        "previous_response_id", "conversation", "prompt", "item_reference", "item_reference"]


# ----------------------------------------------------------------------------- built-in tools the agent runs

ACTION = {"commands": ["cat a.py", "pytest -q"], "timeout_ms": 120000, "max_output_length": 4096}
UPDATE = {"type": "update_file", "path": "a.py", "diff": "@@\n-x = a - b\n+x = a + b\n"}
DELETE = {"type": "delete_file", "path": "b.py"}
SLEEP = {"commands": ["sleep 999"], "timeout_ms": 1000, "max_output_length": None}
BUILT_IN = [  # a GPT-5.1 agent's turns with the shell and apply_patch tools, the items as the SDK types them
    _said("user", "fix a.py"),
    {"type": "shell_call", "id": "sh_1", "call_id": "c1", "action": ACTION, "status": "completed"},
    {"type": "shell_call_output", "id": "sho_1", "call_id": "c1", "status": "completed", "max_output_length": 4096,
     "output": [{"stdout": "x = a - b\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}},
                {"stdout": "", "stderr": "1 failed", "outcome": {"type": "exit", "exit_code": 1}}]},
    _said("assistant", "Fixing."),
    {"type": "apply_patch_call", "id": "ap_1", "call_id": "c2", "status": "completed", "operation": UPDATE},
    {"type": "apply_patch_call", "id": "ap_2", "call_id": "c3", "status": "completed", "operation": DELETE},
    {"type": "apply_patch_call_output", "call_id": "c2", "status": "completed", "output": "Updated a.py"},
    {"type": "apply_patch_call_output", "call_id": "c3", "status": "failed", "output": None},
    {"type": "shell_call", "call_id": "c4", "action": SLEEP, "status": "completed"},
    {"type": "shell_call_output", "call_id": "c4", "output": [
        {"stdout": "", "stderr": "", "outcome": {"type": "timeout"}}]},
    _said("assistant", "Fixed.")]
BUILT_IN_TOOLS = [{"type": "shell", "environment": {"type": "local"}}, {"type": "apply_patch"},
                  {"type": "mcp", "server_label": "docs", "server_url": "https://docs.example/mcp",
                   "require_approval": "never"}]


def _built_in_call(cid: str, name: str, arguments: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


BUILT_IN_HISTORY = [  # as chat messages, the instructions first
    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "fix a.py"},
    {"role": "assistant", "content": "", "tool_calls": [_built_in_call("c1", "shell", ACTION)]},
    {"role": "tool", "tool_call_id": "c1", "content": "x = a - b\nexit code 0\n1 failed\nexit code 1"},
    {"role": "assistant", "content": "Fixing.", "tool_calls": [
        _built_in_call("c2", "apply_patch", UPDATE), _built_in_call("c3", "apply_patch", DELETE)]},
    {"role": "tool", "tool_call_id": "c2", "content": "Updated a.py"},
    {"role": "tool", "tool_call_id": "c3", "content": "failed"},
    {"role": "assistant", "content": "", "tool_calls": [_built_in_call("c4", "shell", SLEEP)]},
    {"role": "tool", "tool_call_id": "c4", "content": "timed out"},
    {"role": "assistant", "content": "Fixed."}]


def test_the_shell_and_apply_patch_tools_calls_read_as_calls_and_their_outputs_as_tool_messages(tmp_path):
    """A ``shell_call`` is a call of ``shell`` whose arguments are its ``action``, an
    ``apply_patch_call`` one of ``apply_patch`` whose arguments are its ``operation``, as
    given; an output is a ``tool`` message bound by ``call_id``: a shell output's entries as
    their stdout, stderr and outcome each starting a line, a patch output without an
    ``output`` as its status. The same in a Responses API line, in a Codex rollout, and in a
    rollout written before the envelope."""
    line = _line(BUILT_IN[:-1], BUILT_IN[-1:], "resp_1", tools=BUILT_IN_TOOLS, model="gpt-5.1")
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", [line]))
    assert corrupt == [] and len(sessions) == 1
    assert replay._render_history(sessions[0]) == BUILT_IN_HISTORY
    enveloped = [{"timestamp": "t", "type": "session_meta", "payload": {"id": "s"}},
                 *({"timestamp": "t", "type": "response_item", "payload": item} for item in BUILT_IN)]
    bare = [{"id": "s", "timestamp": "t"}, *BUILT_IN]
    for name, rollout in (("rollout.jsonl", enveloped), ("bare.jsonl", bare)):
        codex, corrupt = replay.load_recordings(_write(tmp_path / name, rollout))
        assert corrupt == [] and replay._render_history(codex[0]) == BUILT_IN_HISTORY[1:], name
    assert all(codex_log.is_rollout_line(item) for item in BUILT_IN[1:-1])
    turns, origin = replay.recording_turns(sessions[0])
    assert origin == "recorded" and [t.expected["tool_calls"] for t in turns[:3]] == [
        [{"name": "shell", "arguments": ACTION}],
        [{"name": "apply_patch", "arguments": UPDATE}, {"name": "apply_patch", "arguments": DELETE}],
        [{"name": "shell", "arguments": SLEEP}]]


def test_the_shell_and_apply_patch_tools_are_functions_taking_what_their_calls_are_read_as(tmp_path):
    """``{"type": "shell"}`` and ``{"type": "apply_patch"}`` are function tools whose schemas
    are their calls' ``action`` and ``operation`` (the SDK's ``Action`` and ``Operation``);
    an ``mcp`` tool, a server whose tools no ``mcp_list_tools`` item lists here, is none. The
    recording renders through a template with them and its strict rows compile for both
    tools."""
    from mlx_fill.assets.store import load_tokenizer
    from mlx_fill.evidence.transcripts import markers, render_recording
    from mlx_fill.strict.source import compile_strict

    line = _line(BUILT_IN[:-1], BUILT_IN[-1:], "resp_1", tools=BUILT_IN_TOOLS, model="gpt-5.1")
    (session,), _ = replay.load_recordings(_write(tmp_path / "p.jsonl", [line]))
    assert session["tools"] == [
        {"type": "function", "function": {"name": "shell", "parameters": {"type": "object", "properties": {
            "commands": {"type": "array", "items": {"type": "string"}}, "timeout_ms": {"type": ["integer", "null"]},
            "max_output_length": {"type": ["integer", "null"]}}, "required": ["commands"]}}},
        {"type": "function", "function": {"name": "apply_patch", "parameters": {"type": "object", "properties": {
            "type": {"type": "string", "enum": ["create_file", "update_file", "delete_file"]},
            "path": {"type": "string"}, "diff": {"type": "string"}}, "required": ["type", "path"]}}}]
    tok = load_tokenizer("qwen3")
    rendered = render_recording(session, tok, markers(tok))
    assert rendered.tools_origin == "recorded" and len(rendered.turns) == 4
    first = tok.decode(rendered.tokens[rendered.turns[0].start:rendered.turns[0].end])
    assert json.dumps({"name": "shell", "arguments": ACTION}) in first
    compiled = compile_strict(tok, rendered.messages[:rendered.turns[0].message_index], rendered.tools)
    assert compiled is not None and list(compiled.table.tools) == ["shell", "apply_patch"]


def test_a_tool_named_as_an_earlier_one_is_dropped_so_the_tools_stay_a_valid_set():
    """A function ``shell`` beside the built-in ``shell`` (or a custom ``apply_patch`` beside
    the built-in) would be two tools of one name, which no strict table takes: the first wins."""
    from mlx_fill.evidence.responses_items import chat_tools
    from mlx_fill.strict.schema import tool_schemas

    tools = chat_tools([{"type": "function", "name": "shell", "parameters": {"type": "object"}},
                        {"type": "shell"}, {"type": "apply_patch"},
                        {"type": "custom", "name": "apply_patch"}])
    assert [(t["function"]["name"], t["function"]["parameters"]) for t in tools] == [
        ("shell", {"type": "object"}), ("apply_patch", tools[1]["function"]["parameters"])]
    assert tools[1]["function"]["parameters"]["required"] == ["type", "path"]
    assert len(tool_schemas(tools)) == 2


# ----------------------------------------------------------------------------- MCP servers' tools

SEARCH = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
FETCH = {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}
MCP_SERVERS = [{"type": "mcp", "server_label": "docs", "server_url": "https://docs.example/mcp",
                "require_approval": "never"},
               {"type": "mcp", "server_label": "wiki", "server_url": "https://wiki.example/mcp"},
               {"type": "mcp", "server_label": "down", "server_url": "https://down.example/mcp"}]
LISTINGS = [  # what the servers list, as the response's first items: a name listed twice, or named as a
    # declared function, is the first tool of that name; a server that could not list gives none
    {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "docs", "tools": [
        {"name": "search_docs", "input_schema": SEARCH, "description": "Search the docs",
         "annotations": {"readOnlyHint": True}},
        {"name": "fetch_page", "input_schema": FETCH, "annotations": None}], "error": None},
    {"type": "mcp_list_tools", "id": "mcpl_2", "server_label": "wiki", "tools": [
        {"name": "search_docs", "input_schema": {"type": "object"}, "description": "Search the wiki"},
        {"name": "shell", "input_schema": {"type": "object"}}]},
    {"type": "mcp_list_tools", "id": "mcpl_3", "server_label": "down", "tools": [],
     "error": "Error retrieving tool list from MCP server: 'down'"}]


def _mcp_call(cid: str, name: str, arguments: dict, **result) -> dict:
    return {"type": "mcp_call", "id": cid, "server_label": "docs", "name": name, "arguments": json.dumps(arguments),
            **result}


HTTP_ERROR = {"type": "http_error", "code": 404, "message": "Not Found"}
APPROVAL = {"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "wiki", "name": "search_docs",
            "arguments": '{"q": "Y"}'}
MCP_TURNS = [  # (what the agent adds to the input, what the model gives) as the SDK types them
    ([_said("user", "how do I configure X?")],
     [*LISTINGS, _mcp_call("mcp_1", "search_docs", {"q": "X"}, output="x.toml: enabled = true", error=None,
                           status="completed"),
      _mcp_call("mcp_2", "fetch_page", {"url": "/x"}, output=None, error=HTTP_ERROR, status="failed"),
      _said("assistant", "X is set in x.toml.")]),
    ([_said("user", "and Y?")], [APPROVAL]),  # the call waits for the user's approval
    ([{"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True}],
     [{**_mcp_call("mcp_3", "search_docs", {"q": "Y"}, status="completed"), "server_label": "wiki",
       "approval_request_id": "mcpr_1"},
      _mcp_call("mcp_4", "fetch_page", {"url": "/y"}, error="Request timed out"),  # as earlier SDKs typed it
      _call("c1", "cat y.toml")])]
MCP_HISTORY = [  # the conversation the agent's last line holds, as chat messages
    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "how do I configure X?"},
    {"role": "assistant", "content": "", "tool_calls": [_built_in_call("mcp_1", "search_docs", {"q": "X"})]},
    {"role": "tool", "tool_call_id": "mcp_1", "content": "x.toml: enabled = true"},
    {"role": "assistant", "content": "", "tool_calls": [_built_in_call("mcp_2", "fetch_page", {"url": "/x"})]},
    {"role": "tool", "tool_call_id": "mcp_2", "content": json.dumps(HTTP_ERROR)},
    {"role": "assistant", "content": "X is set in x.toml."}, {"role": "user", "content": "and Y?"},
    {"role": "assistant", "content": "", "tool_calls": [_built_in_call("mcp_3", "search_docs", {"q": "Y"})]},
    {"role": "tool", "tool_call_id": "mcp_3", "content": ""},
    {"role": "assistant", "content": "", "tool_calls": [_built_in_call("mcp_4", "fetch_page", {"url": "/y"})]},
    {"role": "tool", "tool_call_id": "mcp_4", "content": "Request timed out"},
    {"role": "assistant", "content": "", "tool_calls": [_built_in_call("c1", "shell", {"command": "cat y.toml"})]}]
MCP_CHAT_TOOLS = [CHAT_TOOLS[0],
                  {"type": "function", "function": {"name": "search_docs", "description": "Search the docs",
                                                    "parameters": SEARCH}},
                  {"type": "function", "function": {"name": "fetch_page", "parameters": FETCH}}]
AWAITING = "a response without an assistant message (no output item of a message or a call)"


def _mcp_agent(chained: bool) -> list[dict]:
    """An agent given a function and three MCP servers, resending its history, or letting the
    server keep it: then its last line goes on from its first with the question the approval
    was asked for (a line going on from the line awaiting approval, which holds no
    conversation, would be none to read)."""
    tools = [TOOLS[0], *MCP_SERVERS]
    if chained:
        (first, output), _, (_, last) = MCP_TURNS
        return [_line(first, output, "resp_1", tools=tools),
                _line([_said("user", "and Y?")], last, "resp_3", tools=tools, previous_response_id="resp_1")]
    lines, history = [], []
    for number, (added, output) in enumerate(MCP_TURNS, 1):
        history = [*history, *added]
        lines.append(_line(history, output, f"resp_{number}", tools=tools))
        history = [*history, *output]
    return lines


def test_an_mcp_call_reads_as_a_call_and_its_result_and_the_listed_tools_as_functions(tmp_path):
    """An ``mcp_call`` is a call of the function named as its ``name`` (arguments as written,
    bound by its ``id``) followed by a ``tool`` message of its output, else its error (an
    object as its JSON text, text as written), else empty text; the next item the model gives
    starts another assistant message. The tools ``mcp_list_tools`` items list follow the
    request's, the first of a name kept. Approval requests and responses add nothing: the line
    awaiting approval is a skipped line, the call read where the server made it."""
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", _mcp_agent(chained=False)))
    assert [(c.line, c.reason) for c in corrupt] == [(2, AWAITING)] and len(sessions) == 1
    assert replay._render_history(sessions[0]) == MCP_HISTORY
    assert sessions[0]["tools"] == MCP_CHAT_TOOLS
    turns, origin = replay.recording_turns(sessions[0])
    assert origin == "recorded" and [t.expected["tool_calls"] for t in turns[:2]] == [
        [{"name": "search_docs", "arguments": {"q": "X"}}], [{"name": "fetch_page", "arguments": {"url": "/x"}}]]
    chained, corrupt = replay.load_recordings(_write(tmp_path / "c.jsonl", _mcp_agent(chained=True)))
    assert corrupt == [] and chained == sessions


def test_the_tools_an_earlier_response_listed_are_the_tools_of_a_line_going_on_from_it(tmp_path):
    """The API lists an MCP server's tools once, in a response: a later line naming that
    response has them among its tools, one naming none has only its own; a request declaring
    no tools has those the listing in its input gives."""
    first, last = _mcp_agent(chained=True)
    assert proxy_log.exchange_session(first)["tools"] == MCP_CHAT_TOOLS
    assert proxy_log.exchange_session({**last, "request": {**last["request"], "previous_response_id": None}})[
        "tools"] == CHAT_TOOLS[:1]
    given = {**first, "request": {**first["request"], "tools": None, "input": [
        *first["request"]["input"], LISTINGS[0]]}, "response": _response("resp_1", [_said("assistant", "ok")])}
    assert proxy_log.exchange_session(given)["tools"] == MCP_CHAT_TOOLS[1:]


def test_a_conversation_of_mcp_calls_renders_through_a_template_and_its_strict_rows_compile(tmp_path):
    from mlx_fill.assets.store import load_tokenizer
    from mlx_fill.evidence.transcripts import markers, render_recording
    from mlx_fill.strict.source import compile_strict

    (session,), _ = replay.load_recordings(_write(tmp_path / "p.jsonl", _mcp_agent(chained=True)))
    tok = load_tokenizer("qwen3")
    rendered = render_recording(session, tok, markers(tok))
    assert rendered.tools_origin == "recorded" and len(rendered.turns) == 6
    first = tok.decode(rendered.tokens[rendered.turns[0].start:rendered.turns[0].end])
    assert json.dumps({"name": "search_docs", "arguments": {"q": "X"}}) in first
    compiled = compile_strict(tok, rendered.messages[:rendered.turns[0].message_index], rendered.tools)
    assert compiled is not None and list(compiled.table.tools) == ["shell", "search_docs", "fetch_page"]


def test_a_codex_rollout_reads_mcp_calls_as_a_responses_line_does(tmp_path):
    """The same calls and results; the rollout's session has no tools (a rollout logs none of
    the model's, and the listed ones alone would stand for all): they are synthesized from its
    calls, the MCP tools' among them."""
    items = [item for added, output in MCP_TURNS for item in (*added, *output)]
    rollout = [{"timestamp": "t", "type": "session_meta", "payload": {"id": "s"}},
               *({"timestamp": "t", "type": "response_item", "payload": item} for item in items)]
    (session,), corrupt = replay.load_recordings(_write(tmp_path / "rollout.jsonl", rollout))
    assert corrupt == [] and replay._render_history(session) == MCP_HISTORY[1:] and "tools" not in session
    tools, origin = replay.session_tools(session)
    assert origin == "synthesized" and [t["function"]["name"] for t in tools] == ["search_docs", "fetch_page", "shell"]
    assert codex_log.is_rollout_line(MCP_TURNS[0][1][3])


# ----------------------------------------------------------------------------- streamed

def _events(response: dict) -> list[dict]:
    """The events the API streams ``response`` in: created, in progress, per output item its
    ``added``, its deltas and its ``done``, then ``response.completed`` with it whole."""
    events = [{"type": "response.created", "response": {**response, "status": "in_progress", "output": []}},
              {"type": "response.in_progress", "response": {**response, "status": "in_progress", "output": []}}]
    for index, item in enumerate(response["output"]):
        at = {"output_index": index, "item_id": item.get("id")}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [{"type": "response.output_item.added", "output_index": index, "item": {**item, "content": []}},
                       {"type": "response.content_part.added", **at, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}},
                       *({"type": "response.output_text.delta", **at, "content_index": 0, "delta": text[i:i + 3]}
                         for i in range(0, len(text), 3)),
                       {"type": "response.output_text.done", **at, "content_index": 0, "text": text}]
        elif item["type"] == "function_call":
            events += [{"type": "response.output_item.added", "output_index": index, "item": {**item, "arguments": ""}},
                       *({"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"][i:i + 4]}
                         for i in range(0, len(item["arguments"]), 4)),
                       {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": response})
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def _sse(events: list[dict]) -> str:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def _ended_without_output(events: list[dict]) -> list[dict]:
    """As a server that gives the items only in their ``output_item.done`` events."""
    return [*events[:-1], {**events[-1], "response": {**events[-1]["response"], "output": []}}]


FORMS = {  # how a proxy logs a stream's events
    "server-sent events": _sse,
    "a list of events": lambda events: events,
    "a list of events as JSON text": json.dumps,
    "events in an HTTP envelope": lambda events: {"status_code": 200, "headers": {
        "content-type": "text/event-stream"}, "body": _sse(events)},
    "a response.completed without its output": lambda events: _sse(_ended_without_output(events)),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("turn", [0, 1, 2])
def test_a_streamed_responses_line_reads_as_the_line_logged_whole(tmp_path, turn, form):
    whole = _resending_agent()[turn]
    streamed = {**whole, "response": FORMS[form](_events(whole["response"]))}
    assert proxy_log.exchange_session(streamed) == proxy_log.exchange_session(whole)
    read = replay.load_recordings(_write(tmp_path / "s.jsonl", [streamed]))
    assert read == replay.load_recordings(_write(tmp_path / "w.jsonl", [whole])) and read[1] == []


def test_a_streamed_responses_agent_chains_and_drops_as_a_whole_one(tmp_path):
    lines = [{**line, "response": _sse(_events(line["response"]))} for line in _chaining_agent()]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "p.jsonl", lines))
    assert corrupt == [] and replay._render_history(sessions[0]) == HISTORY and len(sessions) == 1


# ----------------------------------------------------------------------------- not read

def test_a_response_that_did_not_complete_or_a_stream_cut_off_is_a_skipped_line_saying_why(tmp_path):
    """Failed (whole, a ``response.failed`` event, an ``error`` event, an HTTP error), not
    finished (``incomplete`` for a token limit, whole or streamed; still ``in_progress``), or
    cut off before its end (no ``response.completed``, ``response.failed`` or
    ``response.incomplete``, the log ending at an event or inside one)."""
    line = _resending_agent()[1]
    events = _events(line["response"])
    failed = _response("resp_2", [], "failed", error={"code": "server_error", "message": "The server had an error"})
    incomplete = _response("resp_2", line["response"]["output"][:1], "incomplete",
                           incomplete_details={"reason": "max_output_tokens"})
    responses = [failed,
                 [*events[:4], {"type": "response.failed", "response": failed}],
                 _sse([*events[:4], {"type": "error", "code": "rate_limit_exceeded", "message": "Slow down",
                                     "param": None, "sequence_number": 4}]),
                 {"status_code": 429, "body": {"error": {"message": "Rate limit reached", "type": "requests"}}},
                 incomplete,
                 [*events[:4], {"type": "response.incomplete", "response": incomplete}],
                 _response("resp_2", [], "in_progress"),
                 events[:-1],
                 _sse(events)[:_sse(events).index('"type": "response.completed"') + 20]]
    reasons = [proxy_log.exchange_session({**line, "response": response}) for response in responses]
    assert reasons[:4] == ["an error response (server_error: The server had an error)"] * 2 + [
        "an error response (rate_limit_exceeded: Slow down)",
        "an error response (requests: Rate limit reached)"]
    assert reasons[4:7] == ["a response that did not complete (status incomplete: max_output_tokens)"] * 2 + [
        "a response that did not complete (status in_progress)"]
    assert [r.split(" (")[0] for r in reasons[7:]] == [CUT_OFF] * 2
    sessions, corrupt = replay.load_recordings(_write(
        tmp_path / "p.jsonl", [{**line, "response": response} for response in responses]))
    assert sessions == [] and [c.reason for c in corrupt] == reasons


def test_a_responses_stream_that_cannot_be_joined_is_a_skipped_line_saying_why():
    line = _resending_agent()[1]
    events = _events(line["response"])
    lines = {"a response.completed event without its response": [*events[:-1], {"type": "response.completed"}],
             "a response.output_item.done event without its item": _ended_without_output(
                 [{**event, "item": None} if event["type"] == "response.output_item.done" else event
                  for event in events])}
    for why, response in lines.items():
        reason = proxy_log.exchange_session({**line, "response": response})
        assert reason.startswith("a streamed response that cannot be joined into a message") and why in reason


def test_a_line_whose_items_cannot_be_read_is_skipped_saying_why():
    """As a Codex rollout's line is, the items named as the API's."""
    lines = [_line([{"type": "function_call", "call_id": "c9", "arguments": "{}"}], [_said("assistant", "ok")], "r1"),
             _line([_said("user", "hi")], [{"type": "message", "role": "assistant", "content": 3}], "r2"),
             _line(3, [_said("assistant", "ok")], "r3"),
             _line("hi", [REASONING], "r4"),
             _line("hi", "ok", "r5")]
    assert [proxy_log.exchange_session(line) for line in lines] == [
        "a Responses API function_call without a name",
        "a Responses API message whose content is neither text nor parts",
        "a Responses API request whose input is neither text nor a list of items",
        "a response without an assistant message (no output item of a message or a call)",
        "a response without an assistant message (no output item of a message or a call)"]


COMMANDS = "shell_call whose action's commands are not a list of text"
ENTRIES = ("shell_call_output whose output is neither text nor entries of stdout, stderr and an outcome "
           "(an exit code or a timeout)")
OPERATION = ("apply_patch_call whose operation is not a create_file, update_file or delete_file of a path as "
             "text (with a diff as text, but to delete)")
PATCHED = "apply_patch_call_output whose output is neither text nor parts (nor absent, with a status)"
MALFORMED = [  # a built-in tool's call or output that cannot be read, and why
    ({**BUILT_IN[1], "action": "cat a.py"}, "shell_call whose action is not an object"),
    ({**BUILT_IN[1], "action": {"commands": "cat a.py"}}, COMMANDS),
    ({**BUILT_IN[1], "action": {"commands": ["ls", 1]}}, COMMANDS),
    ({**BUILT_IN[2], "output": {"stdout": "a.py"}}, ENTRIES),
    *(({**BUILT_IN[2], "output": [entry]}, ENTRIES) for entry in [
        "a.py", {"stdout": "a.py", "stderr": ""}, {"stdout": "a.py", "outcome": {"type": "timeout"}},
        {"stdout": "a.py", "stderr": "", "outcome": {"type": "exit"}},
        {"stdout": "a.py", "stderr": "", "outcome": {"type": "exit", "exit_code": True}},
        {"stdout": "a.py", "stderr": "", "outcome": {"type": "killed"}}]),
    ({**BUILT_IN[4], "operation": "*** Begin Patch"}, "apply_patch_call whose operation is not an object"),
    *(({**BUILT_IN[4], "operation": operation}, OPERATION) for operation in [
        {**UPDATE, "type": "rename_file"}, {**UPDATE, "path": None}, {"type": "create_file", "path": "c.py"}]),
    ({**BUILT_IN[6], "output": 3}, PATCHED),
    ({"type": "apply_patch_call_output", "call_id": "c2"}, PATCHED)]
SEARCH_CALL = MCP_TURNS[0][1][3]
LISTED = "mcp_list_tools whose tools are not a list of tools with names as text"
MCP_MALFORMED = [  # an MCP server's call or list of tools that cannot be read, and why
    *(({**SEARCH_CALL, "name": name}, "mcp_call without a name") for name in (None, 3)),
    ({k: v for k, v in SEARCH_CALL.items() if k != "name"}, "mcp_call without a name"),
    ({k: v for k, v in SEARCH_CALL.items() if k != "id"}, "mcp_call without an id"),
    *(({**SEARCH_CALL, "arguments": arguments}, "mcp_call whose arguments are not a JSON string")
      for arguments in (None, {"q": "X"})),
    ({**SEARCH_CALL, "output": ["x.toml"]}, "mcp_call whose output is neither text nor null"),
    ({**SEARCH_CALL, "output": None, "error": 404}, "mcp_call whose error is neither text, an object nor null"),
    *(({**LISTINGS[0], "tools": tools}, LISTED) for tools in (
        None, "search_docs", {"name": "search_docs"}, ["search_docs"], [{"input_schema": SEARCH}],
        [*LISTINGS[0]["tools"], {"name": 3, "input_schema": SEARCH}])),
    ({k: v for k, v in LISTINGS[2].items() if k != "tools"}, LISTED)]


@pytest.mark.parametrize(("item", "why"), [*MALFORMED, *MCP_MALFORMED])
def test_a_tools_call_output_or_list_that_cannot_be_read_is_a_skipped_line_saying_why(tmp_path, item, why):
    """A built-in tool's call or output, an MCP server's call or list of tools: in a
    Responses API line's input or output and in a Codex rollout (its line skipped, the rest
    read)."""
    assert proxy_log.exchange_session(_line([_said("user", "hi"), item], [_said("assistant", "ok")], "r1")) == (
        f"a Responses API {why}")
    assert proxy_log.exchange_session(_line([_said("user", "hi")], [item], "r1")) == f"a Responses API {why}"
    rollout = [{"timestamp": "t", "type": "session_meta", "payload": {"id": "s"}},
               *({"timestamp": "t", "type": "response_item", "payload": i} for i in
                 [_said("user", "hi"), item, _said("assistant", "ok")])]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "rollout.jsonl", rollout))
    assert [(c.line, c.reason) for c in corrupt] == [(3, f"a Codex {why}")]
    assert [m["content"] for m in sessions[0]["messages"]] == ["hi", "ok"]

def test_items_taken_from_done_events_are_each_output_item_once_in_its_order():
    """Where ``response.completed`` holds no items, the output is the items of the
    ``response.output_item.done`` events by their ``output_index``: an event logged twice is
    its item once, events out of order give the items in order; an index left out before the
    last one the events give, two events that differ for one index, or an index that is no
    index, are a skipped line saying so, not an output short of an item or with one twice."""
    line = _resending_agent()[1]
    events = _ended_without_output(_events(line["response"]))
    done = [i for i, e in enumerate(events) if e["type"] == "response.output_item.done"]
    whole = proxy_log.exchange_session(line)
    twice = [*events[:done[0] + 1], events[done[0]], *events[done[0] + 1:]]
    swapped = list(events)
    swapped[done[0]], swapped[done[1]] = events[done[1]], events[done[0]]
    for response in (twice, swapped, _sse(twice)):
        assert proxy_log.exchange_session({**line, "response": response}) == whole
    other = {**events[done[0]], "item": _said("assistant", "Writing.")}
    broken = {"response.output_item.done events without output item 0":
                  [e for i, e in enumerate(events) if i != done[0]],
              "two response.output_item.done events for output item 0 that differ":
                  [*events[:done[0] + 1], other, *events[done[0] + 1:]],
              "a response.output_item.done event whose output_index is not a non-negative integer":
                  [{**e, "output_index": "0"} if i == done[0] else e for i, e in enumerate(events)],
              "response.output_item.done events without output item 1":
                  [{**e, "output_index": 10 ** 30} if i == done[1] else e for i, e in enumerate(events)]}
    for why, response in broken.items():
        assert proxy_log.exchange_session({**line, "response": response}) == (
            f"a streamed response that cannot be joined into a message ({why})")


def test_a_responses_stream_with_payloads_of_another_api_is_a_skipped_line_saying_so():
    """The chunks of a chat completion among its events are not passed over."""
    line = _resending_agent()[1]
    events = _events(line["response"])
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}}]}
    assert proxy_log.exchange_session({**line, "response": [*events[:3], chunk, *events[3:]]}) == (
        "a streamed response that cannot be joined into a message (payloads of more than one API: "
        "chat.completion.chunk objects, Responses API events)")


def test_an_item_without_a_type_is_a_skipped_line_not_an_item_dropped(tmp_path):
    """An item of a type no reader knows adds nothing (a built-in tool's call); one without a
    type is no item to read, and its line is skipped saying so, in a Responses API line and
    in a Codex rollout alike (the reply it held was read as no reply)."""
    untyped = [{k: v for k, v in _said("assistant", "Reading.").items() if k != "type"},
               {**_call("c2", "cat a.py"), "type": None}, {**_output("c1", "a.py"), "type": 7}]
    lines = [_line([_said("user", "hi")], [untyped[0]], "r1"), _line([_said("user", "hi")], [untyped[1]], "r2"),
             _line([_said("user", "hi"), untyped[2]], [_said("assistant", "ok")], "r3")]
    assert [proxy_log.exchange_session(line) for line in lines] == ["a Responses API item without a type"] * 3
    rollout = [{"timestamp": "t", "type": "session_meta", "payload": {"id": "s"}},
               *({"timestamp": "t", "type": "response_item", "payload": item}
                 for item in [_said("user", "hi"), *untyped, _said("assistant", "ok")])]
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "rollout.jsonl", rollout))
    assert [(c.line, c.reason) for c in corrupt] == [(n, "a Codex item without a type") for n in (3, 4, 5)]
    assert [m["content"] for m in sessions[0]["messages"]] == ["hi", "ok"]


def test_only_a_response_without_a_status_or_completed_is_taken_for_completed():
    """A status that is not ``completed`` (empty text, a list, false, 0) says nothing of the
    model completing: the line is skipped naming it, not read as a completed response."""
    line = _resending_agent()[1]
    assert isinstance(proxy_log.exchange_session({**line, "response": {**line["response"], "status": None}}), dict)
    reasons = [proxy_log.exchange_session({**line, "response": {**line["response"], "status": status}})
               for status in ("", [], False, 0)]
    assert reasons == [f"a response that did not complete (status {said})" for said in ('""', "[]", "false", "0")]


def _agent(turns: int, chained: bool) -> list[dict]:
    """An agent's lines over ``turns`` turns (a call and its output each), letting the server
    keep the conversation (``chained``) or resending it."""
    lines, history = [], []
    for turn in range(1, turns + 1):
        added = [_said("user", "go")] if turn == 1 else [_output(f"c{turn - 1}", f"out {turn - 1}")]
        output = [_said("assistant", f"step {turn}"), _call(f"c{turn}", f"run {turn}")]
        history = [*history, *added]
        chain = {"previous_response_id": f"resp_{turn - 1}"} if chained and turn > 1 else {}
        lines.append(_line(added if chained else history, output, f"resp_{turn}", **chain))
        history = [*history, *output]
    return lines


def _converted(monkeypatch) -> list[int]:
    """The length of every session the loader converts to a recording, as it converts them."""
    lengths, convert = [], replay.as_recording
    monkeypatch.setattr(replay, "as_recording", lambda obj: lengths.append(len(obj["messages"])) or convert(obj))
    return lengths


def test_a_chain_reads_as_the_history_resent_and_in_work_linear_in_its_lines(tmp_path, monkeypatch):
    """A line that a later line holds whole by going on from its response is not read itself:
    a chain of n lines converts and compares the messages of its last line, not n²/2 (a chain
    of 2,000 lines read in 95 s and 2.5 GB), and reads as the agent that resends its history."""
    resent, _ = replay.load_recordings(_write(tmp_path / "r.jsonl", _agent(30, chained=False)))
    chained, corrupt = replay.load_recordings(_write(tmp_path / "c.jsonl", _agent(30, chained=True)))
    assert corrupt == [] and chained == resent and len(chained[0]["messages"]) == 1 + 2 * 30
    converted = _converted(monkeypatch)
    sessions, corrupt = replay.load_recordings(_write(tmp_path / "long.jsonl", _agent(600, chained=True)))
    assert corrupt == [] and [len(s["messages"]) for s in sessions] == [1 + 2 * 600]
    assert sum(converted) < 10 * 600


def test_a_chain_on_a_line_that_cannot_be_read_is_skipped_line_by_line_in_linear_work(tmp_path, monkeypatch):
    """Every line of a chain holds what the lines before it hold: text that is not Unicode in
    one makes it and each line after it a skipped line saying so, found without reading each
    whole; the conversation of the line before it is read."""
    why = "text that is not Unicode (a lone surrogate escape such as \\ud800)"
    for bad in (0, 299):
        lines = _agent(600, chained=True)
        lines[bad]["response"]["output"][0]["content"][0]["text"] = "step \ud800"
        converted = _converted(monkeypatch)
        sessions, corrupt = replay.load_recordings(_write(tmp_path / "c.jsonl", lines))
        before, _ = replay.load_recordings(_write(tmp_path / "b.jsonl", lines[:bad]))
        assert sessions == before and [(c.line, c.reason) for c in corrupt] == [(n, why) for n in range(bad + 1, 601)]
        assert sum(converted) < 10 * 600
