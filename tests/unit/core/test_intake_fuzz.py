"""Run requests fuzzed from their own JSON Schema (`cmdop-worker schema run-request`).

Each field is drawn from its schema (a valid value), from arbitrary JSON (mostly an
invalid one), or left out; unknown fields are mixed in. `parse_request` must accept
what the schema allows and refuse anything else with `InvalidRequest` — never another
exception — in a message that names a field.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmdop_worker.core.intake import MAX_DEPTH, parse_request
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import RunRequest

SCHEMA = RunRequest.model_json_schema()
FIELDS = sorted(SCHEMA["properties"])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under `schema` (the subset of JSON Schema pydantic emits here)."""
    if "$ref" in schema:
        return from_schema(SCHEMA["$defs"][schema["$ref"].rsplit("/", 1)[-1]])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of(
            [from_schema(option) for option in schema.get("anyOf", schema.get("oneOf"))]
        )
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    makers = {
        "string": _string,
        "integer": lambda s: st.integers(s.get("minimum"), s.get("maximum")),
        "number": _number,
        "boolean": lambda s: st.booleans(),
        "null": lambda s: st.none(),
        "array": lambda s: st.lists(
            from_schema(s.get("items", {})),
            min_size=s.get("minItems", 0),
            max_size=min(s.get("maxItems", 3), 3),
        ),
        "object": _object,
    }
    return makers[kind](schema) if kind in makers else json_values


def _string(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    if "pattern" in schema:
        return st.from_regex(schema["pattern"], fullmatch=True)
    return st.text(
        min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 30), 30)
    )


def _number(schema: dict[str, Any]) -> st.SearchStrategy[float]:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    return st.floats(
        min_value=low,
        max_value=schema.get("maximum"),
        exclude_min="exclusiveMinimum" in schema,
        allow_nan=False,
        allow_infinity=False,
    )


def _object(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties = schema.get("properties")
    if not properties:
        return st.dictionaries(st.text(max_size=8), json_values, max_size=3)
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries(
        {k: from_schema(v) for k, v in properties.items() if k in required},
        optional={k: from_schema(v) for k, v in properties.items() if k not in required},
    )


def _field(name: str) -> st.SearchStrategy[Any]:
    return st.one_of(from_schema(SCHEMA["properties"][name]), json_values)


fuzzed_requests = st.fixed_dictionaries(
    {}, optional={name: _field(name) for name in FIELDS}
).flatmap(
    lambda request: st.dictionaries(st.text(min_size=1, max_size=12), json_values, max_size=2).map(
        lambda extra: {**extra, **request}
    )
)

# `output_schema` is an object to the request's schema, and a JSON Schema to the
# intake, which checks it against the meta-schema: valid ones are drawn from a few.
OUTPUT_SCHEMAS = st.sampled_from(
    [
        None,
        {"type": "object"},
        {"type": "object", "properties": {"disk": {"type": "string"}}, "required": ["disk"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "string", "enum": ["ok", "degraded"]},
    ]
)


def _valid(name: str) -> st.SearchStrategy[Any]:
    return OUTPUT_SCHEMAS if name == "output_schema" else from_schema(SCHEMA["properties"][name])


valid_requests = st.fixed_dictionaries(
    {},
    optional={name: _valid(name) for name in FIELDS if name not in ("prompt", "messages")},
).flatmap(
    lambda request: st.one_of(
        from_schema(SCHEMA["properties"]["prompt"]["anyOf"][0]).map(lambda p: {"prompt": p}),
        from_schema(SCHEMA["properties"]["messages"]["anyOf"][0]).map(lambda m: {"messages": m}),
    ).map(lambda one: {**request, **one})
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(fuzzed_requests)
def test_any_request_is_accepted_or_refused_naming_a_field(request: dict[str, Any]) -> None:
    try:
        parse_request(request)
    except InvalidRequest as exc:
        message = str(exc)
        named = set(FIELDS) | {str(key) for key in request}
        assert any(name and name in message for name in named), message


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(valid_requests)
def test_every_request_the_schema_allows_is_accepted(request: dict[str, Any]) -> None:
    parsed = parse_request(request)
    assert parsed.model_dump(exclude_unset=True).keys() == request.keys()


@given(st.sampled_from(FIELDS), st.integers(MAX_DEPTH + 1, 3000))
@settings(max_examples=30)
def test_deep_nesting_is_refused_before_it_can_break_storage(field: str, depth: int) -> None:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    try:
        parse_request({"prompt": "hi", field: value})
    except InvalidRequest as exc:
        assert field in str(exc)
    else:
        raise AssertionError("a request nested this deep was accepted")


@given(json_values.filter(lambda v: not isinstance(v, dict)))
def test_a_request_that_is_not_an_object_is_refused(payload: Any) -> None:
    try:
        parse_request(payload)
    except InvalidRequest as exc:
        assert "request" in str(exc)
    else:
        raise AssertionError("accepted a non-object request")
