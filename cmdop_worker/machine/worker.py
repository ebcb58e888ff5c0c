"""A machine worker's side of a tool call: check, ask, run, report.

Called by the `cmdop.tool` task on the machine the call is addressed to. In order:
refuse a call addressed to another machine; then, in one atomic step (`start_call`):
return at once if the call's outcome is already stored (a redelivery), skip it if the
run was cancelled, else mark it started and write its TOOL_START — a call found already
started but without an outcome was cut short by a crash and is answered "outcome
unknown", never run twice; check the permission policy (asking a person through the
run's events when the policy says "ask"); run it under a cancel watch that kills its
processes on a ui cancel; record the outcome through the same barrier as every other
writer. The happy path costs two Redis round trips: the start and the record.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import redis

from cmdop_worker import metrics
from cmdop_worker.machine.audit import FinalVerdict
from cmdop_worker.machine.paths import PathRefused, canonical_input
from cmdop_worker.machine.permissions import Decision, decide
from cmdop_worker.machine.sandbox import Confinement
from cmdop_worker.machine.side import MachineSide
from cmdop_worker.machine.toolbox import ToolContext
from cmdop_worker.models import ToolCall, ToolOutcome, ToolStatus
from cmdop_worker.outcomes import record, start_data
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.cancel import CancelWatch
from cmdop_worker.state.store import Started

log = logging.getLogger(__name__)
# Tells this process from an earlier one with the same pid (a restarted container).
_PROCESS_ID = uuid.uuid4().hex[:12]
_RECORD_PATIENCE_S = 120.0


def execute_tool_call(side: MachineSide, call: ToolCall) -> ToolStatus | None:
    rt = side.rt
    if call.machine != side.machine:
        log.error("call %s for machine %s reached %s", call.tool_use_id, call.machine, side.machine)
        _report(
            rt,
            call,
            "invalid",
            f"call addressed to machine {call.machine} reached {side.machine}; refused",
        )
        return None
    # Watched from before the start: a cancel is either seen by `start_call` or pushed
    # to the watch afterwards, never missed in between.
    with rt.hub.watch(call.run_id, call.run_deadline_ms, read_now=False) as watch:
        if not _may_start(side, call):
            return None
        started = time.monotonic()
        outcome = _gate_and_run(side, call, watch)
        # The call's time from its TOOL_START, a wait for a person's answer included (a
        # denial after that wait took that long), as the live view's spinner shows it.
        duration_ms = int((time.monotonic() - started) * 1000)
    _record_durably(rt, call, outcome.model_copy(update={"duration_ms": duration_ms}))
    return outcome.status  # as the call ran here (None above: it did not run here)


def _may_start(side: MachineSide, call: ToolCall) -> bool:
    """Mark the call started (with its TOOL_START), or report why it must not run
    (again). One Redis round trip on the way to running a tool."""
    rt = side.rt
    holder = f"{side.machine}:{os.getpid()}:{_PROCESS_ID}"
    data = start_data(call.tool_use_id, call.tool, side.machine, call.input)
    started, detail = rt.store.start_call(
        call.run_id,
        call.turn,
        call.tool_use_id,
        holder,
        deadline_passed=now_ms() >= call.run_deadline_ms,
        start_event=rt.events.frame(call.run_id, "TOOL_START", call.turn, data),
    )
    if started is Started.CANCELLED:
        _report(rt, call, "cancelled", "cancelled before it started")
    elif started is Started.AGAIN and detail == holder:
        # A second copy (the broker's visibility timeout passed) while this very process
        # still runs the first one: that one will report.
        log.info("call %s is already running here", call.tool_use_id)
    elif started is Started.AGAIN:
        _report(
            rt, call, "unknown", f"started earlier on {side.machine}; outcome unknown; machine lost"
        )
    return started is Started.FIRST


def _record_durably(rt: Runtime, call: ToolCall, outcome: ToolOutcome) -> None:
    """Record the outcome of a call that ran, riding out a Redis restart: the call must
    not be reported lost just because Redis was away when it ended."""
    give_up = time.monotonic() + _RECORD_PATIENCE_S
    while True:
        try:
            record(rt, call.run_id, call.turn, outcome)
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if time.monotonic() > give_up:
                raise
            log.warning("cannot record %s yet (%s); retrying", call.tool_use_id, exc)
            time.sleep(0.5)


def _report(rt: Runtime, call: ToolCall, status: str, output: str) -> None:
    outcome = ToolOutcome.model_validate(
        {
            "tool_use_id": call.tool_use_id,
            "tool": call.tool,
            "machine": call.machine,
            "status": status,
            "output": output,
        }
    )
    record(rt, call.run_id, call.turn, outcome, tool_input=call.input)


def _gate_and_run(side: MachineSide, call: ToolCall, watch: CancelWatch) -> ToolOutcome:
    """Canonical paths, then the permission gate, then the tool in its sandbox."""
    try:
        args = canonical_input(call.tool, call.input, side.cwd)
    except PathRefused as exc:
        return _refusal(side, call, "denied", f"permission denied: {exc}")
    except (ValueError, OSError) as exc:  # a NUL in a path, a name too long, …
        return _refusal(side, call, "invalid", f"invalid path for {call.tool}: {exc}")
    decision = decide(call.tool, args, side.policy)
    final: FinalVerdict | None = None if decision.verdict == "ask" else decision.verdict
    if final is None:
        final = _ask_person(side, call, args, decision, watch)
    _audit(side, call, decision, final)
    if final == "allow" or final == "approved":
        return _run(side, call, args, side.jail_for(final), watch)
    wait_s = side.rt.settings.approval_timeout_s
    why = {
        "deny": f"permission denied: {decision.reason}",
        "denied": f"permission denied by a person: {decision.reason}",
        "timeout": f"permission denied: nobody approved within {wait_s:g} s",
        "cancelled": "cancelled while waiting for approval",
    }[final]
    return _refusal(side, call, "cancelled" if final == "cancelled" else "denied", why)


def _refusal(side: MachineSide, call: ToolCall, status: str, why: str) -> ToolOutcome:
    return ToolOutcome.model_validate(
        {
            "tool_use_id": call.tool_use_id,
            "tool": call.tool,
            "machine": side.machine,
            "status": status,
            "output": why,
        }
    )


def _run(
    side: MachineSide,
    call: ToolCall,
    args: dict[str, Any],
    jail: Confinement,
    watch: CancelWatch,
) -> ToolOutcome:
    remaining_s = (call.deadline_ms - now_ms()) / 1000
    ctx = ToolContext(
        machine=side.machine,
        run_id=call.run_id,
        tool_use_id=call.tool_use_id,
        deadline_monotonic=time.monotonic() + max(remaining_s, 0.001),
        cancelled=watch.event,
        output_max_bytes=side.rt.settings.tool_output_max_bytes,
        cwd=side.cwd,
        jail=jail,
    )
    started = time.monotonic()
    outcome = side.registry.run(call.tool, args, ctx)
    ran_s = time.monotonic() - started  # the tool's own time, without any approval wait
    metrics.TOOL_SECONDS.labels(tool=call.tool, status=outcome.status).observe(ran_s)
    return outcome.model_copy(update={"machine": side.machine})


def _ask_person(
    side: MachineSide,
    call: ToolCall,
    args: dict[str, Any],
    decision: Decision,
    watch: CancelWatch,
) -> FinalVerdict:
    """Ask through the run's events; the person sees the input as the model wrote it
    and, when they differ, as the gate resolved it (the file that will be touched)."""
    rt = side.rt
    timeout_s = rt.settings.approval_timeout_s
    data = {
        "tool_call_id": call.tool_use_id,
        "tool": call.tool,
        "machine": side.machine,
        "input": call.input,
        "reason": decision.reason,
        "timeout_s": timeout_s,
    }
    if args != call.input:
        data["resolved_input"] = args
    rt.events.emit(call.run_id, "APPROVAL_REQUEST", call.turn, data)
    key = rt.keys.approval(call.run_id, call.tool_use_id)
    give_up = time.monotonic() + timeout_s
    while (left := give_up - time.monotonic()) > 0:
        if watch.cancelled:
            return "cancelled"
        answer = rt.redis.blpop([key], timeout=min(left, 0.25))
        if answer is not None:
            return "approved" if answer[1] == "approve" else "denied"
    return "cancelled" if watch.cancelled else "timeout"


def _audit(side: MachineSide, call: ToolCall, decision: Decision, final: FinalVerdict) -> None:
    if side.audit is None:
        return
    side.audit.append(
        machine=side.machine,
        run_id=call.run_id,
        tool_use_id=call.tool_use_id,
        tool=call.tool,
        args=call.input,
        decision=decision,
        final=final,
    )
