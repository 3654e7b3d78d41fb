"""Streamed chat and Responses API responses, as an API proxy logs them, joined into the whole
response each streams.

A stream (:func:`is_stream`) is logged as its server-sent-events text (read by
:func:`~.sse.event_data`, each event's data JSON or ``[DONE]``), as a list of its payloads, or
as one payload alone. :func:`whole_body` joins it into the body the same call made without
``stream`` would have returned, so that it reads as a whole response does:

* OpenAI chat completions (``chat.completion.chunk`` payloads, ``data: [DONE]`` after the
  last): choice 0's deltas join into its message, other choices are not read. ``role`` is the
  first a delta gives; ``content``, ``refusal``, ``reasoning_content`` and ``reasoning`` pieces
  (text, or parts whose text parts are joined as a whole message's are) each join into the
  field of that name (``content`` None, the others absent, where no piece
  held text, as in a whole message); ``tool_calls`` pieces join by their ``index`` into calls in
  its order: a call's ``id``, ``type`` and function ``name`` are the first its pieces give, its
  ``arguments`` their ``arguments`` text joined, kept as written (text that is no JSON is read
  as a whole message's would be); the deprecated ``function_call`` pieces join the same way.
  The whole completion is ``{"id", "object": "chat.completion", "model", "choices": [{"index":
  0, "message", "finish_reason"}]}`` (``id`` and ``model`` the first a chunk gives), its
  ``choices`` empty where no chunk held choice 0.
* Anthropic Messages (events: ``message_start``, per content block a ``content_block_start``,
  its ``content_block_delta`` events and a ``content_block_stop``, ``message_delta``,
  ``message_stop``; ``ping`` anywhere): the message ``message_start`` holds, the
  ``message_delta`` fields (``stop_reason``) over it, its ``content`` the started blocks in the
  order of their ``index``, each with its deltas joined: ``text_delta`` text and
  ``thinking_delta`` thinking appended, ``signature_delta`` its signature, ``citations_delta``
  a citation appended, ``input_json_delta`` partial JSON joined and parsed as the block's
  ``input`` (``tool_use``, ``server_tool_use``; none given: the input it started with). Input
  text that does not parse is kept as the ``input``, which
  :func:`~.log_formats.as_recording` reads as an arguments string that is no JSON, as it reads
  an OpenAI call's. Events not named here are passed over (the API's versioning policy may
  add some, and asks a reader to pass them over gracefully), and so are delta types.
* OpenAI Responses API (events typed ``response.…``: ``response.created``, per output item
  its ``response.output_item.added``, its deltas and its ``response.output_item.done``, then
  the event that ends the stream: ``response.completed``, ``response.failed`` or
  ``response.incomplete``): the response the ending event carries, whole as the API returns
  it unstreamed, its ``status`` saying how it ended; where that response holds no output
  items (a server that gives them only in ``response.output_item.done`` events, from which
  Codex CLI takes its items), the items of those events by their ``output_index`` (an event
  logged twice gives its item once). Deltas are not joined: the ending response and the
  ``done`` events give every item whole.

A stream is not joined where :func:`whole_body` returns instead: the error payload it carries
(OpenAI's ``{"error"}``, Anthropic's ``error`` event, the Responses API's ``{"type": "error",
"code", "message"}`` event), the body of a whole error response; why it stands for no whole
response: it was cut off before its end (:data:`CUT_OFF`: an OpenAI stream with neither a
``finish_reason`` for choice 0 nor ``[DONE]``, an Anthropic stream with neither
``message_stop`` nor a ``message_delta`` with a ``stop_reason``, a Responses API stream
without the event that ends it; its last call may be short of arguments the model was still
writing), or it cannot be joined (:data:`UNJOINABLE`: event data that is no JSON object,
payloads of no API read here or of more than one, an event of an event stream without a
``type``, a ``tool_calls`` piece without an ``index``, no ``message_start``, a
``content_block_start`` without its ``index`` and block or a second one for its index, a
delta for a block never started, a Responses API ending event without its response, a
``response.output_item.done`` without its item, two that differ for one ``output_index`` or
one missing below the highest). An index is a non-negative integer. What the join reads into
the message given as another type than it reads (a choice, its delta, a text field,
``tool_calls``, a call piece, its function and the function's name and arguments; a delta's
type, its text, thinking or partial JSON, and the block text it is appended to) is a reason
too, not passed over: the message would lack what it held, where a whole message holding it
is a skipped line. Null reads as absent.
"""

