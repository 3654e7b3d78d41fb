"""Codex CLI rollouts (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``) read as sessions.

A rollout holds one item per line: :func:`is_rollout_line` tells its lines,
:func:`rollout_line_problem` the ones that cannot be read, :func:`sessions_from_rollout` makes
the rollout's conversations of the others, in the OpenAI chat form
:func:`~.log_formats.as_recording` reads.
"""

from __future__ import annotations

from typing import Any

from .log_formats import quoted
from .responses_items import CALL_ITEMS, OUTPUT_ITEMS, add_item, item_problem

__all__ = ["CODEX_SOURCE", "is_rollout_line", "rollout_line_problem", "sessions_from_rollout"]

CODEX_SOURCE = "codex"
# the Responses API items read at the top level of a line, as Codex wrote its items before its
# lines had an envelope (until September 2025): those it wrote then and every call and output
# the mapping reads; and the parts of their messages
BARE_ITEMS = ("message", "reasoning", "web_search_call", *CALL_ITEMS, *OUTPUT_ITEMS)
BARE_PARTS = ("input_text", "input_image", "output_text")
BARE_META_KEYS = {"id", "timestamp", "instructions", "git"}


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
    return (kind is None and isinstance(obj.get("id"), str)
            and isinstance(obj.get("timestamp"), str)
            and set(obj) <= BARE_META_KEYS)


def rollout_line_problem(line: dict) -> str | None:
    """Why a rollout line (:func:`is_rollout_line`) cannot be read, None when it can: a payload
    that is not an object, a session meta without an id, an item (or an item of a compaction's
    ``replacement_history``) without what its conversion needs."""
    kind, payload = _unwrapped(line)
    if not isinstance(payload, dict):
        return f"a Codex {quoted(kind)} line whose payload is not an object"
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
    sessions in the OpenAI chat form :func:`~.log_formats.as_recording` reads; source
    ``codex``, ``model`` the one the ``turn_context`` in effect when the conversation starts
    names (else its first).

    What the model saw: its system prompt, where the meta logs it (``base_instructions``), as a
    system message; the user's instructions (AGENTS.md, the meta's ``instructions`` in logs up to
    early 2026), which the first versions appended to that system prompt and later ones sent as
    a user message, as a system message too, unless a message of the session holds them;
    then its items, as :mod:`.responses_items` makes chat messages of them: messages (a
    ``developer`` one, Codex's own instructions, as the chat form's ``system``), a
    ``function_call`` as a call (its ``arguments`` string kept as written), a
    ``custom_tool_call`` (free text such as a patch) as a call whose arguments are ``{"input":
    TEXT}``, a ``local_shell_call`` or ``shell_call`` as a call of ``local_shell`` or ``shell``
    whose arguments are its ``action`` as logged, an ``apply_patch_call`` as a call of
    ``apply_patch`` whose arguments are its ``operation``, an output as a ``tool`` message
    bound to its call, an ``mcp_call`` as a call (named by its ``id``) followed by the ``tool``
    message of its output (else its error); the items the model gave with no input between are
    one assistant message. Reasoning, web searches, MCP tool lists and approvals and other
    items, and lines that hold no item (``event_msg``, ``turn_context``, state lines), are
    dropped. A session has no ``tools``: a rollout logs none of those the model was given
    (they are synthesized from its calls when it is replayed), and the tools an
    ``mcp_list_tools`` lists, given as the session's, would stand for all of them, leaving the
    calls of the others no schema.

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
    return [(c["last"], {"source": CODEX_SOURCE,
                         "session_id": name + (f"#{part}" if part > 1 else ""),
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
                if add_item(conversations[-1]["messages"], item):
                    conversations[-1]["last"] = index
    return meta or {}, conversations


def _compaction_seed(compacted: dict) -> list[dict]:
    """The items a ``compacted`` line says the model went on from: its ``replacement_history``,
    or its summary as a user message."""
    summary = compacted.get("message")
    return compacted.get("replacement_history") or (
        [{"type": "message", "role": "user", "content": summary}]
        if isinstance(summary, str) else [])


def _system_messages(meta: dict, messages: list[dict]) -> list[dict]:
    """The system messages a session meta gives (see :func:`sessions_from_rollout`);
    ``messages`` are the session's, to tell whether they hold the user's instructions."""
    base = meta.get("base_instructions")
    prompt = base.get("text") if isinstance(base, dict) else None
    user = meta.get("instructions")
    user = user.strip() if isinstance(user, str) else ""
    if user and any(isinstance(m["content"], str) and user in m["content"] for m in messages):
        user = ""
    return [{"role": "system", "content": text} for text in (prompt, user)
            if isinstance(text, str) and text]


def _enveloped(line: dict) -> bool:
    """Whether a line has the rollout envelope ``{"timestamp", "type", "payload"}``."""
    return (isinstance(line.get("timestamp"), str) and isinstance(line.get("type"), str)
            and "payload" in line)


def _unwrapped(line: dict) -> tuple[str, Any]:
    """A rollout line as its kind (``session_meta``, ``response_item``, ...) and payload; a line
    without the envelope is an item, a state line or a session meta as Codex wrote them before."""
    if _enveloped(line):
        return line["type"], line["payload"]
    if line.get("type") in BARE_ITEMS:
        return "response_item", line
    return ("state", line) if line.get("record_type") == "state" else ("session_meta", line)


def _item_problem(item: dict) -> str | None:
    """Why a Codex item cannot be converted (:func:`~.responses_items.item_problem`), None
    when it can."""
    problem = item_problem(item)
    return f"a Codex {problem}" if problem else None
