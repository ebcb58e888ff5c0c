"""A machine worker's side of a tool call: check, ask, run, report.

Called by the `cmdop.tool` task on the machine the call is addressed to. In order:
refuse a call addressed to another machine; then, in one atomic step (`start_call`):
refuse a message its sender's record does not match (`state.sent`: a call no sender
sent, pushed onto this queue by someone else; nothing is run or written), return at
once if the call's outcome is already stored (a redelivery), skip it if the run was
cancelled, answer it "timeout" if its deadline passed before it could start
(it waited in the queue, or was sent that late), else mark it started and write its
TOOL_START — a call found already started but without an outcome was cut short by a
crash and is answered "outcome unknown", never run twice; check the permission policy;
run it under a cancel watch that kills its processes on a ui cancel; record the outcome
through the same barrier as every other writer. The happy path costs two Redis round
trips: the start and the record.

When the policy says "ask", the call is parked (`parked.park`) and the task ends with
no outcome: the wait holds no thread. The answer comes back as another `cmdop.tool`
task carrying it (`ToolCall.approval`), which `carry_out` acts on once, and only if the
parked record holds that answer: a denial is reported with the person's reason; an
approval runs the call (the edited input, when a person edited it, through the gate
again: a person approves past an "ask", never past a deny rule or the floor) with its
own deadline, counted from the approval. An answer found taken by an earlier process
of this machine, with no outcome, was cut short by that process's death: it is
answered "lost" at once, as a started call is (a copy this very process still carries
out is left to it).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from cmdop_worker import metrics
from cmdop_worker.core.event_data import ToolStartData
from cmdop_worker.core.results import unanswered
from cmdop_worker.machine.audit import FinalVerdict
from cmdop_worker.machine.parked import closed_final, denial_text, edited_note, park
from cmdop_worker.machine.paths import PathRefused, canonical_input
from cmdop_worker.machine.permissions import Decision, command_over_limits, decide
from cmdop_worker.machine.sandbox import Confinement
from cmdop_worker.machine.side import MachineSide
from cmdop_worker.machine.toolcall import ToolContext
from cmdop_worker.models import ApprovalAnswer, ToolCall, ToolOutcome, ToolStatus
from cmdop_worker.outcomes import record
from cmdop_worker.runtime import Runtime, now_ms
from cmdop_worker.state.cancel import CancelWatch
from cmdop_worker.state.connect import RedisConnectionError, RedisTimeoutError
from cmdop_worker.state.outage import OUTAGE
from cmdop_worker.state.sent import call_digest
from cmdop_worker.state.store import Started

log = logging.getLogger(__name__)
# Tells this process from an earlier one with the same pid (a restarted container).
_PROCESS_ID = uuid.uuid4().hex[:12]
_RECORD_PATIENCE_S = 120.0
# How much of a worker's own failure the model is told.
_FAULT_TEXT_MAX = 2000


def execute_tool_call(side: MachineSide, call: ToolCall) -> ToolStatus | None:
    rt = side.rt
    if call.approval is not None:
        return carry_out(side, call)
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
        try:
            outcome = _gate_and_run(side, call, watch)
        except Exception as exc:  # a fault of this worker, not of the tool: say so
            log.exception("call %s failed on %s", call.tool_use_id, side.machine)
            why = f"{side.machine} could not run it: {type(exc).__name__}: {exc}"
            outcome = unanswered(call, "error", why[:_FAULT_TEXT_MAX])
        if outcome is None:  # parked: the task that carries out its answer reports it
            return None
        # The call's time from its TOOL_START, a wait for a person's answer included (a
        # denial after that wait took that long), as the live view's spinner shows it.
        duration_ms = int((time.monotonic() - started) * 1000)
    _record_durably(rt, call, outcome.model_copy(update={"duration_ms": duration_ms}))
    return outcome.status  # as the call ran here (None above: it did not run here)


def _may_start(side: MachineSide, call: ToolCall) -> bool:
    """Mark the call started (with its TOOL_START), or report why it must not run
    (again). One Redis round trip on the way to running a tool."""
    rt = side.rt
    holder = _holder(side)
    data = ToolStartData.of(call, machine=side.machine, input=call.input)
    now = now_ms()
    started, detail = rt.store.start_call(
        call.run_id,
        call.turn,
        call.tool_use_id,
        holder,
        deadline_passed=now >= call.run_deadline_ms,
        start_event=rt.events.frame(call.run_id, call.turn, data),
        call_deadline_passed=now >= call.deadline_ms,
        machine=side.machine,
        digest=call_digest(call),
    )
    if started is Started.UNSENT:
        # Not what any sender sent: nothing runs, and nothing is written into the run
        # the message names (it may be anyone's).
        log.error(
            "call %s of run %s refused: not sent to %s as this message has it (forged?)",
            call.tool_use_id,
            call.run_id,
            side.machine,
        )
    elif started is Started.CANCELLED:
        _report(rt, call, "cancelled", "cancelled before it started")
    elif started is Started.LATE:  # it would have had no time at all to run
        _report(rt, call, "timeout", "not started before its deadline")
    elif started is Started.AGAIN and side.approvals.load(
        call.run_id, call.tool_use_id, side.machine
    ):
        log.info("call %s is parked, waiting for a person", call.tool_use_id)  # a redelivery
    elif started is Started.AGAIN and detail == holder:
        # A second copy (the broker's visibility timeout passed) while this very process
        # still runs the first one: that one will report.
        log.info("call %s is already running here", call.tool_use_id)
    elif started is Started.AGAIN:
        _report(
            rt, call, "lost", f"started earlier on {side.machine}; outcome unknown; machine lost"
        )
    return started is Started.FIRST


def _holder(side: MachineSide) -> str:
    """Who runs a call here: this machine, this very process."""
    return f"{side.machine}:{os.getpid()}:{_PROCESS_ID}"


def _record_durably(rt: Runtime, call: ToolCall, outcome: ToolOutcome) -> None:
    """Record the outcome of a call that ran, riding out a Redis restart: the call must
    not be reported lost just because Redis was away when it ended."""
    give_up = time.monotonic() + _RECORD_PATIENCE_S
    while True:
        try:
            record(rt, call.run_id, call.turn, outcome)
            OUTAGE.reached()
            return
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if time.monotonic() > give_up:
                raise
            OUTAGE.failed(f"recording the outcome of {call.tool_use_id}", exc)
            time.sleep(0.5)


def _report(rt: Runtime, call: ToolCall, status: ToolStatus, why: str) -> None:
    """Record an outcome of a call that did not run here, in `why`'s words."""
    record(rt, call.run_id, call.turn, unanswered(call, status, why), tool_input=call.input)


