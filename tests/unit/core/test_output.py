"""Structured output: JSON extraction and the schema subset."""

from __future__ import annotations

from typing import Any

import pytest

from cmdop_worker.core.output import output_retry_message, parse_final_output, schema_error

REPORT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "degraded", "down"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "used_pct": {"type": "number", "minimum": 0, "maximum": 100},
                },
                "required": ["name"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["status", "items"],
}


@pytest.mark.parametrize(
    "text",
    [
        '{"status": "ok", "items": [{"name": "/"}]}',
        'Here you go:\n```json\n{"status": "ok", "items": [{"name": "/"}]}\n```\nDone.',
        'Here you go:\n```\n{"status": "ok", "items": [{"name": "/"}]}\n```',
        'The result is {"status": "ok", "items": [{"name": "/"}]} as requested.',
    ],
)
def test_extraction(text: str) -> None:
    assert parse_final_output(text, REPORT) == ({"status": "ok", "items": [{"name": "/"}]}, None)


def test_array_extraction() -> None:
    assert parse_final_output("Result: [1, 2, 3].", {"type": "array"}) == ([1, 2, 3], None)


def test_first_valid_candidate_wins() -> None:
    text = (
        'Draft: ```json\n{"status": "bad"}\n```\n'
        'Final: ```json\n{"status": "ok", "items": [{"name": "a"}]}\n```'
    )
    value, error = parse_final_output(text, REPORT)
    assert error is None
    assert value["status"] == "ok"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("no json here", "no JSON value found"),
        ("", "no JSON value found"),
        ('{"status": NaN}', "no JSON value found"),
        ('{"status": NaN, "items": []}', "$: expected object, got array"),
        ('{"status": "ok"}', "$.items: required property is missing"),
        ('{"status": "meh", "items": [{"name": "a"}]}', '$.status: expected one of "ok"'),
        ('{"status": "ok", "items": []}', "$.items: expected at least 1 items, got 0"),
        (
            '{"status": "ok", "items": [{"name": "a"}, {"name": "b"}, {"name": 3}]}',
            "$.items[2].name: expected string, got integer",
        ),
        (
            '{"status": "ok", "items": [{"name": "a", "extra": 1}]}',
            "$.items[0].extra: additional property is not allowed",
        ),
        (
            '{"status": "ok", "items": [{"name": "a", "used_pct": 101}]}',
            "$.items[0].used_pct: expected at most 100, got 101",
        ),
        ('{"status": "ok", "items": [{"name": ""}]}', "$.items[0].name: expected at least 1"),
    ],
)
def test_errors_name_the_path(text: str, fragment: str) -> None:
    value, error = parse_final_output(text, REPORT)
    assert value is None
    assert error is not None and fragment in error, error


@pytest.mark.parametrize(
    ("value", "schema", "error"),
    [
        (1, {"type": "integer"}, None),
        (1.0, {"type": "integer"}, None),
        (1.5, {"type": "integer"}, "$: expected integer, got number"),
        (True, {"type": "integer"}, "$: expected integer, got boolean"),
        (True, {"type": "number"}, "$: expected number, got boolean"),
        (3, {"type": "number"}, None),
        (None, {"type": "null"}, None),
        (None, {"type": ["string", "null"]}, None),
        (5, {"type": ["string", "null"]}, "$: expected string or null, got integer"),
        (False, {"type": "boolean"}, None),
        ({}, {"type": "object"}, None),
        ([], {"type": "object"}, "$: expected object, got array"),
        (1, {"const": 1.0}, None),
        (True, {"const": 1}, "$: expected 1"),
        (1, {"enum": [True, "1"]}, '$: expected one of true, "1"'),
        ([1, {"a": [2]}], {"const": [1, {"a": [2]}]}, None),
        ("abcd", {"maxLength": 3}, "$: expected at most 3 characters, got 4"),
        ([1, 2, 3], {"maxItems": 2}, "$: expected at most 2 items, got 3"),
        (-1, {"minimum": 0}, "$: expected at least 0, got -1"),
        ("x", {"minimum": 0}, None),
        ({"a b": 1}, {"properties": {"a b": {"type": "string"}}}, '$["a b"]: expected string'),
        ({"x": "1"}, {"additionalProperties": {"type": "integer"}}, "$.x: expected integer"),
        ("x", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, None),
        (None, {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "$: matches none"),
        (3, {"oneOf": [{"type": "integer"}, {"type": "string"}]}, None),
        (3, {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "$: matches 2 of the oneOf"),
        ("x", {"oneOf": [{"type": "integer"}]}, "$: matches 0 of the oneOf"),
        ("anything", {"format": "email", "title": "ignored"}, None),
    ],
)
def test_schema_subset(value: Any, schema: dict[str, Any], error: str | None) -> None:
    problem = schema_error(value, schema)
    if error is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(error), problem


def test_retry_message_carries_error_and_schema() -> None:
    message = output_retry_message("$.items: required property is missing", REPORT)
    assert "$.items: required property is missing" in message
    assert '"additionalProperties": false' in message
    assert "only the JSON value" in message
