"""What a request's ``tools`` array says about argument keys, read with ``jsonschema``.

Strict rows may assert an argument key or a call close only when the schema leaves no choice:
:class:`ToolSchema` records the declared properties, the required ones, and whether any other key
could appear (``additionalProperties`` not ``false``, non-empty ``patternProperties``, or a
composite schema whose keys cannot be read off ``properties``). :func:`tool_schemas` validates the
array and raises ``ValueError`` naming the offending path (``tools[2].function.parameters...``).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

import jsonschema
from referencing import Registry, Resource
from referencing.exceptions import NoSuchAnchor, PointerToNowhere, Unresolvable
from referencing.jsonschema import DRAFT202012

from mlx_fill.limits import SCHEMA_DEPTH_CAP, value_depth

_COMPOSITE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas",
              "dependentRequired", "unevaluatedProperties", "propertyNames")


@dataclass(frozen=True)
class ToolSchema:
    """Argument-key facts of one tool. ``open`` means keys outside ``properties`` may appear."""

    name: str
    properties: tuple[str, ...]
    required: frozenset[str]
    open: bool

    @property
    def sole_key(self) -> str | None:
        """The key every call must start with, when the schema makes it certain."""
        if not self.open and len(self.properties) == 1 and self.properties[0] in self.required:
            return self.properties[0]
        return None

    def closable(self, keys: tuple[str, ...]) -> bool:
        """True when no further argument can legally follow ``keys``."""
        return not self.open and set(self.properties) <= set(keys)

    def next_required(self, keys: tuple[str, ...]) -> str | None:
        """The required key after the last of ``keys`` in the schema's order that is not among
        them: what a call writing its keys in that order writes next (None: no such key)."""
        order = {k: i for i, k in enumerate(self.properties)}
        last = max((order[k] for k in keys if k in order), default=-1)
        return next((k for k in self.properties[last + 1:]
                     if k in self.required and k not in keys), None)


def _path(prefix: str, parts) -> str:
    out = prefix
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _json_key(value: object) -> object:
    """A hashable key equal for two JSON values exactly when jsonschema's ``equal`` says so
    (``1 == 1.0``, ``true != 1``, objects by content)."""
    if isinstance(value, bool) or value is None:
        return ("const", value)
    if isinstance(value, (int, float)):
        return ("number", value)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(_json_key(v) for v in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _json_key(v)) for k, v in value.items()))
    return ("other", id(value))


def _unique_items(validator, unique, instance, schema):
    """``uniqueItems`` in linear time (jsonschema's falls back to pairwise comparison when the
    items do not sort, e.g. an ``enum`` mixing strings and numbers: quadratic)."""
    if unique and validator.is_type(instance, "array"):
        keys = [_json_key(v) for v in instance]
        if len(set(keys)) != len(keys):
            yield jsonschema.ValidationError(f"array of {len(keys)} items has non-unique elements")


_META_VALIDATORS: dict[type, type] = {}


def _meta_validator(params: dict):
    """The meta-schema validator ``check_schema`` would use for ``params`` (an unknown
    ``$schema`` means the latest draft), with :func:`_unique_items`; one per JSON Schema draft."""
    cls = jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)
    if cls not in _META_VALIDATORS:
        meta = jsonschema.validators.validator_for(cls.META_SCHEMA, default=cls)
        fast = jsonschema.validators.extend(meta, {"uniqueItems": _unique_items})
        # without "$schema", a "$ref" back into the meta-schema keeps this class
        # (jsonschema re-derives the class of a subschema from its "$schema")
        schema = {k: v for k, v in cls.META_SCHEMA.items() if k != "$schema"}
        _META_VALIDATORS[cls] = fast(schema, format_checker=meta.FORMAT_CHECKER)
    return _META_VALIDATORS[cls]


MAX_MESSAGE = 300


def _check_schema(params: dict) -> tuple[tuple, str] | None:
    """(path, message) of the first way ``params`` is not a valid JSON Schema, or None. Schemas
    nested deeper than :data:`~mlx_fill.limits.SCHEMA_DEPTH_CAP` are refused before jsonschema
    (whose check recurses per level) sees them."""
    if value_depth(params) > SCHEMA_DEPTH_CAP:
        return (), f"nested deeper than {SCHEMA_DEPTH_CAP} levels"
    if not isinstance(params.get("$schema", ""), str):
        return ("$schema",), "must be a string"
    try:
        error = next(iter(_meta_validator(params).iter_errors(params)), None)
    except RecursionError:
        return (), "nested too deeply to check"
    if error is None:
        return None
    message = error.message
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return tuple(error.path), message


def _non_string_key(value: object, path: tuple = ()) -> tuple[tuple, str] | None:
    """(path, message) of the first object key in ``value`` that is not a string (JSON has
    none; a schema built in Python can), or None. ``value`` is at most
    :data:`~mlx_fill.limits.SCHEMA_DEPTH_CAP` deep."""
    if isinstance(value, dict):
        for key, sub in value.items():
            if not isinstance(key, str):
                return path, f"key {key!r} is not a string"
            if (found := _non_string_key(sub, (*path, key))) is not None:
                return found
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            if (found := _non_string_key(sub, (*path, i))) is not None:
                return found
    return None


class _Memo:
    """Check results keyed by the SHA-256 of a schema's canonical JSON, least recently used
    evicted first. Invariant: at most ``max_entries`` entries and ``max_bytes`` bytes of keys
    and results (a schema's text is never kept)."""

    def __init__(self, max_entries: int = 512, max_bytes: int = 1 << 20):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[bytes, tuple[tuple[tuple, str] | None, int]] = OrderedDict()
        self.bytes = 0
        self.hits = 0

    def get(self, digest: bytes, compute):
        if digest in self.entries:
            self.hits += 1
            self.entries.move_to_end(digest)
            return self.entries[digest][0]
        result = compute()
        size = len(digest) + (0 if result is None else
                              len(result[1]) + sum(len(str(p)) for p in result[0]))
        self.entries[digest] = (result, size)
        self.bytes += size
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped
        return result


_memo = _Memo()


def _schema_error(params: dict) -> tuple[tuple, str] | None:
    """:func:`_check_schema`, memoized on the digest of the schema's canonical JSON: an agent
    sends the same tools with every turn, and the meta-schema check is most of a request's
    set-up cost."""
    if value_depth(params) > SCHEMA_DEPTH_CAP:
        return _check_schema(params)
    if (where := _non_string_key(params)) is not None:  # before the memo: JSON makes 1 "1"
        return where
    try:
        canonical = json.dumps(params, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not plain JSON: check it as is, uncached
        return _check_schema(params)
    return _memo.get(hashlib.sha256(canonical.encode()).digest(), lambda: _check_schema(params))


def _resolve(root: dict, node: object, where: str) -> dict:
    """``node`` with its ``$ref`` chain resolved against ``root`` ($defs / definitions, ``#``)."""
    seen = 0
    resource = Resource.from_contents(root, default_specification=DRAFT202012)
    resolver = Registry().with_resource("urn:mlx-fill:params", resource).resolver(
        "urn:mlx-fill:params")
    while isinstance(node, dict) and "$ref" in node:
        seen += 1
        if seen > 16:
            raise ValueError(f"{where}.$ref: reference cycle")
        try:
            node = resolver.lookup(node["$ref"]).contents
        except Unresolvable as e:  # its text quotes the whole schema: name the kind only
            kind = ("nothing is at that pointer in the schema" if isinstance(e, PointerToNowhere)
                    else "no such anchor in the schema" if isinstance(e, NoSuchAnchor)
                    else "only references into the schema itself resolve")
            raise ValueError(f"{where}.$ref: cannot resolve {node['$ref']!r} ({kind})") from None
    if not isinstance(node, dict):
        raise ValueError(f"{where}: must resolve to an object schema")
    return node


def tool_schema(tool: object, index: int) -> ToolSchema:
    """One validated entry of an OpenAI-style ``tools`` array."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ValueError(f"{where}: must be an object, got {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise ValueError(f"{where}.type: only 'function' tools are supported, got {tool['type']!r}")
    fn = tool.get("function", tool)
    if "function" in tool:
        where += ".function"
    if not isinstance(fn, dict):
        raise ValueError(f"{where}: must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: must be a non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    where += ".parameters"
    if not isinstance(params, dict):
        raise ValueError(f"{where}: must be an object schema, got {type(params).__name__}")
    error = _schema_error(params)
    if error is not None:
        raise ValueError(f"{_path(where, error[0])}: {error[1]}")
    root = params
    params = _resolve(root, params, where)
    props = params.get("properties", {})
    for key, sub in props.items():
        if isinstance(sub, dict) and "$ref" in sub:
            _resolve(root, sub, f"{where}.properties.{key}")
    is_object = params.get("type", "object") == "object"
    open_ = (params.get("additionalProperties", True) is not False
             or bool(params.get("patternProperties"))
             or any(k in params for k in _COMPOSITE)
             or not is_object)
    required = params.get("required", [])
    return ToolSchema(name, tuple(props), frozenset(required), open_)


def tool_schemas(tools: list | None) -> list[ToolSchema]:
    """Validated schemas for a ``tools`` array; duplicate names are an error."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list, got {type(tools).__name__}")
    schemas, seen = [], {}
    for i, t in enumerate(tools):
        schema = tool_schema(t, i)
        if schema.name in seen:
            raise ValueError(f"tools[{i}].function.name: duplicate tool name {schema.name!r} "
                             f"(also tools[{seen[schema.name]}])")
        seen[schema.name] = i
        schemas.append(schema)
    return schemas