def _gate(side: MachineSide, call: ToolCall) -> tuple[dict[str, Any], Decision] | ToolOutcome:
    """Canonical paths, then the permission gate: the input as decided on, and the
    decision; or the refusal of an input whose paths cannot be used, or of a command
    over the limits of what the gate reads."""
    over_limits = command_over_limits(call.tool, call.input)
    if over_limits is not None:
        return unanswered(call, "invalid", f"invalid input for {call.tool}: {over_limits}")
    try:
        args = canonical_input(call.tool, call.input, side.cwd)
    except PathRefused as exc:
        return unanswered(call, "denied", f"permission denied: {exc}")
    except (ValueError, OSError) as exc:  # a NUL in a path, a name too long, …
        return unanswered(call, "invalid", f"invalid path for {call.tool}: {exc}")
    return args, decide(call.tool, args, side.policy)


def _gate_and_run(side: MachineSide, call: ToolCall, watch: CancelWatch) -> ToolOutcome | None:
    """The gate, then the tool in its sandbox; None when the call was parked."""
    gated = _gate(side, call)
    if isinstance(gated, ToolOutcome):
        return gated
    args, decision = gated
    if decision.verdict == "ask":
        if park(side, call, args, decision) != "cancelled":
            return None
        _audit(side, call, decision, "cancelled")
        return unanswered(call, "cancelled", "cancelled while waiting for approval")
    _audit(side, call, decision, decision.verdict)
    if decision.verdict == "allow":
        return _run(side, call, args, side.jail_for("allow"), watch)
    return unanswered(call, "denied", f"permission denied: {decision.reason}")


