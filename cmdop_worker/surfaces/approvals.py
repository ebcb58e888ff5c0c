"""What a person's answer to a parked call says, and why one was not taken.

`Client.approve` reads the call's parked record (`state.approvals`, the one source of
truth about whether it waits) and answers it there; these are the pure parts around
that: the edited input a person may give (`edited_input`), whether what a person was
shown is what the record asks (`shown_differs`), and the one line that says
why an answer reached nobody (`refusal_message`) — an unknown call, one already
answered, expired, cancelled while it waited, or ended another way — and whether a
name the answer is given `by` can be recorded (`by_problem`).

Pure: the record and the call's outcome come in as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cmdop_worker.core.event_data import ApprovalRequestData
from cmdop_worker.core.textsafe import line_breaker, one_line, shown_as
from cmdop_worker.errors import InvalidRequest
from cmdop_worker.models import ToolCall, ToolOutcome
from cmdop_worker.state.approvals import ParkedRecord, Refused


def edited_input(call: ToolCall, edited: dict[str, Any] | None, *, approve: bool) -> Any:
    """The input a person wants the call to run with instead (None: as the model wrote
    it). It stays on the call's machine: a person edits what runs, not where."""
    if edited is None:
        return None
    if not approve:
        raise InvalidRequest("input: a denied call runs nothing; give an input only to approve")
    if not isinstance(edited, dict):
        raise InvalidRequest("input: must be a JSON object of the tool's arguments")
    machine = edited.get("machine", call.machine)
    if machine != call.machine:
        raise InvalidRequest(f"input: machine: the call runs on {call.machine}, not {machine}")
    return {**edited, "machine": call.machine}


def by_problem(by: str) -> str | None:
    """Why `by` (who answers) may not be recorded, or None. It is shown in one line
    after "approved by", so a line break, a control or a bidi character in it could
    start a line of its own (pushing the "(via NAME)" the gateway adds onto it) or
    make the line read otherwise."""
    found = line_breaker(by)
    if found is None:
        return None
    return f"holds a control character ({shown_as(found)}); a name is one line of plain text"


def shown_differs(asked: ApprovalRequestData, shown: Mapping[str, Any]) -> bool:
    """Whether the request a person was shown (an APPROVAL_REQUEST's data) asks about
    another call than the record does: any machine may write a run's events, so what
    was shown is only taken as asked when the record (its machine's alone) agrees."""
    fields = ("tool", "machine", "input", "resolved_input")
    return any(shown.get(field) != getattr(asked, field) for field in fields)


def refusal_message(
    why: Refused,
    run_id: str,
    tool_call_id: str,
    parked: ParkedRecord | None,
    ended: ToolOutcome | None = None,
) -> str:
    """One line saying why an answer to the call would reach nobody."""
    if why == "no_request" or parked is None:
        return f"run {run_id} has no approval request for tool call {tool_call_id}"
    return f"tool call {tool_call_id} of run {run_id} is no longer waiting: " + _gone(
        why, parked, ended
    )


def _gone(why: Refused, parked: ParkedRecord, ended: ToolOutcome | None) -> str:
    answer = parked.answer
    if why == "answered" and answer is not None:
        return f"it has already been answered ({answer.verdict} by {one_line(answer.by)})"
    if why == "cancelled":
        return "it was cancelled while waiting for approval"
    if why == "changed":
        return "its request changed after it was read; read it again before answering"
    if why == "expired":
        return f"its approval request expired after {parked.wait_s:g} s"
    if ended is not None:
        first = ended.output.strip().splitlines()[:1]
        return f"it has ended ({ended.status}: {first[0] if first else 'no output'})"
    return "it has ended"
