"""The pure step decisions: before a model call, after its reply, and reply repairs."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from cmdop_worker.core.output import output_retry_message, parse_final_output
from cmdop_worker.core.step import (
    CallModel,
    Cancelled,
    Fail,
    Finish,
    ModelReply,
    RetryOutput,
    RunTools,
    TurnFacts,
    normalize_reply,
    step_after_model,
    step_before_model,
)
from cmdop_worker.models import CancelRequest, Usage

# --- step_before_model --------------------------------------------------------------

BASE = TurnFacts(
    turn=2,
    max_turns=5,
    usage=Usage(input_tokens=10),
    token_budget=1_000,
    last_text="so far",
    cancel=None,
    now_ms=1_000,
    deadline_ms=2_000,
)
OVER_BUDGET = Usage(
    input_tokens=400,
    output_tokens=300,
    cache_read_input_tokens=200,
    cache_creation_input_tokens=100,
)


def ui(reason: str = "user") -> CancelRequest:
    return CancelRequest(channel="ui", reason=reason)


def operation(reason: str) -> CancelRequest:
    return CancelRequest(channel="operation", reason=reason)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param({}, CallModel(), id="nothing-stops-it"),
        # A cancel: stop_reason "timeout" only when the cancel says so.
        pytest.param({"cancel": ui()}, Cancelled("ui", "user", "cancelled"), id="ui-cancel"),
        pytest.param(
            {"cancel": ui("Ctrl-C")}, Cancelled("ui", "Ctrl-C", "cancelled"), id="ui-any-reason"
        ),
        pytest.param(
            {"cancel": operation("timeout")},
            Cancelled("operation", "timeout", "timeout"),
            id="operation-timeout",
        ),
        pytest.param(
            {"cancel": ui("timeout")}, Cancelled("ui", "timeout", "timeout"), id="ui-timeout"
        ),
        pytest.param(
            {"cancel": operation("shutdown")},
            Cancelled("operation", "shutdown", "cancelled"),
            id="operation-other-reason",
        ),
        # The deadline: reached counts as passed.
        pytest.param({"now_ms": 1_999}, CallModel(), id="just-before-deadline"),
        pytest.param(
            {"now_ms": 2_000}, Cancelled("operation", "timeout", "timeout"), id="at-deadline"
        ),
        pytest.param(
            {"now_ms": 9_000}, Cancelled("operation", "timeout", "timeout"), id="past-deadline"
        ),
        # The turn limit: the last allowed turn still calls the model.
        pytest.param({"turn": 5}, CallModel(), id="last-allowed-turn"),
        pytest.param({"turn": 6}, Finish("so far", "max_turns"), id="over-max-turns"),
        # The token budget counts every usage field; reaching it is enough.
        pytest.param(
            {"usage": OVER_BUDGET, "token_budget": 1_001}, CallModel(), id="just-under-budget"
        ),
        pytest.param({"usage": OVER_BUDGET}, Finish("so far", "budget"), id="at-budget"),
        pytest.param(
            {"usage": OVER_BUDGET, "last_text": ""}, Finish("", "budget"), id="budget-no-text"
        ),
    ],
)
def test_step_before_model(changes: dict[str, Any], expected: object) -> None:
    assert step_before_model(replace(BASE, **changes)) == expected


EVERYTHING_WRONG = {"cancel": ui(), "now_ms": 5_000, "turn": 9, "usage": OVER_BUDGET}


@pytest.mark.parametrize(
    ("dropped", "expected"),
    [
        pytest.param((), Cancelled("ui", "user", "cancelled"), id="cancel-first"),
        pytest.param(("cancel",), Cancelled("operation", "timeout", "timeout"), id="then-deadline"),
        pytest.param(("cancel", "now_ms"), Finish("so far", "max_turns"), id="then-max-turns"),
        pytest.param(("cancel", "now_ms", "turn"), Finish("so far", "budget"), id="then-budget"),
        pytest.param(("cancel", "now_ms", "turn", "usage"), CallModel(), id="then-call"),
    ],
)
def test_step_before_model_precedence(dropped: tuple[str, ...], expected: object) -> None:
    changes = {k: v for k, v in EVERYTHING_WRONG.items() if k not in dropped}
    assert step_before_model(replace(BASE, **changes)) == expected


# --- step_after_model ---------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def use(call_id: str, name: str = "execute_command", **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def reply(*content: dict[str, Any], stop_reason: str | None = "end_turn") -> ModelReply:
    return ModelReply(list(content), stop_reason, Usage(input_tokens=1, output_tokens=1))


def after(
    model_reply: ModelReply,
    schema: dict[str, Any] | None = None,
    *,
    retried: bool = False,
    repairs: dict[str, str] | None = None,
) -> object:
    return step_after_model(
        model_reply, output_schema=schema, output_retry_used=retried, repairs=repairs or {}
    )


def retry_message(answer: str) -> str:
    _, error = parse_final_output(answer, SCHEMA)
    assert error is not None
    return output_retry_message(error, SCHEMA)


@pytest.mark.parametrize(
    ("model_reply", "schema", "retried", "expected"),
    [
        pytest.param(
            reply(text("done "), text("here")),
            None,
            False,
            Finish("done here", "end_turn"),
            id="no-schema-end-turn",
        ),
        pytest.param(reply(), None, False, Finish("", "end_turn"), id="empty-reply"),
        pytest.param(
            reply(text("cut"), stop_reason="max_tokens"),
            None,
            False,
            Finish("cut", "max_tokens"),
            id="no-schema-max-tokens",
        ),
        pytest.param(
            reply(text("odd"), stop_reason=None),
            None,
            False,
            Finish("odd", "end_turn"),
            id="no-stop-reason",
        ),
        pytest.param(
            reply(text('{"ok": true}')),
            SCHEMA,
            False,
            Finish('{"ok": true}', "end_turn", {"ok": True}),
            id="schema-valid",
        ),
        pytest.param(
            reply(text('Result:\n```json\n{"ok": false}\n```')),
            SCHEMA,
            True,
            Finish('Result:\n```json\n{"ok": false}\n```', "end_turn", {"ok": False}),
            id="schema-valid-after-retry",
        ),
        pytest.param(
            reply(text('{"ok": "yes"}')),
            SCHEMA,
            False,
            RetryOutput(retry_message('{"ok": "yes"}')),
            id="schema-invalid-first-time",
        ),
        pytest.param(
            reply(text("no json here")),
            SCHEMA,
            False,
            RetryOutput(retry_message("no json here")),
            id="schema-no-json-first-time",
        ),
    ],
)
def test_step_after_model(
    model_reply: ModelReply, schema: dict[str, Any] | None, retried: bool, expected: object
) -> None:
    assert after(model_reply, schema, retried=retried) == expected


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ('{"ok": "yes"}', "$.ok"),
        ("no json here", "no JSON value found in the answer"),
    ],
)
def test_invalid_output_after_the_retry_fails(answer: str, error: str) -> None:
    step = after(reply(text(answer)), SCHEMA, retried=True)
    assert isinstance(step, Fail) and step.kind == "output_invalid"
    assert step.message.startswith("the final answer does not match output_schema: ")
    assert error in step.message


def test_retry_message_names_the_problem_and_the_schema() -> None:
    step = after(reply(text('{"ok": "yes"}')), SCHEMA)
    assert isinstance(step, RetryOutput)
    assert "$.ok" in step.message and '"required": [' in step.message


@pytest.mark.parametrize("schema", [None, SCHEMA])
@pytest.mark.parametrize("stop_reason", ["tool_use", "max_tokens", "end_turn"])
def test_tool_uses_are_dispatched_with_their_repairs(
    schema: dict[str, Any] | None, stop_reason: str
) -> None:
    first, second = use("toolu_a", command="ls"), use("toolu_b", name="read_file", path="/x")
    repairs = {"toolu_b": "the call named no tool"}
    model_reply = reply(text("checking"), first, text("and"), second, stop_reason=stop_reason)
    # Tool uses win over everything else, even a final answer that fails the schema.
    assert after(model_reply, schema, repairs=repairs) == RunTools((first, second), repairs)


# --- normalize_reply ----------------------------------------------------------------

NO_ID = "the call had no usable id; it was not run"
NOT_OBJECT = "the arguments were not a JSON object; the call was not run"
NO_NAME = "the call named no tool"


@pytest.mark.parametrize(
    ("content", "expected", "repairs"),
    [
        pytest.param(
            [text("hi"), use("toolu_1", command="ls"), use("toolu_2", name="glob", pattern="*")],
            [text("hi"), use("toolu_1", command="ls"), use("toolu_2", name="glob", pattern="*")],
            {},
            id="well-formed-unchanged",
        ),
        pytest.param([], [], {}, id="empty"),
        pytest.param(
            [text("a"), {"type": "tool_use", "name": "glob", "input": {}}],
            [
                text("a"),
                {"type": "tool_use", "name": "glob", "input": {}, "id": "toolu_cmdop_t3_1"},
            ],
            {"toolu_cmdop_t3_1": NO_ID},
            id="missing-id",
        ),
        pytest.param(
            [{"type": "tool_use", "id": "", "name": "glob", "input": {}}],
            [{"type": "tool_use", "id": "toolu_cmdop_t3_0", "name": "glob", "input": {}}],
            {"toolu_cmdop_t3_0": NO_ID},
            id="empty-id",
        ),
        pytest.param(
            [{"type": "tool_use", "id": 7, "name": "glob", "input": {}}],
            [{"type": "tool_use", "id": "toolu_cmdop_t3_0", "name": "glob", "input": {}}],
            {"toolu_cmdop_t3_0": NO_ID},
            id="non-string-id",
        ),
        pytest.param(
            [use("toolu_1", command="a"), use("toolu_1", command="b")],
            [use("toolu_1", command="a"), use("toolu_cmdop_t3_1", command="b")],
            {"toolu_cmdop_t3_1": NO_ID},
            id="duplicate-id",
        ),
        pytest.param(
            [{"type": "tool_use", "id": "toolu_1", "name": "glob", "input": ["*"]}],
            [{"type": "tool_use", "id": "toolu_1", "name": "glob", "input": {}}],
            {"toolu_1": NOT_OBJECT},
            id="list-input",
        ),
        pytest.param(
            [{"type": "tool_use", "id": "toolu_1", "name": "glob", "input": '{"pattern": "*"}'}],
            [{"type": "tool_use", "id": "toolu_1", "name": "glob", "input": {}}],
            {"toolu_1": NOT_OBJECT},
            id="string-input",
        ),
        pytest.param(
            [{"type": "tool_use", "id": "toolu_1", "name": "glob"}],
            [{"type": "tool_use", "id": "toolu_1", "name": "glob", "input": {}}],
            {"toolu_1": NOT_OBJECT},
            id="missing-input",
        ),
        pytest.param(
            [{"type": "tool_use", "id": "toolu_1", "input": {}}],
            [{"type": "tool_use", "id": "toolu_1", "input": {}, "name": "unknown"}],
            {"toolu_1": NO_NAME},
            id="missing-name",
        ),
        pytest.param(
            [{"type": "tool_use", "id": "toolu_1", "name": None, "input": {}}],
            [{"type": "tool_use", "id": "toolu_1", "name": "unknown", "input": {}}],
            {"toolu_1": NO_NAME},
            id="null-name",
        ),
        pytest.param(
            [{"type": "tool_use", "input": "x"}],
            [{"type": "tool_use", "input": {}, "id": "toolu_cmdop_t3_0", "name": "unknown"}],
            {"toolu_cmdop_t3_0": NO_ID},
            id="everything-wrong-reports-the-id",
        ),
        pytest.param(
            [{"type": "tool_use", "id": "toolu_1", "input": 5}],
            [{"type": "tool_use", "id": "toolu_1", "input": {}, "name": "unknown"}],
            {"toolu_1": NOT_OBJECT},
            id="input-reported-before-name",
        ),
        pytest.param(
            [{"type": "text", "text": "x", "id": 5}, {"type": "thinking", "thinking": "t"}],
            [{"type": "text", "text": "x", "id": 5}, {"type": "thinking", "thinking": "t"}],
            {},
            id="other-blocks-untouched",
        ),
    ],
)
def test_normalize_reply(
    content: list[dict[str, Any]], expected: list[dict[str, Any]], repairs: dict[str, str]
) -> None:
    before = copy.deepcopy(content)
    fixed, found = normalize_reply(content, turn=3)
    assert fixed == expected
    assert found == repairs
    assert content == before  # the model's reply is never mutated
    if fixed:
        assert all(a is not b for a, b in zip(fixed, content, strict=True))


def test_normalized_ids_are_unique_and_every_repair_names_a_call() -> None:
    content = [use("toolu_1"), use("toolu_1"), {"type": "tool_use", "name": "glob", "input": {}}]
    fixed, repairs = normalize_reply(content, turn=1)
    ids = [block["id"] for block in fixed]
    assert len(set(ids)) == len(ids) == 3
    assert set(repairs) == set(ids[1:])
