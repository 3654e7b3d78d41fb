"""Claude Code session logs (``~/.claude/projects/PROJECT/SESSION.jsonl``) read as sessions.

Such a log holds no session per line but one event per line: :func:`is_event` tells its lines,
:func:`sessions_from_events` makes the log's conversations of them, in the Anthropic Messages
form :func:`~.log_formats.as_recording` reads.
"""

from __future__ import annotations

from typing import Any

from .log_formats import CALL_PART, RESULT_PART, quoted

__all__ = ["CLAUDE_CODE_SOURCE", "is_event", "sessions_from_events"]

CLAUDE_CODE_SOURCE = "claude_code"
# lines of a Claude Code session log that hold no message and no place in a conversation
BOOKKEEPING_EVENTS = ("summary", "file-history-snapshot", "queue-operation")
UNROOTED = ("a conversation that goes on from an event this log does not hold (its first line's "
            "parentUuid {} names no line of the file: a compaction summarizer's log, or a log cut "
            "from its start)")
UNREADABLE = "a conversation holding a {} event (uuid {}) whose message is not an object"


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
    :func:`~.log_formats.as_recording` reads.

    A conversation is the chain of ``parentUuid`` links from a reply back to its root (an
    event with no parent; an event without the field follows the line before it, so a log that
    keeps no links reads in file order): the log's last reply gives the conversation as it
    finally stood; an earlier reply whose chain shares no event with a conversation already
    taken starts another (what a compaction or a subagent began; under its session's id, which
    the reader makes ``SESSION#2`` and on after the first, :func:`~.replay.load_recordings`;
    ``SESSION/AGENT`` for a subagent), and one whose chain does
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
    reason it is not read. So does a conversation holding a user or assistant event whose
    message is not an object (:data:`UNREADABLE`): read without it, the conversation would
    not be what the model saw."""
    parents = _parents(events)
    taken: set[int] = set()
    found: list[tuple[int, dict | str]] = []
    for index in range(len(events) - 1, -1, -1):
        if not _is_reply(events[index]) or index in taken:
            continue
        chain = _chain(index, parents)
        if not taken.intersection(chain):
            conversation = _conversation(chain, events)
            why = _unrooted(chain[0], events, parents) or _unreadable(conversation, events)
            found.append((conversation[-1], why or _session([events[i] for i in conversation])))
            taken.update(conversation)
        taken.update(chain)
    found.reverse()
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
    return UNROOTED.format(quoted(named)) if isinstance(named, str) and parents[root] is None else None


def _unreadable(conversation: list[int], events: list[dict]) -> str | None:
    """:data:`UNREADABLE` for a conversation (event indices) holding a user or assistant event
    whose message is not an object; None where every message can be read."""
    for event in (events[i] for i in conversation):
        if event.get("type") in ("user", "assistant") and not isinstance(event.get("message"), dict):
            return UNREADABLE.format(event["type"], quoted(event.get("uuid")))
    return None


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
        out = {"role": event["type"],
               "content": list(content) if isinstance(content, list) else content}
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
