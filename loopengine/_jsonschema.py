"""A small JSON Schema validator for tool inputs given as raw schemas.

Tools built from functions or pydantic models are validated by pydantic. A
tool given only a raw ``input_schema`` is validated here, against the subset
of JSON Schema that tool definitions use: ``type`` (one or a list),
``properties``, ``patternProperties``, ``required``, ``additionalProperties``, ``items``,
``prefixItems``, ``enum``, ``const``, numeric and length bounds, ``anyOf`` /
``oneOf`` / ``allOf`` / ``not`` and local ``$ref`` (``#``, or into ``$defs``
or ``definitions``). Keywords outside the subset (``format``, ``pattern``...)
are annotations here: they are not enforced.

`check_schema` refuses, when the tool is defined, a schema whose enforced
keywords have the wrong shape (``properties`` that is not an object of
schemas, ``required`` that is not a list of names...) or a local ``$ref`` that
points to nothing, so that checking an input later can rely on them. A
``$ref`` loop (``{"$ref": "#"}``) or an input nested deeper than `MAX_DEPTH`
ends the check with an error line, never a ``RecursionError``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

from loopengine._errors import ConfigError

__all__ = ["MAX_DEPTH", "check_schema", "schema_errors", "subschemas"]

MAX_DEPTH = 256
"""How many nested schema checks one input may take (``$ref`` hops included)."""

_SCHEMA_KEYWORDS = ("items", "additionalProperties", "not")
_SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")

_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    and not (isinstance(v, float) and math.isnan(v)),
}


def schema_errors(schema: Mapping[str, Any], value: Any) -> list[str]:
    """Every way ``value`` fails ``schema``, as ``"path: problem"`` lines (empty: valid)."""
    errors: list[str] = []
    _check(schema, value, "input", schema, errors)
    return errors


def check_schema(field: str, schema: object) -> None:
    """Check that the keywords `schema_errors` enforces have the shapes it reads,
    that every local ``$ref`` points to a schema in ``schema``, and that no
    ``$ref`` loops back to itself without descending into the input.

    Args:
        field: The schema's path, e.g. ``"input_schema"``.
        schema: A JSON Schema (a mapping or a bool).

    Raises:
        ConfigError: ``.field`` is the offending keyword's path, e.g.
            ``"input_schema.properties.limit.minimum"``.
    """
    _check_shape(field, schema, 0)
    if isinstance(schema, Mapping):
        _check_loops(field, schema)


def _check_loops(field: str, root: Mapping[str, Any]) -> None:
    """Refuse a cycle of ``$ref`` / ``allOf`` / ``anyOf`` / ``oneOf`` / ``not``:
    those apply another schema to the same value, so a cycle of them never ends
    (``{"$ref": "#"}``); a cycle through ``properties`` or ``items`` descends
    into the input and ends with it (a tree of nodes)."""
    done: set[int] = set()
    stack: set[int] = set()

    def same_value(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        found: list[object] = [node.get("not")]
        if isinstance(node.get("$ref"), str):
            found.append(_resolve(root, node["$ref"]))
        for key in ("allOf", "anyOf", "oneOf"):
            found.extend(node.get(key, ()))
        return [n for n in found if isinstance(n, Mapping)]

    def visit(node: Mapping[str, Any]) -> None:
        if id(node) in done:
            return
        if id(node) in stack:
            raise ConfigError(field, "has a $ref loop that never descends into the input "
                                     "(a schema that applies itself to the same value)")
        stack.add(id(node))
        for child in same_value(node):
            visit(child)
        stack.discard(id(node))
        done.add(id(node))

    nodes = [node for _, node in subschemas(root)]
    for node in nodes:
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and _target(
                root, ref) is None:
            # A JSON pointer into the schema that names nothing: checked as {} (any
            # value), while the API refuses the tool definition. (A plain-name
            # fragment, ``#node``, names an ``$anchor``: left to the API.)
            raise ConfigError(field, f"has a $ref {ref[:80]!r} that names no schema in it "
                                     "(a local $ref must point into the schema)")
    for node in nodes:
        visit(node)


def subschemas(schema: object, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], Mapping[str, Any]]]:
    """Every schema object in ``schema``, itself first, each with its path from
    the root (``("properties", "tags", "items")``): what ``properties``,
    ``$defs``, ``definitions``, ``items``, ``prefixItems``,
    ``additionalProperties``, ``allOf`` / ``anyOf`` / ``oneOf`` and ``not``
    hold, depth first. A node's keys are read after it is yielded, so a caller
    may add to a node it is handed (``items``) and have that walked too."""
    if not isinstance(schema, Mapping):
        return
    yield path, schema
    for key in (*_SCHEMA_KEYWORDS, *_SCHEMA_LISTS, *_SCHEMA_MAPS):
        value = schema.get(key)
        if isinstance(value, Mapping) and key in _SCHEMA_MAPS:
            for name, child in value.items():
                yield from subschemas(child, (*path, key, str(name)))
        elif isinstance(value, list):
            for i, child in enumerate(value):
                yield from subschemas(child, (*path, key, str(i)))
        else:
            yield from subschemas(value, (*path, key))


def _check_shape(field: str, schema: object, depth: int) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise ConfigError(field, f"must be a JSON Schema (an object or a bool), got a "
                                 f"{type(schema).__name__}")
    if depth > MAX_DEPTH:
        raise ConfigError(field, f"is nested more than {MAX_DEPTH} levels deep")
    kind = schema.get("type")
    if kind is not None and not (isinstance(kind, str) or (
            isinstance(kind, list) and all(isinstance(k, str) for k in kind))):
        raise ConfigError(f"{field}.type", "must be a type name or a list of them")
    for name in [kind] if isinstance(kind, str) else kind or ():
        if name not in _TYPES:
            # The API refuses the tool definition (a 400 after the attempt's row),
            # and the input check would let any value pass.
            raise ConfigError(f"{field}.type", f"{name[:40]!r} is not a JSON Schema type "
                                               f"(one of {', '.join(sorted(_TYPES))})")
    for key in _SCHEMA_KEYWORDS:
        if key in schema:
            _check_shape(f"{field}.{key}", schema[key], depth + 1)
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                raise ConfigError(f"{field}.{key}", "must be a list of schemas")
            for i, sub in enumerate(schema[key]):
                _check_shape(f"{field}.{key}[{i}]", sub, depth + 1)
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], Mapping):
                raise ConfigError(f"{field}.{key}", "must be an object of schemas")
            for name, sub in schema[key].items():
                _check_shape(f"{field}.{key}.{name}", sub, depth + 1)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ConfigError(f"{field}.required", "must be a list of property names")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ConfigError(f"{field}.enum", "must be a list of values")
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        raise ConfigError(f"{field}.$ref", "must be a string")
    for key in _NUMBERS:
        if key in schema and (isinstance(schema[key], bool)
                              or not isinstance(schema[key], int | float)):
            raise ConfigError(f"{field}.{key}", "must be a number")
    for key in _COUNTS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int)):
            raise ConfigError(f"{field}.{key}", "must be an integer")


def _target(root: Mapping[str, Any], ref: str) -> object:
    """What a local ``$ref`` (``#``, ``#/$defs/name``) points to in ``root``, or
    None when it points to nothing."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        # A URI fragment: percent-decoded first, then the pointer's escapes.
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _resolve(root: Mapping[str, Any], ref: str) -> Mapping[str, Any]:
    node = _target(root, ref)
    return node if isinstance(node, Mapping) else {}


def _check(
    schema: Mapping[str, Any] | bool, value: Any, path: str, root: Mapping[str, Any],
    errors: list[str], depth: int = 0,
) -> None:
    if schema is True or schema == {}:
        return
    if schema is False:
        errors.append(f"{path}: no value is allowed here")
        return
    assert isinstance(schema, Mapping)
    if depth > MAX_DEPTH:
        # A ``$ref`` loop or an input nested without end: stop, do not recurse on.
        errors.append(f"{path}: nested too deep to check (more than {MAX_DEPTH} levels)")
        return
    deeper = depth + 1
    if "$ref" in schema:
        _check(_resolve(root, str(schema["$ref"])), value, path, root, errors, deeper)

    kind = schema.get("type")
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else list(kind)
        if not any(_TYPES.get(k, lambda v: True)(value) for k in kinds):
            errors.append(f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__}")
            return

    if "enum" in schema and not any(_equal(value, item) for item in schema["enum"]):
        errors.append(f"{path}: must be one of {schema['enum']!r}")
    if "const" in schema and not _equal(value, schema["const"]):
        errors.append(f"{path}: must be {schema['const']!r}")

    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: must be >= {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: must be <= {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            errors.append(f"{path}: must be > {schema['exclusiveMinimum']}")
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            errors.append(f"{path}: must be < {schema['exclusiveMaximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: must have at most {schema['maxLength']} characters")

    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                errors.append(f"{path}.{name}: is required")
        extra = schema.get("additionalProperties", True)
        patterns = schema.get("patternProperties", {})
        for name, item in value.items():
            matched = False
            for pattern, sub in patterns.items():
                found = _matches(pattern, name)
                if found is not False:
                    matched = True
                    if found:
                        _check(sub, item, f"{path}.{name}", root, errors, deeper)
            if name in properties:
                _check(properties[name], item, f"{path}.{name}", root, errors, deeper)
            elif matched:
                continue  # not an additional property: a pattern names it
            elif extra is False:
                errors.append(f"{path}.{name}: is not an allowed property")
            elif isinstance(extra, Mapping):
                _check(extra, item, f"{path}.{name}", root, errors, deeper)

    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path}: must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: must have at most {schema['maxItems']} items")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            if i < len(prefix):
                _check(prefix[i], item, f"{path}[{i}]", root, errors, deeper)
            elif "items" in schema:
                _check(schema["items"], item, f"{path}[{i}]", root, errors, deeper)

    for sub in schema.get("allOf", ()):
        _check(sub, value, path, root, errors, deeper)
    if "anyOf" in schema and not any(
        not schema_errors_from(sub, value, root, deeper) for sub in schema["anyOf"]
    ):
        errors.append(f"{path}: matches none of the allowed shapes")
    if "oneOf" in schema:
        matches = sum(1 for sub in schema["oneOf"]
                      if not schema_errors_from(sub, value, root, deeper))
        if matches != 1:
            errors.append(f"{path}: must match exactly one allowed shape (matched {matches})")
    if "not" in schema and not schema_errors_from(schema["not"], value, root, deeper):
        errors.append(f"{path}: matches a shape that is not allowed")


def _matches(pattern: str, name: str) -> bool | None:
    """Whether ``pattern`` (a ``patternProperties`` key, a regular expression
    that is not anchored) finds a match in ``name``; None when Python's `re`
    cannot read it (ECMA-262 syntax it lacks, such as ``\\p{L}``): the name may
    match, so it is not taken for an additional property, and not checked."""
    try:
        return re.search(pattern, name) is not None
    except (re.error, RecursionError):
        return None


def _equal(value: Any, expected: Any) -> bool:
    """Whether two JSON values are equal as JSON Schema compares them: a boolean
    is never a number (Python's ``True == 1`` is), numbers are equal by value
    (``1.0`` is ``1``), arrays item by item and objects key by key."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
    if isinstance(value, list) and isinstance(expected, list):
        return len(value) == len(expected) and all(
            _equal(a, b) for a, b in zip(value, expected, strict=True))
    if isinstance(value, Mapping) and isinstance(expected, Mapping):
        return value.keys() == expected.keys() and all(
            _equal(value[key], expected[key]) for key in value)
    if isinstance(value, list | Mapping) or isinstance(expected, list | Mapping):
        return False
    return bool(value == expected)


def schema_errors_from(
    schema: Any, value: Any, root: Mapping[str, Any], depth: int = 0
) -> list[str]:
    """`schema_errors` for a sub-schema whose ``$ref`` resolve against ``root``."""
    errors: list[str] = []
    _check(schema, value, "input", root, errors, depth)
    return errors
