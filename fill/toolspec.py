"""What a request's ``tools`` array says about argument keys, read with ``jsonschema``.

Strict rows may assert an argument key or a call close only when the schema leaves no choice:
:class:`ToolSpec` records the declared properties, the required ones, and whether any other key
could appear (``additionalProperties`` not ``false``, non-empty ``patternProperties``, or a
composite schema whose keys cannot be read off ``properties``). :func:`tool_specs` validates the
array and raises ``ValueError`` naming the offending path (``tools[2].function.parameters...``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import jsonschema
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

_COMPOSITE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas",
              "dependentRequired", "unevaluatedProperties", "propertyNames")


@dataclass(frozen=True)
class ToolSpec:
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


def _path(prefix: str, parts) -> str:
    out = prefix
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _check_schema(params: dict) -> tuple[tuple, str] | None:
    """(path, message) of the first way ``params`` is not a valid JSON Schema, or None."""
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        return tuple(e.path), e.message
    return None


@functools.lru_cache(maxsize=512)
def _check_schema_json(canonical: str) -> tuple[tuple, str] | None:
    return _check_schema(json.loads(canonical))


def _schema_error(params: dict) -> tuple[tuple, str] | None:
    """:func:`_check_schema`, memoized on the schema's canonical JSON: an agent sends the same
    tools with every turn, and the meta-schema check is most of a request's set-up cost."""
    try:
        canonical = json.dumps(params, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not plain JSON: check it as is, uncached
        return _check_schema(params)
    return _check_schema_json(canonical)


def _resolve(params: dict, where: str) -> dict:
    """``params`` with a top-level ``$ref`` resolved against itself ($defs / definitions)."""
    seen = 0
    resource = Resource.from_contents(params, default_specification=DRAFT202012)
    resolver = Registry().with_resource("urn:mlx-fill:params", resource).resolver(
        "urn:mlx-fill:params")
    node = params
    while isinstance(node, dict) and "$ref" in node:
        seen += 1
        if seen > 16:
            raise ValueError(f"{where}.$ref: reference cycle")
        try:
            node = resolver.lookup(node["$ref"]).contents
        except Unresolvable as e:
            raise ValueError(f"{where}.$ref: cannot resolve {node['$ref']!r} ({e})") from None
    if not isinstance(node, dict):
        raise ValueError(f"{where}: must resolve to an object schema")
    return node


def tool_spec(tool: object, index: int) -> ToolSpec:
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
    params = _resolve(params, where)
    props = params.get("properties", {})
    for key, sub in props.items():
        if isinstance(sub, dict) and "$ref" in sub:
            _resolve({**params, **sub, "properties": {}}, f"{where}.properties.{key}")
    is_object = params.get("type", "object") == "object"
    open_ = (params.get("additionalProperties", True) is not False
             or bool(params.get("patternProperties"))
             or any(k in params for k in _COMPOSITE)
             or not is_object)
    required = params.get("required", [])
    return ToolSpec(name, tuple(props), frozenset(required), open_)


def tool_specs(tools: list | None) -> list[ToolSpec]:
    """Validated specs for a ``tools`` array; duplicate names are an error."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list, got {type(tools).__name__}")
    specs, seen = [], {}
    for i, t in enumerate(tools):
        spec = tool_spec(t, i)
        if spec.name in seen:
            raise ValueError(f"tools[{i}].function.name: duplicate tool name {spec.name!r} "
                             f"(also tools[{seen[spec.name]}])")
        seen[spec.name] = i
        specs.append(spec)
    return specs
