"""Parking a call the gate says to ask a person about, and the words of its answer.

`park` is called by `worker` when the verdict is "ask": it stores the call with the
gate's reason in Redis (`state.approvals`), writes the APPROVAL_REQUEST and returns,
so the wait holds no worker thread. The person sees the input as the model wrote it
and, when they differ, as the gate resolved it (the file that will be touched). The
wait ends at the machine's `CMDOP_APPROVAL_TIMEOUT_S`, or the run's deadline if that
comes first, counted by Redis's clock from when the call is parked; the call's own
timeout starts only once it is approved.

The rest is pure: what the model is told of a person's answer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from cmdop_worker.core.event_data import ApprovalRequestData
from cmdop_worker.machine.audit import FinalVerdict
from cmdop_worker.machine.permissions import Decision
from cmdop_worker.machine.side import MachineSide
from cmdop_worker.models import ApprovalAnswer, ApprovalVerdict, ToolCall
from cmdop_worker.runtime import now_ms
from cmdop_worker.state.approvals import Parked, ParkedCall


def park(side: MachineSide, call: ToolCall, args: dict[str, Any], decision: Decision) -> Parked:
    """Park the call: "parked"; "cancelled" when the run has a cancel request (the
    caller reports it); "answered" or "again" when it has an outcome or was parked."""
    settings = side.rt.settings
    asked_ms = now_ms()
    expires_ms = min(asked_ms + int(settings.approval_timeout_s * 1000), call.run_deadline_ms)
    parked = ParkedCall(
        call=call,
        reason=decision.reason,
        gate=dataclasses.asdict(decision),
        resolved_input=args if args != call.input else None,
        asked_ms=asked_ms,
        expires_ms=expires_ms,
        timeout_ms=max(call.deadline_ms - asked_ms, 1),
    )
    request = ApprovalRequestData(
        tool_call_id=call.tool_use_id,
        tool=call.tool,
        machine=side.machine,
        input=call.input,
        reason=decision.reason,
        timeout_s=settings.approval_timeout_s,
        resolved_input=parked.resolved_input,
    )
    return side.approvals.park(parked, request, grace_ms=settings.tool_grace_ms)


def denial_text(answer: ApprovalAnswer, asked_because: str) -> str:
    """What the model is told of a person's denial: who, and their reason."""
    if answer.reason:
        return f"permission denied by a person ({answer.by}): {answer.reason}"
    return f"permission denied by a person ({answer.by}); they were asked because: {asked_because}"


def edited_note(answer: ApprovalAnswer, *, suffix: bool = False) -> str:
    """The model must know that what ran is not what it asked for."""
    if answer.input is None:
        return ""
    shown = {k: v for k, v in answer.input.items() if k != "machine"}
    text = json.dumps(shown, ensure_ascii=False)
    return (
        f" (input as edited by {answer.by}: {text})"
        if suffix
        else (f"[ran with input edited by {answer.by}: {text}]")
    )


def closed_final(verdict: ApprovalVerdict) -> FinalVerdict:
    """The audit log's word for a wait that ended without a person's answer."""
    return "timeout" if verdict == "expired" else "cancelled"
