"""Validation of OpenAI chat-completion request bodies for ``mlx-fill serve``.

:func:`parse_chat_request` turns a decoded JSON body into a :class:`ChatRequest` or raises
:class:`RequestError` carrying the HTTP status and the offending parameter path: 422 for a value
of the wrong type, 400 for a well-typed value that is not acceptable (malformed tools or JSON
schemas, an unknown tool in ``tool_choice``, a malformed ``prediction``, a request-supplied chat
template or a ``chat_template_kwargs`` key the model's template does not read, a ``seed``
outside uint64, anything over the operator's :class:`~mlx_fill.limits.Limits`, and ``logprobs``
or a ``response_format`` other than text, which the endpoint does not implement). Nothing here
touches the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlx_fill.limits import DEFAULT_LIMITS, Limits, value_depth
from mlx_fill.sources.prediction import prediction_text
from mlx_fill.strict.schema import tool_schemas

MAX_STOP = 4
# OpenAI's chat roles a chat template can render. ``function`` (OpenAI's deprecated result role)
# is refused with a pointer to ``tool``: templates read a function's result from ``tool``.
ROLES = ("system", "developer", "user", "assistant", "tool")


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (lone surrogates) escaped as ``\\udXXX``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestError(ValueError):
    """A client error: ``status`` (4xx), ``param`` (the offending path), ``code`` (OpenAI's
    error code where one applies, e.g. ``context_length_exceeded``). Message and param are
    always UTF-8 encodable: a value echoed from the request is escaped where it is not."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(_encodable(message))
        self.status = status
        self.param = None if param is None else _encodable(param)
        self.code = code

    def body(self) -> dict:
        kind = "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                422: "invalid_type"}.get(self.status, self.code)
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": code}}


@dataclass
class ChatRequest:
    """A validated chat completion request (OpenAI field names)."""

    messages: list[dict]
    model: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    prediction: dict | None = None
    chat_template_kwargs: dict = field(default_factory=dict)

    @property
    def shown_tools(self) -> list[dict] | None:
        """The tools the prompt shows the model, and the only ones a reply's calls are parsed
        against: none under ``tool_choice: "none"`` (OpenAI's contract: no call is returned)."""
        return None if self.tool_choice == "none" else self.tools


def _typed(body: dict, name: str, types: tuple, label: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types:
        raise RequestError(422, f"{name}: expected {label}, got a boolean", name)
    if not isinstance(value, types):
        raise RequestError(422, f"{name}: expected {label}, got {type(value).__name__}", name)
    return value


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = _typed(body, name, (int, float), "a number")
    if value is None:
        return default
    if not lo <= value <= hi:
        raise RequestError(400, f"{name}: must be between {lo} and {hi}, got {value}", name)
    return float(value)


# Sampling controls this server does not apply, with the value that means "off": any other value
# is refused rather than ignored, since it would change what the client asked to sample.
_UNAPPLIED = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "top_k": 0,
              "min_p": 0}


