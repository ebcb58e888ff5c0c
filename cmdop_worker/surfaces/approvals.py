"""Whether a tool call is waiting for a person's answer, decided from its run's events.

`approval_check` is what `Client.approve` asks before it writes an answer. A machine
worker asks by writing the call's APPROVAL_REQUEST (its `ts_ms` and `timeout_s` bound
the wait) and stops waiting when it has an answer, when the wait runs out, or when the
run is cancelled; the call's TOOL_END follows each of these. So the call waits for an
answer from its request until its TOOL_END, the run's end or the request's timeout,
whichever comes first, and only while no answer is already queued for it.

Pure: the events, the clock and whether an answer is queued come in as arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cmdop_worker.models import ApprovalRequestData, Event, ToolEndData

ApprovalWhy = Literal["pending", "no_request", "answered", "expired", "run_ended"]


@dataclass(frozen=True)
class ApprovalCheck:
    why: ApprovalWhy
    request: ApprovalRequestData | None = None
    end: ToolEndData | None = None  # the call's TOOL_END, when it has one

    def message(self, run_id: str, tool_call_id: str) -> str:
        """One line saying why an answer to the call would reach nobody."""
        if self.why == "no_request":
            return f"run {run_id} has no approval request for tool call {tool_call_id}"
        if self.why == "pending":
            return f"tool call {tool_call_id} of run {run_id} is waiting for an answer"
        return f"tool call {tool_call_id} of run {run_id} is no longer waiting: {self._gone()}"

    def _gone(self) -> str:
        if self.end is not None:
            first = self.end.output.strip().splitlines()[:1]
            return f"it has ended ({self.end.status}: {first[0] if first else 'no output'})"
        if self.why == "answered":
            return "it has already been answered"
        if self.why == "run_ended":
            return "the run has ended"
        timeout_s = self.request.timeout_s if self.request is not None else 0
        return f"its approval request timed out after {timeout_s:g} s"


def approval_check(
    events: Iterable[Event], tool_call_id: str, *, now_ms: int, answer_queued: bool
) -> ApprovalCheck:
    """Whether the call's approval request is still waiting for an answer, and if not why."""
    asked: Event | None = None
    end: ToolEndData | None = None
    run_ended = False
    for event in events:
        concerns_call = event.data.get("tool_call_id") == tool_call_id
        if event.type == "APPROVAL_REQUEST" and concerns_call:
            asked = event
        elif event.type == "TOOL_END" and concerns_call:
            end = ToolEndData.model_validate(event.data)
        run_ended = run_ended or event.is_terminal
    if asked is None:
        return ApprovalCheck("no_request")
    request = ApprovalRequestData.model_validate(asked.data)
    why: ApprovalWhy = "pending"
    if end is not None or answer_queued:
        why = "answered"
    elif run_ended:
        why = "run_ended"
    elif now_ms >= asked.ts_ms + int(request.timeout_s * 1000):
        why = "expired"
    return ApprovalCheck(why, request, end)
