"""A small JSON Schema validator for tool inputs given as raw schemas.

Tools built from functions or pydantic models are validated by pydantic. A
tool given only a raw ``input_schema`` is validated here, against the subset
of JSON Schema that tool definitions use: ``type`` (one or a list),
``properties``, ``required``, ``additionalProperties``, ``items``,
``prefixItems``, ``enum``, ``const``, numeric and length bounds, ``anyOf`` /
``oneOf`` / ``allOf`` / ``not`` and local ``$ref`` into ``$defs`` or
``definitions``. Keywords outside the subset (``format``, ``pattern``...) are
annotations here: they are not enforced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["schema_errors"]

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


def _resolve(root: Mapping[str, Any], ref: str) -> Mapping[str, Any]:
    if not ref.startswith("#/"):
        return {}
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            return {}
        node = node[part]
    return node if isinstance(node, Mapping) else {}


def _check(
    schema: Mapping[str, Any] | bool, value: Any, path: str, root: Mapping[str, Any],
    errors: list[str],
) -> None:
    if schema is True or schema == {}:
        return
    if schema is False:
        errors.append(f"{path}: no value is allowed here")
        return
    assert isinstance(schema, Mapping)
    if "$ref" in schema:
        _check(_resolve(root, str(schema["$ref"])), value, path, root, errors)

    kind = schema.get("type")
    if kind is not None:
        kinds = [kind] if isinstance(kind, str) else list(kind)
        if not any(_TYPES.get(k, lambda v: True)(value) for k in kinds):
            errors.append(f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__}")
            return

    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: must be one of {schema['enum']!r}")
    if "const" in schema and value != schema["const"]:
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
        for name, item in value.items():
            if name in properties:
                _check(properties[name], item, f"{path}.{name}", root, errors)
            elif extra is False:
                errors.append(f"{path}.{name}: is not an allowed property")
            elif isinstance(extra, Mapping):
                _check(extra, item, f"{path}.{name}", root, errors)

    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path}: must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: must have at most {schema['maxItems']} items")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            if i < len(prefix):
                _check(prefix[i], item, f"{path}[{i}]", root, errors)
            elif "items" in schema:
                _check(schema["items"], item, f"{path}[{i}]", root, errors)

    for sub in schema.get("allOf", ()):
        _check(sub, value, path, root, errors)
    if "anyOf" in schema and not any(
        not schema_errors_from(sub, value, root) for sub in schema["anyOf"]
    ):
        errors.append(f"{path}: matches none of the allowed shapes")
    if "oneOf" in schema:
        matches = sum(1 for sub in schema["oneOf"] if not schema_errors_from(sub, value, root))
        if matches != 1:
            errors.append(f"{path}: must match exactly one allowed shape (matched {matches})")
    if "not" in schema and not schema_errors_from(schema["not"], value, root):
        errors.append(f"{path}: matches a shape that is not allowed")


def schema_errors_from(schema: Any, value: Any, root: Mapping[str, Any]) -> list[str]:
    """`schema_errors` for a sub-schema whose ``$ref`` resolve against ``root``."""
    errors: list[str] = []
    _check(schema, value, "input", root, errors)
    return errors
