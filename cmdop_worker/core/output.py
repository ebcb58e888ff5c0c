"""Structured output: pull a JSON value out of the final answer and check it.

Owns JSON extraction from model text and a small JSON Schema validator (the subset
below; no `jsonschema` dependency). Called by the next step (`core/step.py`, which the
coordinator's `coordinator/reply.py` takes) when a run has an `output_schema`: on an
error it sends `output_retry_message` back to the model once, then fails the run as
`output_invalid`.

Supported keywords: type (one or a list), properties, required, additionalProperties
(false or a schema), items, enum, const, minimum, maximum, minLength, maxLength,
minItems, maxItems, anyOf, oneOf. Unknown keywords are ignored, as the standard says.
Errors name the JSON path of the first failure: `$.items[2].name: expected string`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

Schema = Mapping[str, Any]
_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTAINER_NAMES: tuple[tuple[type, str], ...] = (
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def parse_final_output(text: str, schema: Mapping[str, Any]) -> tuple[Any, str | None]:
    """`(value, None)` when `text` holds JSON matching `schema`, else `(None, error)`.

    Candidates, in order: the whole text, each fenced block, the outermost {...} and
    [...] spans. The first candidate that validates wins; otherwise the error of the
    first one that parsed is returned.
    """
    first_error: str | None = None
    for candidate in _candidates(text):
        try:
            value = json.loads(candidate, parse_constant=_reject_constant)
        except ValueError:
            continue
        error = schema_error(value, schema)
        if error is None:
            return value, None
        first_error = first_error or error
    return None, first_error or "no JSON value found in the answer"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _candidates(text: str) -> list[str]:
    found = [text.strip()]
    found.extend(match.group(1).strip() for match in _FENCE.finditer(text))
    for opener, closer in ("{}", "[]"):
        start, end = text.find(opener), text.rfind(closer)
        if 0 <= start < end:
            found.append(text[start : end + 1])
    return [c for c in dict.fromkeys(found) if c]


def output_retry_message(error: str, schema: Mapping[str, Any]) -> str:
    """What the model is told, once, when its final answer did not match the schema."""
    rendered = json.dumps(schema, indent=2, sort_keys=True)
    return (
        f"Your final answer did not match the required output schema: {error}\n"
        "Reply again with only the JSON value, no prose around it, matching this schema:\n"
        f"```json\n{rendered}\n```"
    )


def schema_error(value: Any, schema: Schema, path: str = "$") -> str | None:
    """The first violation of `schema` by `value`, as `<path>: <problem>`, or None."""
    if isinstance(schema, bool):  # `true` allows anything, `false` nothing
        return None if schema else f"{path}: no value is allowed here"
    if not isinstance(schema, Mapping):  # a form outside the subset: nothing checked
        return None
    for check in _CHECKS:
        problem = check(value, schema, path)
        if problem is not None:
            return problem
    return None


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    for kind, name in _CONTAINER_NAMES:
        if isinstance(value, kind):
            return name
    return "unknown"


def _has_type(value: Any, wanted: str) -> bool:
    actual = _type_name(value)
    return actual == wanted or (wanted == "number" and actual == "integer")


def _check_type(value: Any, schema: Schema, path: str) -> str | None:
    wanted = schema.get("type")
    if wanted is None:
        return None
    options = [wanted] if isinstance(wanted, str) else list(wanted)
    if any(_has_type(value, option) for option in options):
        return None
    return f"{path}: expected {' or '.join(options)}, got {_type_name(value)}"


def _check_enum_const(value: Any, schema: Schema, path: str) -> str | None:
    if "const" in schema and not _json_equal(value, schema["const"]):
        return f"{path}: expected {json.dumps(schema['const'])}"
    if "enum" in schema and not any(_json_equal(value, v) for v in schema["enum"]):
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        return f"{path}: expected one of {allowed}"
    return None


def _json_equal(left: Any, right: Any) -> bool:
    """Equality as JSON sees it: true is not 1, and 1 equals 1.0."""
    if isinstance(left, bool) or isinstance(right, bool):
        return type(left) is type(right) and left == right
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(_json_equal, left, right))
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_json_equal(left[k], right[k]) for k in left)
    return bool(left == right) and _type_name(left) == _type_name(right)


def _check_bounds(value: Any, schema: Schema, path: str) -> str | None:
    if _type_name(value) in ("integer", "number"):
        measured, low, high, unit = value, "minimum", "maximum", ""
    elif isinstance(value, str):
        measured, low, high, unit = len(value), "minLength", "maxLength", " characters"
    elif isinstance(value, list):
        measured, low, high, unit = len(value), "minItems", "maxItems", " items"
    else:
        return None
    if low in schema and measured < schema[low]:
        return f"{path}: expected at least {schema[low]}{unit}, got {measured}"
    if high in schema and measured > schema[high]:
        return f"{path}: expected at most {schema[high]}{unit}, got {measured}"
    return None


def _check_object(value: Any, schema: Schema, path: str) -> str | None:
    if not isinstance(value, dict):
        return None
    for name in schema.get("required", []):
        if name not in value:
            return f"{_child(path, name)}: required property is missing"
    properties: Mapping[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in properties:
            problem = schema_error(item, properties[name], _child(path, name))
        elif extra is False:
            problem = f"{_child(path, name)}: additional property is not allowed"
        elif isinstance(extra, Mapping):
            problem = schema_error(item, extra, _child(path, name))
        else:
            problem = None
        if problem is not None:
            return problem
    return None


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if _IDENTIFIER.match(name) else f"{path}[{json.dumps(name)}]"


def _check_items(value: Any, schema: Schema, path: str) -> str | None:
    items = schema.get("items")
    if not isinstance(value, list) or not isinstance(items, Mapping):
        return None
    for index, item in enumerate(value):
        problem = schema_error(item, items, f"{path}[{index}]")
        if problem is not None:
            return problem
    return None


def _check_any_one_of(value: Any, schema: Schema, path: str) -> str | None:
    if "anyOf" in schema:
        matches = [schema_error(value, sub, path) is None for sub in schema["anyOf"]]
        if not any(matches):
            return f"{path}: matches none of the anyOf schemas"
    if "oneOf" in schema:
        count = sum(schema_error(value, sub, path) is None for sub in schema["oneOf"])
        if count != 1:
            return f"{path}: matches {count} of the oneOf schemas, expected exactly 1"
    return None


_CHECKS: tuple[Callable[[Any, Schema, str], str | None], ...] = (
    _check_type,
    _check_enum_const,
    _check_bounds,
    _check_object,
    _check_items,
    _check_any_one_of,
)
