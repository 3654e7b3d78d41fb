"""OpenAI Responses API items and tools in the OpenAI chat form
:func:`~.log_formats.as_recording` reads.

The one mapping of an item to chat messages, read by both readers of Responses items: a Codex
CLI rollout's (:mod:`.codex_log`) and an API-proxy log's Responses API lines
(:mod:`.proxy_log`). :func:`item_problem` tells an item that cannot be converted;
:func:`add_item` adds one to a conversation's chat messages:

* a ``message`` keeps its role (``developer`` is the chat form's ``system``), its text parts
  joined, other parts (images, files, refusals) dropped;
* a ``function_call`` is a call whose arguments are its ``arguments`` string as written, a
  ``custom_tool_call`` (free text such as an ``apply_patch`` patch) one whose arguments are
  ``{"input": TEXT}``, a ``local_shell_call`` a call of ``local_shell`` whose arguments are its
  ``action`` as given; a call is named by its ``call_id`` (else its ``id``);
* an output (``function_call_output``, ``custom_tool_call_output``, and
  ``local_shell_call_output``, which names its call by ``id``) is a ``tool`` message bound to
  that call, its text (or text parts joined);
* the items the model gave with no input between are one assistant message: its calls in
  order, its texts joined by a blank line (a text after a call starts another);
* an item of any other type (reasoning, the calls of built-in tools such as web searches)
  adds nothing; an item without a type (as text) is none to read (:func:`item_problem`).

:func:`chat_tools` gives a request's tools as the chat form's function tools, the ones its
calls are read as calls of.
"""

from __future__ import annotations

from .log_formats import function_tool, part_text

__all__ = ["CALL_ITEMS", "OUTPUT_ITEMS", "add_item", "chat_tools", "item_problem"]

CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call")
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
CALL_NAMED_BY = {"local_shell_call_output": "id"}  # an output's key naming its call, else call_id
LOCAL_SHELL = "local_shell"  # the Responses API's name for the shell tool its local_shell_call runs
ROLES = {"developer": "system"}  # a Responses role as the chat form names it
CUSTOM_SCHEMA = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def item_problem(item: dict) -> str | None:
    """Why a Responses item cannot be converted (:func:`add_item`), None when it can; said of
    the item (``function_call without a name``), for the reader to say whose item it is."""
    kind = item.get("type")
    if not isinstance(kind, str):
        return "item without a type"
    if kind == "message" and not isinstance(item.get("role"), str):
        return "message without a role"
    if kind == "message" and part_text(item.get("content")) is None:
        return "message whose content is neither text nor parts"
    if kind in ("function_call", "custom_tool_call") and not isinstance(item.get("name"), str):
        return f"{kind} without a name"
    if kind == "function_call" and not isinstance(item.get("arguments"), (str, dict)):
        return "function_call whose arguments are neither a JSON string nor an object"
    if kind == "custom_tool_call" and not isinstance(item.get("input"), str):
        return "custom_tool_call whose input is not text"
    if kind == "local_shell_call" and not isinstance(item.get("action"), dict):
        return "local_shell_call whose action is not an object"
    if kind in OUTPUT_ITEMS and part_text(item.get("output")) is None:
        return f"{kind} whose output is neither text nor parts"
    return None


def add_item(messages: list[dict], item: dict) -> bool:
    """``item`` (one :func:`item_problem` passes) added to a conversation's chat ``messages``
    (see the module contract); whether it added anything."""
    kind, previous = item.get("type"), messages[-1] if messages else {}
    if kind in CALL_ITEMS:
        call = _chat_call(item)
        if previous.get("role") == "assistant":
            previous["tool_calls"] = [*previous.get("tool_calls", []), call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind in OUTPUT_ITEMS:
        messages.append({"role": "tool", "tool_call_id": item.get(CALL_NAMED_BY.get(kind, "call_id")),
                         "content": part_text(item["output"])})
    elif kind == "message":
        role, text = ROLES.get(item["role"], item["role"]), part_text(item["content"])
        joins = previous.get("role") == "assistant" and not previous.get("tool_calls")
        if role == "assistant" and joins:
            previous["content"] = "\n\n".join(t for t in (previous["content"], text) if t)
        else:
            messages.append({"role": role, "content": text})
    else:
        return False
    return True


def chat_tools(tools: list) -> list[dict]:
    """A Responses request's ``tools`` as chat function tools, in their order: a ``function``
    tool as ``{"type": "function", "function": {"name", "description"?, "parameters"}}`` (an
    open object schema where it gives none); a ``custom`` tool as a function taking the
    ``{"input": TEXT}`` its calls are read as; ``local_shell`` as the function ``local_shell``
    taking an open object (its calls' ``action``). The other built-in tools (web search, file
    search, ...), whose calls are read as no calls, and tools without a name, are dropped."""
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == LOCAL_SHELL:
            out.append(function_tool(LOCAL_SHELL, None, None))
        elif kind in ("function", "custom") and isinstance(tool.get("name"), str):
            parameters = tool.get("parameters") if kind == "function" else CUSTOM_SCHEMA
            out.append(function_tool(tool["name"], tool.get("description"), parameters))
    return out


def _chat_call(item: dict) -> dict:
    """A call item as an OpenAI chat tool call (see the module contract)."""
    if item["type"] == "function_call":
        name, arguments = item["name"], item["arguments"]
    elif item["type"] == "custom_tool_call":
        name, arguments = item["name"], {"input": item["input"]}
    else:
        name, arguments = LOCAL_SHELL, item["action"]
    call_id = item.get("call_id") or item.get("id")
    return {**({"id": call_id} if isinstance(call_id, str) else {}), "type": "function",
            "function": {"name": name, "arguments": arguments}}
