"""Agent logs in the forms APIs write them, read as recordings (``fixtures/transcripts/README.md``).

:func:`as_recording` takes one logged session, a JSON object with a ``messages`` list, and
returns it in the recording format. It reads three forms, message by message:

* the recording format itself (calls as ``{"name", "arguments": {...}}``);
* OpenAI chat logs: calls as ``{"id", "type": "function", "function": {"name", "arguments":
  str}}`` (or the older ``function_call`` answered by a ``function`` message), content as a
  string or as text parts;
* Anthropic Messages logs: a session's ``system`` and ``tools`` (``input_schema``) at the top
  level, a call as a ``tool_use`` part of an assistant message, its result as a ``tool_result``
  part of the user message after it. A user message's results become ``tool`` messages in
  their order, its text a user message where it stands between them.

Parts that hold neither text, a call nor a result (images, thinking) are dropped. What this
module cannot convert is left as it is, for the loader to report as the line's problem: a call
part outside an assistant message, a result part outside a user message.

A Claude Code session log is no session per line but one event per line: :func:`is_event` tells
its lines, :func:`sessions_from_events` makes the log's conversations of them, in the Anthropic
form. A Codex CLI rollout is one item per line too: :func:`is_rollout_line` tells its lines,
:func:`rollout_line_problem` the ones that cannot be read, :func:`sessions_from_rollout` makes
the rollout's conversations of the others, in the OpenAI chat form.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CALL_PARTS", "CLAUDE_CODE_SOURCE", "CODEX_SOURCE", "TEXT_PARTS", "TOOL_CALL_STYLES",
           "UNNAMED_SOURCE", "arguments_object", "as_recording", "is_event", "is_rollout_line",
           "rollout_line_problem", "sessions_from_events", "sessions_from_rollout"]

TEXT_PARTS = ("text", "input_text", "output_text")
CALL_PART, RESULT_PART = "tool_use", "tool_result"
CALL_PARTS = (CALL_PART, RESULT_PART)
TOOL_CALL_STYLES = ("structured", "inline_text")
UNNAMED_SOURCE = "(unnamed)"


def as_recording(obj: Any) -> Any:
    """A session in the recording format (anything without a ``messages`` list is returned as
    it is; see the module contract for the forms read). A session without a ``source`` gets
    :data:`UNNAMED_SOURCE`; one whose ``tool_call_style`` is not one of
    :data:`TOOL_CALL_STYLES` is ``structured`` when it has tools, tool calls or tool results,
    else ``inline_text``. An OpenAI call's ``arguments`` string becomes ``arguments`` (the
    object it holds, ``{}`` where it holds none) and ``arguments_raw`` (the string); so does a
    recorded call whose ``arguments`` is that string; an Anthropic call's ``input`` is its
    ``arguments``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        return obj
    messages = [converted for m in obj["messages"] for converted in
                (_messages_from_parts(m) if isinstance(m, dict) else [m])]
    messages = [_message_from_openai(m) if isinstance(m, dict) else m for m in messages]
    obj = {**obj, "messages": _with_system(messages, obj.get("system"))}
    if isinstance(obj.get("tools"), list):
        obj["tools"] = [_tool_from_anthropic(t) for t in obj["tools"]]
    if not isinstance(obj.get("source"), str) or not obj["source"]:
        obj["source"] = UNNAMED_SOURCE
    if obj.get("tool_call_style") not in TOOL_CALL_STYLES:
        tooled = obj.get("tools") or any(isinstance(m, dict) and (
            m.get("tool_calls") or m.get("role") == "tool") for m in obj["messages"])
        obj["tool_call_style"] = "structured" if tooled else "inline_text"
    return obj


def arguments_object(raw: Any) -> dict:
    """The object a tool call's ``arguments`` hold (a JSON string parsed); ``{}`` when they
    hold no JSON object."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            return {}
    return raw if isinstance(raw, dict) else {}


def _part_text(content: Any) -> str | None:
    """The text of ``content`` given as a string or as parts (strings and text parts joined,
    other parts dropped); None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, (dict, str)) for p in content):
        return "".join(p if isinstance(p, str) else p["text"] for p in content
                       if isinstance(p, str) or (p.get("type") in TEXT_PARTS
                                                 and isinstance(p.get("text"), str)))
    return None


