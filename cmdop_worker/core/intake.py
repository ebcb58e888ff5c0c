"""A run request as it arrives (a dict from JSON or Celery), checked and parsed.

Shared by every door a run comes in by: the `cmdop.run` task, child runs, and the
client that validates before it sends. `parse_request` raises `InvalidRequest` naming
each bad field; sizes and nesting that would break storing the run later are refused
before validation walks them, and an `output_schema` is checked against its
metaschema with `jsonschema`, so a bad one is refused here, not after a model call.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import MAX_PROMPT_CHARS, RunRequest

# A message's blocks nest a few levels, a tool input a few more; nothing real needs 64.
MAX_DEPTH = 64
MAX_OBJECT_BYTES = 64_000


def parse_request(payload: Any) -> RunRequest:
    if isinstance(payload, RunRequest):
        return payload
    if not isinstance(payload, dict):
        raise InvalidRequest(f"request: expected a JSON object, got {type(payload).__name__}")
    _check_shape(payload)
    try:
        request = RunRequest.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None
    if request.output_schema is not None:
        check_output_schema(request.output_schema)
    return request


def check_output_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is no JSON Schema, by its own metaschema (`$schema`, else
    draft 2020-12), before any model call is made to answer it."""
    validator = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f".{part}" for part in exc.absolute_path)
        raise InvalidRequest(
            f"output_schema{where}: not a valid JSON Schema: {exc.message}"
        ) from None


def _check_shape(payload: dict[Any, Any]) -> None:
    """Refuse nesting and sizes that would break storing the run later (pydantic will
    not serialise past ~250 levels) before validation walks them."""
    for name, value in payload.items():
        if _depth(value) > MAX_DEPTH:
            raise InvalidRequest(f"{name}: nested deeper than {MAX_DEPTH} levels")
    for name in ("metadata", "output_schema"):
        if name in payload and _json_size(payload[name]) > MAX_OBJECT_BYTES:
            raise InvalidRequest(f"{name}: larger than {MAX_OBJECT_BYTES} bytes as JSON")
    if _content_chars(payload.get("messages")) > MAX_PROMPT_CHARS:
        raise InvalidRequest(
            f"messages: the content is longer than {MAX_PROMPT_CHARS} characters in total "
            "(the limit of prompt)"
        )


def _content_chars(messages: Any) -> int:
    """Characters of the messages' content: a string as it is, blocks as their JSON."""
    if not isinstance(messages, list):
        return 0  # not messages at all: validation says what is wrong with them
    contents = [m.get("content") for m in messages if isinstance(m, dict)]
    return sum(len(c) if isinstance(c, str) else _json_size(c) for c in contents)


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value`, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)
    return deepest


def _json_size(value: Any) -> int:
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        return 0  # not JSON at all: validation says what is wrong with it


def describe_validation_error(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "request"
        problems.append(f"{where}: {error['msg']}")
    return "invalid run request: " + "; ".join(problems[:10])