def _refuse_unapplied(body: dict) -> None:
    """RequestError for a sampling control set to anything but off, ``logit_bias`` with entries,
    or ``parallel_tool_calls`` that is not a boolean."""
    for name, off in _UNAPPLIED.items():
        value = _typed(body, name, (int, float), "a number")
        if value is not None and value != off and not (name == "top_k" and value == -1):
            raise RequestError(400, f"{name}: not supported by mlx-fill serve (send {off} or omit it)",
                               name)
    if _typed(body, "logit_bias", (dict,), "an object"):
        raise RequestError(400, "logit_bias: not supported by mlx-fill serve", "logit_bias")
    _typed(body, "parallel_tool_calls", (bool,), "a boolean")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise RequestError(422, "messages: expected an array", "messages")
    if not value:
        raise RequestError(400, "messages: must not be empty", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(422, f"{where}: expected an object", where)
        role = m.get("role")
        if not isinstance(role, str):
            raise RequestError(422, f"{where}.role: expected a string", f"{where}.role")
        if role == "function":
            raise RequestError(400, f"{where}.role: 'function' is not supported; send the "
                                    f"function's result as a 'tool' message", f"{where}.role")
        if role not in ROLES:
            raise RequestError(400, f"{where}.role: {role!r} is not one of {', '.join(ROLES)}",
                               f"{where}.role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(422, f"{where}.content: expected a string or an array", f"{where}.content")
        if content is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise RequestError(400, f"{where}.content: required unless an assistant message "
                                        f"has tool_calls", f"{where}.content")
            m = dict(m, content="")  # templates read a string
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise RequestError(400, f"{where}.content[{j}]: only text parts are supported",
                                       f"{where}.content[{j}]")
                if not isinstance(part.get("text"), str):
                    raise RequestError(422, f"{where}.content[{j}].text: expected a string",
                                       f"{where}.content[{j}].text")
                texts.append(part["text"])
            m = dict(m, content="".join(texts))
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise RequestError(422, f"{where}.tool_calls: expected an array", f"{where}.tool_calls")
            m = dict(m, tool_calls=[_call_for_template(c, f"{where}.tool_calls[{k}]")
                                    for k, c in enumerate(calls)])
        out.append(m)
    return out


def _call_for_template(call: Any, where: str) -> dict:
    """Templates expect ``function.arguments`` as a mapping; OpenAI sends a JSON string (required,
    as OpenAI requires it; null is passed on). A string holding JSON other than an object stays
    the string (templates write a string argument verbatim, so the prompt holds what the model
    wrote)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RequestError(422, f"{where}.function: expected an object", f"{where}.function")
    fn = dict(call["function"])
    if not isinstance(fn.get("name"), str):
        raise RequestError(422, f"{where}.function.name: expected a string", f"{where}.function.name")
    args = fn.get("arguments")
    if "arguments" not in fn or (args is not None and not isinstance(args, (str, dict))):
        raise RequestError(422, f"{where}.function.arguments: expected a JSON string or an object",
                           f"{where}.function.arguments")
    if isinstance(args, str):
        try:
            decoded = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(400, f"{where}.function.arguments: invalid JSON ({e})",
                               f"{where}.function.arguments") from None
        if isinstance(decoded, dict):
            fn["arguments"] = decoded
    return dict(call, function=fn)


def _tools(value: Any, limits: Limits) -> list[dict] | None:
    """Validated tools: at most ``limits.max_tools``, each parameters schema within the depth and
    size limits (checked before the meta-schema check, whose cost grows with both)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError(422, "tools: expected an array", "tools")
    if len(value) > limits.max_tools:
        raise RequestError(400, f"tools: at most {limits.max_tools} tools, got {len(value)}",
                           "tools")
    for i, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if params is None:
            continue
        where = f"tools[{i}]" + (".function.parameters" if "function" in tool else ".parameters")
        if isinstance(params, dict) and params.get("type", "object") != "object":
            raise RequestError(400, f"{where}: must be a schema of type 'object', got type "
                                    f"{params['type']!r}", where)
        if value_depth(params) > limits.max_schema_depth:
            raise RequestError(400, f"{where}: nested deeper than {limits.max_schema_depth} levels",
                               where)
        size = len(json.dumps(params, ensure_ascii=False).encode())
        if size > limits.max_schema_bytes:
            raise RequestError(400, f"{where}: {size} bytes of JSON schema, at most "
                                    f"{limits.max_schema_bytes}", where)
    try:
        tool_schemas(value)
    except ValueError as e:
        raise RequestError(400, str(e), str(e).split(":", 1)[0]) from None
    return value or None


def _template_kwargs(body: dict, allowed: frozenset[str]) -> dict:
    kwargs = _typed(body, "chat_template_kwargs", (dict,), "an object") or {}
    for key in kwargs:
        if key not in allowed:
            where = f"chat_template_kwargs.{key}"
            known = ", ".join(sorted(allowed)) or "none"
            raise RequestError(400, f"{where}: not a variable the model's chat template reads "
                                    f"(allowed: {known})", where)
    return kwargs


def _seed(body: dict) -> int | None:
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 1 << 64:
        raise RequestError(400, f"seed: must be between 0 and 2**64 - 1, got {seed}", "seed")
    return seed


def _tool_choice(value: Any, tools: list[dict] | None) -> Any:
    if value is None or value in ("auto", "none"):
        return value
    if value == "required":
        if not tools:
            raise RequestError(400, "tool_choice: 'required' needs tools", "tool_choice")
        return value
    if isinstance(value, str):
        raise RequestError(400, f"tool_choice: unknown value {value!r}", "tool_choice")
    if not isinstance(value, dict):
        raise RequestError(422, "tool_choice: expected a string or an object", "tool_choice")
    name = (value.get("function") or {}).get("name") if isinstance(value.get("function"), dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise RequestError(400, "tool_choice: expected {'type': 'function', 'function': {'name': str}}",
                           "tool_choice")
    if name not in {t.get("function", t)["name"] for t in tools or []}:
        raise RequestError(400, f"tool_choice.function.name: no tool named {name!r}",
                           "tool_choice.function.name")
    return value


def parse_chat_request(body: Any, *, limits: Limits = DEFAULT_LIMITS,
                       template_vars: frozenset[str] = frozenset()) -> ChatRequest:
    """A validated :class:`ChatRequest`; :class:`RequestError` for anything a client got wrong
    or anything over ``limits``. ``template_vars``: the ``chat_template_kwargs`` keys allowed
    (the variables the model's chat template reads; see :mod:`.template_vars`)."""
    if not isinstance(body, dict):
        raise RequestError(422, "request body: expected a JSON object")
    if "chat_template" in body:
        raise RequestError(400, "chat_template: templates come only from the model directory",
                           "chat_template")
    if _typed(body, "n", (int,), "an integer") not in (None, 1):
        raise RequestError(400, "n: only n=1 is supported", "n")
    if "messages" not in body:
        raise RequestError(400, "messages: required", "messages")
    tools = _tools(body.get("tools"), limits)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise RequestError(422, "stop: expected a string or an array of strings", "stop")
    if stop and len(stop) > MAX_STOP:
        raise RequestError(400, f"stop: at most {MAX_STOP} sequences", "stop")
    max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _typed(body, "max_tokens", (int,), "an integer"), "max_tokens"
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens_ceiling:
        raise RequestError(400, f"{name}: must be between 1 and {limits.max_tokens_ceiling}", name)
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError(422, "stream_options.include_usage: expected a boolean",
                           "stream_options.include_usage")
    prediction = body.get("prediction")
    if prediction is not None:
        try:
            prediction_text(prediction)
        except ValueError as e:
            raise RequestError(400, str(e), str(e).split(":", 1)[0]) from None
    if _typed(body, "logprobs", (bool,), "a boolean") or _typed(body, "top_logprobs", (int,), "an integer"):
        raise RequestError(400, "logprobs: not supported by mlx-fill serve", "logprobs")
    _refuse_unapplied(body)
    response_format = _typed(body, "response_format", (dict,), "an object")
    if response_format not in (None, {"type": "text"}):
        raise RequestError(400, "response_format: only {'type': 'text'} is supported", "response_format")
    kwargs = _template_kwargs(body, template_vars)
    return ChatRequest(
        messages=_messages(body["messages"]),
        model=_typed(body, "model", (str,), "a string"),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        stream=bool(_typed(body, "stream", (bool,), "a boolean")),
        include_usage=include_usage,
        stop=[s for s in stop or [] if s],
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0, 0.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        seed=_seed(body),
        prediction=prediction,
        chat_template_kwargs=kwargs,
    )
