"""API-proxy and gateway logs (one request and its response per line) read as sessions.

A line ``{"request": REQUEST, "response": RESPONSE, ...}`` (:func:`is_exchange`) is one call of
a chat API: REQUEST an OpenAI chat-completions or Anthropic Messages request body (``messages``,
``tools``, ``model``; Anthropic's ``system``), RESPONSE the completion or message it got: an
OpenAI chat completion (its ``choices[0].message``) or an Anthropic message (``{"role":
"assistant", "content": [parts]}``), or either streamed (server-sent-events text, a list of its
chunks or events, or one alone), joined into the whole response it streams
(:func:`~.streamed.whole_body`). Either may be held in an HTTP envelope, ``{"body": BODY,
...}`` (a gateway's ``{"method", "path", "headers", "body"}``, the ``{"status_code",
"request_id", "body"}`` of OpenAI's batch output), and a body may be logged as JSON text.
:func:`exchange_session` makes a session of the line, in the forms
:func:`~.log_formats.as_recording` reads: the request's conversation followed by the response's
assistant message, the request's ``system`` and ``tools``, ``model`` the request's (else the
response's), ``session_id`` the response's ``id``; a line has no ``source``.

What is not read, each a reason the line is skipped for: an error response (an ``error``,
Anthropic's ``type: error``, an HTTP status of 400 or more, an error a stream carries); a
stream cut off before its end (an OpenAI stream with neither a ``finish_reason`` for choice 0
nor ``[DONE]``, an Anthropic stream with neither ``message_stop`` nor a ``stop_reason``: a
recording stands for what the agent wrote, and the stream's last call may be short of arguments
it was still writing), or one that cannot be joined; a response without an assistant message
(no ``choices``, a token count); a request without a ``messages`` list (a Responses API or
embeddings request); a line without a response. A stream that ended is what the model wrote,
however it ended (a token limit included): a call's arguments that are no JSON are read as a
whole response's would be.

An agent sends its whole history with every request, so a file's lines repeat each other:
:func:`latest_conversations` keeps a line's session only where no later line of the file holds
its whole conversation (the same system prompt and tools, its messages the start of the later
one's); of lines that hold the same conversation the last is kept.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .streamed import is_stream, whole_body

__all__ = ["exchange_session", "is_exchange", "latest_conversations"]

NO_REPLY = "a response without an assistant message (neither choices[0].message nor an Anthropic message)"
NO_REQUEST = ("a request without a messages list (neither a chat completions nor an Anthropic "
              "Messages request)")
ERROR_STATUS = 400
ERROR_DETAIL_CHARS = 200  # of an error response's message, in the reason a line is skipped for


def is_exchange(obj: Any) -> bool:
    """Whether ``obj`` is a line of an API-proxy log (a ``request``, a ``response``, or both)
    rather than a session."""
    return isinstance(obj, dict) and "messages" not in obj and ("request" in obj or "response" in obj)


def exchange_session(line: dict) -> dict | str:
    """The session a proxy log's line (:func:`is_exchange`) holds, or why it holds none (see
    the module contract)."""
    if line.get("response") is None:
        error = line.get("error")
        return "an exchange without a response" + (f" ({_detail(error)})" if error else "")
    envelope = line["response"]
    status = envelope.get("status_code") if isinstance(envelope, dict) else None
    reply = _reply(_body(envelope), status if isinstance(status, int) else line.get("status_code"))
    if isinstance(reply, str):
        return reply
    response, message = reply
    request = _body(line.get("request"))
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        return NO_REQUEST
    session = {key: request[key] for key in ("system", "tools") if key in request}
    model = request.get("model") or response.get("model")
    if isinstance(model, str):
        session["model"] = model
    if isinstance(response.get("id"), str):
        session["session_id"] = response["id"]
    return {**session, "messages": [*request["messages"], message]}


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


def _reply(response: Any, status: Any) -> tuple[dict, dict] | str:
    """The whole response a response body (out of its envelope, :func:`_body`) is or streams
    (:func:`~.streamed.whole_body`) and the assistant message it holds, or why it holds none;
    ``status`` the HTTP status logged with it."""
    failed = isinstance(status, int) and status >= ERROR_STATUS
    if is_stream(response) and not failed:
        response = whole_body(response)
        if isinstance(response, str):
            return response
    if isinstance(response, dict) and (response.get("type") == "error" or response.get("error")):
        return f"an error response ({_detail(response.get('error'))})"
    if failed:
        return f"an error response (HTTP status {status}: {_detail(response)})"
    if not isinstance(response, dict):
        return NO_REPLY
    choices = response.get("choices")
    if isinstance(choices, list):
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
        return (response, {**message, "role": "assistant"}) if isinstance(message, dict) else NO_REPLY
    if response.get("role") == "assistant" and isinstance(response.get("content"), list):
        return response, {"role": "assistant", "content": response["content"]}
    return NO_REPLY


def _detail(error: Any) -> str:
    """An error as a reason quotes it: its type and message where it has them."""
    if isinstance(error, dict):
        said = [error.get(key) for key in ("type", "code", "message")]
        text = ": ".join(str(s) for s in said if isinstance(s, (str, int)) and s != "")
    else:
        text = str(error)
    text = " ".join((text or "no message").split())
    return text if len(text) <= ERROR_DETAIL_CHARS else text[:ERROR_DETAIL_CHARS] + "..."


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
