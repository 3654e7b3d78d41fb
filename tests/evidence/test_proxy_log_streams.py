"""Streamed responses in API-proxy logs read as the message they stream: a streamed line and
the same exchange logged whole are the same recording; a stream cut off before its end, or one
that carries an error, is a skipped line saying so.

OpenAI's chunks are the ones ``mlx-fill serve`` sent the ``openai`` client
(``captured/mlx_fill_serve.jsonl``, see its README) and ones built in their shape: choice 0's
``delta`` carries ``content`` pieces and ``tool_calls`` pieces by ``index`` (the first piece
of a call with its ``id``, ``type`` and ``function.name``, later ones more of
``function.arguments``), the last chunk of the choice its ``finish_reason``, then the usage
chunk (``choices: []``) and ``data: [DONE]``. Anthropic's events are built as its Messages
streaming docs give them (https://docs.claude.com/en/api/messages-streaming): ``message_start``
(the message, ``content`` empty), per content block a ``content_block_start``, its
``content_block_delta`` events (``text_delta``, ``input_json_delta`` whose ``partial_json``
pieces join into the ``tool_use`` or ``server_tool_use`` input, ``thinking_delta``,
``signature_delta``, ``citations_delta``; a ``redacted_thinking`` or server tool result block
starts whole) and a ``content_block_stop``, ``message_delta`` (``stop_reason``),
``message_stop``; ``ping`` events anywhere; an ``error`` event such as ``overloaded_error``
mid-stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_fill.evidence import proxy_log, replay

CAPTURED = Path(__file__).parent / "captured" / "mlx_fill_serve.jsonl"
HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": "bash", "input_schema": OPENAI_TOOLS[0]["function"]["parameters"]}]
CUT_OFF = "a streamed response cut off before its end"


def _read(folder: Path, line: dict) -> tuple[list[dict], list[replay.CorruptLine]]:
    """The recordings of a proxy log of one line."""
    path = folder / f"{len(list(folder.iterdir()))}.jsonl"
    path.write_text(json.dumps(line) + "\n")
    return replay.load_recordings(path)


def _same_recording(folder: Path, streamed: dict, whole: dict) -> None:
    """The streamed line and the whole one hold the same reply (thinking included, which the
    recording drops) and read as the same recording."""
    assert proxy_log.exchange_session(streamed) == proxy_log.exchange_session(whole)
    read, whole_read = _read(folder, streamed), _read(folder, whole)
    assert read == whole_read and read[1] == [] and len(read[0]) == 1


def _sse(payloads: list[dict], *, named: bool = False, done: bool = False) -> str:
    """Server-sent events of ``payloads`` (each named by its ``type``, as Anthropic's are)."""
    events = [(f"event: {p['type']}\n" if named else "") + f"data: {json.dumps(p)}\n\n" for p in payloads]
    return "".join(events) + ("data: [DONE]\n\n" if done else "")


# ----------------------------------------------------------------------------- OpenAI

def _piece(index: int, arguments: str, cid: str | None = None) -> dict:
    """A ``tool_calls`` piece: the first of a call (``cid`` given) names it."""
    head = {"id": cid, "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return {"index": index, **head} if cid else {"index": index, "function": {"arguments": arguments}}


def _call(cid: str, arguments: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "bash", "arguments": arguments}}


OPENAI_REPLIES = {  # name: (deltas, the message logged whole, finish_reason)
    "text": ([{"role": "assistant", "content": ""}, {"content": "Two"}, {"content": " files."}, {}],
             {"content": "Two files."}, "stop"),
    "one call": ([{"role": "assistant", "content": None, "tool_calls": [_piece(0, "", "call_1")]},
                  {"tool_calls": [_piece(0, '{"comm')]}, {"tool_calls": [_piece(0, 'and": "ls"}')]}, {}],
                 {"content": None, "tool_calls": [_call("call_1", '{"command": "ls"}')]}, "tool_calls"),
    "parallel calls": ([{"role": "assistant", "content": "Both"}, {"content": "."},
                        {"tool_calls": [_piece(0, '{"command"', "call_1")]},
                        {"tool_calls": [_piece(0, ': "ls"}'), _piece(1, "", "call_2")]},
                        {"tool_calls": [_piece(1, '{"command": "pwd"}')]}, {}],
                       {"content": "Both.", "tool_calls": [_call("call_1", '{"command": "ls"}'),
                                                           _call("call_2", '{"command": "pwd"}')]},
                       "tool_calls"),
    "reasoning": ([{"role": "assistant", "reasoning_content": ""}, {"reasoning_content": "Files are "},
                   {"reasoning_content": "asked for."}, {"content": "Listing."},
                   {"tool_calls": [_piece(0, '{"command": "ls"}', "call_1")]}, {}],
                  {"reasoning_content": "Files are asked for.", "content": "Listing.",
                   "tool_calls": [_call("call_1", '{"command": "ls"}')]}, "tool_calls"),
    "reasoning as reasoning": ([{"role": "assistant", "reasoning": "Files."}, {"content": "Listing."}, {}],
                               {"reasoning": "Files.", "content": "Listing."}, "stop"),
    "refusal": ([{"role": "assistant", "content": None, "refusal": ""}, {"refusal": "I cannot"},
                 {"refusal": " help."}, {}], {"content": None, "refusal": "I cannot help."}, "stop"),
    "function_call": ([{"role": "assistant", "content": None, "function_call": {"name": "bash", "arguments": ""}},
                       {"function_call": {"arguments": '{"command": "ls"}'}}, {}],
                      {"content": None, "function_call": {"name": "bash", "arguments": '{"command": "ls"}'}},
                      "function_call"),
}


def _chunks(deltas: list[dict], finish: str | None) -> list[dict]:
    """The chunks OpenAI streams choice 0's ``deltas`` in, the last with ``finish``, then the
    usage chunk."""
    def chunk(choices: list[dict]) -> dict:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "gpt-4o-2024-08-06", "choices": choices}
    out = [chunk([{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]) for d in deltas]
    out[-1]["choices"][0]["finish_reason"] = finish
    return [*out, {**chunk([]), "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}]


def _openai_line(response, stream: bool = True) -> dict:
    return {"request": {"model": "gpt-4o", "tools": OPENAI_TOOLS, "messages": HISTORY, "stream": stream},
            "response": response}


def _openai_whole(message: dict, finish: str) -> dict:
    return _openai_line({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                         "model": "gpt-4o-2024-08-06", "choices": [{
                             "index": 0, "message": {"role": "assistant", **message},
                             "logprobs": None, "finish_reason": finish}]}, stream=False)


OPENAI_FORMS = {  # how a proxy logs a stream's chunks
    "server-sent events": lambda chunks: _sse(chunks, done=True),
    "a list of chunks": lambda chunks: chunks,
    "a list of chunks as JSON text": json.dumps,
    "events in an HTTP envelope": lambda chunks: {"status_code": 200, "headers": {
        "content-type": "text/event-stream"}, "body": _sse(chunks, done=True)},
}


@pytest.mark.parametrize("form", OPENAI_FORMS)
@pytest.mark.parametrize("reply", OPENAI_REPLIES)
def test_a_streamed_openai_reply_reads_as_the_reply_logged_whole(tmp_path, reply, form):
    deltas, message, finish = OPENAI_REPLIES[reply]
    streamed = _openai_line(OPENAI_FORMS[form](_chunks(deltas, finish)))
    _same_recording(tmp_path, streamed, _openai_whole(message, finish))


def _captured() -> list[tuple[dict, dict]]:
    """(streamed, whole) line pairs of the captured log."""
    lines = [json.loads(line) for line in CAPTURED.read_text().splitlines()]
    return list(zip(lines[::2], lines[1::2]))


def _without_ids(session: dict) -> dict:
    """A recording less the ids a server draws per reply (its ``id``, its calls')."""
    messages = [{**m, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]}
                if m.get("tool_calls") else m for m in session["messages"]]
    return {**{k: v for k, v in session.items() if k != "session_id"}, "messages": messages}


@pytest.mark.parametrize("pair", range(2), ids=["a call", "content pieces"])
def test_a_captured_stream_reads_as_its_whole_twin(tmp_path, pair):
    """Two requests to a real server: the reply's ids differ, all it wrote is the same."""
    streamed, whole = _captured()[pair]
    (read,), corrupt = _read(tmp_path, streamed)
    (read_whole,), _ = _read(tmp_path, whole)
    assert corrupt == [] and _without_ids(read) == _without_ids(read_whole)
    assert read["session_id"] == json.loads(streamed["response"].split("data: ", 2)[1])["id"]


@pytest.mark.parametrize("pair", range(2), ids=["a call", "content pieces"])
def test_a_captured_stream_joins_as_the_openai_client_joins_it(pair):
    """The same text and calls (the client keeps a first delta's empty content as "" where
    the server's whole completion writes null, as the join does)."""
    streaming = pytest.importorskip("openai.lib.streaming.chat")
    chunk_type = pytest.importorskip("openai.types.chat").ChatCompletionChunk
    streamed, _ = _captured()[pair]
    state = streaming.ChatCompletionStreamState()
    for line in streamed["response"].splitlines():
        if line.startswith("data: {"):
            state.handle_chunk(chunk_type.model_validate(json.loads(line.removeprefix("data: "))))
    expected = state.current_completion_snapshot.choices[0].message
    reply = proxy_log.exchange_session(streamed)["messages"][-1]
    assert (reply["content"] or "") == (expected.content or "")
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls", [])]
    assert calls == [(c.id, c.function.name, c.function.arguments) for c in expected.tool_calls or []]


def test_server_sent_events_are_read_as_the_standard_reads_them(tmp_path):
    """CRLF line ends, comments, fields other than data, and an event's data over several lines
    (joined with a line feed, JSON's whitespace)."""
    deltas, message, finish = OPENAI_REPLIES["one call"]
    chunks = _chunks(deltas, finish)
    events = [": keep-alive\r\nretry: 3000\r\n\r\n", "data:" + json.dumps(chunks[0]) + "\r\n\r\n"]
    events += ["".join(f"data: {part}\r\n" for part in json.dumps(c, indent=1).split("\n")) + "\r\n"
               for c in chunks[1:]]
    streamed = _openai_line("".join(events) + ": done\r\ndata: [DONE]\r\n\r\n")
    _same_recording(tmp_path, streamed, _openai_whole(message, finish))


def test_arguments_that_are_no_json_at_a_streams_end_read_as_the_same_arguments_logged_whole(tmp_path):
    """A reply the token limit ended mid-call is what the model wrote: its arguments string
    follows the reader's rules for one that is no JSON (``arguments`` {}, ``arguments_raw``)."""
    deltas = [{"role": "assistant", "tool_calls": [_piece(0, "", "call_1")]},
              {"tool_calls": [_piece(0, '{"command": "l')]}]
    streamed = _openai_line(_sse(_chunks(deltas, "length"), done=True))
    _same_recording(tmp_path, streamed, _openai_whole({"content": None, "tool_calls": [
        _call("call_1", '{"command": "l')]}, "length"))
    (read,), _ = _read(tmp_path, streamed)
    assert read["messages"][-1]["tool_calls"] == [
        {"id": "call_1", "name": "bash", "arguments": {}, "arguments_raw": '{"command": "l'}]


def test_only_choice_0_is_read_and_a_stream_ends_at_its_finish_reason_or_done(tmp_path):
    deltas, message, finish = OPENAI_REPLIES["text"]
    chunks = _chunks(deltas, finish)
    other = {**chunks[1], "choices": [{"index": 1, "delta": {"content": "Other."}, "finish_reason": "stop"}]}
    whole = _openai_whole(message, finish)
    _same_recording(tmp_path, _openai_line(_sse([*chunks[:2], other, *chunks[2:]])), whole)  # no [DONE]
    chunks[-2]["choices"][0]["finish_reason"] = None
    _same_recording(tmp_path, _openai_line(_sse(chunks, done=True)), whole)


# ----------------------------------------------------------------------------- Anthropic

def _block(kind: str, **fields) -> dict:
    return {"type": kind, **fields}


def _text(*pieces: str) -> tuple[dict, list[dict]]:
    return _block("text", text=""), [{"type": "text_delta", "text": p} for p in pieces]


def _tool_use(tid: str, *partial_json: str) -> tuple[dict, list[dict]]:
    return (_block("tool_use", id=tid, name="bash", input={}),
            [{"type": "input_json_delta", "partial_json": p} for p in ("", *partial_json)])


def _thinking(signature: str, *pieces: str) -> tuple[dict, list[dict]]:
    return (_block("thinking", thinking=""),
            [*({"type": "thinking_delta", "thinking": p} for p in pieces),
             {"type": "signature_delta", "signature": signature}])


CITATION = {"type": "char_location", "cited_text": "files", "document_index": 0, "document_title": "notes",
            "start_char_index": 0, "end_char_index": 5}
ANTHROPIC_REPLIES = {  # name: (blocks as streamed, content logged whole, stop_reason)
    "text": ([_text("Two", " files.")], [_block("text", text="Two files.")], "end_turn"),
    "one call": ([_tool_use("toolu_1", '{"command": "l', 's"}')],
                 [_block("tool_use", id="toolu_1", name="bash", input={"command": "ls"})], "tool_use"),
    "parallel calls": ([_text("Both."), _tool_use("toolu_1", '{"command": "ls"}'),
                        _tool_use("toolu_2", '{"comm', 'and": "pwd"}')],
                       [_block("text", text="Both."),
                        _block("tool_use", id="toolu_1", name="bash", input={"command": "ls"}),
                        _block("tool_use", id="toolu_2", name="bash", input={"command": "pwd"})], "tool_use"),
    "thinking": ([(_block("redacted_thinking", data="EmwKAhgBEgy3va3p"), []),
                  _thinking("EqQBCgIYAh", "Files are ", "asked for."), _text("Listing."),
                  _tool_use("toolu_1", '{"command": "ls"}')],
                 [_block("redacted_thinking", data="EmwKAhgBEgy3va3p"),
                  _block("thinking", thinking="Files are asked for.", signature="EqQBCgIYAh"),
                  _block("text", text="Listing."),
                  _block("tool_use", id="toolu_1", name="bash", input={"command": "ls"})], "tool_use"),
    "server tool and citations": (
        [(_block("server_tool_use", id="srvtoolu_1", name="web_search", input={}),
          [{"type": "input_json_delta", "partial_json": '{"query": "mlx'}, {"type": "input_json_delta",
                                                                          "partial_json": ' fill"}'}]),
         (_block("web_search_tool_result", tool_use_id="srvtoolu_1", content=[]), []),
         (_block("text", text=""), [{"type": "text_delta", "text": "No result."},
                                    {"type": "citations_delta", "citation": CITATION}])],
        [_block("server_tool_use", id="srvtoolu_1", name="web_search", input={"query": "mlx fill"}),
         _block("web_search_tool_result", tool_use_id="srvtoolu_1", content=[]),
         _block("text", text="No result.", citations=[CITATION])], "end_turn"),
}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929",
           "stop_sequence": None, "usage": {"input_tokens": 25, "output_tokens": 1}}


def _events(blocks: list[tuple[dict, list[dict]]], stop: str | None) -> list[dict]:
    """The events Anthropic streams a message of ``blocks`` in, ``stop`` its stop_reason (None:
    the stream ends after its last block)."""
    events = [{"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None}}]
    for index, (start, deltas) in enumerate(blocks):
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += [{"type": "ping"}] if index == 0 else []
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": index})
    ends = [{"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
             "usage": {"output_tokens": 15}}, {"type": "message_stop"}]
    return events + (ends if stop else [])


def _anthropic_line(response) -> dict:
    return {"request": {"model": "claude-sonnet-4-5", "max_tokens": 1024, "stream": True, "system": "be brief",
                        "tools": ANTHROPIC_TOOLS, "messages": HISTORY[1:]}, "response": response}


ANTHROPIC_FORMS = {
    "server-sent events": lambda events: _sse(events, named=True),
    "a list of events": lambda events: events,
    "events in an HTTP envelope": lambda events: {"status_code": 200, "body": _sse(events, named=True)},
}


@pytest.mark.parametrize("form", ANTHROPIC_FORMS)
@pytest.mark.parametrize("reply", ANTHROPIC_REPLIES)
def test_a_streamed_anthropic_reply_reads_as_the_message_logged_whole(tmp_path, reply, form):
    blocks, content, stop = ANTHROPIC_REPLIES[reply]
    streamed = _anthropic_line(ANTHROPIC_FORMS[form](_events(blocks, stop)))
    whole = _anthropic_line({**MESSAGE, "content": content, "stop_reason": stop})
    _same_recording(tmp_path, streamed, whole)


def test_partial_json_that_is_no_json_at_a_streams_end_reads_as_arguments_that_are_no_json(tmp_path):
    """As an OpenAI call's arguments string that is no JSON: ``arguments`` {}, ``arguments_raw``."""
    events = _events([_tool_use("toolu_1", '{"command": "l')], "max_tokens")
    streamed = _anthropic_line(_sse(events, named=True))
    (read,), corrupt = _read(tmp_path, streamed)
    assert corrupt == [] and read["messages"][-1]["tool_calls"] == [
        {"id": "toolu_1", "name": "bash", "arguments": {}, "arguments_raw": '{"command": "l'}]


# ----------------------------------------------------------------------------- not joined

def _cut(text: str, before: str) -> str:
    return text[:text.index(before)]


def test_a_stream_cut_off_before_its_end_is_a_skipped_line_saying_so(tmp_path):
    """Without its end a stream's last call may be short of arguments it was writing: no
    recording is made of it, whether the log ends at an event or inside one."""
    deltas, _, finish = OPENAI_REPLIES["one call"]
    openai_events = _sse(_chunks(deltas, finish), done=True)
    anthropic_events = _sse(_events(*ANTHROPIC_REPLIES["one call"][::2]), named=True)
    cut = [_openai_line(_chunks(deltas[:-1], None)[:-1]),
           _openai_line(_cut(openai_events, '"finish_reason": "tool_calls"')),
           _anthropic_line(_events(ANTHROPIC_REPLIES["one call"][0], None)),
           _anthropic_line(_cut(anthropic_events, "event: message_delta")),
           _anthropic_line(_cut(anthropic_events, 's\\"}"}}'))]
    for line in cut:
        sessions, corrupt = _read(tmp_path, line)
        assert sessions == [] and [c.reason.split(" (")[0] for c in corrupt] == [CUT_OFF]
        assert proxy_log.exchange_session(line).startswith(CUT_OFF)


def test_a_stream_carrying_an_error_is_an_error_response(tmp_path):
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    events = _events(*ANTHROPIC_REPLIES["text"][::2])
    deltas, _, finish = OPENAI_REPLIES["text"]
    failed = {"error": {"message": "The server had an error", "type": "server_error"}}
    lines = [_anthropic_line(_sse([*events[:4], overloaded], named=True)),
             _openai_line(_sse([*_chunks(deltas, finish)[:2], failed], done=True))]
    reasons = [proxy_log.exchange_session(line) for line in lines]
    assert reasons == ["an error response (overloaded_error: Overloaded)",
                       "an error response (server_error: The server had an error)"]


def test_a_stream_that_cannot_be_joined_is_a_skipped_line_saying_why():
    deltas, _, finish = OPENAI_REPLIES["one call"]
    chunks = _chunks(deltas, finish)
    unindexed = json.loads(json.dumps(chunks))
    del unindexed[1]["choices"][0]["delta"]["tool_calls"][0]["index"]
    lines = {"event data that is no JSON": _openai_line("data: {\"id\": \n\ndata: [DONE]\n\n"),
             "a tool_calls piece without an index": _openai_line(unindexed),
             "neither chat.completion.chunk objects, Anthropic Messages events nor Responses API events":
                 _openai_line([{"x": 1}]),
             "no message_start": _anthropic_line(_events(*ANTHROPIC_REPLIES["text"][::2])[1:]),
             "a content_block_delta for a block never started": _anthropic_line(
                 [e for e in _events(*ANTHROPIC_REPLIES["text"][::2]) if e["type"] != "content_block_start"])}
    for why, line in lines.items():
        reason = proxy_log.exchange_session(line)
        assert reason.startswith("a streamed response that cannot be joined into a message") and why in reason


# ----------------------------------------------------------------------------- pieces not read

def _changed(payloads: list[dict], at: int, path: tuple, value) -> list[dict]:
    """``payloads`` with the value at ``path`` of payload ``at`` set to ``value``."""
    out = json.loads(json.dumps(payloads))
    target = out[at]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def test_a_chunk_piece_the_join_cannot_read_is_a_skipped_line_naming_it(tmp_path):
    """A piece of a known kind given as another type is not passed over (the message would
    lack what it held: a whole message with such a field is a skipped line too); a choice or
    call index is a non-negative integer (``true`` would join call 1, ``-1`` go first)."""
    chunks = _chunks(*OPENAI_REPLIES["parallel calls"][::2])
    choice, piece = (0, "choices", 0), (0, "choices", 0, "delta", "tool_calls", 0)
    broken = [  # (chunk, path, value, what the reason names)
        (1, ("choices", 0), 7, "a choice that is no object"),
        (1, (*choice[1:], "index"), "0", "a choice whose index is not a non-negative integer"),
        (1, (*choice[1:], "index"), True, "a choice whose index is not a non-negative integer"),
        (1, (*choice[1:], "delta"), 7, "a delta that is no object"),
        (1, (*choice[1:], "delta", "content"), 7, "a delta whose content is neither text, text parts nor null"),
        (2, (*choice[1:], "delta", "tool_calls"), {"index": 0}, "a delta whose tool_calls is not a list"),
        (2, (*piece[1:], "function"), "bash", "a tool_calls piece whose function is not an object"),
        (2, (*piece[1:], "function", "arguments"), 7,
         "a tool_calls piece whose function name or arguments are not text"),
        (3, (*piece[1:], "index"), True, "a tool_calls piece without an index"),
        (3, (*piece[1:], "index"), -1, "a tool_calls piece without an index")]
    for at, path, value, why in broken:
        reason = proxy_log.exchange_session(_openai_line(_sse(_changed(chunks, at, path, value), done=True)))
        assert reason == f"a streamed response that cannot be joined into a message ({why})", (path, value)


def test_an_event_piece_the_join_cannot_read_is_a_skipped_line_naming_it_not_a_traceback(tmp_path):
    """A block index that is no index (a list or an object too), a block whose text is no
    text, a text or partial JSON delta that is no text, a delta without its type, a block
    started twice, an event without a type: each is a reason, none passed over."""
    events = _events(*ANTHROPIC_REPLIES["parallel calls"][::2])
    starts = [i for i, e in enumerate(events) if e["type"] == "content_block_start"]
    text_delta = next(i for i, e in enumerate(events) if e.get("delta", {}).get("type") == "text_delta")
    json_delta = next(i for i, e in enumerate(events) if e.get("delta", {}).get("type") == "input_json_delta")
    stop = next(i for i, e in enumerate(events) if e["type"] == "message_delta")
    broken = [
        (text_delta, ("index",), [0], "a content_block_delta for a block never started (index [0])"),
        (text_delta, ("index",), {"i": 0}, 'a content_block_delta for a block never started (index {"i": 0})'),
        (text_delta, ("index",), 0.0, "a content_block_delta for a block never started (index 0.0)"),
        (starts[0], ("content_block", "text"), 7, "a text_delta to a block whose text is not text"),
        (starts[0], ("content_block", "text"), [], "a text_delta to a block whose text is not text"),
        (starts[0], ("index",), True, "a content_block_start without its index and block"),
        (starts[1], ("index",), 0, "a second content_block_start for index 0"),
        (text_delta, ("delta", "text"), 7, "a text_delta whose text is not text"),
        (json_delta, ("delta", "partial_json"), None, "an input_json_delta whose partial_json is not text"),
        (text_delta, ("delta", "type"), None, "a content_block_delta whose delta has no type"),
        (text_delta, ("delta",), "x", "a content_block_delta without its delta"),
        (stop, ("delta",), 7, "a message_delta without its delta"),
        (stop, ("type",), None, "an event without a type")]
    for at, path, value, why in broken:
        for sse in (False, True):
            changed = _changed(events, at, path, value)
            line = _anthropic_line(_sse(changed) if sse else changed)
            reason = proxy_log.exchange_session(line)
            assert reason == f"a streamed response that cannot be joined into a message ({why})", (path, value)


def test_a_stream_mixing_the_payloads_of_two_apis_is_a_skipped_line_saying_so():
    """Neither API's payloads are passed over for the other's (Anthropic events read without
    the chunks between them, a chat stream said to be cut off for the events in it)."""
    chunks = _chunks(*OPENAI_REPLIES["text"][::2])
    events = _events(*ANTHROPIC_REPLIES["text"][::2])
    for line in (_anthropic_line(_sse([*events[:3], chunks[1], *events[3:]])),
                 _openai_line(_sse([*chunks[:2], events[0], *chunks[2:]], done=True))):
        assert proxy_log.exchange_session(line) == (
            "a streamed response that cannot be joined into a message (payloads of more than one API: "
            "chat.completion.chunk objects, Anthropic Messages events)")


def test_content_pieces_given_as_text_parts_read_as_a_whole_messages_parts(tmp_path):
    """A server may stream ``content`` as parts: their text parts join as a whole message's do."""
    deltas, message, finish = OPENAI_REPLIES["text"]
    as_parts = [{**d, "content": [{"type": "text", "text": d["content"]}, {"type": "image_url"}]}
                if d.get("content") else d for d in deltas]
    _same_recording(tmp_path, _openai_line(_sse(_chunks(as_parts, finish), done=True)), _openai_whole(message, finish))


def test_what_the_recording_drops_is_read_without_error_however_it_is_given(tmp_path):
    """A text block whose citations are no list, before a citations delta: citations are not
    in the recording, which reads as the message logged whole."""
    blocks, content, stop = ANTHROPIC_REPLIES["server tool and citations"]
    events = _events(blocks, stop)
    start = next(i for i, e in enumerate(events) if e.get("content_block", {}).get("type") == "text")
    streamed = _anthropic_line(_changed(events, start, ("content_block", "citations"), 7))
    (read,), corrupt = _read(tmp_path, streamed)
    (whole,), _ = _read(tmp_path, _anthropic_line({**MESSAGE, "content": content, "stop_reason": stop}))
    assert corrupt == [] and read == whole
