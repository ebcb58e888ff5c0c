"""The fleet's messages as `messages` builds them: task, queue, task id, arguments and
the options `send` hands to Celery's `send_task`."""

from __future__ import annotations

from typing import Any

import pytest

from cmdop_worker.celery_app import DECLARE_ON_PUBLISH
from cmdop_worker.messages import (
    ANSWER_TASK_EXPIRES_S,
    SENT_MS_HEADER,
    Outgoing,
    answer_message,
    hand_on_message,
    local_tool_message,
    run_message,
    send,
    sent_ms_of,
    tool_message,
    turn_message,
)
from cmdop_worker.models import ApprovalAnswer, ToolCall

CALL = ToolCall(
    run_id="r1",
    turn=2,
    tool_use_id="toolu_1",
    tool="execute_command",
    machine="web-1",
    input={"command": "uptime"},
    deadline_ms=5_000,
    run_deadline_ms=9_000,
)
ANSWER = ApprovalAnswer(verdict="approved", by="ann", answered_ms=1)
TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


class Recorder:
    """A sender that keeps what it was asked to send (the seam `send` writes to)."""

    def __init__(self, declares: bool = True) -> None:
        self.conf = {DECLARE_ON_PUBLISH: declares}
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, *args: Any, **options: Any) -> None:
        self.sent.append((name, options))


@pytest.mark.parametrize(
    ("message", "task", "queue", "task_id", "args"),
    [
        (
            run_message({"run_id": "r1", "prompt": "hi"}),
            "cmdop.run",
            "cmdop.coordinator",
            "r1.start",
            (),
        ),
        (turn_message("r1", 3), "cmdop.turn", "cmdop.coordinator.next", "r1.turn.3", ["r1", 3]),
        (tool_message(CALL, TRACE), "cmdop.tool", "cmdop.machine.web-1", "r1.toolu_1", ()),
        (
            answer_message(CALL, ANSWER),
            "cmdop.tool",
            "cmdop.machine.web-1",
            "r1.toolu_1.approved",
            (),
        ),
        (
            local_tool_message("r1", 2, "toolu_1", deadline_ms=7_000, headers=TRACE),
            "cmdop.local_tool",
            "cmdop.coordinator.next",
            "r1.toolu_1",
            ["r1", 2, "toolu_1", 7_000],
        ),
        (
            hand_on_message("r1", 2, "toolu_1", headers=TRACE),
            "cmdop.hand_on",
            "cmdop.coordinator.next",
            "r1.toolu_1.hand_on",
            ["r1", 2, "toolu_1"],
        ),
    ],
    ids=["run", "turn", "tool", "answer", "local_tool", "hand_on"],
)
def test_each_message_has_its_task_queue_and_id(
    message: Outgoing, task: str, queue: str, task_id: str, args: Any
) -> None:
    assert (message.task, message.queue, message.task_id, message.args) == (
        task,
        queue,
        task_id,
        args,
    )


def test_a_coordinator_tool_without_a_deadline_of_its_own_takes_the_planned_one() -> None:
    message = local_tool_message("r1", 2, "toolu_1", deadline_ms=0, headers={})
    assert message.args == ["r1", 2, "toolu_1", None]


def test_an_answer_carries_the_answer_and_expires() -> None:
    message = answer_message(CALL, ANSWER)
    assert message.kwargs is not None
    assert message.kwargs["call"]["approval"]["verdict"] == "approved"
    assert message.expires_s == ANSWER_TASK_EXPIRES_S
    assert "uptime" not in (message.kwargsrepr or "")  # Flower shows no arguments


def test_send_gives_only_the_options_a_message_has() -> None:
    sender = Recorder()
    send(tool_message(CALL, TRACE), via=sender)
    send(run_message({"run_id": "r1"}, shown="{'request': ...}"), via=sender)
    (tool, tool_options), (run, run_options) = sender.sent
    assert (tool, tool_options["headers"], tool_options["ignore_result"]) == (
        "cmdop.tool",
        TRACE,
        True,
    )
    assert "expires" not in tool_options and "declare" not in tool_options
    # A client reads the result of its `cmdop.run`: the message does not say to drop it.
    assert run == "cmdop.run" and "ignore_result" not in run_options
    assert (run_options["argsrepr"], run_options["kwargsrepr"]) == ("()", "{'request': ...}")


def test_send_declares_no_queue_for_an_app_that_must_not() -> None:
    sender = Recorder(declares=False)
    send(turn_message("r1", 1), via=sender)
    ((_, options),) = sender.sent
    assert options["declare"] == []


def test_a_start_carries_when_it_was_first_sent_and_only_an_integer_counts() -> None:
    stamped = run_message({"run_id": "r1"}, sent_ms=1_700_000_000_123)
    assert stamped.headers == {SENT_MS_HEADER: 1_700_000_000_123}
    assert sent_ms_of(stamped.headers) == 1_700_000_000_123
    assert run_message({"run_id": "r1"}).headers is None  # a bare start: no stamp
    for headers in (None, {}, {SENT_MS_HEADER: "1700"}, {SENT_MS_HEADER: True}):
        assert sent_ms_of(headers) is None
