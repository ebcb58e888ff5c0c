"""Parked calls seen from the coordinator: their expiry, a cancel, a turn's deadline.

A machine parks a call it must ask a person about (`state.approvals`) and ends its
task; answering it is the client's. What is left to the coordinator, all called by
the watchdog:

- `parked_due`, for a due `approval:<run>:<tuid>` entry: while the call waits, nobody
  answered in time, so it is denied ("nobody approved within N s"), once; once a person
  answered, the machine has not taken the answer within a grace, so the task carrying it
  is sent again (the first may never have been sent: a broker hiccup, the answering
  client killed), and again, further apart, until it is taken or the call has an
  outcome.
- `close_parked`, for every cancel of a running run: its waiting calls are answered
  "cancelled while waiting for approval" at once, whatever the channel.
- `parked_hold_ms`: how long a turn's deadline must still wait for its parked calls.

An expired or cancelled call is also told to its machine by a `cmdop.tool` task
carrying the answer (`messages.answer_message`, as a person's answer is sent), so
the machine's audit log records the final verdict.
"""

from __future__ import annotations

import logging

from cmdop_worker.core.results import unanswered
from cmdop_worker.messages import answer_message, send
from cmdop_worker.models import ApprovalAnswer, CancelRequest, ToolStatus
from cmdop_worker.outcomes import record
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.approvals import Approvals, ParkedRecord

log = logging.getLogger(__name__)


def approvals_of(rt: Runtime) -> Approvals:
    return Approvals(rt.redis, rt.keys, rt.events, ttl_s=rt.settings.run_ttl_s)


def parked_due(rt: Runtime, run_id: str, tool_use_id: str) -> None:
    approvals = approvals_of(rt)
    parked = approvals.load(run_id, tool_use_id)
    if parked is None:
        return
    if parked.state == "waiting":
        _expire(rt, approvals, parked)
    elif parked.answer is not None and approvals.resend(parked):
        log.warning(
            "run %s: the answer to call %s is not taken yet; sending it again",
            run_id,
            tool_use_id,
        )
        send(answer_message(parked.call, parked.answer))


def _expire(rt: Runtime, approvals: Approvals, parked: ParkedRecord) -> None:
    answer = ApprovalAnswer(verdict="expired", by="timeout", answered_ms=now_ms())
    why = f"permission denied: nobody approved within {parked.wait_s:g} s"
    _close(rt, approvals, parked, answer, "denied", why)


def close_parked(rt: Runtime, run_id: str, cancel: CancelRequest) -> int:
    """Answer the run's waiting calls as cancelled; returns how many. An operation
    cancel too, though it otherwise lets work in progress finish: a parked call is not
    in progress, and the loop boundary where the cancel is honoured would wait for it
    as long as nobody answers, which may be hours."""
    approvals = approvals_of(rt)
    closed = 0
    for parked in approvals.of_run(run_id):
        if parked.state != "waiting":
            continue
        answer = ApprovalAnswer(
            verdict="cancelled",
            by=f"{cancel.channel} cancel",
            reason=cancel.reason,
            answered_ms=now_ms(),
        )
        why = "cancelled while waiting for approval"
        closed += _close(rt, approvals, parked, answer, "cancelled", why)
    return closed


def parked_hold_ms(rt: Runtime, run_id: str, turn: int) -> int:
    """Until when turn n's deadline must wait for its parked calls without an outcome
    (0: it need not): a call's wait for a person, and once approved its own deadline,
    both start after the turn's deadline was set."""
    parked = [p for p in approvals_of(rt).of_run(run_id) if p.call.turn == turn]
    if not parked:
        return 0
    stored = rt.store.outcomes(run_id, turn)
    return max((p.hold_ms() for p in parked if p.call.tool_use_id not in stored), default=0)


def _close(
    rt: Runtime,
    approvals: Approvals,
    parked: ParkedRecord,
    answer: ApprovalAnswer,
    status: ToolStatus,
    why: str,
) -> int:
    if not approvals.close(parked, answer):
        return 0
    call = parked.call
    log.info("run %s: parked call %s %s", call.run_id, call.tool_use_id, answer.verdict)
    outcome = unanswered(call, status, why, duration_ms=answer.answered_ms - parked.parked.asked_ms)
    record(rt, call.run_id, call.turn, outcome)  # its TOOL_START was written at its start
    send(answer_message(call, answer))
    return 1
