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

Logs of one event or item per line are made sessions of by their own modules
(:mod:`.claude_code_log`, :mod:`.codex_log`), in one of these forms.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CALL_PART", "CALL_PARTS", "QUOTED_CHARS", "RESULT_PART", "TEXT_PARTS", "TOOL_CALL_STYLES",
           "UNNAMED_SOURCE", "arguments_object", "as_recording", "function_tool", "part_text", "quoted"]

TEXT_PARTS = ("text", "input_text", "output_text")
CALL_PART, RESULT_PART = "tool_use", "tool_result"
CALL_PARTS = (CALL_PART, RESULT_PART)
TOOL_CALL_STYLES = ("structured", "inline_text")
UNNAMED_SOURCE = "(unnamed)"
QUOTED_CHARS = 200  # of a value of a log, in the reason a line is skipped for


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


def quoted(value: Any) -> str:
    """A value of a log as the reason a line is skipped for quotes it, one line of printable
    UTF-8 text: text as it is, blank text and any other value as JSON (an array or object
    nested too deeply to write, as which it is); a lone surrogate (a ``\\ud800`` escape JSON
    reads) as that escape, runs of white space and other unprintable characters as one space,
    and no more than :data:`QUOTED_CHARS` characters of it (the rest as ``...``)."""
    if not isinstance(value, str) or not value.strip():
        try:
            value = json.dumps(value, ensure_ascii=False)
        except RecursionError:
            value = "an array" if isinstance(value, list) else "an object"
    text = value[:QUOTED_CHARS + 1].encode("utf-8", "backslashreplace").decode("utf-8")
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text[:QUOTED_CHARS] + "..." if len(text) > QUOTED_CHARS else text


def part_text(content: Any) -> str | None:
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
    kinds = {kind for p in content if isinstance(kind := p.get("type"), str)}
    if role == "assistant" and RESULT_PART not in kinds and CALL_PART in kinds:
        calls = [{"id": p.get("id"), "name": p.get("name"), "arguments": p.get("input")}
                 for p in content if p.get("type") == CALL_PART]
        return [{**message, "content": part_text(content),
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
        if part_text(text):
            out.append({**message, "content": part_text(text)})
        text = []
        if part is None:
            break
        given = part.get("content")
        result = part_text("" if given is None else given)
        out.append({"role": "tool", "tool_call_id": part.get("tool_use_id"),
                    "content": result if result is not None else [part]})
    return out


def _with_system(messages: list, system: Any) -> list:
    """``messages`` with an Anthropic session's top-level ``system`` (a string or text parts)
    as their first message, unless their first message is a system message holding it
    already."""
    text = part_text(system)
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    if not text or (first.get("role") == "system" and part_text(first.get("content")) == text):
        return messages
    return [{"role": "system", "content": text}, *messages]


def function_tool(name: str, description: Any, parameters: Any) -> dict:
    """An OpenAI function tool: its ``description`` where that is text, its ``parameters``
    where they are a schema object, else an open object schema (``{"type": "object"}``)."""
    function = {"name": name}  # keys in OpenAI's order: templates write them as given
    if isinstance(description, str):
        function["description"] = description
    function["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object"}
    return {"type": "function", "function": function}


def _tool_from_anthropic(tool: Any) -> Any:
    """An Anthropic tool (``{"name", "description"?, "input_schema"}``) as an OpenAI function
    tool; one without a schema (a server-defined tool such as ``bash_20250124``) takes an open
    object schema. Any other value is returned as it is."""
    if not isinstance(tool, dict) or "function" in tool or not isinstance(tool.get("name"), str):
        return tool
    return function_tool(tool["name"], tool.get("description"), tool.get("input_schema"))


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
        out["content"] = part_text(content)
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
