"""Whether a tool call is waiting for an answer, from its run's events (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from cmdop_worker.models import Event
from cmdop_worker.surfaces.approvals import approval_check

ASKED_MS = 1_000_000


def event(seq: int, type_: str, ts_ms: int = ASKED_MS, **data: Any) -> Event:
    return Event.model_validate(
        {"run_id": "r", "seq": seq, "type": type_, "turn": 1, "ts_ms": ts_ms, "data": data}
    )


ASK = event(
    2,
    "APPROVAL_REQUEST",
    tool_call_id="t1",
    tool="execute_command",
    machine="m",
    input={},
    reason="mode default",
    timeout_s=60,
)
START = event(1, "TOOL_START", tool_call_id="t1", tool="execute_command", machine="m", input={})
END = event(
    3,
    "TOOL_END",
    tool_call_id="t1",
    tool="execute_command",
    machine="m",
    is_error=True,
    status="denied",
    output="permission denied: nobody approved within 60 s\nmore",
    duration_ms=60000,
)
OTHER_END = END.model_copy(update={"data": {**END.data, "tool_call_id": "t2"}})
CANCELLED = event(4, "CANCELLED", channel="ui", reason="x", partial_text="", usage={})


@pytest.mark.parametrize(
    ("events", "now_ms", "queued", "why", "says"),
    [
        ([START, ASK], ASKED_MS + 59_999, False, "pending", "is waiting for an answer"),
        ([START, ASK, OTHER_END], ASKED_MS + 1, False, "pending", "is waiting"),
        ([START], ASKED_MS, False, "no_request", "run r has no approval request for tool call t1"),
        ([], ASKED_MS, False, "no_request", "no approval request"),
        ([START, ASK], ASKED_MS + 1, True, "answered", "it has already been answered"),
        (
            [START, ASK, END],
            ASKED_MS + 1,
            False,
            "answered",
            "it has ended (denied: permission denied: nobody approved within 60 s)",
        ),
        ([START, ASK, CANCELLED], ASKED_MS + 1, False, "run_ended", "the run has ended"),
        ([START, ASK], ASKED_MS + 60_000, False, "expired", "timed out after 60 s"),
    ],
)
def test_approval_check(events, now_ms, queued, why, says) -> None:
    check = approval_check(events, "t1", now_ms=now_ms, answer_queued=queued)
    assert check.why == why
    message = check.message("r", "t1")
    assert says in message and "\n" not in message
    assert (check.request is None) == (why == "no_request")
