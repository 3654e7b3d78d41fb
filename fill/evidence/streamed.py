"""Streamed chat and Responses API responses, as an API proxy logs them, joined into the whole
response each streams.

A stream (:func:`is_stream`) is logged as its server-sent-events text (read by
:func:`~.sse.event_data`, each event's data JSON or ``[DONE]``), as a list of its payloads, or
as one payload alone. :func:`whole_body` joins it into the body the same call made without
``stream`` would have returned, so that it reads as a whole response does:

* OpenAI chat completions (``chat.completion.chunk`` payloads, ``data: [DONE]`` after the
  last): choice 0's deltas join into its message, other choices are not read. ``role`` is the
  first a delta gives; ``content``, ``refusal``, ``reasoning_content`` and ``reasoning`` pieces
  each join into the field of that name (``content`` None, the others absent, where no piece
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
  Codex CLI takes its items), the items of those events in their order. Deltas are not
  joined: the ending response and the ``done`` events give every item whole.

A stream is not joined where :func:`whole_body` returns instead: the error payload it carries
(OpenAI's ``{"error"}``, Anthropic's ``error`` event, the Responses API's ``{"type": "error",
"code", "message"}`` event), the body of a whole error response; why it stands for no whole
response: it was cut off before its end (:data:`CUT_OFF`: an OpenAI stream with neither a
``finish_reason`` for choice 0 nor ``[DONE]``, an Anthropic stream with neither
``message_stop`` nor a ``message_delta`` with a ``stop_reason``, a Responses API stream
without the event that ends it; its last call may be short of arguments the model was still
writing), or it cannot be joined (:data:`UNJOINABLE`: event data that is no JSON object,
payloads of no API read here, a ``tool_calls`` piece without an ``index``, no
``message_start``, a ``content_block_start`` without its ``index`` and block, a delta for a
block never started, a Responses API ending event without its response or a
``response.output_item.done`` without its item).
"""

from __future__ import annotations

import json
from typing import Any

from .log_formats import quoted
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
    if any(p.get("type") in EVENTS for p in objects):
        return _anthropic_message(objects)
    if any(_is_response_event(p) for p in objects):
        return _responses_response(objects)
    if all(isinstance(p.get("choices"), list) for p in objects):
        return _openai_completion(objects, DONE in payloads)
    return UNJOINABLE.format("neither chat.completion.chunk objects, Anthropic Messages events nor "
                             "Responses API events")


def _is_response_event(payload: dict) -> bool:
    """Whether ``payload`` is an event of a Responses API stream other than ``error``."""
    kind = payload.get("type")
    return isinstance(kind, str) and kind.startswith(RESPONSE_EVENT)


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
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                deltas.append(choice.get("delta") if isinstance(choice.get("delta"), dict) else {})
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
    message: dict[str, Any] = {
        "role": next((d["role"] for d in deltas if isinstance(d.get("role"), str)), "assistant")}
    for field in MESSAGE_TEXT:
        text = "".join(d[field] for d in deltas if isinstance(d.get(field), str))
        if text or field == "content":
            message[field] = text or None
    pieces = [piece for d in deltas if isinstance(d.get("tool_calls"), list) for piece in d["tool_calls"]]
    if not all(isinstance(piece, dict) and isinstance(piece.get("index"), int) for piece in pieces):
        return UNJOINABLE.format("a tool_calls piece without an index")
    calls: dict[int, list[dict]] = {}
    for piece in pieces:
        calls.setdefault(piece["index"], []).append(piece)
    if calls:
        message["tool_calls"] = [_openai_call(calls[index]) for index in sorted(calls)]
    legacy = [d["function_call"] for d in deltas if isinstance(d.get("function_call"), dict)]
    if legacy:
        message["function_call"] = _function(legacy)
    return message


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
            if not isinstance(index, int) or not isinstance(event.get("content_block"), dict):
                return UNJOINABLE.format("a content_block_start without its index and block")
            blocks[index] = dict(event["content_block"])
        elif kind == "content_block_delta":
            if index not in blocks or not isinstance(event.get("delta"), dict):
                return UNJOINABLE.format(f"a content_block_delta for a block never started "
                                         f"(index {quoted(index)})")
            _add_delta(blocks[index], event["delta"], inputs.setdefault(index, []))
        elif kind == "message_delta" and isinstance(event.get("delta"), dict):
            message.update(event["delta"])
    if not message.get("stop_reason") and not any(e.get("type") == "message_stop" for e in events):
        return CUT_OFF.format(f"{len(events)} events: neither message_stop nor a message_delta "
                              f"with a stop_reason")
    for index, pieces in inputs.items():
        if "".join(pieces):
            blocks[index]["input"] = _input("".join(pieces))
    return {**message, "content": [blocks[index] for index in sorted(blocks)]}


def _add_delta(block: dict, delta: dict, input_json: list[str]) -> None:
    """Join one ``content_block_delta``'s ``delta`` into its ``block`` (partial JSON into
    ``input_json``, the block's input text so far)."""
    kind = delta.get("type")
    if kind in BLOCK_TEXT and isinstance(delta.get(BLOCK_TEXT[kind]), str):
        field = BLOCK_TEXT[kind]
        block[field] = (block.get(field) or "") + delta[field]
    elif kind == "signature_delta":
        block["signature"] = delta.get("signature")
    elif kind == "citations_delta":
        block["citations"] = [*(block.get("citations") or []), delta.get("citation")]
    elif kind == "input_json_delta" and isinstance(delta.get("partial_json"), str):
        input_json.append(delta["partial_json"])


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
    items = [event.get("item") for event in events if event.get("type") == ITEM_DONE]
    if not all(isinstance(item, dict) for item in items):
        return UNJOINABLE.format(f"a {ITEM_DONE} event without its item")
    return {**response, "output": items}
