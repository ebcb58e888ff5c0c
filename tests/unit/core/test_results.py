"""Tool results as the model reads them, and the words of a call its tool never answered."""

from __future__ import annotations

import pytest

from cmdop_worker.core.results import (
    Call,
    Unanswered,
    closing_message,
    collected,
    result_block,
    unanswered,
    unanswered_outcome,
)
from cmdop_worker.models import Message, ToolOutcome, Usage

ON_ALPHA = Call("toolu_1", "execute_command", "alpha")
HERE = Call("toolu_1", "list_machines")  # a coordinator tool: no machine


@pytest.mark.parametrize(
    ("call", "situation", "started", "status", "words"),
    [
        (ON_ALPHA, "cancel", False, "cancelled", "cancelled (user) before it started"),
        (ON_ALPHA, "cancel", True, "cancelled", "cancelled (user) before it finished"),
        (ON_ALPHA, "deadline", False, "timeout", "machine alpha did not run the call"),
        (ON_ALPHA, "deadline", True, "lost", "started on alpha; outcome unknown; machine lost"),
        (HERE, "deadline", False, "timeout", "not run before the call's deadline"),
        (HERE, "deadline", True, "timeout", "no answer before the call's deadline"),
        (ON_ALPHA, "machine_gone", False, "offline", "machine alpha went offline before"),
        (ON_ALPHA, "machine_gone", True, "lost", "started on alpha; outcome unknown"),
        (ON_ALPHA, "offline", False, "offline", "machine alpha is offline"),
        (HERE, "dispatch_lost", False, "lost", "the coordinator stopped while dispatching"),
        (ON_ALPHA, "no_result", True, "lost", "no result was recorded for this call"),
    ],
)
def test_the_same_situation_gets_the_same_words(
    call: Call, situation: Unanswered, started: bool, status: str, words: str
) -> None:
    outcome = unanswered_outcome(call, situation, started=started, reason="user")
    assert (outcome.status, outcome.machine, outcome.tool) == (status, call.machine, call.tool)
    assert words in outcome.output
    assert outcome.is_error


def test_an_answer_in_own_words_keeps_the_call_and_its_wait() -> None:
    outcome = unanswered(ON_ALPHA, "denied", "nobody approved within 5 s", duration_ms=5_000)
    assert outcome == ToolOutcome(
        tool_use_id="toolu_1",
        tool="execute_command",
        machine="alpha",
        status="denied",
        output="nobody approved within 5 s",
        duration_ms=5_000,
    )


def test_a_result_block_marks_errors_and_never_is_empty() -> None:
    ok = ToolOutcome(tool_use_id="t", tool="x", output="")
    assert result_block(ok) == {"type": "tool_result", "tool_use_id": "t", "content": "(no output)"}
    assert result_block(unanswered(Call("t", "x"), "error", "boom"))["is_error"] is True


def test_results_come_in_the_order_of_the_calls_with_what_they_spent() -> None:
    first, second, third = Call("a", "x", "m"), Call("b", "ask_machine"), Call("c", "x", "m")
    spent = Usage(input_tokens=10, output_tokens=5)
    stored = {
        "c": ToolOutcome(tool_use_id="c", tool="x", output="third"),
        "b": ToolOutcome(tool_use_id="b", tool="ask_machine", output="asked", usage=spent),
    }
    message, usage = collected([first, second, third], stored, Usage(input_tokens=1))
    assert message.role == "user"
    assert [b["tool_use_id"] for b in message.content] == ["a", "b", "c"]
    assert message.content[0]["content"] == "no result was recorded for this call"
    assert message.content[0]["is_error"] is True
    assert usage == Usage(input_tokens=1) + spent


def test_closing_answers_each_open_call_by_its_outcome_or_as_cancelled() -> None:
    reply = Message(
        role="assistant",
        content=[
            {"type": "text", "text": "running"},
            {"type": "tool_use", "id": "a", "name": "x", "input": {}},
            {"type": "tool_use", "id": "b", "name": "y", "input": {}},
        ],
    )
    done = ToolOutcome(tool_use_id="a", tool="x", output="done early")
    closing = closing_message([reply], "cancelled (user)", {"a": done})
    assert closing is not None
    assert closing.content == [
        result_block(done),
        {
            "type": "tool_result",
            "tool_use_id": "b",
            "content": "cancelled (user)",
            "is_error": True,
        },
    ]


def test_nothing_to_close_without_an_assistant_message_of_calls() -> None:
    assert closing_message([], "why", {}) is None
    assert closing_message([Message(role="user", content="hi")], "why", {}) is None
    assert closing_message([Message(role="assistant", content="bye")], "why", {}) is None
    text_only = Message(role="assistant", content=[{"type": "text", "text": "bye"}])
    assert closing_message([text_only], "why", {}) is None
