"""Request bodies of ``mlx-fill serve``: raw bytes to a decoded JSON value, every failure a
:class:`~.openai_request.RequestError` (413 over the byte limit, 400 for anything else).

:func:`decode_body` refuses, in this order: nesting deeper than ``max_json_depth`` (measured on
the bytes in one linear pass, before the recursive parser runs), text that is not JSON (invalid
UTF-8, ``NaN`` / ``Infinity``, an integer past Python's int-string limit), and a string anywhere
in the body that UTF-8 cannot carry (a lone surrogate escape such as ``"\\ud800"``), since such
text cannot be tokenized or echoed. Its cost is linear in the body; it holds the GIL only in
C passes over the bytes, so it runs on a worker thread (``run_in_threadpool``) without
stalling the event loop.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from mlx_fill.limits import Limits, deep_member, json_depth
from .openai_request import RequestError

# a \uD800-\uDFFF escape (possibly part of a valid pair): the only way JSON text can carry a
# string UTF-8 cannot encode
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error response."""
    return JSONResponse(RequestError(status, message, param).body(), status_code=status)


async def read_body(request: Request, limits: Limits) -> bytes:
    """The raw body; 413 over ``max_request_bytes`` (read no further)."""
    too_large = RequestError(413, f"request body exceeds {limits.max_request_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limits.max_request_bytes:
            raise too_large
    return bytes(raw)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_body(raw: bytes, limits: Limits) -> Any:
    """The decoded JSON body; 400 for nesting deeper than ``max_json_depth`` (``param`` names
    the top-level member), for text that is not JSON, and for a string UTF-8 cannot encode
    (``param`` names where)."""
    if json_depth(raw) > limits.max_json_depth:
        member = deep_member(raw, limits.max_json_depth)
        raise RequestError(400, f"{member or 'request body'}: JSON nested deeper than "
                                f"{limits.max_json_depth} levels", member)
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digits
        raise RequestError(400, f"request body: invalid JSON ({e})") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = unencodable_path(body)
        if where is not None:
            raise RequestError(400, f"{where or 'request body'}: a string UTF-8 cannot encode "
                                    "(a lone surrogate escape)", where or None)
    return body


def unencodable_path(value: Any) -> str | None:
    """The path (``messages[0].content``; ``""`` for ``value`` itself) of a string or object
    key in a decoded JSON value that UTF-8 cannot encode, or None when there is none.
    Iterative; a C pass first, the walk only when that pass fails."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not _encodes(node):
                return path
        elif isinstance(node, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            for key, child in reversed(list(node.items())):
                where = f"{path}.{key}" if path else key
                if not _encodes(key):
                    return where
                stack.append((child, where))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