def _messages_from_parts(message: dict) -> list[dict]:
    """An Anthropic message holding call or result parts as recording messages (``[message]``
    for any other message, and for parts this module cannot place: see the module contract)."""
    content, role = message.get("content"), message.get("role")
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        return [message]
    kinds = {p.get("type") for p in content}
    if role == "assistant" and RESULT_PART not in kinds and CALL_PART in kinds:
        calls = [{"id": p.get("id"), "name": p.get("name"), "arguments": p.get("input")}
                 for p in content if p.get("type") == CALL_PART]
        return [{**message, "content": _part_text(content),
                 "tool_calls": [{k: v for k, v in c.items() if v is not None} for c in calls]}]
    if role == "user" and CALL_PART not in kinds and RESULT_PART in kinds:
        return _user_turn(message, content)
    return [message]


def _user_turn(message: dict, content: list[dict]) -> list[dict]:
    """A user message of result and text parts: a ``tool`` message per result, a user
    message per run of text between them (runs with no text dropped). A result whose content
    is neither text nor parts is kept as the part, which the loader reports."""
    out: list[dict] = []
    text: list[dict] = []
    for part in [*content, None]:
        if part is not None and part.get("type") != RESULT_PART:
            text.append(part)
            continue
        if _part_text(text):
            out.append({**message, "content": _part_text(text)})
        text = []
        if part is None:
            break
        given = part.get("content")
        result = _part_text("" if given is None else given)
        out.append({"role": "tool", "tool_call_id": part.get("tool_use_id"),
                    "content": result if result is not None else [part]})
    return out


def _with_system(messages: list, system: Any) -> list:
    """``messages`` with an Anthropic session's top-level ``system`` (a string or text parts)
    as their first message, unless they hold a system message already."""
    text = _part_text(system)
    if not text or any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": text}, *messages]


def _tool_from_anthropic(tool: Any) -> Any:
    """An Anthropic tool (``{"name", "description"?, "input_schema"}``) as an OpenAI function
    tool; one without a schema (a server-defined tool such as ``bash_20250124``) takes an open
    object schema. Any other value is returned as it is."""
    if not isinstance(tool, dict) or "function" in tool or not isinstance(tool.get("name"), str):
        return tool
    function = {"name": tool["name"]}  # keys in OpenAI's order: templates write them as given
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    schema = tool.get("input_schema")
    function["parameters"] = schema if isinstance(schema, dict) else {"type": "object"}
    return {"type": "function", "function": function}


def _message_from_openai(message: dict) -> dict:
    out = dict(message)
    legacy = message.get("function_call")
    if isinstance(legacy, dict) and not message.get("tool_calls"):
        del out["function_call"]
        out["tool_calls"] = [{"type": "function", "function": legacy}]
    if message.get("role") == "function":
        out["role"] = "tool"
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") not in CALL_PARTS
                                         for p in content):
        out["content"] = _part_text(content)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_call_from_openai(c) if isinstance(c, dict) else c for c in calls]
    return out


def _call_from_openai(call: dict) -> dict:
    function = call.get("function")
    if "name" in call or not isinstance(function, dict):
        raw = call.get("arguments")
        if not isinstance(raw, str):
            return call
        return {**call, "arguments": arguments_object(raw), "arguments_raw": call.get("arguments_raw", raw)}
    raw = function.get("arguments")
    out = {k: v for k, v in call.items() if k not in ("function", "type")}
    out["name"] = function.get("name")
    out["arguments"] = arguments_object(raw)
    if isinstance(raw, str):
        out["arguments_raw"] = raw
    return out


# ----------------------------------------------------------------------------- event logs

CLAUDE_CODE_SOURCE = "claude_code"
# lines of a Claude Code session log that hold no message and no place in a conversation
BOOKKEEPING_EVENTS = ("summary", "file-history-snapshot", "queue-operation")
UNROOTED = ("a conversation that goes on from an event this log does not hold (its first line's "
            "parentUuid {} names no line of the file: a compaction summarizer's log, or a log cut "
            "from its start)")


def is_event(obj: Any) -> bool:
    """Whether ``obj`` is a line of a Claude Code session log (one event per line, chained by
    ``uuid`` and ``parentUuid``) rather than a session."""
    return (isinstance(obj, dict) and "messages" not in obj
            and (isinstance(obj.get("sessionId"), str) or obj.get("type") in BOOKKEEPING_EVENTS
                 or (obj.get("type") in ("user", "assistant")
                     and isinstance(obj.get("message"), dict))))


