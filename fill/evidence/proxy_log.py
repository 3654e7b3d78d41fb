"""API-proxy and gateway logs (one request and its response per line) read as sessions.

A line ``{"request": REQUEST, "response": RESPONSE, ...}`` (:func:`is_exchange`) is one call of
an LLM API: REQUEST an OpenAI chat-completions, Anthropic Messages or OpenAI Responses API
request body, RESPONSE what it got: an OpenAI chat completion (its ``choices[0].message``), an
Anthropic message (``{"role": "assistant", "content": [parts]}``) or a Responses API response
(``{"object": "response", "status", "output": [items]}``), or any of them streamed
(server-sent-events text, a list of its chunks or events, or one alone), joined into the whole
response it streams (:func:`~.streamed.whole_body`). Either may be held in an HTTP envelope,
``{"body": BODY, ...}`` (a gateway's ``{"method", "path", "headers", "body"}``, the
``{"status_code", "request_id", "body"}`` of OpenAI's batch output), and a body may be logged
as JSON text. :func:`exchange_session` makes a session of the line, in the forms
:func:`~.log_formats.as_recording` reads, ``model`` the request's (else the response's),
``session_id`` the response's ``id``; a line has no ``source``:

* a chat-completions or Anthropic Messages line: the request's conversation (``messages``)
  followed by the response's assistant message, the request's ``system`` and ``tools``;
* a Responses API line (a request with an ``input``, answered by a response object): the
  request's ``instructions`` as a system message, then the chat messages of its ``input``
  (text: one user message; items, a message's ``type`` optional) and of the response's
  ``output`` items, as :mod:`.responses_items` makes them (the Codex reader's mapping: the
  items the model gave are its assistant message, reasoning dropped); its ``tools``, then the
  tools the ``mcp_list_tools`` items of its conversation list, as
  :func:`~.responses_items.chat_tools` gives them. A request that goes on from an earlier
  response (``previous_response_id``) sends only what it adds, the server holding the rest:
  where an earlier line of the file holds that response, the line's conversation is the items
  of that line's followed by its own (an MCP server's tools listed there among them), its
  instructions its own (the API does not carry a previous response's instructions over).

What is not read, each a reason the line is skipped for: an error response (an ``error``,
Anthropic's ``type: error``, an HTTP status of 400 or more, an error a stream carries); a
Responses API response the model did not complete (a ``status`` other than ``completed``:
``incomplete`` for a token limit or a content filter, ``in_progress``, ``cancelled``: the API
says it did not finish, unlike a chat completion whose ``finish_reason`` is a token limit); a
stream cut off before its end (an OpenAI stream with neither a ``finish_reason`` for choice 0
nor ``[DONE]``, an Anthropic stream with neither ``message_stop`` nor a ``stop_reason``, a
Responses API stream without the event that ends it: a recording stands for what the agent
wrote, and the stream's last call may be short of arguments it was still writing), or one that
cannot be joined; a response without an assistant message (no ``choices``, a token count, a
Responses API output without a message or call); a Responses API request that goes on from
what the server holds, not the file (a ``previous_response_id`` no earlier line of the file
answered, a stored ``conversation`` or ``prompt``, an ``item_reference``), or whose input or
items cannot be read (:func:`~.responses_items.item_problem`); a request of no API read here
(an embeddings request); a line without a response. A stream that ended is what the model
wrote, however it ended (a token limit included): a call's arguments that are no JSON are read
as a whole response's would be.

An agent sends its whole history with every request (a Responses API agent too, unless it lets
the server keep it: then its lines chain, as above), so a file's lines repeat each other:
:func:`latest_conversations` keeps a line's session only where no later line of the file holds
its whole conversation (the same system prompt and tools, its messages the start of the later
one's); of lines that hold the same conversation the last is kept. :class:`ProxyLog` reads a
file's lines so: a line that a later one holds whole by going on from its response is not
read where that one is kept, so a chain's work is linear in its lines.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from .log_formats import quoted
from .responses_items import add_item, chat_tools, item_problem, listed_tools
from .streamed import is_stream, whole_body

__all__ = ["ProxyLog", "exchange_session", "is_exchange", "latest_conversations"]

NO_REPLY = "a response without an assistant message (neither choices[0].message nor an Anthropic message)"
NO_OUTPUT = "a response without an assistant message (no output item of a message or a call)"
NO_REQUEST = ("a request of no API read here (neither a messages list nor a Responses API input "
              "answered by a response object: an embeddings request, a call of another API)")
UNREAD_INPUT = "a Responses API request whose input is neither text nor a list of items"
UNFINISHED = "a response that did not complete (status {})"
SERVER_HELD = "a Responses API request that goes on from what the server holds ({}), not the file"
FINISHED = "completed"  # the status of a Responses API response the model completed
STORED = ("conversation", "prompt")  # Responses API request keys naming what the server stores
REFERENCE = "item_reference"  # a Responses API input item naming one the server holds
ERROR_STATUS = 400


def is_exchange(obj: Any) -> bool:
    """Whether ``obj`` is a line of an API-proxy log (a ``request``, a ``response``, or both)
    rather than a session."""
    return isinstance(obj, dict) and "messages" not in obj and ("request" in obj or "response" in obj)


def exchange_session(line: dict) -> dict | str:
    """The session a proxy log's line (:func:`is_exchange`) holds read alone, or why it holds
    none (see the module contract; a Responses API line that goes on from an earlier response
    holds none alone: :class:`ProxyLog` reads a file's lines together)."""
    read = _line_session(line, {}, -1)
    return read if isinstance(read, str) else read.session


@dataclass(frozen=True)
class _Answered:
    """A Responses API line's conversation, kept as what it adds to the one it goes on from:
    ``own`` its chat messages after ``earlier``'s (the first of them, where it goes on from
    one, a copy of ``earlier``'s last, which its first items may add to) and after its system
    message (``system``, none without instructions); ``listed`` the tools the
    ``mcp_list_tools`` items of the whole conversation list
    (:func:`~.responses_items.listed_tools`); ``tools`` the request's, then those (None where
    it declares none and none are listed); ``place`` the line's among the log's sessions. So a
    chain of n lines keeps n lines' messages, not the n²/2 of each line's whole
    conversation."""

    place: int
    system: list[dict]
    tools: list[dict] | None
    listed: list[dict]
    earlier: _Answered | None
    own: list[dict]

    def messages(self) -> list[dict]:
        """The conversation's chat messages, its system message first."""
        parts, at = [], self
        while at is not None:
            parts.append(at.own)
            at = at.earlier
        messages: list[dict] = []
        for own in reversed(parts):
            messages[len(messages) - 1:] = own  # its first: the copy of the last before it
        return [*self.system, *messages]

    def holds_earlier(self) -> bool:
        """Whether it holds the conversation it goes on from whole: the same instructions and
        tools, every message of it as it was (the copy of its last unchanged)."""
        earlier = self.earlier
        return (earlier is not None and (earlier.system, earlier.tools) == (self.system, self.tools)
                and self.own[0] == earlier.own[-1])


@dataclass(frozen=True)
class _Read:
    """A line's session: ``fields`` all but its messages, which are ``messages`` or, for a
    Responses API line, those of its conversation (``answered``)."""

    fields: dict
    messages: list[dict] | None = None
    answered: _Answered | None = None

    @property
    def session(self) -> dict:
        """The session, its messages made whole."""
        messages = self.answered.messages() if self.answered is not None else self.messages
        return {**self.fields, "messages": messages}

    @property
    def holds(self) -> int | None:
        """The place of the line whose conversation it holds whole
        (:meth:`_Answered.holds_earlier`), None for none."""
        answered = self.answered
        return answered.earlier.place if answered is not None and answered.holds_earlier() else None

    def added(self) -> dict:
        """Its session with only the messages it adds to the conversation it holds whole."""
        return {**self.fields, "messages": self.answered.own[1:]}


class ProxyLog:
    """An API-proxy log's lines, added in file order, and the sessions of those no later line
    holds whole (see the module contract).

    A Responses API line that goes on from an earlier line's response holds that line's
    conversation, its own after it (:class:`_Answered`); where it holds it whole, the earlier
    line's session is kept only if the later line's is refused, and is not read otherwise
    (:meth:`sessions`). So a chain of n lines reads the messages of its last line, not the
    n²/2 of every line's."""

    def __init__(self) -> None:
        self._read: list[tuple[int, _Read]] = []  # (line number, what it read), a place each
        self._answered: dict[str, _Answered] = {}  # Responses API conversations by response id

    def add(self, number: int, line: dict) -> str | None:
        """Read the log's line ``number`` (:func:`is_exchange`, after the lines added before it):
        None where it holds a session, else why it holds none."""
        read = _line_session(line, self._answered, len(self._read))
        if isinstance(read, str):
            return read
        self._read.append((number, read))
        return None

    def sessions(self, recording: Callable[[dict], dict | str]
                 ) -> tuple[list[dict], list[tuple[int, str]]]:
        """The recordings ``recording`` makes of the sessions read (a recording, or why the
        session is none) that :func:`latest_conversations` keeps, in file order, and the
        ``(line number, why)`` of those it refuses. Read from the last: a line a kept line
        holds whole is not read (it would not be kept); one whose messages hold what a line
        holding it whole was refused for, its own messages refused for nothing, is refused
        for that without reading it again."""
        kept, refused = [], []
        held: set[int] = set()  # places a kept line holds whole
        failed: dict[int, str] = {}  # places refused for what a line holding them was
        for place in range(len(self._read) - 1, -1, -1):
            number, read = self._read[place]
            if place not in held:
                made = failed.get(place) or recording(read.session)
                if isinstance(made, str):
                    refused.append((number, made))
                    if read.holds is not None and not isinstance(recording(read.added()), str):
                        failed[read.holds] = made  # what it was refused for is in those messages
                    continue
                kept.append(made)
            if read.holds is not None:  # a kept line holds what this one holds whole
                held.add(read.holds)
        return latest_conversations(kept[::-1]), refused[::-1]


def _line_session(line: dict, answered: dict[str, _Answered], place: int) -> _Read | str:
    """What a proxy log's line reads as (see :func:`exchange_session`), going on from the
    Responses API conversations ``answered`` by earlier lines (its own added, as ``place``)."""
    if line.get("response") is None:
        error = line.get("error")
        return "an exchange without a response" + (f" ({_detail(error)})" if error else "")
    envelope = line["response"]
    status = envelope.get("status_code") if isinstance(envelope, dict) else None
    status = status if isinstance(status, int) else line.get("status_code")
    response = _whole_response(_body(envelope), status)
    if isinstance(response, str):
        return response
    request = _body(line.get("request"))
    if _is_responses_exchange(request, response):
        return _responses_session(request, response, answered, place)
    message = _assistant_message(response)
    if isinstance(message, str):
        return message
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        return NO_REQUEST
    session = {key: request[key] for key in ("system", "tools") if key in request}
    return _Read({**session, **_names(request, response)}, [*request["messages"], message])


def latest_conversations(sessions: list[dict]) -> list[dict]:
    """The ``sessions`` (recordings, a file's in its order) whose conversation no later one
    holds whole, in their order (see the module contract)."""
    chains = [_prefix_digests(session) for session in sessions]
    continued = {digest for chain in chains for digest in chain[:-1]}
    kept, later = [], set()
    for session, chain in zip(reversed(sessions), reversed(chains)):
        if chain[-1] not in continued and chain[-1] not in later:
            kept.append(session)
        later.add(chain[-1])
    return kept[::-1]


def _body(value: Any) -> Any:
    """The body an HTTP envelope (``{"body": ...}``, not itself a request or response body)
    holds, JSON text parsed; ``value`` as it is where it is no envelope, text that is not JSON
    as it is."""
    if isinstance(value, dict) and "body" in value and not {"messages", "choices", "content"} & set(value):
        value = value["body"]
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _whole_response(response: Any, status: Any) -> dict | str:
    """The whole response a response body (out of its envelope, :func:`_body`) is or streams
    (:func:`~.streamed.whole_body`), or why it stands for none to read (an error response, a
    stream not joined, a body that is no object); ``status`` the HTTP status logged with it."""
    failed = isinstance(status, int) and status >= ERROR_STATUS
    if is_stream(response) and not failed:
        response = whole_body(response)
        if isinstance(response, str):
            return response
    if isinstance(response, dict) and (response.get("type") == "error" or response.get("error")):
        return f"an error response ({_detail(_error_of(response))})"
    if failed:
        return f"an error response (HTTP status {status}: {_detail(response)})"
    return response if isinstance(response, dict) else NO_REPLY


def _error_of(response: dict) -> Any:
    """The error an error response carries: its ``error`` (OpenAI's, Anthropic's, a failed
    Responses API response's), else its own ``code`` and ``message`` (the Responses API's
    ``error`` event)."""
    return response.get("error") or {key: response.get(key) for key in ("code", "message")}


def _assistant_message(response: dict) -> dict | str:
    """The assistant message a whole chat completion or Anthropic message holds, or why none."""
    choices = response.get("choices")
    if isinstance(choices, list):
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
        return {**message, "role": "assistant"} if isinstance(message, dict) else NO_REPLY
    if response.get("role") == "assistant" and isinstance(response.get("content"), list):
        return {"role": "assistant", "content": response["content"]}
    return NO_REPLY


def _names(request: dict, response: dict) -> dict:
    """A line's ``model`` (the request's, else the response's) and ``session_id`` (the
    response's ``id``), where they are text."""
    names = {}
    model = request.get("model") or response.get("model")
    if isinstance(model, str):
        names["model"] = model
    if isinstance(response.get("id"), str):
        names["session_id"] = response["id"]
    return names


def _is_responses_exchange(request: Any, response: dict) -> bool:
    """Whether a line is a Responses API call: a request with an ``input`` and no
    ``messages``, answered by a response object (``object: "response"``, or its ``output``)."""
    return (isinstance(request, dict) and "input" in request and "messages" not in request
            and (response.get("object") == "response" or isinstance(response.get("output"), list)))


def _responses_session(request: dict, response: dict, answered: dict[str, _Answered],
                       place: int) -> _Read | str:
    """What a Responses API line reads as (see the module contract), or why it holds none;
    its conversation is added to ``answered`` under its response's ``id``, as ``place``."""
    output = _output_items(response)
    if isinstance(output, str):
        return output
    given = _input_items(request)
    if isinstance(given, str):
        return given
    earlier = _earlier(request, given, answered)
    if isinstance(earlier, str):
        return earlier
    instructions = request.get("instructions")
    system = ([{"role": "system", "content": instructions}]
              if isinstance(instructions, str) and instructions else [])
    own = [dict(earlier.own[-1])] if earlier is not None else []
    _add_items(own, given)
    if not _add_items(own, output):
        return NO_OUTPUT
    listed = [*(earlier.listed if earlier is not None else []), *listed_tools([*given, *output])]
    declared = request.get("tools")
    tools = (chat_tools(declared if isinstance(declared, list) else [], listed)
             if isinstance(declared, list) or listed else None)
    conversation = _Answered(place, system, tools, listed, earlier, own)
    if isinstance(response.get("id"), str):
        answered[response["id"]] = conversation
    fields = {"tools": tools} if tools is not None else {}
    return _Read({**fields, **_names(request, response)}, answered=conversation)


def _output_items(response: dict) -> list[dict] | str:
    """The output items of a Responses API response the model completed (a response without a
    ``status``, or a null one, taken for one), or why it holds none to read."""
    status = response.get("status")
    if status is not None and status != FINISHED:
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return UNFINISHED.format(f"{quoted(status)}: {quoted(reason)}" if isinstance(reason, str)
                                 else quoted(status))
    output = response.get("output")
    if not isinstance(output, list) or not all(isinstance(item, dict) for item in output):
        return NO_OUTPUT
    return _items_problem(output) or output


def _input_items(request: dict) -> list[dict] | str:
    """A Responses API request's ``input`` as items, or why it cannot be read: text is one
    user message; an item without a ``type`` is a message where it has a ``role``, else an
    ``item_reference`` (as the API reads them)."""
    given = request["input"]
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if not isinstance(given, list) or not all(isinstance(item, dict) for item in given):
        return UNREAD_INPUT
    items = [item if "type" in item else {**item, "type": "message" if "role" in item else REFERENCE}
             for item in given]
    return _items_problem(items) or items


def _earlier(request: dict, given: list[dict], answered: dict[str, _Answered]) -> _Answered | None | str:
    """The conversation a Responses API request goes on from: the one of the earlier line (in
    ``answered``) whose response its ``previous_response_id`` names, None where it names none;
    why none where it goes on from what the server holds (see the module contract)."""
    held = [f"{key} {quoted(_id(request[key]))}" for key in STORED if request.get(key)]
    held += [f"{REFERENCE} {quoted(_id(item))}" for item in given if item.get("type") == REFERENCE]
    previous = request.get("previous_response_id")
    if previous is not None and not (isinstance(previous, str) and previous in answered):
        held.append(f"previous_response_id {quoted(previous)}, a response no earlier line of the "
                    f"file holds")
    if held:
        return SERVER_HELD.format("; ".join(held))
    return None if previous is None else answered[previous]


def _id(stored: Any) -> Any:
    """What names a thing the server stores: its ``id`` where it is an object."""
    return stored.get("id") if isinstance(stored, dict) else stored


def _items_problem(items: list[dict]) -> str | None:
    """Why one of a Responses API line's ``items`` cannot be read, None when all can."""
    problem = next(filter(None, map(item_problem, items)), None)
    return f"a Responses API {problem}" if problem else None


def _add_items(messages: list[dict], items: list[dict]) -> bool:
    """``items`` added to the chat ``messages`` in order (:func:`~.responses_items.add_item`);
    whether any of them added anything."""
    added = False
    for item in items:
        added = add_item(messages, item) or added
    return added


def _detail(error: Any) -> str:
    """An error as a reason quotes it (:func:`~.log_formats.quoted`): its type and message
    where it has them."""
    if isinstance(error, dict):
        said = [error.get(key) for key in ("type", "code", "message")]
        error = ": ".join(str(s) for s in said if isinstance(s, (str, int)) and s != "")
    return "no message" if isinstance(error, str) and not error.strip() else quoted(error)


def _prefix_digests(session: dict) -> list[bytes]:
    """A digest of the session's system prompt and tools, then one of each prefix of its
    messages, each chained on the one before: two sessions share a digest exactly where they
    share those and that prefix of messages. A message counts by its role, text, calls (name,
    arguments as they parse) and the call it answers; other keys (ids of the log, thinking
    dropped by the reader, cache marks) are not the conversation."""
    digest = hashlib.sha256(_canonical(session.get("tools"))).digest()
    chain = [digest]
    for message in session["messages"]:
        calls = [[c.get("id"), c.get("name"), _arguments(c)] for c in message.get("tool_calls") or []]
        said = [message.get("role"), message.get("content") or "", calls, message.get("tool_call_id")]
        digest = hashlib.sha256(digest + _canonical(said)).digest()
        chain.append(digest)
    return chain


def _arguments(call: dict) -> Any:
    """A call's arguments as they parse (a string written with other spacing is the same
    arguments), the string where it is no JSON."""
    raw = call.get("arguments_raw")
    if not isinstance(raw, str):
        return call.get("arguments")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
