"""Per-request work bounds of a serving process, with their defaults stated once.

:class:`Limits` is what an operator can set (``mlx-fill serve`` turns every field into a
``--flag``; the ``MLX_FILL`` hook uses the defaults). :func:`json_depth` measures the nesting
of raw JSON bytes in one linear pass without recursion, so a body can be refused before a
recursive parser sees it (:func:`deep_member` names where); :func:`value_depth` does the same for a decoded value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import numpy as np

# jsonschema's meta-schema check recurses ~10 Python frames per level: past ~95 levels it
# exhausts the default recursion limit. No schema deeper than this reaches jsonschema.
SCHEMA_DEPTH_CAP = 64
# json.loads recurses once per level (RecursionError from ~963 levels on).
JSON_DEPTH_CAP = 512


def _limit(default, what: str, cap: int | None = None):
    return field(default=default, metadata={"help": what, "cap": cap})


@dataclass(frozen=True)
class Limits:
    """Bounds on one request's work. Invariants (checked on construction): every bound is
    positive, ``max_json_depth <= JSON_DEPTH_CAP``, ``max_schema_depth <= SCHEMA_DEPTH_CAP``."""

    max_request_bytes: int = _limit(4 << 20, "request body bytes (413 above)")
    max_json_depth: int = _limit(64, "nesting depth of the JSON body, anywhere in it (400 above; "
                                     f"at most {JSON_DEPTH_CAP})", JSON_DEPTH_CAP)
    max_schema_depth: int = _limit(32, "nesting depth of one tool's parameters schema (400 above; "
                                       f"at most {SCHEMA_DEPTH_CAP})", SCHEMA_DEPTH_CAP)
    max_schema_bytes: int = _limit(256 << 10, "JSON bytes of one tool's parameters schema "
                                              "(400 above)")
    max_tools: int = _limit(128, "entries in tools (400 above)")
    max_prompt_tokens: int = _limit(32768, "rendered prompt tokens, checked before any prefill "
                                           "(400 context_length_exceeded above)")
    max_tokens_ceiling: int = _limit(4096, "ceiling on a request's max_tokens / "
                                           "max_completion_tokens (400 above)")
    fill_compile_bytes: int = _limit(128 << 10, "JSON bytes of all tool schemas together above "
                                                "which a request is served without fill "
                                                "(usage.fill.refusals.compile_budget)")
    shutdown_grace_s: int = _limit(10, "seconds in-flight requests may finish after SIGTERM "
                                       "before they are cancelled")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
            if f.metadata["cap"] is not None and getattr(self, f.name) > f.metadata["cap"]:
                raise ValueError(f"{f.name} must be <= {f.metadata['cap']}")


DEFAULT_LIMITS = Limits()

_DELTA = np.zeros(256, dtype=np.int8)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1
_SPACE = np.zeros(256, dtype=bool)
_SPACE[[ord(" "), ord("\t"), ord("\n"), ord("\r")]] = True
_QUOTE, _BACKSLASH, _COLON = ord('"'), ord("\\"), ord(":")


@dataclass(frozen=True)
class _Scan:
    """One pass over raw JSON bytes (n of them). ``quotes``: positions of the quotes that open
    or close a string (a quote after an odd run of backslashes is escaped); ``depth[i]``: the
    bracket nesting after byte i, brackets inside strings not counted (shape (n,))."""

    bytes_: np.ndarray
    quotes: np.ndarray
    depth: np.ndarray


def _scan(raw: bytes) -> _Scan:
    """The string/escape state machine as a fixed sequence of whole-array passes, each linear
    in ``len(raw)``: no pass looks at a byte more than a constant number of times, whatever the
    content (unterminated strings, runs of escaped quotes)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    n = b.size
    count = np.int32 if n < 2 ** 31 - 1 else np.int64
    index = np.arange(n, dtype=count)
    # the last byte at or before i that is not a backslash: i - that is the run ending at i
    last_plain = np.maximum.accumulate(np.where(b == _BACKSLASH, -1, index))
    escaped = np.zeros(n, dtype=bool)
    escaped[1:] = ((index[:-1] - last_plain[:-1]) & 1).astype(bool)
    quote = (b == _QUOTE) & ~escaped
    before = np.cumsum(quote, dtype=count) - quote  # quotes before i
    in_string = (before & 1).astype(bool)  # a quote itself is never a bracket
    delta = np.where(in_string, 0, _DELTA[b])
    return _Scan(b, np.flatnonzero(quote), np.cumsum(delta, dtype=count))


def json_depth(raw: bytes) -> int:
    """The deepest bracket nesting of ``raw`` (brackets inside JSON strings do not count).
    One linear pass (:func:`_scan`), no recursion; for text that is not JSON the result is only
    an estimate, and the parser rejects such text anyway."""
    raw = bytes(raw)
    return int(max(0, _scan(raw).depth.max())) if raw else 0


def deep_member(raw: bytes, limit: int) -> str | None:
    """The top-level member of a JSON object ``raw`` in which the nesting first goes past
    ``limit``; None when it is not inside a member (or never goes past ``limit``). Linear time
    (one :func:`_scan` and array lookups); meant for bodies :func:`json_depth` already refused."""
    raw = bytes(raw)
    if not raw:
        return None
    scan = _scan(raw)
    over = np.flatnonzero(scan.depth > limit)
    if not over.size:
        return None
    opens, closes = scan.quotes[0::2], scan.quotes[1::2]
    opens = opens[:closes.size]  # strings that end
    # a key: a string at depth 1, before the first level past the limit, followed by a colon
    key = (scan.depth[opens] == 1) & (closes < over[0])
    plain = np.flatnonzero(~_SPACE[scan.bytes_])
    after = np.searchsorted(plain, closes + 1)
    found = after < plain.size
    key[found] &= scan.bytes_[plain[after[found]]] == _COLON
    key[~found] = False
    keys = np.flatnonzero(key)
    if not keys.size:
        return None
    k = keys[-1]
    try:
        name = json.loads(raw[opens[k]:closes[k] + 1])
    except ValueError:
        return None
    return name if isinstance(name, str) else None


def value_depth(value: object) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0, ``[]`` / ``{}`` are 1), iteratively."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in node)
    return deepest


def over_compile_budget(tools: object, limits: Limits = DEFAULT_LIMITS) -> bool:
    """True when fill should not compile ``tools`` (an OpenAI ``tools`` value, unvalidated):
    more than ``max_tools`` entries, a schema deeper than ``max_schema_depth``, or more than
    ``fill_compile_bytes`` of JSON in all. Linear in the size of ``tools``; never recurses."""
    if not isinstance(tools, list) or not tools:
        return False
    nesting = 3  # tools[i].function.parameters
    if len(tools) > limits.max_tools or value_depth(tools) > limits.max_schema_depth + nesting:
        return True
    try:
        size = len(json.dumps(tools, ensure_ascii=False).encode())
    except (TypeError, ValueError):
        return True
    return size > limits.fill_compile_bytes