def sessions_from_events(events: list[dict]) -> list[tuple[int, dict | str]]:
    """The conversations of a Claude Code session log's events (file order), as ``(index of
    the event that ends it, session)``, the sessions in the Anthropic Messages form
    :func:`as_recording` reads.

    A conversation is the chain of ``parentUuid`` links from a reply back to its root (an
    event with no parent; an event without the field follows the line before it, so a log that
    keeps no links reads in file order): the log's last reply gives the conversation as it
    finally stood; an earlier reply whose chain shares no event with a conversation already
    taken starts another (what a compaction or a subagent began; named ``SESSION#2`` and on
    after the first of its session, ``SESSION/AGENT`` for a subagent), and one whose chain does
    (a branch the user rewound) is dropped. Messages that no reply follows (a prompt never
    answered, local commands typed after the last reply) are in no conversation: they hold no
    turn. Events that hold no message keep their place in a chain; an error Claude Code wrote
    in the assistant's place (``isApiErrorMessage``, model ``<synthetic>``) is no reply. The
    events of one reply (one per content part, sharing the message ``id``) are its one message,
    where the first of them stands; those a chain leaves off, and the results to their calls,
    are in its conversation too, in file order (:func:`_conversation`).

    A conversation whose root names a parent the log does not hold goes on from one held
    elsewhere (the log of a compaction's summarizer, ``subagents/agent-acompact-*.jsonl``,
    holds only what it added to the main session's conversation; a log cut from its start):
    the model saw more than the log holds, so the session's place holds :data:`UNROOTED`, the
    reason it is not read."""
    parents = _parents(events)
    taken: set[int] = set()
    found: list[tuple[int, dict | str]] = []
    for index in range(len(events) - 1, -1, -1):
        if not _is_reply(events[index]) or index in taken:
            continue
        chain = _chain(index, parents)
        if not taken.intersection(chain):
            conversation = _conversation(chain, events)
            why = _unrooted(chain[0], events, parents)
            found.append((conversation[-1], why or _session([events[i] for i in conversation])))
            taken.update(conversation)
        taken.update(chain)
    found.reverse()
    named: dict[str, int] = {}
    for _, session in found:  # a log's later conversations of one session id: "ID#2", "ID#3"
        if isinstance(session, dict):
            named[session["session_id"]] = count = named.get(session["session_id"], 0) + 1
            if count > 1:
                session["session_id"] += f"#{count}"
    return found


def _parents(events: list[dict]) -> list[int | None]:
    """Each event's parent, as an index into ``events``: the event its ``parentUuid`` names
    (the first with that ``uuid``), or for an event without the field the one before it; None
    for a root."""
    first: dict[str, int] = {}
    for i, event in enumerate(events):
        if isinstance(uuid := event.get("uuid"), str):
            first.setdefault(uuid, i)
    return [(first.get(e["parentUuid"]) if isinstance(e["parentUuid"], str) else None)
            if "parentUuid" in e else (i - 1 if i else None) for i, e in enumerate(events)]


def _message(event: dict) -> dict | None:
    """The user or assistant message an event holds, None for any other event."""
    message = event.get("message")
    if event.get("type") not in ("user", "assistant") or not isinstance(message, dict):
        return None
    if event.get("isApiErrorMessage") or message.get("model") == "<synthetic>":
        return None
    return message


def _unrooted(root: int, events: list[dict], parents: list[int | None]) -> str | None:
    """:data:`UNROOTED` for a conversation whose root event names a parent the log does not
    hold; None for one whose root has no parent."""
    named = events[root].get("parentUuid")
    return UNROOTED.format(named) if isinstance(named, str) and parents[root] is None else None


def _chain(index: int, parents: list[int | None]) -> list[int]:
    """Event ``index`` and its ancestors, root first (a cycle ends the walk)."""
    chain, seen = [index], {index}
    while (parent := parents[chain[-1]]) is not None and parent not in seen:
        chain.append(parent)
        seen.add(parent)
    return chain[::-1]


