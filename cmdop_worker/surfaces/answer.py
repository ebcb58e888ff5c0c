"""Answering a parked call: the effects behind `Client.approve`.

The call's parked record (`state.approvals`) is the one source of truth about whether
it waits. The answer is written there once, with its APPROVAL_RESOLVED event, and a
new `cmdop.tool` task carries it to the call's machine, which acts on it only if the
record holds that very answer. Once written, the answer stands: when the task cannot
be sent (the broker away) the coordinator's watchdog sends it, as it does for a client
killed in between, so the person is not told it failed. Called by `Client.approve` only.
"""

from __future__ import annotations

import getpass
import logging
import os
from collections.abc import Mapping
from typing import Any

from cmdop_worker.core.event_data import ApprovalRequestData
from cmdop_worker.errors import ApprovalNotPending, InvalidRequest
from cmdop_worker.messages import SEND_FAILURES, TaskSender, send_answer
from cmdop_worker.models import ApprovalAnswer, ApprovalVerdict
from cmdop_worker.state.approvals import Approvals, ParkedRecord
from cmdop_worker.state.connect import now_ms
from cmdop_worker.state.store import RunStore
from cmdop_worker.surfaces.approvals import (
    by_problem,
    edited_input,
    refusal_message,
    shown_differs,
)

log = logging.getLogger(__name__)


def answer_parked(
    approvals: Approvals,
    store: RunStore,
    celery: TaskSender,
    run_id: str,
    tool_call_id: str,
    verdict: ApprovalVerdict,
    input: dict[str, Any] | None,
    reason: str | None,
    by: str | None,
    shown: Mapping[str, Any] | None = None,
) -> ApprovalRequestData:
    """Answer the call once and send the task that carries the answer out; raises
    `ApprovalNotPending` saying why when the call is not waiting, or when `shown` (the
    request as the person saw it) is not what its record asks; `InvalidRequest` for a
    `by` that may not be recorded (`by_problem`). Either way nothing is answered."""
    problem = None if by is None else by_problem(by)
    if problem is not None:
        raise InvalidRequest(f"by: {problem}")
    parked = approvals.load(run_id, tool_call_id)
    if parked is None:
        message = refusal_message("no_request", run_id, tool_call_id, None)
        raise ApprovalNotPending("no_request", message)
    if shown is not None and shown_differs(request_of(parked), shown):
        message = refusal_message("changed", run_id, tool_call_id, parked)
        raise ApprovalNotPending("changed", message)
    answer = ApprovalAnswer(
        verdict=verdict,
        by=by or os_user(),
        reason=reason,
        input=edited_input(parked.call, input, approve=verdict == "approved"),
        answered_ms=now_ms(),
    )
    why = approvals.answer(parked, answer)
    if why is not None:
        ended = store.outcome(run_id, parked.call.turn, tool_call_id)
        raise ApprovalNotPending(why, refusal_message(why, run_id, tool_call_id, parked, ended))
    try:
        send_answer(celery, parked.call, answer)
    except SEND_FAILURES as exc:
        log.warning(
            "answer to call %s recorded; its task was not sent (%s): the watchdog sends it",
            tool_call_id,
            exc,
        )
    return request_of(parked)


def request_of(parked: ParkedRecord) -> ApprovalRequestData:
    """The approval request a parked call made, as its APPROVAL_REQUEST showed it."""
    call = parked.call
    return ApprovalRequestData(
        tool_call_id=call.tool_use_id,
        tool=call.tool,
        machine=call.machine,
        input=call.input,
        reason=parked.parked.reason,
        timeout_s=parked.wait_s,
        resolved_input=parked.parked.resolved_input,
    )


def os_user() -> str:
    """Who answered, when the caller does not say: the OS user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