from __future__ import annotations

import json
from typing import Any

from .log_formats import part_text, quoted
from .sse import event_data

__all__ = ["is_stream", "whole_body"]

CUT_OFF = "a streamed response cut off before its end ({})"
UNJOINABLE = "a streamed response that cannot be joined into a message ({})"
DONE = "[DONE]"  # the data of the event that ends an OpenAI stream
CHUNK = "chat.completion.chunk"
SSE_FIELDS = ("data:", "event:", "id:", "retry:", ":")  # how a server-sent event's lines start
EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
          "message_delta", "message_stop", "ping")  # Anthropic's, less ``error``
MESSAGE_TEXT = ("content", "refusal", "reasoning_content", "reasoning")  # joined delta fields
BLOCK_TEXT = {"text_delta": "text", "thinking_delta": "thinking"}  # delta type: field appended
RESPONSE_EVENT = "response."  # how the type of every Responses API event but ``error`` starts
RESPONSE_ENDS = ("response.completed", "response.failed", "response.incomplete")
ITEM_DONE = "response.output_item.done"
# the payloads of each API, as a reason names them
CHUNKS, ANTHROPIC_EVENTS, RESPONSES_EVENTS = (
    "chat.completion.chunk objects", "Anthropic Messages events", "Responses API events")


def is_stream(body: Any) -> bool:
    """Whether a response body (out of its envelope) is a stream: server-sent-events text, a
    list (of payloads), or one OpenAI chunk, Anthropic stream event or Responses API event."""
    if isinstance(body, str):
        return body.removeprefix("\ufeff").lstrip().startswith(SSE_FIELDS)
    return isinstance(body, list) or (isinstance(body, dict) and (
        body.get("object") == CHUNK or body.get("type") in EVENTS or _is_response_event(body)))


def whole_body(stream: Any) -> dict | str:
    """The whole response :func:`is_stream` body ``stream`` stands for, the error payload it
    carries, or why it stands for none (see the module contract)."""
    payloads = _payloads(stream)
    if isinstance(payloads, str):
        return payloads
    objects = [p for p in payloads if p != DONE]
    error = next((p for p in objects if p.get("type") == "error" or p.get("error")), None)
    if error is not None:
        return error
    found = {_api(p) for p in objects}
    apis = [api for api in (CHUNKS, ANTHROPIC_EVENTS, RESPONSES_EVENTS) if api in found]
    if len(apis) > 1:
        return UNJOINABLE.format(f"payloads of more than one API: {', '.join(apis)}")
    if apis and apis[0] != CHUNKS and not all(isinstance(p.get("type"), str) for p in objects):
        return UNJOINABLE.format("an event without a type")
    if apis == [ANTHROPIC_EVENTS]:
        return _anthropic_message(objects)
    if apis == [RESPONSES_EVENTS]:
        return _responses_response(objects)
    if all(isinstance(p.get("choices"), list) for p in objects):
        return _openai_completion(objects, DONE in payloads)
    return UNJOINABLE.format("neither chat.completion.chunk objects, Anthropic Messages events nor "
                             "Responses API events")


def _api(payload: dict) -> str | None:
    """Whose stream ``payload`` is of: :data:`CHUNKS` (a ``choices`` list),
    :data:`ANTHROPIC_EVENTS` (a type :data:`EVENTS` names), :data:`RESPONSES_EVENTS`
    (:func:`_is_response_event`); None for any other (an event of a type not named here)."""
    if isinstance(payload.get("choices"), list):
        return CHUNKS
    if payload.get("type") in EVENTS:
        return ANTHROPIC_EVENTS
    return RESPONSES_EVENTS if _is_response_event(payload) else None