def _conversation(chain: list[int], events: list[dict]) -> list[int]:
    """``chain`` and the events of its replies that Claude Code logged off it, in file order:
    every event of a reply in the chain (its message ``id``) and the first result to each of
    their calls that the chain does not answer. Claude Code 2.1 logs a reply's parallel calls
    one line each, chained, and each result as the child of its own call's line: the next
    reply goes on from one result, and the calls after that result's call, and the other
    results, are off its chain."""
    replies = {reply_id for i in chain if (reply_id := _reply_id(events[i])) is not None}
    parts = [i for i, event in enumerate(events) if _reply_id(event) in replies]
    calls = {_part_id(p, CALL_PART, "id") for i in parts for p in _parts(events[i])}
    answered = {_part_id(p, RESULT_PART, "tool_use_id") for i in chain for p in _parts(events[i])}
    calls -= {None, *answered}
    results: dict[str, int] = {}
    for i, event in enumerate(events):
        for p in _parts(event) if event.get("type") == "user" else []:
            if (call_id := _part_id(p, RESULT_PART, "tool_use_id")) in calls:
                results.setdefault(call_id, i)
    return sorted({*chain, *parts, *results.values()})


def _part_id(part: dict, kind: str, key: str) -> str | None:
    """The id a part of type ``kind`` holds under ``key`` (a call's ``id``, a result's
    ``tool_use_id``); None for a part of another type or an id that is no string."""
    value = part.get(key) if part.get("type") == kind else None
    return value if isinstance(value, str) else None


def _is_reply(event: dict) -> bool:
    """Whether an event holds (a part of) a reply of the model."""
    return event.get("type") == "assistant" and _message(event) is not None


def _reply_id(event: dict) -> str | None:
    """The message ``id`` of a reply's event; None for any other event, and for a reply
    without one."""
    reply_id = _message(event).get("id") if _is_reply(event) else None
    return reply_id if isinstance(reply_id, str) else None


def _parts(event: dict) -> list[dict]:
    """The content parts of an event's message (none for a message whose content is text)."""
    message = _message(event)
    content = message.get("content") if message is not None else None
    return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


def _session(conversation: list[dict]) -> dict:
    """One conversation's events, in order, as an Anthropic Messages session."""
    messages: list[dict] = []
    replies: dict[str, dict] = {}  # message id -> its message, to gather the reply's parts
    for event in conversation:
        message = _message(event)
        if message is None:
            continue
        reply_id = _reply_id(event)
        content = message.get("content")
        if reply_id in replies and isinstance(content, list):
            replies[reply_id]["content"] += content
            continue
        out = {"role": event["type"], "content": list(content) if isinstance(content, list) else content}
        if reply_id is not None and isinstance(out["content"], list):
            replies[reply_id] = out
        messages.append(out)
    last = conversation[-1]
    name = str(last.get("sessionId", ""))
    if last.get("isSidechain") and isinstance(last.get("agentId"), str):
        name += f"/{last['agentId']}"
    models = [m.get("model") for e in conversation if _is_reply(e) and (m := _message(e))]
    return {"source": CLAUDE_CODE_SOURCE, "session_id": name, "harness": "claude-code",
            "model": next((m for m in models if isinstance(m, str)), None), "messages": messages}


# ----------------------------------------------------------------------------- Codex rollouts

CODEX_SOURCE = "codex"
CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call")
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output")
# the Responses API items Codex wrote at the top level of a line, before its lines had an
# envelope (until September 2025), and the parts of their messages
BARE_ITEMS = ("message", "reasoning", "web_search_call", *CALL_ITEMS, *OUTPUT_ITEMS)
BARE_PARTS = ("input_text", "input_image", "output_text")
BARE_META_KEYS = {"id", "timestamp", "instructions", "git"}
LOCAL_SHELL = "local_shell"  # the Responses API's name for the shell tool its local_shell_call runs
ROLES = {"developer": "system"}  # a Responses role as the chat form names it


def is_rollout_line(obj: Any) -> bool:
    """Whether ``obj`` is a line of a Codex CLI rollout (``~/.codex/sessions/.../rollout-*.jsonl``)
    rather than a session: ``{"timestamp", "type", "payload"}``, or a line as Codex wrote them
    before that envelope (the session meta ``{"id", "timestamp", "instructions"?, "git"?}``, a
    Responses API item, a ``{"record_type": "state"}`` line). An item is only taken for Codex's
    when it has a Responses type, a message only when its parts are Responses parts."""
    if not isinstance(obj, dict) or "messages" in obj:
        return False
    kind = obj.get("type")
    if _enveloped(obj) or obj.get("record_type") == "state":
        return True
    if kind == "message":
        content = obj.get("content")
        return isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in BARE_PARTS for p in content)
    if kind in BARE_ITEMS:
        return True
    return (kind is None and isinstance(obj.get("id"), str) and isinstance(obj.get("timestamp"), str)
            and set(obj) <= BARE_META_KEYS)