def carry_out(side: MachineSide, task: ToolCall) -> ToolStatus | None:
    """Act once on the answer a task carries to a parked call, as its record has it."""
    answer = task.approval
    assert answer is not None
    parked = side.approvals.load(task.run_id, task.tool_use_id, side.machine)
    if parked is None or parked.call.machine != side.machine:
        log.warning("answer to call %s not carried out: not parked here", task.tool_use_id)
        return None
    taken, taker = side.approvals.take(parked.call, answer, taker=_holder(side))
    if taken == "again" and taker != _holder(side):
        # Taken by an earlier process of this machine, which died carrying it out (this
        # is the broker's redelivery): nobody else will report it.
        log.warning("answer to call %s was taken by %s, now gone", task.tool_use_id, taker)
        why = f"started on {side.machine}; outcome unknown; machine lost"
        _report(side.rt, parked.call, "lost", why)
        return None
    if taken != "ok":  # a replay, a forgery, a copy this process runs, or an ended call
        log.warning("answer to call %s not carried out: %s", task.tool_use_id, taken)
        return None
    answered_ms = now_ms()
    call, decision = parked.call, Decision(**parked.parked.gate)
    if answer.verdict in ("expired", "cancelled"):  # answered by the coordinator
        _audit(side, call, decision, closed_final(answer.verdict))
        return None
    if answer.verdict == "denied":
        _audit(side, call, decision, "denied")
        outcome = unanswered(call, "denied", denial_text(answer, decision.reason))
    else:
        deadline_ms = parked.deadline_ms or call.deadline_ms  # set when it was approved
        approved = call.model_copy(
            update={"input": answer.input or call.input, "deadline_ms": deadline_ms}
        )
        with side.rt.hub.watch(call.run_id, call.run_deadline_ms) as watch:
            ran = time.monotonic()
            outcome = _run_approved(side, approved, answer, decision, watch)
            outcome = outcome.model_copy(
                update={"duration_ms": int((time.monotonic() - ran) * 1000)}
            )
    # Its own run time, and beside it the wait for the person (from its TOOL_START).
    waited_ms = max(answered_ms - parked.parked.asked_ms, 0)
    _record_durably(side.rt, call, outcome.model_copy(update={"waited_ms": waited_ms}))
    return outcome.status


def _run_approved(
    side: MachineSide, call: ToolCall, answer: ApprovalAnswer, asked: Decision, watch: CancelWatch
) -> ToolOutcome:
    """Run an approved call through the gate once more: its paths are resolved anew (a
    symlink may have moved while it waited) and an edited input is decided on."""
    gated = _gate(side, call)
    if isinstance(gated, ToolOutcome):
        return gated
    args, decision = gated
    if decision.verdict == "deny":
        _audit(side, call, decision, "deny")
        why = f"permission denied: {decision.reason}"
        return unanswered(call, "denied", why + edited_note(answer, suffix=True))
    _audit(side, call, asked if answer.input is None else decision, "approved")
    if watch.cancelled:
        return unanswered(call, "cancelled", "cancelled before it started")
    outcome = _run(side, call, args, side.jail_for("approved"), watch)
    if answer.input is None:
        return outcome
    return outcome.model_copy(update={"output": edited_note(answer) + "\n" + outcome.output})


def _run(
    side: MachineSide,
    call: ToolCall,
    args: dict[str, Any],
    jail: Confinement,
    watch: CancelWatch,
) -> ToolOutcome:
    # The run's deadline is part of what the sender recorded (`state.sent`); the call's
    # own is not (a sequential turn's is set as it is handed out): never past the run's.
    remaining_s = (min(call.deadline_ms, call.run_deadline_ms) - now_ms()) / 1000
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
    metrics.tool_seconds(call.tool, outcome.status).observe(ran_s)
    if outcome.machine == side.machine:  # as `ToolRegistry.run` names it: no copy needed
        return outcome
    return outcome.model_copy(update={"machine": side.machine})


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
