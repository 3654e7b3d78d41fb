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
  ``{"input": TEXT}``; the call of a built-in tool the agent runs is a call of a function named
  as the tool, its arguments the object the model wrote as given: a ``local_shell_call``'s
  ``action`` (``local_shell``), a ``shell_call``'s ``action`` (``shell``: ``{"commands",
  "timeout_ms", "max_output_length"}``), an ``apply_patch_call``'s ``operation``
  (``apply_patch``: ``{"type": "create_file" | "update_file" | "delete_file", "path",
  "diff"}``); a call is named by its ``call_id`` (else its ``id``);
* an output (``function_call_output``, ``custom_tool_call_output``,
  ``local_shell_call_output``, which names its call by ``id``, ``shell_call_output``,
  ``apply_patch_call_output``) is a ``tool`` message bound to that call, its text (or text
  parts joined); a ``shell_call_output``'s entries (one per command) as their stdout, stderr
  and outcome (``exit code N``, ``timed out``), each of these that is not empty starting a
  line; an ``apply_patch_call_output`` without an ``output`` its ``status``;
* an ``mcp_call`` (the call of an MCP server's tool, which the API made inside the response)
  is a call of the function named as its ``name``, its arguments its ``arguments`` string as
  written, named by its ``id``, followed by the ``tool`` message of its result as the item
  holds it: its ``output``; where that is null or empty its ``error`` (text as written; an
  object, as the SDK types it, a protocol, tool-execution or HTTP error, as its JSON text);
  where it has neither, empty text: the model went on after the call was made, a template
  expects a result after each call, and the item holds no other text the model read of it. A
  call made on approval (its ``approval_request_id``) is read so too;
* the items the model gave with no input between are one assistant message: its calls in
  order, its texts joined by a blank line (a text after a call starts another, and so does
  anything after an ``mcp_call``, whose result the model read before it);
* an item of any other type adds nothing: reasoning; an ``mcp_list_tools`` (its tools are the
  conversation's tools: :func:`listed_tools`); an ``mcp_approval_request``, whose call is read
  where the API makes it (the ``mcp_call`` naming the request), or nowhere where it is
  refused, and the ``mcp_approval_response`` that answers it (the user's, not the model's);
  the calls of tools the server runs inside a response (``web_search_call``,
  ``file_search_call``, ``code_interpreter_call``, ``image_generation_call``), whose items do
  not hold as text what the model read of their results (search results and a program's
  outputs only where the request asks, images); a ``computer_call``, whose actions are clicks
  and keys on the screenshots its output returns as images. An item without a type (as text)
  is none to read (:func:`item_problem`).

:func:`chat_tools` gives a request's tools, and the tools its conversation's
``mcp_list_tools`` items list (:func:`listed_tools`), as the chat form's function tools, the
ones its calls are read as calls of. An MCP tool is the function named as the tool (as the
model names it in an ``mcp_call``), not by its server: a name listed twice, or named as a
tool the request declares, is one tool, the first.

Item and tool shapes: openai/openai-python ``src/openai/types/responses/`` at e43b422
(``response_function_shell_tool_call.py``, ``response_function_shell_tool_call_output.py``,
``response_apply_patch_tool_call.py``, ``response_apply_patch_tool_call_output.py``,
``response_input_item_param.py``, ``function_shell_tool_param.py``,
``apply_patch_tool_param.py``, ``response_output_item.py``'s ``McpCall``, ``McpListTools``,
``McpListToolsTool``, ``McpApprovalRequest`` and ``McpApprovalResponse``,
``mcp_tool_call_error.py``; an ``mcp_call``'s ``error`` was typed as text before f38355e).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .log_formats import function_tool, part_text

__all__ = ["CALL_ITEMS", "OUTPUT_ITEMS", "add_item", "chat_tools", "item_problem", "listed_tools"]

SHELL_SCHEMA = {"type": "object", "properties": {  # a shell_call's action
    "commands": {"type": "array", "items": {"type": "string"}},
    "timeout_ms": {"type": ["integer", "null"]}, "max_output_length": {"type": ["integer", "null"]}},
    "required": ["commands"]}
PATCH_OPERATIONS = ("create_file", "update_file", "delete_file")
PATCH_SCHEMA = {"type": "object", "properties": {  # an apply_patch_call's operation
    "type": {"type": "string", "enum": list(PATCH_OPERATIONS)}, "path": {"type": "string"},
    "diff": {"type": "string"}}, "required": ["type", "path"]}
# a call item of a built-in tool the agent runs: the tool's type (the name of the function its
# calls are read as calls of), the key of the object the call's arguments are, and the schema
# of that object (None: an open object)
BUILT_IN_CALLS = {"local_shell_call": ("local_shell", "action", None),
                  "shell_call": ("shell", "action", SHELL_SCHEMA),
                  "apply_patch_call": ("apply_patch", "operation", PATCH_SCHEMA)}
BUILT_IN_TOOLS = {tool: schema for tool, _, schema in BUILT_IN_CALLS.values()}
MCP_CALL, MCP_LISTING = "mcp_call", "mcp_list_tools"  # an MCP server's call and its list of tools
CALL_ITEMS = ("function_call", "custom_tool_call", *BUILT_IN_CALLS, MCP_CALL)
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output",
                "shell_call_output", "apply_patch_call_output")
CALL_NAMED_BY = {"local_shell_call_output": "id"}  # an output's key naming its call, else call_id
UNREAD_OUTPUT = {  # what an output item's output is not, where it cannot be read (else text or parts)
    "shell_call_output": "text nor entries of stdout, stderr and an outcome (an exit code or a timeout)",
    "apply_patch_call_output": "text nor parts (nor absent, with a status)"}
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
    if kind in ("function_call", "custom_tool_call", MCP_CALL) and not isinstance(item.get("name"), str):
        return f"{kind} without a name"
    if kind == MCP_CALL:
        return _mcp_call_problem(item)
    if kind == MCP_LISTING and _listing_tools(item) is None:
        return "mcp_list_tools whose tools are not a list of tools with names as text"
    if kind == "function_call" and not isinstance(item.get("arguments"), (str, dict)):
        return "function_call whose arguments are neither a JSON string nor an object"
    if kind == "custom_tool_call" and not isinstance(item.get("input"), str):
        return "custom_tool_call whose input is not text"
    if kind in BUILT_IN_CALLS:
        key = BUILT_IN_CALLS[kind][1]
        if not isinstance(item.get(key), dict):
            return f"{kind} whose {key} is not an object"
        return _arguments_problem(kind, item[key])
    if kind in OUTPUT_ITEMS and _output_text(item) is None:
        return f"{kind} whose output is neither {UNREAD_OUTPUT.get(kind, 'text nor parts')}"
    return None


def _mcp_call_problem(call: dict) -> str | None:
    """Why an ``mcp_call`` with a name cannot be converted, None when it can: its ``id``
    (which its tool message is bound to) and ``arguments`` are text, its ``output`` text or
    null, its ``error`` text, an object or null."""
    if not isinstance(call.get("id"), str):
        return "mcp_call without an id"
    if not isinstance(call.get("arguments"), str):
        return "mcp_call whose arguments are not a JSON string"
    if not isinstance(call.get("output"), (str, type(None))):
        return "mcp_call whose output is neither text nor null"
    if not isinstance(call.get("error"), (str, dict, type(None))):
        return "mcp_call whose error is neither text, an object nor null"
    return None


def _arguments_problem(kind: str, arguments: dict) -> str | None:
    """Why a built-in tool's call whose arguments are the object ``arguments`` does not fit its
    tool's schema (:data:`BUILT_IN_CALLS`) where that schema requires a key, None when it fits."""
    if kind == "shell_call":
        commands = arguments.get("commands")
        if not (isinstance(commands, list) and all(isinstance(c, str) for c in commands)):
            return "shell_call whose action's commands are not a list of text"
    if kind == "apply_patch_call" and not (
            arguments.get("type") in PATCH_OPERATIONS and isinstance(arguments.get("path"), str)
            and (arguments["type"] == "delete_file" or isinstance(arguments.get("diff"), str))):
        return ("apply_patch_call whose operation is not a create_file, update_file or "
                "delete_file of a path as text (with a diff as text, but to delete)")
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
        if kind == MCP_CALL:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": _mcp_result(item)})
    elif kind in OUTPUT_ITEMS:
        messages.append({"role": "tool", "tool_call_id": item.get(CALL_NAMED_BY.get(kind, "call_id")),
                         "content": _output_text(item)})
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


def chat_tools(tools: list, listed: Sequence[dict] = ()) -> list[dict]:
    """A Responses request's ``tools`` as chat function tools, in their order, then the
    function tools ``listed`` (those its conversation's MCP servers list:
    :func:`listed_tools`): a ``function`` tool as ``{"type": "function", "function": {"name",
    "description"?, "parameters"}}`` (an open object schema where it gives none); a ``custom``
    tool as a function taking the ``{"input": TEXT}`` its calls are read as; a built-in tool
    the agent runs as the function named as the tool, taking the object its calls' arguments
    are: ``local_shell`` an open object (its calls' ``action``), ``shell``
    :data:`SHELL_SCHEMA`, ``apply_patch`` :data:`PATCH_SCHEMA`. The other built-in tools (web
    search, file search, ...), whose calls are read as no calls, an ``mcp`` tool (a server,
    whose tools are those it lists), tools without a name, and a tool named as an earlier one
    (a function ``shell`` beside the built-in ``shell``, an MCP tool named as a declared
    function or as another server's tool: the first is kept) are dropped."""
    out, names = [], set()
    for made in [*filter(None, map(_declared_tool, tools)), *listed]:
        if made["function"]["name"] not in names:
            names.add(made["function"]["name"])
            out.append(made)
    return out


def listed_tools(items: list[dict]) -> list[dict]:
    """The tools the ``mcp_list_tools`` among ``items`` (ones :func:`item_problem` passes)
    list, in their order, as chat function tools: each ``{"name", "input_schema",
    "description"?}`` as the function of that name taking that schema (an open object schema
    where it is no object)."""
    return [tool for item in items if item.get("type") == MCP_LISTING for tool in _listing_tools(item)]


def _declared_tool(tool: Any) -> dict | None:
    """A tool a Responses request declares as a chat function tool (see :func:`chat_tools`),
    None for one dropped."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if isinstance(kind, str) and kind in BUILT_IN_TOOLS:
        return function_tool(kind, None, BUILT_IN_TOOLS[kind])
    if kind in ("function", "custom") and isinstance(tool.get("name"), str):
        parameters = tool.get("parameters") if kind == "function" else CUSTOM_SCHEMA
        return function_tool(tool["name"], tool.get("description"), parameters)
    return None


def _listing_tools(listing: dict) -> list[dict] | None:
    """An ``mcp_list_tools`` item's tools as chat function tools (see :func:`listed_tools`),
    None where its ``tools`` are not a list of tools with names as text."""
    tools = listing.get("tools")
    if not isinstance(tools, list) or not all(
            isinstance(tool, dict) and isinstance(tool.get("name"), str) for tool in tools):
        return None
    return [function_tool(tool["name"], tool.get("description"), tool.get("input_schema")) for tool in tools]


def _chat_call(item: dict) -> dict:
    """A call item as an OpenAI chat tool call (see the module contract)."""
    if item["type"] in ("function_call", MCP_CALL):
        name, arguments = item["name"], item["arguments"]
    elif item["type"] == "custom_tool_call":
        name, arguments = item["name"], {"input": item["input"]}
    else:
        name, key, _ = BUILT_IN_CALLS[item["type"]]
        arguments = item[key]
    call_id = item.get("call_id") or item.get("id")
    return {**({"id": call_id} if isinstance(call_id, str) else {}), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _mcp_result(call: dict) -> str:
    """What an ``mcp_call``'s tool message holds (see the module contract): its output, else its
    error as text, else empty text."""
    output, error = call.get("output"), call.get("error")
    if output:
        return output
    if isinstance(error, dict):
        return json.dumps(error, ensure_ascii=False)
    return error or ""


def _output_text(item: dict) -> str | None:
    """An output item's text (see the module contract), None where it has none to read."""
    output = item.get("output")
    if item["type"] == "shell_call_output" and isinstance(output, list):
        entries = [_shell_entry(entry) for entry in output]
        return None if None in entries else _on_lines([p for entry in entries for p in entry])
    if item["type"] == "apply_patch_call_output" and output is None:
        output = item.get("status")
        return output if isinstance(output, str) else None
    return part_text(output)


def _shell_entry(entry: Any) -> list[str] | None:
    """A ``shell_call_output`` entry's stdout, stderr and outcome (``exit code N``, ``timed
    out``), None where it is not an entry of these."""
    outcome = entry.get("outcome") if isinstance(entry, dict) else None
    if not isinstance(outcome, dict) or not all(isinstance(entry.get(k), str) for k in ("stdout", "stderr")):
        return None
    code = outcome.get("exit_code")
    if outcome.get("type") == "exit" and isinstance(code, int) and not isinstance(code, bool):
        said = f"exit code {code}"
    elif outcome.get("type") == "timeout":
        said = "timed out"
    else:
        return None
    return [entry["stdout"], entry["stderr"], said]


def _on_lines(pieces: list[str]) -> str:
    """``pieces`` joined, each that is not empty starting a line (a newline put before one
    where the text before it does not end with one)."""
    out: list[str] = []
    for piece in filter(None, pieces):
        if out and not out[-1].endswith("\n"):
            out.append("\n")
        out.append(piece)
    return "".join(out)