def rollout_line_problem(line: dict) -> str | None:
    """Why a rollout line (:func:`is_rollout_line`) cannot be read, None when it can: a payload
    that is not an object, a session meta without an id, an item (or an item of a compaction's
    ``replacement_history``) without what its conversion needs."""
    kind, payload = _unwrapped(line)
    if not isinstance(payload, dict):
        return f"a Codex {kind} line whose payload is not an object"
    if kind == "session_meta" and not isinstance(payload.get("id"), str):
        return "a Codex session_meta without an id"
    if kind == "response_item":
        return _item_problem(payload)
    if kind == "compacted" and (history := payload.get("replacement_history")) is not None:
        if not isinstance(history, list) or not all(isinstance(i, dict) for i in history):
            return "a Codex compacted line whose replacement_history is not a list of items"
        return next(filter(None, map(_item_problem, history)), None)
    return None


def sessions_from_rollout(lines: list[dict]) -> list[tuple[int, dict]]:
    """The conversations of a Codex CLI rollout's lines (file order, lines
    :func:`rollout_line_problem` passes), as ``(index of the line that ends it, session)``, the
    sessions in the OpenAI chat form :func:`as_recording` reads; source ``codex``, ``model`` the
    one the ``turn_context`` in effect when the conversation starts names (else its first).

    What the model saw: its system prompt, where the meta logs it (``base_instructions``), as a
    system message; the user's instructions (AGENTS.md, the meta's ``instructions`` in logs up to
    early 2026), which the first versions appended to that system prompt and later ones sent as
    a user message, as a system message too, unless a message of the session holds them;
    then its items: messages (a ``developer`` one, Codex's own instructions, as the chat form's
    ``system``; text parts joined, images dropped), a ``function_call`` as a call (its
    ``arguments`` string kept as written), a ``custom_tool_call`` (free text such as a patch) as
    a call whose arguments are ``{"input": TEXT}``, a ``local_shell_call`` as a call of
    ``local_shell`` whose arguments are its ``action`` as logged, an output as a ``tool`` message
    bound by ``call_id``. Items the model gave with no input between are one assistant message:
    its calls in order, its texts joined by a blank line (a text after a call starts another).
    Reasoning, web searches and other items, and lines that hold no item (``event_msg``,
    ``turn_context``, state lines), are dropped.

    A rollout is one session, named by its first session meta: a fork logs its own meta, then
    its parent's lines (their metas too) as the history it went on from. A ``compacted`` line
    ends a conversation; the session's next one (``ID#2``, ...) starts from what the model went
    on from: the line's ``replacement_history``, or without one its summary as a user message
    (Codex sent the summary with the user's earlier messages, which such a log does not keep as
    sent). A rollback (``thread_rolled_back``) is not applied: the turns it took back stay in
    the conversation."""
    meta, conversations = _rollout_conversations(lines)
    conversations = [c for c in conversations if c["messages"]]
    system = _system_messages(meta, [m for c in conversations for m in c["messages"]])
    name = meta["id"] if isinstance(meta.get("id"), str) else ""
    return [(c["last"], {"source": CODEX_SOURCE, "session_id": name + (f"#{part}" if part > 1 else ""),
                         "harness": "codex", "model": c["model"],
                         "messages": [*map(dict, system), *c["messages"]]})
            for part, c in enumerate(conversations, 1)]


def _rollout_conversations(lines: list[dict]) -> tuple[dict, list[dict]]:
    """A rollout's first session meta (``{}`` if it has none) and its conversations, as
    ``{"last": index of the line that ends it, "model", "messages"}`` (some maybe without
    messages), as :func:`sessions_from_rollout` tells them apart."""
    meta: dict | None = None
    conversations: list[dict] = []
    model: str | None = None  # the one in effect
    for index, line in enumerate(lines):
        kind, payload = _unwrapped(line)
        if kind == "session_meta" and meta is None:
            meta = payload
        elif kind == "turn_context" and isinstance(payload.get("model"), str):
            model = payload["model"]
            if conversations and conversations[-1]["model"] is None:
                conversations[-1]["model"] = model
        elif kind in ("response_item", "compacted"):
            if not conversations or kind == "compacted":
                conversations.append({"last": index, "model": model, "messages": []})
            for item in [payload] if kind == "response_item" else _compaction_seed(payload):
                if _add_item(conversations[-1]["messages"], item):
                    conversations[-1]["last"] = index
    return meta or {}, conversations


