"""A tool call's outcome, stored once through the turn barrier, by whoever answers it.

Both sides of a call write here: the machine worker that ran it, the coordinator for
a call it refused or ran itself, the watchdog and the liveness probe for a call whose
machine went quiet. `record` stores the outcome with its TOOL_END (and, given the call's
input, the TOOL_START of a call answered without starting: written only if it never
started, so every TOOL_END has exactly one TOOL_START) in one script. The writer whose
outcome completes the turn enqueues the next one (`enqueue_turn`), so a turn advances
exactly once whichever side finishes last; in a sequential turn the writer whose
outcome was the call out now sends the next call (`send_queued`; a machine sends
another machine's call by way of a coordinator, `hand_on`), so the calls run one
at a time in the model's order, whoever answers each; each is given its own time as it
is sent (a wait for a person before it eats none of it), and once the run has a cancel
request, any channel, the calls not yet sent are answered instead, never started.

A call answered by someone other than the tool gets the same status word for the same
situation, wherever it is written (`unanswered_outcome` for the coordinator's side; the
machine worker's words match):

    situation                                   never started     started
    a cancel to honour now (ui, or past the     cancelled         cancelled
      deadline)
    an operation cancel, a sequential turn's    cancelled         -
      call not yet sent
    the call's deadline passed                  timeout           lost (a machine call:
                                                                  its machine went
                                                                  quiet); timeout (a
                                                                  coordinator tool)
    its machine went away (liveness)            offline           lost
    a second copy finds it started, unanswered  -                 lost
    routed, or re-sent, to a machine offline    offline           -
    no outcome at all when the turn closes      lost              lost

`unknown` is no longer written (records from before may hold it). A tool's own words
(`ok`, `error`, `timeout`, `cancelled`, `denied`, `invalid`) come from the machine side.

The messages it sends on are built and sent by `messages`.
"""

from __future__ import annotations

from typing import Any, Literal

from cmdop_worker.core.tools import cap_output
from cmdop_worker.messages import (
    enqueue_turn,
    hand_on_message,
    local_tool_message,
    send,
    tool_message,
)
from cmdop_worker.models import CancelRequest, ToolOutcome, ToolStatus
from cmdop_worker.runtime import Runtime
from cmdop_worker.state.barrier import Handed
from cmdop_worker.state.keys import advance_member
from cmdop_worker.state.store import PendingCall, QueuedCall, Recorded

Unanswered = Literal["cancel", "deadline", "machine_gone"]


def record(
    rt: Runtime,
    run_id: str,
    turn: int,
    outcome: ToolOutcome,
    *,
    tool_input: Any = None,
) -> Recorded:
    """Store an outcome once, with its TOOL_END (and a TOOL_START first, given the
    `tool_input` of a call that may never have started); the writer that completes the
    turn enqueues the next, the one that answered a sequential turn's call out sends
    the call after it."""
    recorded, handed = _record_one(rt, run_id, turn, outcome, tool_input)
    if handed is not None:
        while handed is not None:  # refused (or cancelled) calls in line are answered here
            handed = send_queued(rt, run_id, turn, handed.call, handed.cancel)
        # Sent: the watchdog's resend entry (for a sender that died) is not needed.
        rt.store.unschedule(advance_member(run_id, turn))
    return recorded


def _record_one(
    rt: Runtime, run_id: str, turn: int, outcome: ToolOutcome, tool_input: Any
) -> tuple[Recorded, Handed | None]:
    outcome = _capped(rt, outcome)
    end = rt.events.frame(run_id, "TOOL_END", turn, end_data(rt, outcome))
    start = None
    if tool_input is not None:
        data = start_data(outcome.tool_use_id, outcome.tool, outcome.machine, tool_input)
        start = rt.events.frame(run_id, "TOOL_START", turn, data)
    recorded, handed = rt.store.barrier.record_outcome(run_id, turn, outcome, [end], start=start)
    if recorded is Recorded.ADVANCE:
        enqueue_turn(run_id, turn + 1)
    return recorded, handed