def _is_response_event(payload: dict) -> bool:
    """Whether ``payload`` is an event of a Responses API stream other than ``error``."""
    kind = payload.get("type")
    return isinstance(kind, str) and kind.startswith(RESPONSE_EVENT)


def _is_index(value: Any) -> bool:
    """Whether ``value`` is an index: a non-negative integer (``true`` is none)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _odd(pieces: list[dict], key: str, kind: type) -> bool:
    """Whether one of ``pieces`` gives ``key`` as neither a ``kind`` nor null."""
    return any(piece.get(key) is not None and not isinstance(piece[key], kind) for piece in pieces)


def _payloads(stream: Any) -> list | str:
    """The stream's payloads in order, each a dict or :data:`DONE`, or why it has none."""
    if isinstance(stream, dict):
        return [stream]
    if isinstance(stream, list):
        if all(isinstance(p, dict) or p == DONE for p in stream):
            return stream
        return UNJOINABLE.format("a payload that is no JSON object")
    data = event_data(stream)
    payloads = []
    for number, text in enumerate(data, 1):
        try:
            payload = text if text == DONE else json.loads(text)
        except (ValueError, RecursionError):
            payload = None
        if not isinstance(payload, dict) and payload != DONE:
            return UNJOINABLE.format(f"event data that is no JSON object, in event {number} of {len(data)}")
        payloads.append(payload)
    return payloads