def _compaction_seed(compacted: dict) -> list[dict]:
    """The items a ``compacted`` line says the model went on from: its ``replacement_history``,
    or its summary as a user message."""
    summary = compacted.get("message")
    return compacted.get("replacement_history") or (
        [{"type": "message", "role": "user", "content": summary}] if isinstance(summary, str) else [])


def _system_messages(meta: dict, messages: list[dict]) -> list[dict]:
    """The system messages a session meta gives (see :func:`sessions_from_rollout`);
    ``messages`` are the session's, to tell whether they hold the user's instructions."""
    base = meta.get("base_instructions")
    prompt = base.get("text") if isinstance(base, dict) else None
    user = meta.get("instructions")
    user = user.strip() if isinstance(user, str) else ""
    if user and any(isinstance(m["content"], str) and user in m["content"] for m in messages):
        user = ""
    return [{"role": "system", "content": text} for text in (prompt, user) if isinstance(text, str) and text]


def _enveloped(line: dict) -> bool:
    """Whether a line has the rollout envelope ``{"timestamp", "type", "payload"}``."""
    return isinstance(line.get("timestamp"), str) and isinstance(line.get("type"), str) and "payload" in line


def _unwrapped(line: dict) -> tuple[str, Any]:
    """A rollout line as its kind (``session_meta``, ``response_item``, ...) and payload; a line
    without the envelope is an item, a state line or a session meta as Codex wrote them before."""
    if _enveloped(line):
        return line["type"], line["payload"]
    if line.get("type") in BARE_ITEMS:
        return "response_item", line
    return ("state", line) if line.get("record_type") == "state" else ("session_meta", line)


def _item_problem(item: dict) -> str | None:
    """Why a Responses item cannot be converted (:func:`_add_item`), None when it can."""
    kind = item.get("type")
    if kind == "message" and not isinstance(item.get("role"), str):
        return "a Codex message without a role"
    if kind == "message" and _part_text(item.get("content")) is None:
        return "a Codex message whose content is neither text nor parts"
    if kind in ("function_call", "custom_tool_call") and not isinstance(item.get("name"), str):
        return f"a Codex {kind} without a name"
    if kind == "function_call" and not isinstance(item.get("arguments"), (str, dict)):
        return "a Codex function_call whose arguments are neither a JSON string nor an object"
    if kind == "custom_tool_call" and not isinstance(item.get("input"), str):
        return "a Codex custom_tool_call whose input is not text"
    if kind == "local_shell_call" and not isinstance(item.get("action"), dict):
        return "a Codex local_shell_call whose action is not an object"
    if kind in OUTPUT_ITEMS and _part_text(item.get("output")) is None:
        return f"a Codex {kind} whose output is neither text nor parts"
    return None


def _add_item(messages: list[dict], item: dict) -> bool:
    """``item`` (one :func:`_item_problem` passes) added to a conversation's chat messages as
    :func:`sessions_from_rollout` says; whether it added anything."""
    kind, previous = item.get("type"), messages[-1] if messages else {}
    if kind in CALL_ITEMS:
        call = _rollout_call(item)
        if previous.get("role") == "assistant":
            previous["tool_calls"] = [*previous.get("tool_calls", []), call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind in OUTPUT_ITEMS:
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _part_text(item["output"])})
    elif kind == "message":
        role, text = ROLES.get(item["role"], item["role"]), _part_text(item["content"])
        if role == "assistant" and previous.get("role") == "assistant" and not previous.get("tool_calls"):
            previous["content"] = "\n\n".join(t for t in (previous["content"], text) if t)
        else:
            messages.append({"role": role, "content": text})
    else:
        return False
    return True


def _rollout_call(item: dict) -> dict:
    """A call item as an OpenAI chat tool call (see :func:`sessions_from_rollout`)."""
    if item["type"] == "function_call":
        name, arguments = item["name"], item["arguments"]
    elif item["type"] == "custom_tool_call":
        name, arguments = item["name"], {"input": item["input"]}
    else:
        name, arguments = LOCAL_SHELL, item["action"]
    call_id = item.get("call_id") or item.get("id")
    return {**({"id": call_id} if isinstance(call_id, str) else {}), "type": "function",
            "function": {"name": name, "arguments": arguments}}