def send_queued(
    rt: Runtime, run_id: str, turn: int, call: QueuedCall, cancel: CancelRequest | None = None
) -> Handed | None:
    """Send a sequential turn's next call where it runs; a refused call is answered
    here, and so is every call given the run's cancel request (it never starts), which
    may hand out the call after it (returned)."""
    if call.send == "answer" and call.answer is not None:
        return _record_one(rt, run_id, turn, call.answer, call.input)[1]
    if cancel is not None:
        machine = call.call.machine if call.call is not None else None
        pending = PendingCall(
            tool_use_id=call.tool_use_id, tool=call.tool, machine=machine, deadline_ms=0
        )
        answer = unanswered_outcome(pending, "cancel", started=False, reason=cancel.reason)
        return _record_one(rt, run_id, turn, answer, {} if call.input is None else call.input)[1]
    if call.send == "machine" and call.call is not None:
        if rt.settings.machine not in (None, call.call.machine):
            # A machine pushes onto its own queue and the continuation queue only (`state.acl`):
            # another machine's call goes there by way of a coordinator (`hand_on`).
            send(hand_on_message(run_id, turn, call.tool_use_id, headers=call.headers))
        else:
            send_tool_call(run_id, turn, call)
    else:  # a coordinator tool: a coordinator runs it (`cmdop.local_tool`)
        # Its deadline as handed out now: a wait before it (a parked call) is not its own.
        args = (run_id, turn, call.tool_use_id)
        send(local_tool_message(*args, deadline_ms=call.deadline_ms, headers=call.headers))
    return None


def hand_on(rt: Runtime, run_id: str, turn: int, tool_use_id: str) -> None:
    """Send a sequential turn's call, handed out by the machine that answered the call
    before it, to its own machine: if it is still the one out and never started. Its
    deadline is counted from now, as recovery's re-sending counts it."""
    barrier = rt.store.barrier
    if barrier.current_call(run_id, turn) != tool_use_id:
        return  # answered meanwhile (a cancel), or the turn was closed
    queued = barrier.queued_call(run_id, turn, tool_use_id)
    if queued is None or queued.call is None or rt.store.was_started(run_id, tool_use_id):
        return
    send_tool_call(run_id, turn, barrier.hand_out_again(run_id, turn, queued))


def send_tool_call(run_id: str, turn: int, call: QueuedCall) -> None:
    """Send a sequential turn's machine call, or one recovery sends again, to its queue."""
    assert call.call is not None
    send(tool_message(call.call, call.headers))


def unanswered_outcome(
    call: PendingCall, situation: Unanswered, *, started: bool, reason: str = ""
) -> ToolOutcome:
    """The outcome of a call answered for it, by the table in this module's docstring."""
    machine = call.machine
    status: ToolStatus
    if situation == "cancel":
        status, why = (
            "cancelled",
            f"cancelled ({reason}) before it " + ("finished" if started else "started"),
        )
    elif started and (situation == "machine_gone" or machine is not None):
        status, why = "lost", f"started on {machine}; outcome unknown; machine lost"
    elif situation == "machine_gone":
        status, why = "offline", f"machine {machine} went offline before running the call"
    elif started:
        status, why = "timeout", "no answer before the call's deadline"
    elif machine is not None:
        status, why = "timeout", f"machine {machine} did not run the call before its deadline"
    else:
        status, why = "timeout", "not run before the call's deadline"
    return ToolOutcome(
        tool_use_id=call.tool_use_id, tool=call.tool, machine=machine, status=status, output=why
    )


def _capped(rt: Runtime, outcome: ToolOutcome) -> ToolOutcome:
    capped = cap_output(outcome.output, rt.settings.tool_output_max_bytes)
    return outcome if capped == outcome.output else outcome.model_copy(update={"output": capped})


def start_data(tool_use_id: str, tool: str, machine: str | None, tool_input: Any) -> dict[str, Any]:
    """The data of a TOOL_START event, wherever the call starts."""
    return {"tool_call_id": tool_use_id, "tool": tool, "machine": machine, "input": tool_input}


def end_data(rt: Runtime, outcome: ToolOutcome) -> dict[str, Any]:
    limit = rt.settings.event_output_max_chars
    output = outcome.output
    if len(output) > limit:
        output = output[:limit] + f"… [{len(outcome.output) - limit} more characters]"
    return {
        "tool_call_id": outcome.tool_use_id,
        "tool": outcome.tool,
        "machine": outcome.machine,
        "is_error": outcome.is_error,
        "status": outcome.status,
        "output": output,
        "duration_ms": outcome.duration_ms,
    }