def _openai_completion(chunks: list[dict], done: bool) -> dict | str:
    """The chat completion OpenAI ``chunks`` stream (``done``: ``[DONE]`` ended them), or why
    none; each chunk holds a ``choices`` list (:func:`whole_body` takes no others for OpenAI's)."""
    deltas, finish = [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if not isinstance(choice, dict):
                return UNJOINABLE.format("a choice that is no object")
            if not _is_index(choice.get("index", 0)):
                return UNJOINABLE.format("a choice whose index is not a non-negative integer")
            if _odd([choice], "delta", dict):
                return UNJOINABLE.format("a delta that is no object")
            if choice.get("index", 0) == 0:
                deltas.append(choice.get("delta") or {})
                finish = choice.get("finish_reason") or finish
    if finish is None and not done:
        return CUT_OFF.format(f"{len(chunks)} chunks: neither a finish_reason for choice 0 nor data: {DONE}")
    completion: dict[str, Any] = {"object": "chat.completion", "choices": []}
    for key in ("id", "model"):
        given = next((chunk[key] for chunk in chunks if isinstance(chunk.get(key), str)), None)
        if given is not None:
            completion[key] = given
    if deltas:
        message = _openai_message(deltas)
        if isinstance(message, str):
            return message
        completion["choices"] = [{"index": 0, "message": message, "finish_reason": finish}]
    return completion


def _openai_message(deltas: list[dict]) -> dict | str:
    """The message choice 0's ``deltas`` join into (see the module contract), or why none."""
    if problem := _delta_problem(deltas):
        return UNJOINABLE.format(problem)
    message: dict[str, Any] = {
        "role": next((d["role"] for d in deltas if isinstance(d.get("role"), str)), "assistant")}
    for field in MESSAGE_TEXT:
        text = "".join(part_text(d[field]) for d in deltas if d.get(field) is not None)
        if text or field == "content":
            message[field] = text or None
    calls: dict[int, list[dict]] = {}
    for piece in (piece for d in deltas for piece in d.get("tool_calls") or []):
        calls.setdefault(piece["index"], []).append(piece)
    if calls:
        message["tool_calls"] = [_openai_call(calls[index]) for index in sorted(calls)]
    legacy = [d["function_call"] for d in deltas if d.get("function_call")]
    if legacy:
        message["function_call"] = _function(legacy)
    return message


def _delta_problem(deltas: list[dict]) -> str | None:
    """What of choice 0's ``deltas`` the join cannot read, None where it reads all: a text
    field (text, or parts whose text parts join as a whole message's do), ``tool_calls`` or
    ``function_call``, a call piece (its ``index`` a non-negative integer), its ``function``
    or a function's ``name`` or ``arguments`` given as another type than the join reads (null
    reads as absent). None is passed over: the message would lack what it held, where a whole
    message holding it is a skipped line."""
    if field := next((field for field in MESSAGE_TEXT if any(
            d.get(field) is not None and part_text(d[field]) is None for d in deltas)), None):
        return f"a delta whose {field} is neither text, text parts nor null"
    if _odd(deltas, "tool_calls", list):
        return "a delta whose tool_calls is not a list"
    if _odd(deltas, "function_call", dict):
        return "a delta whose function_call is not an object"
    pieces = [piece for d in deltas for piece in d.get("tool_calls") or []]
    if not all(isinstance(piece, dict) and _is_index(piece.get("index")) for piece in pieces):
        return "a tool_calls piece without an index"
    if _odd(pieces, "function", dict):
        return "a tool_calls piece whose function is not an object"
    functions = [piece["function"] for piece in pieces if piece.get("function")]
    if _odd(functions, "name", str) or _odd(functions, "arguments", str):
        return "a tool_calls piece whose function name or arguments are not text"
    legacy = [d["function_call"] for d in deltas if d.get("function_call")]
    if _odd(legacy, "name", str) or _odd(legacy, "arguments", str):
        return "a function_call whose name or arguments are not text"
    return None


def _openai_call(pieces: list[dict]) -> dict:
    """The call a tool call's ``pieces`` (one ``index``) join into."""
    call: dict[str, Any] = {}
    for key in ("id", "type"):
        given = next((piece[key] for piece in pieces if isinstance(piece.get(key), str)), None)
        if given is not None:
            call[key] = given
    call["function"] = _function([p["function"] for p in pieces if isinstance(p.get("function"), dict)])
    return call


def _function(pieces: list[dict]) -> dict:
    """A function (``name``: the first piece's that has one; ``arguments``: their text joined)."""
    name = next((piece["name"] for piece in pieces if isinstance(piece.get("name"), str)), None)
    arguments = "".join(piece["arguments"] for piece in pieces if isinstance(piece.get("arguments"), str))
    return {"name": name, "arguments": arguments}


def _anthropic_message(events: list[dict]) -> dict | str:
    """The message Anthropic ``events`` stream (see the module contract), or why none."""
    start = next((e.get("message") for e in events if e.get("type") == "message_start"), None)
    if not isinstance(start, dict):
        return UNJOINABLE.format("no message_start with its message")
    message = dict(start)
    blocks: dict[int, dict] = {}  # by index: each started block, its deltas joined in
    inputs: dict[int, list[str]] = {}  # by index: a block's partial JSON pieces
    for event in events:
        kind, index = event.get("type"), event.get("index")
        if kind == "content_block_start":
            if not _is_index(index) or not isinstance(event.get("content_block"), dict):
                return UNJOINABLE.format("a content_block_start without its index and block")
            if index in blocks:
                return UNJOINABLE.format(f"a second content_block_start for index {index}")
            blocks[index] = dict(event["content_block"])
        elif kind == "content_block_delta":
            if not _is_index(index) or index not in blocks:
                return UNJOINABLE.format(f"a content_block_delta for a block never started "
                                         f"(index {quoted(index)})")
            if not isinstance(event.get("delta"), dict):
                return UNJOINABLE.format("a content_block_delta without its delta")
            if problem := _add_delta(blocks[index], event["delta"], inputs.setdefault(index, [])):
                return UNJOINABLE.format(problem)
        elif kind == "message_delta":
            if not isinstance(event.get("delta"), dict):
                return UNJOINABLE.format("a message_delta without its delta")
            message.update(event["delta"])
    if not message.get("stop_reason") and not any(e.get("type") == "message_stop" for e in events):
        return CUT_OFF.format(f"{len(events)} events: neither message_stop nor a message_delta "
                              f"with a stop_reason")
    for index, pieces in inputs.items():
        if "".join(pieces):
            blocks[index]["input"] = _input("".join(pieces))
    return {**message, "content": [blocks[index] for index in sorted(blocks)]}


def _add_delta(block: dict, delta: dict, input_json: list[str]) -> str | None:
    """Join one ``content_block_delta``'s ``delta`` into its ``block`` (partial JSON into
    ``input_json``, the block's input text so far); why it cannot be joined, None where it
    is: a delta without a type, text, thinking or partial JSON that is no text, a block whose
    text or thinking is no text to append to. A delta of a type not named here is passed
    over; citations, which no recording holds, are appended to a list however the block gave
    them."""
    kind = delta.get("type")
    if not isinstance(kind, str):
        return "a content_block_delta whose delta has no type"
    if kind in BLOCK_TEXT:
        field = BLOCK_TEXT[kind]
        if not isinstance(delta.get(field), str):
            return f"a {kind} whose {field} is not text"
        if _odd([block], field, str):
            return f"a {kind} to a block whose {field} is not text"
        block[field] = (block.get(field) or "") + delta[field]
    elif kind == "signature_delta":
        block["signature"] = delta.get("signature")
    elif kind == "citations_delta":
        given = block.get("citations")
        block["citations"] = [*(given if isinstance(given, list) else []), delta.get("citation")]
    elif kind == "input_json_delta":
        if not isinstance(delta.get("partial_json"), str):
            return "an input_json_delta whose partial_json is not text"
        input_json.append(delta["partial_json"])
    return None


def _input(text: str) -> Any:
    """A block's joined partial JSON parsed, the text itself where it does not parse."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _responses_response(events: list[dict]) -> dict | str:
    """The response a Responses API stream's ``events`` end with (see the module contract), or
    why none."""
    end = next((event for event in events if event.get("type") in RESPONSE_ENDS), None)
    if end is None:
        return CUT_OFF.format(f"{len(events)} events: none of {', '.join(RESPONSE_ENDS)}")
    response = end.get("response")
    if not isinstance(response, dict):
        return UNJOINABLE.format(f"a {end['type']} event without its response")
    if response.get("output"):
        return response
    items = _done_items([event for event in events if event.get("type") == ITEM_DONE])
    return UNJOINABLE.format(items) if isinstance(items, str) else {**response, "output": items}


def _done_items(done: list[dict]) -> list[dict] | str:
    """The output items the ``response.output_item.done`` events ``done`` give, or why they
    cannot be read: by their ``output_index`` (in their order where none gives one), an event
    logged twice its item once; an event without its item, an index that is no index or given
    by some events only, two events for one index that differ, or an index left out below the
    highest one (an event missing from the log: one after the last cannot be told) is a
    reason."""
    if not all(isinstance(event.get("item"), dict) for event in done):
        return f"a {ITEM_DONE} event without its item"
    indexes = [event.get("output_index") for event in done]
    if all(index is None for index in indexes):
        return [event["item"] for event in done]
    if not all(_is_index(index) for index in indexes):
        return f"a {ITEM_DONE} event whose output_index is not a non-negative integer"
    items: dict[int, dict] = {}
    for index, event in zip(indexes, done):
        if items.setdefault(index, event["item"]) != event["item"]:
            return f"two {ITEM_DONE} events for output item {index} that differ"
    indexes = sorted(items)
    if indexes[-1] >= len(indexes):  # the lowest index left out is the first out of its place
        left_out = next(place for place, index in enumerate(indexes) if index != place)
        return f"{ITEM_DONE} events without output item {left_out}"
    return [items[index] for index in indexes]
